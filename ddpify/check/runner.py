"""Check files: find them, run the enabled rules once per file (in parallel), apply fixes."""

from __future__ import annotations

import os
import re
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import libcst as cst

from ddpify.check.config import DEFAULT_EXCLUDE, Config
from ddpify.check.context import FileContext
from ddpify.check.fix import apply_replacements
from ddpify.check.rule import FIX_SAFE, Finding, Report, Rule, all_rules
from ddpify.files import read_source, write_atomic
from ddpify.parsing import SyntaxProblem, parse_module, runs_deep
from ddpify.results import ConvertError

PARSE_ERROR = "DDP000"
MAX_FIX_ROUNDS = 10

_NOQA_RE = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*))?", re.IGNORECASE)


@dataclass
class FileResult:
    path: str
    findings: list[Finding] = field(default_factory=list)
    fixed_source: Optional[str] = None  # set when --fix changed the file
    fixed_count: int = 0
    error: Optional[str] = None  # an internal error (exit 2)


def noqa_lines(source: str) -> dict[int, Optional[set[str]]]:
    """line -> codes suppressed on it (None: every code)."""
    out: dict[int, Optional[set[str]]] = {}
    if "noqa" not in source.lower():
        return out
    for number, text in enumerate(source.splitlines(), start=1):
        if "#" not in text:
            continue
        m = _NOQA_RE.search(text)
        if m is None:
            continue
        codes = m.group("codes")
        out[number] = None if codes is None else {c.upper() for c in re.split(r"[\s,]+", codes) if c}
    return out


def _suppressed(f: Finding, noqa: dict[int, Optional[set[str]]]) -> bool:
    for line in {f.line, f.end_line}:
        if line in noqa:
            codes = noqa[line]
            if codes is None or any(f.code.startswith(c) for c in codes):
                return True
    return False


def _parse_error(path: str, exc: SyntaxProblem) -> Finding:
    return Finding(
        path=path,
        line=exc.line,
        column=exc.column,
        end_line=exc.line,
        end_column=exc.column,
        code=PARSE_ERROR,
        message=f"cannot parse file: {exc.message}; fix it so the file can be checked",
    )


def _rules_for(codes: Iterable[str]) -> list[type[Rule]]:
    wanted = set(codes)
    return [r for r in all_rules() if r.CODE in wanted]


def analyse(
    path: str, source: str, rules: list[type[Rule]], module: Optional[cst.Module] = None, project=None,
    unsafe_fixes: bool = False,
) -> tuple[list[Finding], Optional[cst.Module], list[tuple[cst.CSTNode, cst.CSTNode]]]:
    """Findings of ``rules`` on one source, its module, and the fixes to apply (unsuppressed, and
    safe unless ``unsafe_fixes``).

    ``module``: the source already parsed (e.g. by the converter, whose index is then reused);
    ``project``: the project modules the file imports (`ProjectModules`), analysed with it."""
    try:
        module = module if module is not None else parse_module(source, path)
    except SyntaxProblem as exc:  # not Python: a finding; other parse failures are the file's error
        if any(r.CODE == PARSE_ERROR for r in rules):
            return [_parse_error(path, exc)], None, []
        return [], None, []
    ctx = FileContext(path, source, module, project)
    noqa = noqa_lines(source)
    findings: list[Finding] = []
    fixes: list[tuple] = []
    reported: set[tuple[str, int, int]] = set()
    for rule_cls in rules:
        if rule_cls.CODE == PARSE_ERROR:
            continue
        if rule_cls.DISTRIBUTED_ONLY and not ctx.is_distributed:
            continue
        for report in _in_this_file(ctx, rule_cls, rule_cls().check(ctx)):
            finding = _finding(ctx, rule_cls, report, unsafe_fixes)
            if _suppressed(finding, noqa) or (finding.code, finding.line, finding.column) in reported:
                continue  # silenced, or said already at this position (a return leaving two loops)
            reported.add((finding.code, finding.line, finding.column))
            findings.append(finding)
            if finding.fixable:
                fixes.extend(report.fixes)
    findings.sort(key=lambda f: (f.line, f.column, f.code))
    return findings, ctx.module, fixes


