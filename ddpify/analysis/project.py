"""The project an entry script belongs to: the modules of its own that it imports, found the way
Python finds them, and nothing from site-packages or the standard library.

`python train.py` puts the entry's folder first on `sys.path`; many repositories also run with
their root on the path (`PYTHONPATH=.` or an editable install), so a module is looked up in the
entry's folder, then in the project root (the nearest folder above it with `.git`,
`pyproject.toml`, `setup.py` or `setup.cfg`; the entry's folder when there is none). Packages
(`models/__init__.py`), submodules (`from models import resnet`), `import a.b.c` and relative
imports (`from .base import X`, `from .. import utils`) are followed, transitively. A name that
resolves to no file under the root (torch, numpy, a module in site-packages) is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from ddpify.analysis.index import dotted_name

ROOT_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")


@dataclass
class Project:
    """An entry script and the project modules it reaches, in the order they were found."""

    root: Path
    entry: Path
    modules: dict[Path, str] = field(default_factory=dict)  # file -> dotted module name ("__main__" for the entry)
    imports: dict[Path, list[Path]] = field(default_factory=dict)  # file -> the project files it imports

    @property
    def files(self) -> list[Path]:
        return list(self.modules)


def project_root(entry: Path) -> Path:
    """The nearest folder at or above the entry's with a project marker (else the entry's folder)."""
    folder = entry.resolve().parent
    for candidate in (folder, *folder.parents):
        if any((candidate / marker).exists() for marker in ROOT_MARKERS):
            return candidate
    return folder


def find_project(entry: Path, parse=None, root: Path | None = None, read=None) -> Project:
    """The entry and every project module it imports, directly or through other project modules.
    `parse` turns a file's text into a module and `read` a path into text (the engine's, which
    report syntax errors and decode by the file's coding cookie)."""
    parse = parse or (lambda text, _path: cst.parse_module(text))
    read = read or (lambda path: path.read_text(encoding="utf-8"))
    entry = entry.resolve()
    root = (root or project_root(entry)).resolve()
    project = Project(root=root, entry=entry)
    search = [entry.parent] + ([root] if root != entry.parent else [])
    todo = [(entry, "__main__")]
    while todo:
        path, name = todo.pop(0)
        if path in project.modules:
            continue
        project.modules[path] = name
        module = parse(read(path), str(path))
        found = []
        for dotted in _imported_names(module, name, path):
            target = _resolve(dotted, search, root)
            if target is not None and target != path and target not in found:
                found.append(target)
                todo.append((target, dotted))
        project.imports[path] = found
    return project


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

    optimizer_methods: frozenset[str] = frozenset()  # `model.configure_optimizers(...)`: methods that build an optimizer over self's parameters
    runs_backward: frozenset[str] = frozenset()  # dotted module names whose code runs a backward pass
    builds_loaders: frozenset[str] = frozenset()  # dotted module names whose code builds a DataLoader
    parameter_methods: frozenset[str] = frozenset()  # `model.get_1x_lr_params()`: model methods that hand out its parameters
    module_classes: frozenset[str] = frozenset()  # qualified names of the project's nn.Module classes
    plain_classes: frozenset[str] = frozenset()  # ... and of its classes that are certainly no nn.Module
    # `optim.optim4GPU` -> what the optimizer it builds trains (`Trains("model", 1)`: its argument `model`)
    factories: dict = field(default_factory=dict, hash=False, compare=False)


def project_facts(modules: dict[str, cst.Module]) -> ProjectFacts:
    """Facts from every module of a project (dotted name -> parsed module)."""
    from ddpify.analysis import names as N
    from ddpify.analysis.index import index_of
    from ddpify.analysis.optimizers import Summaries

    backward, loaders = set(), set()
    for name, module in modules.items():
        for ci in index_of(module).calls:
            if ci.receiver is not None and ci.name == "backward":
                backward.add(name)
            if ci.qnames & N.DATALOADER:
                loaders.add(name)
    facts = ProjectFacts(runs_backward=frozenset(backward), builds_loaders=frozenset(loaders))
    for _ in range(2):  # a module's facts may rest on a module summarised after it
        found = [Summaries(index_of(module), known=facts).exported(name) for name, module in modules.items()]
        facts = ProjectFacts(
            optimizer_methods=frozenset().union(*(f["optimizer_methods"] for f in found)),
            runs_backward=facts.runs_backward,
            builds_loaders=facts.builds_loaders,
            parameter_methods=frozenset().union(*(f["parameter_methods"] for f in found)),
            module_classes=frozenset().union(*(f["module_classes"] for f in found)),
            plain_classes=frozenset().union(*(f["plain_classes"] for f in found)),
            factories={q: t for f in found for q, t in f["factories"].items()},
        )
    return facts
