"""The project an entry script belongs to: the modules of its own that it imports, found the way
Python finds them, and nothing from site-packages or the standard library.

`python train.py` puts the entry's folder first on `sys.path`; many repositories also run with
their root on the path (`PYTHONPATH=.` or an editable install), so a module is looked up in the
entry's folder, then in the folders the entry adds to `sys.path` itself (which extend the root to
hold them: analysis.sys_path), then in the project root (the nearest folder above it with `.git`,
`pyproject.toml`, `setup.py` or `setup.cfg`; the entry's folder when there is none). Packages
(`models/__init__.py`), submodules (`from models import resnet`), `import a.b.c` and relative
imports (`from .base import X`, `from .. import utils`) are followed, transitively. A name that
resolves to no file under the root (torch, numpy, a module in site-packages) is left alone.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import libcst as cst

from ddpify.analysis.index import dotted_name
from ddpify.analysis.sys_path import added_folders, python_path_roots

if TYPE_CHECKING:
    from ddpify.analysis.summaries import FunctionSummaries

ROOT_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")


@dataclass
class Project:
    """An entry script and the project modules it reaches, in the order they were found."""

    root: Path
    entry: Path
    modules: dict[Path, str] = field(default_factory=dict)  # file -> dotted module name ("__main__" for the entry)
    imports: dict[Path, list[Path]] = field(default_factory=dict)  # file -> the project files it imports
    unreadable: dict[str, str] = field(default_factory=dict)  # dotted name -> why it cannot be analysed (a syntax error)
    parsed: dict[Path, cst.Module] = field(default_factory=dict, repr=False)  # file -> its module, parsed once
    truncated: bool = False  # the walk stopped at its limit: some imported project modules were not read

    @property
    def files(self) -> list[Path]:
        return list(self.modules)


def project_root(entry: Path) -> Path:
    """The nearest folder at or above the entry's with a project marker; else the folder above the
    packages the entry sits in (`toolkit/run.py` beside `toolkit/__init__.py`: its siblings are
    imported as `toolkit.layers`), or the entry's own folder."""
    folder = entry.resolve().parent
    for candidate in (folder, *folder.parents):
        package = (candidate / "__init__.py").is_file()  # its `setup.py` is a module (dinov2/eval/setup.py)
        if any((candidate / marker).exists() for marker in ROOT_MARKERS if not (package and marker.startswith("setup."))):
            return candidate
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        folder = folder.parent
    return folder


def find_project(entry: Path, parse=None, root: Path | None = None, read=None, limit: int | None = None) -> Project:
    """The entry and every project module it imports, directly or through other project modules.
    `parse` turns a file's text into a module and `read` a path into text (the engine's, which
    report syntax errors and decode by the file's coding cookie); `limit`: at most this many
    modules, the nearest imports first (a script inside a library's own repository reaches
    hundreds of its modules)."""
    parse = parse or (lambda text, _path: cst.parse_module(text))
    read = read or (lambda path: path.read_text(encoding="utf-8"))
    entry = entry.resolve()
    root = (root or project_root(entry)).resolve()
    project = Project(root=root, entry=entry)
    search = [entry.parent] + [folder for folder in _import_roots(root) if folder != entry.parent]
    todo = [(entry, "__main__")]
    while todo:
        path, name = todo.pop(0)
        if path in project.modules:
            continue
        if limit is not None and len(project.modules) >= limit:
            project.truncated = True
            break
        try:
            module = parse(read(path), str(path))
        except Exception as exc:  # noqa: BLE001 - the engine's ConvertError, or a decoding error
            if path == entry:
                raise
            line = getattr(exc, "line", None)
            why = (getattr(exc, "message", None) or str(exc)) + (f", line {line} of {path.name}" if line else "")
            project.unreadable[name] = why  # not followed: said where it is imported
            continue
        project.modules[path] = name
        project.parsed[path] = module
        if path == entry:  # `sys.path.append(ROOT)`, `PYTHONPATH=..`: modules beside those folders are the project's
            for folder in [*path_folders(module, entry, parse, read), *python_path_roots(entry, root)]:
                if folder not in search:
                    search.append(folder)
                if root not in (folder, *folder.parents):
                    root = Path(os.path.commonpath([root, folder]))
            project.root = root
        found = []
        for dotted in _imported_names(module, name, path):
            target = _resolve(dotted, search, root)
            if target is not None and target != path and target not in found:
                found.append(target)
                todo.append((target, dotted))
        project.imports[path] = found
    return project


