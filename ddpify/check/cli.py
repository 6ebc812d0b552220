"""Commands of the linter: ``ddpify check``, ``ddpify rules``, ``ddpify rule CODE``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

# The linter itself (libcst, the rules) is imported by the commands, not at start-up.

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2


def _split(values: Optional[List[str]]) -> Optional[list[str]]:
    if values is None:
        return None
    out = [v.strip().upper() for value in values for v in value.split(",") if v.strip()]
    return out


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(EXIT_ERROR)


def check(
    paths: Optional[List[Path]] = typer.Argument(None, help="Files or folders to check (default: .)."),
    output_format: str = typer.Option(
        "text", "--output-format", metavar="FORMAT",
        help="Print findings as text, concise, json, json-lines, github or sarif.",
    ),
    format: Optional[str] = typer.Option(None, "--format", hidden=True, help="Use --output-format (deprecated)."),
    select: Optional[List[str]] = typer.Option(
        None, "--select", metavar="CODES", help="Enable only these codes or prefixes (ALL for every rule)."
    ),
    extend_select: Optional[List[str]] = typer.Option(
        None, "--extend-select", metavar="CODES", help="Also enable these codes or prefixes (e.g. DDP9)."
    ),
    ignore: Optional[List[str]] = typer.Option(None, "--ignore", metavar="CODES", help="Disable these codes or prefixes."),
    to: str = typer.Option(
        "ddp", "--to", metavar="TARGET",
        help="Target: ddp (default) or fsdp2, which turns off DDP-only advice.",
    ),
    fix: bool = typer.Option(False, "--fix", help="Apply safe fixes in place."),
    unsafe_fixes: bool = typer.Option(False, "--unsafe-fixes", help="With --fix, also apply unsafe fixes."),
    exit_zero: bool = typer.Option(False, "--exit-zero", help="Exit 0 even when there are findings."),
    statistics: bool = typer.Option(False, "--statistics", help="Count findings per rule instead of listing them."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, metavar="N", help="Use N worker processes (default: all cores)."),
    config: Optional[Path] = typer.Option(
        None, "--config", metavar="FILE", help="Read [tool.ddpify] from this pyproject.toml (default: discovered)."
    ),
    color: Optional[bool] = typer.Option(None, "--color/--no-color", help="Colour text output (default: on a terminal)."),
) -> None:
    """Find DDP pitfalls: wrong results, hangs, wasted GPUs, duplicated logs."""
    from ddpify.check import output
    from ddpify.check.config import Config, ConfigError, discover, load_file
    from ddpify.check.rule import TARGETS, select_rules, valid_selector
    from ddpify.check.runner import check_paths, iter_python_files

    format = format or output_format
    if format not in output.FORMATS:
        raise _fail(f"unknown format {format!r}; choose one of {', '.join(output.FORMATS)}")
    if to not in TARGETS:
        raise _fail(f"unknown target {to!r}; choose one of {', '.join(TARGETS)}")
    paths = paths or [Path(".")]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise _fail(f"no such file or folder: {', '.join(missing)}")
    try:
        cfg = load_file(config) or Config() if config else discover(paths[0])
    except ConfigError as exc:
        raise _fail(str(exc))
    cli_select, cli_extend, cli_ignore = _split(select), _split(extend_select) or [], _split(ignore) or []
    for sel in (cli_select or []) + cli_extend + cli_ignore + (cfg.select or []) + cfg.ignore + cfg.extend_select:
        if not valid_selector(sel):
            raise _fail(f"unknown rule code or prefix {sel!r} (see `ddpify rules`)")
    enabled = select_rules(
        cli_select if cli_select is not None else cfg.select,
        ignore=cfg.ignore + cli_ignore,
        extend_select=cfg.extend_select + cli_extend,
        target=to,
    )
    files = iter_python_files(paths, cfg)
    tasks = []
    for f in files:
        per_file = cfg.ignored_for(f)
        codes = frozenset(c for c in enabled if not any(c.startswith(p.upper()) for p in per_file))
        tasks.append((f, codes))
    results = check_paths(tasks, fix=fix, jobs=jobs, unsafe_fixes=unsafe_fixes)
    findings = [f for r in results for f in r.findings]
    findings.sort(key=lambda f: (f.path, f.line, f.column, f.code))
    errors = [r.error for r in results if r.error]
    fixed = sum(r.fixed_count for r in results)
    text = format in ("text", "concise")
    if color is None:
        color = text and sys.stdout.isatty()
    if statistics:
        if format == "json":
            counts: dict[str, int] = {}
            for f in findings:
                counts[f.code] = counts.get(f.code, 0) + 1
            typer.echo(json.dumps([{"code": c, "count": n} for c, n in sorted(counts.items())], indent=2))
        elif findings:
            typer.echo(output.format_statistics(findings))
    else:
        rendered = output.render(findings, format, color, _version())
        if rendered or format in ("json", "sarif"):
            typer.echo(rendered)
    if text:
        typer.echo(_summary(findings, fixed, fix, errors))
    for e in errors:
        typer.echo(f"error: {e}", err=True)
    if errors:
        raise typer.Exit(EXIT_ERROR)
    raise typer.Exit(EXIT_FINDINGS if findings and not exit_zero else EXIT_CLEAN)


def _summary(findings: list, fixed: int, fix: bool, errors: list) -> str:
    """ruff's last lines: what was fixed, what was found, what --fix and --unsafe-fixes would fix,
    or that all passed."""
    lines = [f"Fixed {_count(fixed, 'finding')}."] if fixed else []
    if findings:
        n_fix = sum(f.fixable for f in findings)
        hidden = sum(f.fix is not None and not f.fixable for f in findings)  # unsafe, not enabled
        line = f"Found {_count(len(findings), 'finding')}"
        line += f" ({n_fix} fixable with --fix)." if n_fix and not fix else "."
        if hidden:
            line += f" ({_count(hidden, 'hidden fix', 'hidden fixes')} can be enabled with the --unsafe-fixes option.)"
        lines.append(line)
    elif not errors:
        lines.append("All checks passed!")
    return "\n".join(lines)


def _count(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _version() -> str:
    from ddpify import __version__

    return __version__


def rules() -> None:
    """List every rule: code, whether on by default, its fix (safe or unsafe), name, message."""
    from ddpify.check.rule import all_rules

    for r in all_rules():
        default = "default" if r.DEFAULT else "opt-in "
        fix = f"{r.FIX:<6}" if r.FIX else "      "
        typer.echo(f"{r.CODE}  {default}  {fix}  {r.NAME:<36} {r.MESSAGE}")


def rule(code: str = typer.Argument(..., help="The rule's code, e.g. DDP121.")) -> None:
    """Print one rule's documentation page."""
    from ddpify.check.rule import rules_by_code

    r = rules_by_code().get(code.strip().upper())
    if r is None:
        raise _fail(f"unknown rule {code!r} (see `ddpify rules`)")
    typer.echo(rule_page(r))


