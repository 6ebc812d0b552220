"""The folders a script puts on `sys.path` itself, read without running it.

    ROOT = os.path.dirname(os.path.abspath(__file__)) + "/../"
    sys.path.append(ROOT)                                   # the folder above the script's
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lib"))
    sys.path.append(str(Path(__file__).resolve().parent.parent))

Such a script imports modules that live beside that folder (`import utils.lib_rnn`): they belong
to its project. The path is evaluated from `__file__` with the few operations scripts use
(`os.path.dirname/abspath/realpath/join/normpath`, `+` on strings, `Path(...)`, `.parent`,
`.resolve()`, `/`, `str(...)`), through module-level names bound once; anything else is not a
folder this module can know, and is left out. A relative string is taken from the script's folder
(where it is usually run).
"""

from __future__ import annotations

import os
from pathlib import Path

import libcst as cst

from ddpify.analysis.index import dotted_name

ADDERS = ("sys.path.append", "sys.path.insert", "sys.path.extend")
PATH_FUNCTIONS = {"os.path.dirname": os.path.dirname, "os.path.abspath": os.path.abspath,
                  "os.path.realpath": os.path.abspath, "os.path.normpath": os.path.normpath}  # fmt: skip


def added_folders(module: cst.Module, script: Path) -> list[Path]:
    """The existing folders the module-level code of `script` appends or inserts into sys.path,
    directly or through a helper of the module (`def add_path(p): sys.path.insert(0, p)`, then
    `add_path(osp.join(this_dir, "..", "lib"))`)."""
    aliases = _aliases(module)
    helpers = _adder_helpers(module, aliases)
    bound: dict[str, cst.BaseExpression] = {}
    found: list[Path] = []
    for stmt in _statements(module.body):
        for small in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
            if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
                bound[small.targets[0].target.value] = small.value
            call = small.value if isinstance(small, cst.Expr) else None
            if not isinstance(call, cst.Call) or not call.args:
                continue
            name = _canonical(dotted_name(call.func), aliases)
            if name in ADDERS:
                arg = call.args[-1]
            elif name in helpers and len(call.args) > helpers[name]:
                arg = call.args[helpers[name]]
            else:
                continue
            value = _value(arg.value, bound, script, aliases)
            folder = Path(value) if isinstance(value, (str, Path)) else None
            if folder is not None:
                folder = (script.parent / folder).resolve() if not folder.is_absolute() else folder.resolve()
                if folder.is_dir() and folder not in found:
                    found.append(folder)
    return found


def _aliases(module: cst.Module) -> dict[str, str]:
    """Local names of the module-level imports: `import os.path as osp` -> osp: os.path,
    `from os.path import join` -> join: os.path.join."""
    found: dict[str, str] = {}
    for stmt in module.body:
        for small in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
            if isinstance(small, cst.Import):
                for alias in small.names:
                    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                        found[alias.asname.name.value] = dotted_name(alias.name) or ""
            elif isinstance(small, cst.ImportFrom) and small.module is not None and not small.relative:
                for alias in small.names if not isinstance(small.names, cst.ImportStar) else ():
                    local = alias.asname.name if alias.asname is not None else alias.name
                    if isinstance(local, cst.Name):
                        found[local.value] = f"{dotted_name(small.module)}.{dotted_name(alias.name)}"
    return found


def _canonical(name, aliases: dict[str, str]) -> str:
    """`osp.join` -> `os.path.join` (the import it names), `Path` stays `Path`."""
    if not name:
        return ""
    first, _, rest = name.partition(".")
    full = aliases.get(first)
    if full is None or full == "pathlib.Path":
        return name
    return f"{full}.{rest}" if rest else full


def _adder_helpers(module: cst.Module, aliases: dict[str, str]) -> dict[str, int]:
    """Module-level functions that put one of their parameters on sys.path: name -> its position."""
    found: dict[str, int] = {}
    for stmt in module.body:
        if not isinstance(stmt, cst.FunctionDef):
            continue
        params = [p.name.value for p in stmt.params.params]
        for node in _calls(stmt.body):
            if _canonical(dotted_name(node.func), aliases) in ADDERS and node.args:
                last = node.args[-1].value
                if isinstance(last, cst.Name) and last.value in params:
                    found[stmt.name.value] = params.index(last.value)
    return found


def _calls(node: cst.CSTNode):
    if isinstance(node, cst.Call):
        yield node
    for child in node.children:
        yield from _calls(child)


def _statements(body):
    """Module-level statements, and those of `if` blocks at module level (`if 1: sys.path.append(...)`)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, cst.If) and isinstance(stmt.body, cst.IndentedBlock):
            yield from _statements(stmt.body.body)


def _value(node: cst.BaseExpression, bound: dict, script: Path, aliases: dict, depth: int = 0):
    """A str or Path the expression evaluates to, or None."""
    if depth > 8:
        return None
    if isinstance(node, cst.Name):
        if node.value == "__file__":
            return str(script)
        return _value(bound[node.value], bound, script, aliases, depth + 1) if node.value in bound else None
    if isinstance(node, cst.SimpleString):
        return node.evaluated_value if isinstance(node.evaluated_value, str) else None
    if isinstance(node, cst.BinaryOperation):
        left, right = _value(node.left, bound, script, aliases, depth + 1), _value(node.right, bound, script, aliases, depth + 1)
        if left is None or right is None:
            return None
        if isinstance(node.operator, cst.Add) and isinstance(left, str) and isinstance(right, str):
            return left + right
        if isinstance(node.operator, cst.Divide) and isinstance(left, Path):
            return left / str(right)
        return None
    if isinstance(node, cst.Attribute):
        inner = _value(node.value, bound, script, aliases, depth + 1)
        return inner.parent if isinstance(inner, Path) and node.attr.value == "parent" else None
    if not isinstance(node, cst.Call):
        return None
    args = [_value(a.value, bound, script, aliases, depth + 1) for a in node.args]
    if any(a is None for a in args):
        return None
    name = _canonical(dotted_name(node.func), aliases)
    if name in PATH_FUNCTIONS and len(args) == 1:
        return PATH_FUNCTIONS[name](str(args[0]))
    if name == "os.path.join" and args:
        return os.path.join(*map(str, args))
    if name in ("Path", "pathlib.Path") and args:
        return Path(*map(str, args))
    if name == "str" and len(args) == 1:
        return str(args[0])
    if isinstance(node.func, cst.Attribute) and node.func.attr.value in ("resolve", "absolute") and not args:
        inner = _value(node.func.value, bound, script, aliases, depth + 1)
        return inner.resolve() if isinstance(inner, Path) else None
    return None


def python_path_roots(entry: Path, root: Path) -> list[Path]:
    """The PYTHONPATH entries that hold the entry's folder, at most two levels above it and not
    above the project's `root` when a marker names one (`cd pkg && PYTHONPATH=.. python train.py`):
    they hold its package. A PYTHONPATH far above (a home folder) says nothing of the project."""
    folder = entry.resolve().parent
    near = [folder, *list(folder.parents)[:2]]
    marked = root != folder
    found = []
    for item in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        path = Path(item).resolve()
        if path in near and path != folder and not (marked and root not in (path, *path.parents) and path in root.parents):
            found.append(path)
    return found