def path_folders(module: cst.Module, path: Path, parse, read) -> list[Path]:
    """The folders a script puts on sys.path at import: its own `sys.path.insert(...)`, and those
    of the modules beside it it imports for that (`import _init_paths` first, whose code adds
    `../lib`)."""
    folders = added_folders(module, path)
    top = [small for stmt in module.body if isinstance(stmt, cst.SimpleStatementLine) for small in stmt.body]
    for node in top:
        for alias in node.names if isinstance(node, cst.Import) else ():
            sibling = path.parent / f"{dotted_name(alias.name)}.py"
            if "." not in (dotted_name(alias.name) or ".") and sibling.is_file() and sibling != path:
                try:
                    text = read(sibling)
                    if "sys.path" in text:
                        folders += [f for f in added_folders(parse(text, str(sibling)), sibling) if f not in folders]
                except Exception:  # noqa: BLE001 - unreadable: adds nothing we can see
                    continue
    return folders


MAX_IMPORTER_FILES = 1000  # a project root bigger than this is not searched for importers
MAX_LOOSE_FILES = 500  # above this, only import lines that name the module with its package are followed
MAX_IMPORTED_BY_IMPORTERS = 62  # modules the importers import besides, read at most


def find_importers(target: Path, parse, read=None, root: Path | None = None) -> dict[Path, cst.Module]:
    """The rest of the programs `target` is part of, parsed: the project's files that import it,
    directly or through other files (a package's `__init__` that re-exports it), and the files
    those import. A helper module's callers complete what it starts: the training script
    destroys the group the helper made; a trainer beside the loader module calls `set_epoch`
    on the sampler the loader module built.

    Files are read under the project root (hidden folders, virtual environments and caches left
    out, at most `MAX_IMPORTER_FILES`); only those whose text names an imported file are parsed."""
    read = read or (lambda path: path.read_text(encoding="utf-8"))
    target = target.resolve()
    root = (root or project_root(target)).resolve()
    texts: dict[Path, str] = {}
    for path in _python_files(root):
        try:
            texts[path] = read(path)
        except (OSError, UnicodeDecodeError):
            continue
    found: dict[Path, cst.Module] = {}
    search: dict[Path, list[Path]] = {}  # where each importer's imports are looked up (its sys.path)
    imported, todo = {target}, [target]
    while todo:
        reached = todo.pop()
        stem = reached.parent.name if reached.name == "__init__.py" else reached.stem
        names_it = re.compile(rf"^\s*(from|import)\b[^\n#]*\b{re.escape(stem)}\b", re.MULTILINE)  # an import line naming it
        if len(texts) > MAX_LOOSE_FILES:  # a large project: an import line naming it with its package, or relative
            names_it = _names_with_package(reached, stem)
        dotted = _dotted_under(reached, root)
        for path, text in texts.items():
            if path in imported or stem not in text or (_is_test(path, root) and not _is_test(target, root)):
                continue  # (a test imports the module to try it: it is not a run of the program)
            if not names_it.search(text):
                if any(pattern.fullmatch(dotted) for pattern in _dynamic_imports(text)):
                    try:  # `importlib.import_module(f"app.{name}.train")`: a launcher that picks its module by name
                        found[path] = found.get(path) or parse(text, str(path))
                    except Exception:  # noqa: BLE001 - a file that does not parse imports nothing we can see
                        continue
                    imported.add(path)
                    todo.append(path)
                continue
            try:
                module = found.get(path) or parse(text, str(path))
            except Exception:  # noqa: BLE001 - a file that does not parse imports nothing we can see
                continue
            name = _dotted_under(path, root)
            search[path] = [path.parent, *_import_roots(root), *path_folders(module, path, parse, read)]
            if any(_resolve(d, search[path], root) == reached for d in _imported_names(module, name, path)):
                found[path] = module
                imported.add(path)
                todo.append(path)
    # and what the importers import besides (the trainer beside the loader module, both imported by
    # main.py): the scripts' imports first (`if __name__ == "__main__":`), then the library's
    scripts = [p for p in found if _MAIN_GUARD.search(texts.get(p, ""))]
    for todo in (scripts, [p for p in found if p not in scripts]):
        while todo and len(found) < MAX_IMPORTED_BY_IMPORTERS:  # the nearest first, as find_project's limit
            path = todo.pop(0)
            for dotted in _imported_names(found[path], _dotted_under(path, root), path):
                other = _resolve(dotted, search.get(path, [path.parent, root]), root)
                if other is None or other == target or other in found or other not in texts:
                    continue
                try:
                    found[other] = parse(texts[other], str(other))
                except Exception:  # noqa: BLE001 - unreadable: left out
                    continue
                outer = search.get(path, [path.parent, root])  # sys.path is the process's: the script's folder stays on it
                search[other] = list(dict.fromkeys([other.parent, *outer]))
                todo.append(other)
    return found


_MAIN_GUARD = re.compile(r"""^if\s+__name__\s*==\s*["']__main__["']""", re.MULTILINE)  # a file run as a program


