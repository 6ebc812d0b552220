"""Helpers for tests that check a small project written into a temporary folder."""

from __future__ import annotations

import textwrap
from pathlib import Path

from ddpify.check.rule import select_rules
from ddpify.check.runner import check_paths


def codes(path: Path, select: str | None = None) -> list[str]:
    """`"<line> <code>"` of each finding `ddpify check` reports in `path`, read with its project."""
    [result] = check_paths([(path, frozenset(select_rules(select)))], jobs=1)
    return [f"{f.line} {f.code}" for f in result.findings]


def write_files(folder: Path, files: dict[str, str]) -> None:
    """Write each file (its text dedented) under `folder`, making folders as needed."""
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(textwrap.dedent(text))
