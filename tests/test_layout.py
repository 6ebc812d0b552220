"""The layout the code keeps: conversion passes never import one another (what they share lives
in modules of its own: convert/samplers.py, convert/metrics.py, convert/emit.py, the analysis)."""

from __future__ import annotations

import ast
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