def _in_this_file(ctx: FileContext, rule_cls: type[Rule], reports: Iterable[Report]) -> Iterable[Report]:
    """The reports about the checked file. A report in another module of its project is that
    module's own (it is reported when that file is checked), except for a rule that follows
    calls (`FOLLOWS_CALLS`): it is reported at the call in this file that leads there, naming the
    other file (a rank-0 guard here around a helper whose collective is in utils.py)."""
    for report in reports:
        root = ctx.index.root_of(report.node)
        if root is ctx.module:
            yield report
        elif rule_cls.FOLLOWS_CALLS and ctx.project is not None:
            name = ctx.index.roots.get(root, "")
            where = f"{ctx.project.paths.get(name, name)}:{ctx.line(report.node)}"
            message = f"{report.message or rule_cls.MESSAGE} (the call leads to `{ctx.code(report.node).strip()}` in {where})"
            for site in _sites_here(ctx, report.node):
                yield Report(site, message)


def _sites_here(ctx: FileContext, node: cst.CSTNode, depth: int = 0) -> list[cst.CSTNode]:
    """The calls in the checked file that reach the function holding `node` (through others)."""
    func = ctx.enclosing_func(node)
    if func is None or depth > 4:
        return []
    found = []
    for site in ctx.index.call_sites(func):
        if ctx.index.root_of(site.node) is ctx.module:
            found.append(site.node)
        else:
            found += _sites_here(ctx, site.node, depth + 1)
    return found


def _finding(ctx: FileContext, rule_cls: type[Rule], report: Report, unsafe_fixes: bool = False) -> Finding:
    pos = ctx.position(report.node)
    return Finding(
        path=ctx.path,
        line=pos.start.line,
        column=pos.start.column + 1,
        end_line=pos.end.line,
        end_column=pos.end.column + 1,
        code=rule_cls.CODE,
        message=report.message or rule_cls.MESSAGE,
        severity=rule_cls.SEVERITY,
        fixable=bool(report.fixes) and (rule_cls.FIX == FIX_SAFE or unsafe_fixes),
        fix=rule_cls.FIX if report.fixes else None,
    )


@runs_deep
def check_source(
    source: str,
    path: str = "<string>",
    codes: Iterable[str] | None = None,
    fix: bool = False,
    module: Optional[cst.Module] = None,
    project=None,
    unsafe_fixes: bool = False,
) -> FileResult:
    """Check one file's source; with ``fix``, apply safe fixes (and unsafe ones with
    ``unsafe_fixes``) until the source is stable.

    ``module``: ``source`` already parsed; its analysis is shared with whoever parsed it;
    ``project``: the project modules it imports (`project_modules`)."""
    rules = list(all_rules()) if codes is None else _rules_for(codes)
    findings, module, fixes = analyse(path, source, rules, module, project, unsafe_fixes)
    result = FileResult(path=path, findings=findings)
    if not fix or not fixes:
        return result
    current = source
    before = len(findings)
    for _ in range(MAX_FIX_ROUNDS):
        if not fixes or module is None:
            break
        new = apply_replacements(module, fixes)
        if new == current:
            break
        cst.parse_module(new)  # a fix must never break the file: raises (internal error) if it did
        current = new
        findings, module, fixes = analyse(path, current, rules, project=project, unsafe_fixes=unsafe_fixes)
    if current != source:
        result.fixed_source = current
        result.findings = findings
        result.fixed_count = max(before - len(findings), 0)
    return result


# files ----------------------------------------------------------------------------------


def iter_python_files(paths: Iterable[Path], config: Config) -> list[Path]:
    """Python files under ``paths``; folders walked recursively, skipping excluded ones.

    A file named explicitly is always checked (like ruff without --force-exclude),
    unless the config excludes it.
    """
    out: list[Path] = []
    seen: set[Path] = set()
    for path in paths:
        if path.is_file():
            if not config.is_excluded(path) and path.resolve() not in seen:
                seen.add(path.resolve())
                out.append(path)
            continue
        for folder, dirnames, filenames in os.walk(path):
            here = Path(folder)
            dirnames[:] = sorted(
                d
                for d in dirnames
                if d not in DEFAULT_EXCLUDE
                and not d.endswith(".egg-info")
                and not config.is_excluded(here / d)
            )
            for name in sorted(filenames):
                if not name.endswith((".py", ".pyi")):
                    continue
                file = here / name
                if config.is_excluded(file) or file.resolve() in seen:
                    continue
                seen.add(file.resolve())
                out.append(file)
    return out