_INTERPRETER = re.compile(r"""sys\.executable|["']python[\d.]*["']""")  # `[sys.executable] + args`, `['python3'] + command`


def sibling_launchers(target: Path, read=None) -> list[cst.Module]:
    """The files beside `target` that start processes of the interpreter themselves and send
    their output somewhere (`subprocess.Popen([sys.executable] + args, stdout=...)`,
    `Popen(['python3'] + command, stdout=...)`: a launcher of the project's own, run as `python
    multiproc.py train.py ...` or `distribute.py --script train.py`), parsed."""
    read = read or (lambda path: path.read_text(encoding="utf-8"))
    found = []
    try:
        siblings = sorted(p for p in target.resolve().parent.glob("*.py") if p.resolve() != target.resolve())
    except OSError:
        return []
    for path in siblings[:MAX_IMPORTER_FILES]:
        try:
            text = read(path)
            if _INTERPRETER.search(text) and "stdout=" in text:
                found.append(cst.parse_module(text))
        except Exception:  # noqa: BLE001 - unreadable or not Python 3: not a launcher we can read
            continue
    return found


_IMPORT_MODULE = re.compile(r"import_module\(\s*f?([\"'])([\w.{}\[\]'\"]+?)\1\s*[,)]")


def _dynamic_imports(text: str) -> list[re.Pattern]:
    """The module names `importlib.import_module(f"app.{name}.train")` calls can load, as patterns
    (each `{...}` one or more name parts)."""
    patterns = []
    for match in _IMPORT_MODULE.finditer(text):
        parts = re.split(r"\{[^}]*\}", match.group(2))
        if len(parts) > 1 and any(p.strip(".") for p in parts):
            patterns.append(re.compile(r"[\w.]+".join(re.escape(p) for p in parts)))
    return patterns


def _python_files(root: Path) -> list[Path]:
    skip = {"venv", "env", "site-packages", "node_modules", "__pycache__", "build", "dist"}
    files: list[Path] = []
    for folder, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skip and not d.endswith(".egg-info"))
        files += [Path(folder, f).resolve() for f in sorted(filenames) if f.endswith(".py")]
        if len(files) > MAX_IMPORTER_FILES:
            return []
    return files


def _is_test(path: Path, root: Path) -> bool:
    """A test module of the project (`tests/`, `test_*.py`, `*_test.py`, `conftest.py`)."""
    name = path.name
    return name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py" or any(
        part in ("test", "tests") for part in path.relative_to(root).parent.parts
    )


def _names_with_package(target: Path, stem: str) -> re.Pattern:
    """An import line naming the module with its package (`from s3prl.utility.helper import`,
    `from utility import helper`) or relatively (`from .helper import`, `from . import helper`)."""
    package = re.escape((target.parent.parent if target.name == "__init__.py" else target.parent).name)
    stem = re.escape(stem)
    return re.compile(
        rf"^\s*(?:(?:from|import)\b[^\n#]*(?:\b{package}\.{stem}\b|\b{package}\s+import\b[^\n#]*\b{stem}\b)"
        rf"|from\s+\.+\s*import\b[^\n#]*\b{stem}\b|from\s+\.+{stem}\b)",
        re.MULTILINE,
    )


