"""Convert a project: an entry script and the modules of its own that it imports, as one program.

The analysis reads every module the entry reaches (`analysis.project`), follows calls, returns
and attributes from module to module, and each pass plans its edits wherever the code is: a
loop in `engine.train_fn(loader, model, optimizer)`, a loader from `utils.get_loader()`, a
`Trainer` of a library package, a checkpoint written by `utils.save_checkpoint(...)`. Modules
with nothing to change (models, datasets) stay as they are. A script that imports no module of
its own is a project of one module.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from ddpify.analysis.project import Project, ProjectFacts, find_project, project_facts
from ddpify.engine import ConvertError, ConvertOptions, ConvertResult, convert_source, parse, read_source
from ddpify.parsing import quiet_compile, runs_deep
from ddpify.files import write_atomic

# Not copied into a project's converted copy: data, caches, environments, version control.
SKIP_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".venv", "venv", "env", ".tox", ".mypy_cache",
                       ".pytest_cache", ".ruff_cache", "data", "datasets", "wandb", "runs", "outputs",
                       "checkpoints", "node_modules", ".ipynb_checkpoints"})  # fmt: skip
LARGE = 10 * 1024 * 1024  # bytes: a file this large is data, not code


@dataclass
class ProjectResult:
    """What converting a project did: the files whose code changed, with their results."""

    project: Project
    changed: dict[Path, tuple[ConvertResult, str, str]] = field(default_factory=dict)  # file -> (result, source, encoding)
    already_distributed: bool = False  # set up, wrapped and sharded already: nothing converted


@runs_deep
def is_project(entry: Path, root: Path | None = None) -> bool:
    """Does the entry import a module of its own project? (Then the project is converted as one
    program; a script that imports none is a project of one module.)"""
    try:
        project = find_project(entry, parse=parse, root=root, read=lambda path: read_source(path)[0])
    except ConvertError:
        return False  # the entry's own conversion reports what is wrong with it
    return len(project.files) > 1 or bool(project.unreadable)


@runs_deep
def convert_project(entry: Path, options: ConvertOptions | None = None, root: Path | None = None) -> ProjectResult:
    """Convert `entry` and the project modules it reaches as one program: the analysis follows
    calls, returns and attributes from module to module, and each module gets the edits for its
    own code; raise ConvertError if unsafe."""
    options = options or ConvertOptions()
    if not entry.is_file():
        read_source(entry)  # the engine's one-line error for a missing file or a folder
    project = find_project(entry, parse=parse, root=root, read=lambda path: read_source(path)[0])
    sources = {path: read_source(path) for path in project.files}
    if len(project.files) == 1:
        text, encoding = sources[project.entry]
        facts = ProjectFacts(unreadable=tuple(project.unreadable.items())) if project.unreadable else None
        converted = convert_source(text, str(project.entry), options, facts)
        result = ProjectResult(project)
        if not converted.already_distributed and converted.code != text:
            result.changed[project.entry] = (converted, text, encoding)
        return result
    modules = {project.modules[path]: project.parsed[path] for path in project.files}  # parsed once, by find_project
    facts = dataclasses.replace(project_facts(modules, _packages(project)), unreadable=tuple(project.unreadable.items()))
    return _convert_together(project, sources, modules, options, facts)


def _convert_together(project: Project, sources, modules: dict[str, cst.Module], options: ConvertOptions, facts) -> ProjectResult:
    """Convert the project's entry and modules (dotted name -> parsed) as one program (the analysis follows
    calls from module to module), and verify every changed file (it compiles; converting the
    converted project again changes nothing); raise ConvertError if it cannot be done safely."""
    from ddpify.analysis.script import AnalysisError
    from ddpify.convert import convert_modules

    paths = {name: path for path, name in project.modules.items()}
    modules = dict(modules)
    entry_module = modules.pop("__main__")
    packages = _packages(project)
    try:
        converted = convert_modules(entry_module, modules, packages, options, facts)
    except AnalysisError as exc:
        raise ConvertError(str(project.entry), exc.line, exc.message) from None
    result = ProjectResult(project)
    if converted is None:
        result.already_distributed = True
        return result
    for name, outcome in converted.items():
        path = paths[name or "__main__"]
        text, encoding = sources[path]
        if outcome.code != text:
            result.changed[path] = (outcome, text, encoding)
    _verify_project(result, {"__main__": entry_module, **modules}, options, facts, packages)
    return result


def _verify_project(result: ProjectResult, parsed: dict[str, cst.Module], options: ConvertOptions, facts, packages: frozenset[str]) -> None:
    """Every changed module compiles, and (with `options.self_check`) converting the converted
    project changes nothing."""
    from ddpify.convert import replan_modules

    project = result.project
    codes = {path: (result.changed[path][0].code if path in result.changed else None) for path in project.files}
    for path, code in codes.items():
        try:
            if code is not None:
                quiet_compile(code, str(path))
        except SyntaxError as exc:  # pragma: no cover - a bug
            raise ConvertError(str(path), exc.lineno or 1, f"internal error: the converted module does not compile ({exc.msg})") from None
    if not options.self_check:
        return
    modules = {  # an unchanged module as parsed
        project.modules[path]: parsed[project.modules[path]] if code is None else cst.parse_module(code) for path, code in codes.items()
    }
    entry = modules.pop("__main__")
    planned = replan_modules(entry, modules, packages, dataclasses.replace(options, run=None), facts)  # as engine._verify
    if planned:  # pragma: no cover - a bug
        name, line, what = planned[0]
        raise ConvertError(
            str(project.entry), line, f"internal error: converting the converted project again would change it (pass {name}: {what})"
        )


def _packages(project: Project) -> frozenset[str]:
    """The dotted names of the project's modules that are a package's `__init__`."""
    return frozenset(name for path, name in project.modules.items() if path.name == "__init__.py")


def copy_project(project: Project, out: Path, converted: dict[Path, str]) -> list[Path]:
    """A runnable copy of the project's root in `out`: converted files written with their new
    code, every other file byte for byte, except data folders, caches, environments and large
    files. A data-named folder that is a package or holds modules of the project (`datasets/`)
    keeps its Python files and leaves out the rest. Returns what was left out (relative to the root;
    such a folder is listed too)."""
    left_out: list[Path] = []
    code_folders = {path.resolve().parent for path in project.files}
    modules_only: list[Path] = []  # data-named folders whose Python files are copied
    for folder, dirs, files in os.walk(project.root):
        here = Path(folder)
        for name in list(dirs):
            sub = (here / name).resolve()
            if sub == out.resolve() or name in SKIP_DIRS:
                left_out.append((here / name).relative_to(project.root))
                package = (sub / "__init__.py").is_file()  # imported through a sys.path the code sets, maybe
                if sub != out.resolve() and (package or any(sub == c or sub in c.parents for c in code_folders)):
                    modules_only.append(sub)
                    continue
                dirs.remove(name)
        within = any(here.resolve() == m or m in here.resolve().parents for m in modules_only)
        for name in files:
            path = (here / name).resolve()
            target = out / path.relative_to(project.root)
            if path in converted:
                write_atomic(target, converted[path].encode("utf-8"), make_parents=True)
            elif within and path.suffix != ".py":
                continue
            elif path.stat().st_size > LARGE:
                left_out.append(path.relative_to(project.root))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    return sorted(left_out)


def reads_left_out(project: Project, left_out: list[Path]) -> list[tuple[Path, Path, int]]:
    """The left-out paths the project's code names in a string (`"data/train.csv"`,
    `"./checkpoints"`): (path, file, line), so the user can copy or link them."""
    from ddpify.analysis.index import index_of, iter_nodes

    wanted = {p.as_posix(): p for p in left_out}
    found = []
    for path in project.files:
        module = parse(read_source(path)[0], str(path))
        index = index_of(module)
        for node in iter_nodes(module):
            value = getattr(node, "evaluated_value", None) if isinstance(node, cst.SimpleString) else None
            if not isinstance(value, str):
                continue
            value = value.removeprefix("./")
            hit = next((p for name, p in wanted.items() if value == name or value.startswith(name + "/")), None)
            if hit is not None and all(hit != f[0] for f in found):
                found.append((hit, path, index.line(node)))
    return found
