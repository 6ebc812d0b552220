"""The layout the code keeps: conversion passes never import one another (what they share lives
in modules of its own: convert/samplers.py, convert/metrics.py, convert/emit.py, the analysis)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from ddpify.convert import PASSES

ROOT = Path(__file__).resolve().parent.parent


def test_passes_never_import_other_passes():
    names = {p.__name__ for p in PASSES}
    offenders = []
    for convert_pass in PASSES:
        tree = ast.parse(Path(convert_pass.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in names:
                offenders.append(f"{convert_pass.__name__} imports {node.module}")
            if isinstance(node, ast.ImportFrom) and node.module == "ddpify.convert":
                offenders += [f"{convert_pass.__name__} imports {a.name}" for a in node.names if f"ddpify.convert.{a.name}" in names]
    assert not offenders, offenders


QUALIFIED_NAME = re.compile(r"^torch\.[\w.]*$")


def _name_literals(path: Path) -> list[str]:
    """The string constants of a module that spell a qualified torch name (`"torch.save"`,
    `"torch.cuda."`), docstrings left out; code templates (`"torch.device({x})"`) and messages
    (`"`torch.save` on every rank"`) do not match."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        and QUALIFIED_NAME.match(node.value)
    ]


def test_torch_names_live_in_the_vocabulary():
    """Every qualified torch name the passes and the rules match lives once in
    analysis/names.py, with its alias spellings (`torch.serialization.save` is `torch.save`)."""
    folders = [ROOT / "ddpify" / "convert", ROOT / "ddpify" / "check" / "rules"]
    offenders = [hit for folder in folders for path in sorted(folder.rglob("*.py")) for hit in _name_literals(path)]
    assert not offenders, "\n".join(offenders)


def test_no_module_imports_libcst_matchers():
    """`libcst.matchers` costs as much to import as libcst itself (start-up of `ddpify convert`):
    the code tests node shapes with the helpers of analysis/names.py and walks with `iter_nodes`."""
    offenders = []
    for path in sorted((ROOT / "ddpify").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            imported = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                imported = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(name == "libcst.matchers" or name.startswith("libcst.matchers.") for name in imported):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders
