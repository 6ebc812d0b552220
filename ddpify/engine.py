"""Read, parse, convert, verify, write: the path every conversion takes."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from ddpify.analysis.script import AnalysisError
from ddpify.results import ConvertError, ConvertOptions, ConvertResult, Note

__all__ = ["ConvertError", "ConvertOptions", "ConvertResult", "Note", "convert_source", "read_source", "convert_file"]


def read_source(path: Path) -> tuple[str, str]:
    """The text of a script and its encoding (PEP 263 cookie or UTF-8)."""
    name = str(path)
    if not path.exists():
        raise ConvertError(name, 0, "no such file")
    if not path.is_file():
        raise ConvertError(name, 0, "not a file")
    raw = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(encoding), encoding
    except (SyntaxError, LookupError) as exc:
        raise ConvertError(name, 1, f"unknown encoding: {exc}") from None
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConvertError(name, line, f"cannot decode as {encoding}: not a Python source file?") from None


def parse(source: str, path: str) -> cst.Module:
    """Compile (for CPython's precise message) then parse with libcst; errors become ConvertError."""
    hint = "" if path.endswith((".py", ".pyw", "<string>")) else " (is this a Python file?)"
    try:
        compile(source, path, "exec", dont_inherit=True)
        return cst.parse_module(source)
    except SyntaxError as exc:
        raise ConvertError(path, exc.lineno or 1, f"syntax error: {exc.msg}{hint}") from None
    except cst.ParserSyntaxError as exc:
        raise ConvertError(path, exc.raw_line, f"syntax error: {str(exc).splitlines()[0]}{hint}") from None
    except ValueError as exc:  # e.g. null bytes
        raise ConvertError(path, 1, f"not Python source: {exc}{hint}") from None


def convert_source(source: str, path: str = "<string>", options: ConvertOptions | None = None) -> ConvertResult:
    """Convert one script's source and verify the result; raise ConvertError if unsafe."""
    from ddpify.convert import convert_module

    module = parse(source, path)
    try:
        result = convert_module(module, options or ConvertOptions())
    except AnalysisError as exc:
        raise ConvertError(path, exc.line, exc.message) from None
    if not result.already_distributed:
        _verify(result.code, path)
        findings = [f for f in _lint(result.code, path) if f.severity == "error"]
        if findings and not result.todos:
            # What DDP still gets wrong in the converted script (often a pattern of the
            # input, e.g. two forwards before one backward) is left as TODOs at the lines.
            result.code = annotate(result.code, findings)
            result.todos += [Note(f.line, f"{f.code} {f.message}", in_output=True) for f in findings]
    return result


def _verify(code: str, path: str) -> None:
    """The output must compile and be a fixed point of the conversion."""
    from ddpify.convert import convert_module

    try:
        compile(code, path, "exec")
        again = convert_module(cst.parse_module(code))
    except (SyntaxError, cst.ParserSyntaxError, AnalysisError) as exc:  # pragma: no cover - a bug
        raise ConvertError(path, 1, f"internal error: the converted script does not verify ({exc})") from None
    if not again.already_distributed:  # pragma: no cover - a bug
        raise ConvertError(path, 1, "internal error: converting the output again would change it")


def _lint(code: str, path: str):
    """Default `ddpify check` findings on converted code."""
    from ddpify.check.rule import all_rules
    from ddpify.check.runner import check_source

    return check_source(code, path, codes=[r.CODE for r in all_rules() if r.DEFAULT]).findings


class _Annotate(cst.CSTTransformer):
    """Put `# TODO(ddpify): ...` above the innermost statement holding each finding's line."""

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, findings: list) -> None:
        super().__init__()
        self.findings = findings
        self.owner: dict[int, cst.CSTNode] = {}

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            span = self.get_metadata(PositionProvider, node)
            for f in self.findings:
                if span.start.line <= f.line <= span.end.line:
                    self.owner[f.line] = node  # visited outer first: the innermost wins
        return True

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode):
        notes = [f for f in self.findings if self.owner.get(f.line) is original]
        if not notes:
            return updated
        comments = [cst.EmptyLine(comment=cst.Comment(f"# TODO(ddpify): {f.code} {f.message}")) for f in notes]
        return updated.with_changes(leading_lines=[*updated.leading_lines, *comments])


def annotate(code: str, findings: list) -> str:
    """The code with a TODO comment above each finding."""
    return MetadataWrapper(cst.parse_module(code)).visit(_Annotate(findings)).code


def convert_file(path: Path, options: ConvertOptions | None = None) -> tuple[ConvertResult, str]:
    """Read and convert a file; return the result and the file's encoding."""
    source, encoding = read_source(path)
    return convert_source(source, str(path), options), encoding
