"""Printing findings: text (ruff-like), JSON, GitHub workflow annotations, statistics."""

from __future__ import annotations

import json
from collections import Counter
from typing import Iterable

import typer

from ddpify.check.rule import Finding, rules_by_code

FORMATS = ("text", "json", "github")


def format_text(findings: Iterable[Finding], color: bool = False) -> str:
    lines = []
    for f in findings:
        location = f"{f.path}:{f.line}:{f.column}:"
        code = f.code
        fix = " [*]" if f.fixable else ""
        if color:
            location = typer.style(location, bold=True)
            code = typer.style(code, fg=typer.colors.RED, bold=True)
            fix = typer.style(fix, fg=typer.colors.CYAN) if fix else ""
        lines.append(f"{location} {code}{fix} {f.message}")
    return "\n".join(lines)


def format_json(findings: Iterable[Finding]) -> str:
    return json.dumps([f.as_dict() for f in findings], indent=2)


def _escape_property(value: str) -> str:
    return value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A").replace(":", "%3A").replace(",", "%2C")


def _escape_data(value: str) -> str:
    return value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def format_github(findings: Iterable[Finding]) -> str:
    out = []
    for f in findings:
        level = "error" if f.severity == "error" else "warning"
        props = (
            f"file={_escape_property(f.path)},line={f.line},col={f.column},"
            f"endLine={f.end_line},endColumn={f.end_column},title={_escape_property(f.code)}"
        )
        out.append(f"::{level} {props}::{_escape_data(f'{f.code} {f.message}')}")
    return "\n".join(out)


def format_statistics(findings: Iterable[Finding]) -> str:
    counts = Counter(f.code for f in findings)
    fixable = Counter(f.code for f in findings if f.fixable)
    rules = rules_by_code()
    lines = []
    for code, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        name = rules[code].NAME if code in rules else ""
        mark = "[*]" if fixable[code] else "   "
        lines.append(f"{n:>5}\t{code}\t{mark} {name}")
    return "\n".join(lines)


def render(findings: list[Finding], fmt: str, color: bool = False) -> str:
    if fmt == "json":
        return format_json(findings)
    if fmt == "github":
        return format_github(findings)
    return format_text(findings, color)
