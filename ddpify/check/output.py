"""Printing findings: text (ruff-like; `concise` is the same one line per finding), JSON, JSON
lines, GitHub workflow annotations, SARIF 2.1.0 (GitHub code scanning), statistics."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Iterable

import typer

from ddpify.check.rule import Finding, rules_by_code

FORMATS = ("text", "concise", "json", "json-lines", "github", "sarif")
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
RULES_PAGE = "blob/main/docs/rules"  # under the repository's URL: one page per rule, <CODE>.md


def project_home() -> str | None:
    """The repository URL the installed package declares (`[project.urls]` Repository or
    Homepage), or None: ddpify invents no address."""
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        urls = metadata("ddpify").get_all("Project-URL") or []
    except PackageNotFoundError:
        return None
    found = dict(entry.split(", ", 1) for entry in urls if ", " in entry)
    home = found.get("Repository") or found.get("Homepage")
    return home.rstrip("/") if home else None


def help_uri(code: str, home: str) -> str:
    """The rule's page (docs/rules/<CODE>.md, made from its docstring by ddpify.check.docs)."""
    return f"{home}/{RULES_PAGE}/{code}.md"


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


def format_json_lines(findings: Iterable[Finding]) -> str:
    return "\n".join(json.dumps(f.as_dict()) for f in findings)


def format_sarif(findings: list[Finding], version: str) -> str:
    """One SARIF 2.1.0 run: every rule (stable ids: the codes) and a result per finding."""
    rules = list(rules_by_code().values())
    index = {r.CODE: i for i, r in enumerate(rules)}
    driver_rules = [
        {
            "id": r.CODE,
            "name": r.NAME,
            "shortDescription": {"text": r.MESSAGE},
            "fullDescription": {"text": r.summary() or r.MESSAGE},
            "help": {"text": r.doc(), "markdown": r.doc()},
            "defaultConfiguration": {"level": "error" if r.SEVERITY == "error" else "warning", "enabled": r.DEFAULT},
            "properties": {"fix": r.FIX or "none"},
        }
        for r in rules
    ]
    results = [
        {
            "ruleId": f.code,
            "ruleIndex": index[f.code],
            "level": "error" if f.severity == "error" else "warning",
            "message": {"text": f.message},
            "locations": [{
                "physicalLocation": {
                    "artifactLocation": _artifact(Path(f.path)),
                    "region": {"startLine": f.line, "startColumn": f.column, "endLine": f.end_line, "endColumn": f.end_column},
                }
            }],
        }
        for f in findings
        if f.code in index
    ]
    home = project_home()
    if home:  # links to the rule pages where the package says where it lives
        for rule in driver_rules:
            rule["helpUri"] = help_uri(rule["id"], home)
    driver = {"name": "ddpify", "version": version, "rules": driver_rules, **({"informationUri": home} if home else {})}
    return json.dumps({"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [{"tool": {"driver": driver}, "results": results}]}, indent=2)


def _artifact(path) -> dict:
    """A POSIX path relative to the current folder (the checkout: %SRCROOT%), as code scanning
    wants; a file URI for a file outside it."""
    path = Path(os.path.abspath(path))
    try:
        return {"uri": path.relative_to(Path.cwd()).as_posix(), "uriBaseId": "%SRCROOT%"}
    except ValueError:
        return {"uri": path.as_uri()}


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


def render(findings: list[Finding], fmt: str, color: bool = False, version: str = "0.0.0") -> str:
    if fmt == "json":
        return format_json(findings)
    if fmt == "json-lines":
        return format_json_lines(findings)
    if fmt == "github":
        return format_github(findings)
    if fmt == "sarif":
        return format_sarif(findings, version)
    return format_text(findings, color)
