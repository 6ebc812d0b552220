"""Read, parse, convert, verify, write: the path every conversion takes."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from pathlib import Path

import libcst as cst

from ddpify.analysis.script import AnalysisError
from ddpify.files import read_source
from ddpify.parsing import parse_module, quiet_compile, runs_deep
from ddpify.results import ConvertError, ConvertOptions, ConvertResult, Note

__all__ = ["ConvertError", "ConvertOptions", "ConvertResult", "Note", "convert_source", "read_source", "convert_file"]


@functools.lru_cache(maxsize=4)
def parse(source: str, path: str) -> cst.Module:
    """CPython decides what is Python (its precise message), then libcst parses; ConvertError
    otherwise. The last few trees are kept (they are immutable): `ddpify convert` reads the
    entry's imports to tell a project from a script (`find_project`), then converts the same text."""
    return parse_module(source, path)


@runs_deep
def convert_source(
    source: str, path: str = "<string>", options: ConvertOptions | None = None, facts=None, driver: bool = False
) -> ConvertResult:
    """Convert one script's source and verify the result; raise ConvertError if unsafe.
    `facts` and `driver`: for a module of a project (`convert_project`)."""
    with _no_cycle_collection():
        return _convert_source(source, path, options or ConvertOptions(), facts, driver)


@contextlib.contextmanager
def _no_cycle_collection():
    """Syntax trees hold no reference cycles, but building and walking them allocates enough
    objects to start the cycle collector over and over (a tenth of a conversion's time): it
    waits until the conversion is done."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _convert_source(source: str, path: str, options: ConvertOptions, facts, driver: bool) -> ConvertResult:
    from ddpify.convert import convert_module

    module = parse(source, path)
    try:
        result = convert_module(module, options, facts=facts, driver=driver)
    except AnalysisError as exc:
        raise ConvertError(path, exc.line, exc.message) from None
    if not result.already_distributed:
        _verify(result.code, path, options, facts, driver)
    return result


def _verify(code: str, path: str, options: ConvertOptions, facts=None, driver: bool = False) -> None:
    """The output must compile; with `options.self_check` it must also be a fixed point of the
    conversion: every pass, run over it with the already-distributed shortcut off, recognises its
    own work and plans no edit (a TODO it leaves again is fine: it is already in the output)."""
    from ddpify.convert import replan

    try:
        quiet_compile(code, path)
        if not options.self_check:
            return
        # without the run's facts: they name the original's lines, and a user converts the output again without a run
        planned = replan(cst.parse_module(code), dataclasses.replace(options, run=None), facts=facts, driver=driver)
    except (SyntaxError, cst.ParserSyntaxError, AnalysisError) as exc:  # pragma: no cover - a bug
        raise ConvertError(path, 1, f"internal error: the converted script does not verify ({exc})") from None
    if planned:  # pragma: no cover - a bug
        name, line, what = planned[0]
        raise ConvertError(
            path, line, f"internal error: converting the output again would change it (pass {name}: {what}, line {line} of the output)"
        )


def convert_file(path: Path, options: ConvertOptions | None = None) -> tuple[ConvertResult, str]:
    """Read and convert a file; return the result and the file's encoding."""
    source, encoding = read_source(path)
    return convert_source(source, str(path), options), encoding