def _dotted_under(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(module: cst.Module, name: str, path: Path) -> list[str]:
    """The dotted names a module imports (for `from a import b`: `a.b` first, then `a`, since
    `b` may be a submodule or a name defined in `a`), relative imports made absolute."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[str] = []
    for node in _imports(module):
        if isinstance(node, cst.Import):
            for alias in node.names:
                dotted = dotted_name(alias.name)
                if dotted:
                    parts = dotted.split(".")
                    found += [".".join(parts[: i + 1]) for i in range(len(parts))]  # `import a.b` runs a/__init__ too
            continue
        base = dotted_name(node.module) if node.module is not None else ""
        if node.relative:
            up = len(node.relative)
            parts = package.split(".") if package and package != "__main__" else []
            if up - 1 > len(parts):
                continue
            parent = ".".join(parts[: len(parts) - (up - 1)])
            base = ".".join(p for p in (parent, base) if p)
        if not base:
            continue
        if not isinstance(node.names, cst.ImportStar):
            found += [f"{base}.{dotted_name(a.name)}" for a in node.names if dotted_name(a.name)]
        parts = base.split(".")
        found += [".".join(parts[: i + 1]) for i in range(len(parts))]
    return found


def _imports(module: cst.Module):
    """Every import statement, at any depth (imports inside functions run too)."""
    from ddpify.analysis.index import iter_nodes

    for node in iter_nodes(module):
        if isinstance(node, (cst.Import, cst.ImportFrom)):
            yield node


def _import_roots(root: Path) -> list[Path]:
    """Where the project's own packages are imported from: its root, and `src/` in a src layout
    (`src/mattersim/...` installed as `mattersim`)."""
    return [root, root / "src"] if (root / "src").is_dir() and not (root / "src" / "__init__.py").is_file() else [root]


def _resolve(dotted: str, search: list[Path], root: Path) -> Path | None:
    """The file under `root` that `import dotted` would load, looked up in `search` order."""
    parts = dotted.split(".")
    for base in search:
        folder = base.joinpath(*parts[:-1])
        for candidate in (folder / f"{parts[-1]}.py", folder / parts[-1] / "__init__.py"):
            if candidate.is_file():
                resolved = candidate.resolve()
                return resolved if resolved.is_relative_to(root) else None
    return None


@dataclass(frozen=True)
class ProjectFacts:
    """What the analysis of one module needs to know about the rest of the project."""

    runs_backward: frozenset[str] = frozenset()  # dotted module names whose code runs a backward pass
    builds_loaders: frozenset[str] = frozenset()  # dotted module names whose code builds a DataLoader
    names_cuda: bool = False  # some module names CUDA (a "cuda" string, `.cuda()`, `torch.cuda.*`)
    unreadable: tuple[tuple[str, str], ...] = ()  # (dotted name, why) of project modules the analysis cannot read
    # what the functions of the modules besides the entry do with their parameters (asked per call)
    summaries: FunctionSummaries | None = field(default=None, compare=False)
    # `config.run_folder`: module-level functions that name a folder by the clock, make it and
    # return its name (every rank would make its own, racing; analysis.schedule.clock_names)
    clock_folder_makers: frozenset[str] = frozenset()


def project_facts(modules: dict[str, cst.Module], packages: frozenset[str] = frozenset()) -> ProjectFacts:
    """Facts from every module of a project (dotted name -> parsed module; `packages`: the names
    that are a package's `__init__`)."""
    from ddpify.analysis import names as N
    from ddpify.analysis.index import index_of, main_guard
    from ddpify.analysis.summaries import FunctionSummaries

    backward, loaders, makers = set(), set(), set()
    cuda = False
    for name, module in modules.items():
        index = index_of(module)
        cuda = cuda or names_cuda(module, index)
        makers.update(f"{name}.{fn.name.value}" for fn in module.body if _makes_clock_folder(index, fn))
        test = main_guard(module) if name != "__main__" else None
        self_test = set(index.calls_under(test)) if test is not None else set()  # runs only as a script
        for ci in index.calls:
            if ci in self_test:
                continue
            if ci.receiver is not None and ci.name == "backward":
                backward.add(name)
            if ci.qnames & N.DATALOADER:
                loaders.add(name)
    others = {name: module for name, module in modules.items() if name != "__main__"}
    summaries = FunctionSummaries.of_project(others, packages) if others else None
    return ProjectFacts(
        runs_backward=frozenset(backward), builds_loaders=frozenset(loaders), names_cuda=cuda, summaries=summaries,
        clock_folder_makers=frozenset(makers),
    )


def names_cuda(module: cst.Module, index=None) -> bool:
    """Does the module name CUDA anywhere: a `"cuda"`/`"cuda:N"` string (an option's default, a
    parameter's default, `args.device = "cuda"`), `.cuda()`, or an API under `torch.cuda`? A device
    the analysis cannot follow is then this process's accelerator, never the CPU."""
    from ddpify.analysis import names as N
    from ddpify.analysis.index import index_of, iter_nodes

    index = index or index_of(module)
    if any(ci.name == "cuda" or any(q.startswith("torch.cuda.") for q in ci.qnames) for ci in index.calls):
        return True
    return any(isinstance(node, (cst.SimpleString, cst.FormattedString)) and N.is_cuda_string(node) for node in iter_nodes(module))


def makes_clock_folder(calls, qnames_of, fn: cst.FunctionDef) -> bool:
    """Does `fn` read the clock, make a folder and return a value (the folder's name)? `calls`:
    the calls inside `fn`; `qnames_of(call)`: their qualified names."""
    from ddpify.analysis import names as N
    from ddpify.analysis.index import iter_nodes

    if not any(qnames_of(c) & N.CLOCK for c in calls):
        return False
    if not any(qnames_of(c) & (N.MAKEDIRS | N.MKDIR) or N.call_name(c) == "mkdir" for c in calls):
        return False
    return any(isinstance(n, cst.Return) and n.value is not None for n in iter_nodes(fn))


def _makes_clock_folder(index, fn: cst.CSTNode) -> bool:
    if not isinstance(fn, cst.FunctionDef):
        return False
    calls = [ci.node for ci in index.calls_under(fn)]
    return makes_clock_folder(calls, lambda c: index.qnames(c.func), fn)