def rule_page(r) -> str:
    """A rule's page: its code, message, whether it is on, its fix safety, then its docstring."""
    flags = []
    flags.append("on by default" if r.DEFAULT else "off by default (opinionated): enable with --extend-select")
    if r.DISTRIBUTED_ONLY:
        flags.append("applies to files that use torch.distributed / DDP")
    if r.DDP_ONLY:
        flags.append("off under --to fsdp2 (its advice is DDP's own)")
    if r.FIX == "safe":
        flags.append("fixable with --fix")
    elif r.FIX == "unsafe":
        flags.append("fixable with --fix --unsafe-fixes (an unsafe fix: see Fix safety)")
    about = "; ".join(flags)
    return f"# {r.NAME} ({r.CODE})\n\nMessage: {r.MESSAGE}\n\n{about[0].upper()}{about[1:]}.\n\n{r.doc()}\n"


def register(app: typer.Typer) -> None:
    """Add the linter's commands to the main CLI."""
    app.command("check")(check)
    app.command("rules")(rules)
    app.command("rule")(rule)


def make_app() -> typer.Typer:
    """A CLI with only the linter's commands (``python -m ddpify.check``)."""
    app = typer.Typer(add_completion=False, no_args_is_help=True, help="ddpify's DDP linter.")
    register(app)
    return app