@runs_deep
def _check_path(args: tuple[str, tuple[str, ...], bool, bool]) -> FileResult:
    path, codes, fix, unsafe_fixes = args
    try:
        source, encoding = read_source(Path(path))
    except ConvertError as exc:  # the reader convert uses: cookies, BOM, binary files
        return FileResult(path=path, error=f"{path}:{exc.line}: {exc.message}" if exc.line else f"{path}: {exc.message}")
    try:
        project, module = project_modules(Path(path), source)
        result = check_source(source, path, codes, fix, module=module, project=project, unsafe_fixes=unsafe_fixes)
    except ConvertError as exc:  # read by CPython, but too deep, or beyond libcst's parser
        return FileResult(path=path, error=f"{path}:{exc.line}: {exc.message}")
    except Exception as exc:  # noqa: BLE001 - an internal error: report it, keep checking the others
        return FileResult(path=path, error=f"{path}: internal error ({type(exc).__name__}: {exc}); please report it")
    if result.fixed_source is not None:
        try:
            write_atomic(Path(path), result.fixed_source.encode(encoding))
        except (OSError, UnicodeEncodeError) as exc:
            result.error = f"{path}: cannot write the fixes: {getattr(exc, 'strerror', None) or exc}"
    return result


MAX_PROJECT_MODULES = 32  # a checked file is read with at most this many project modules, the nearest first
_PARSED: dict[tuple[str, float], cst.Module] = {}  # (path, mtime) -> module, per worker process


def _parsed(text: str, where: str) -> cst.Module:
    """`where`'s module, parsed once per process (every checked file that imports it shares it)."""
    key = (where, os.path.getmtime(where))
    if key not in _PARSED:
        _PARSED[key] = parse_module(text, where)
    return _PARSED[key]


def project_modules(path: Path, source: Optional[str] = None):
    """The project modules `path` imports (found as `convert` finds them) and `path`'s own module
    (parsed from `source`, the text the checker read), each file parsed once per process.

    The project is None when the file imports no project module or one cannot be read or
    parsed; the module is None when the file itself does not parse (the check reports it)."""
    from ddpify.analysis.project import find_importers, find_project
    from ddpify.check.context import ProjectModules

    entry = path.resolve()

    def read(file: Path) -> str:
        return source if source is not None and file == entry else _text(file)

    try:
        project = find_project(path, parse=_parsed, read=read, limit=MAX_PROJECT_MODULES)
    except Exception:  # noqa: BLE001 - the file does not parse: check_source reports it
        return None, None
    module = project.parsed.get(entry) if source is not None else None
    try:
        importers = tuple(find_importers(entry, _parsed, read, project.root).values())
    except OSError:
        importers = ()
    if len(project.files) < 2 and not importers:
        return None, module
    others = {name: project.parsed[file] for file, name in project.modules.items() if name != "__main__"}
    paths = {name: os.path.relpath(file) for file, name in project.modules.items()}
    packages = frozenset(name for file, name in project.modules.items() if file.name == "__init__.py")
    return ProjectModules(others, paths, packages, importers, project.truncated), module


_TEXTS: dict[tuple[Path, float], str] = {}  # (path, mtime) -> text, per worker process


def _text(path: Path) -> str:
    key = (path, os.path.getmtime(path))
    if key not in _TEXTS:
        _TEXTS[key] = path.read_text(encoding="utf-8")
    return _TEXTS[key]


def check_paths(
    files: list[tuple[Path, frozenset[str]]], fix: bool = False, jobs: Optional[int] = None, unsafe_fixes: bool = False
) -> list[FileResult]:
    """Check files (each with its enabled codes), in parallel when it pays."""
    tasks = [(str(p), tuple(sorted(codes)), fix, unsafe_fixes) for p, codes in files]
    jobs = jobs or os.cpu_count() or 1
    if jobs <= 1 or len(tasks) < 4:
        return [_check_path(t) for t in tasks]
    # contiguous runs of files (a folder's files together) per worker: a module that several of
    # them import is parsed once per worker, not once per file
    workers = min(jobs, len(tasks))
    size = -(-len(tasks) // (workers * 2))
    chunks = [tasks[i : i + size] for i in range(0, len(tasks), size)]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_check_chunk, chunk) for chunk in chunks]
        wait(futures)
    # a worker that died (a crash in native code) breaks the pool: what it left is checked alone
    results: list[FileResult] = []
    for future, chunk in zip(futures, chunks):
        results += future.result() if future.exception() is None else [_check_alone(t) for t in chunk]
    return results


def _check_chunk(chunk: list[tuple[str, tuple[str, ...], bool, bool]]) -> list[FileResult]:
    return [_check_path(task) for task in chunk]


def _check_alone(task: tuple[str, tuple[str, ...], bool, bool]) -> FileResult:
    """One file in a process of its own, so a crash there is that file's error alone."""
    try:
        with ProcessPoolExecutor(max_workers=1) as pool:
            return pool.submit(_check_path, task).result()
    except BrokenProcessPool:
        return FileResult(path=task[0], error=f"{task[0]}: the checker's process crashed on this file; please report it")
