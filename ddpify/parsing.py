"""Parsing a script safely, shared by `convert` and `check`: CPython decides what is Python,
libcst reads it, and deep code cannot crash either.

libcst's parser and every visitor recurse once per level of nesting, and an `a and b and ...`
chain or an implicitly joined string is one level per term. The work therefore runs on a thread
with a large stack and a raised recursion limit (`runs_deep`), and code nested deeper than
`MAX_DEPTH` levels is refused before libcst sees it (measured: 50,000 levels parse and convert
on a 1 GiB stack in 10 s and 360 MB; the limit leaves room)."""

from __future__ import annotations

import ast
import functools
import re
import sys
import threading
import warnings
from typing import Callable, TypeVar

import libcst as cst

from ddpify.results import ConvertError

MAX_DEPTH = 10_000
STACK_BYTES = 1 << 30  # reserved, not used, until the recursion needs it
RECURSION_LIMIT = 200_000  # Python frames on that stack: a few per level of nesting

T = TypeVar("T")

_state = threading.local()
_DEFAULT_LIMIT = sys.getrecursionlimit()


class SyntaxProblem(ConvertError):
    """The file is not Python that CPython compiles: a finding (DDP000), not a failure of ddpify."""

    def __init__(self, path: str, line: int, message: str, column: int = 1) -> None:
        super().__init__(path, line, message)
        self.column = column


def parse_module(source: str, path: str) -> cst.Module:
    """The libcst module of `source`; ConvertError (one line, with the line number) when CPython
    rejects it (SyntaxProblem), when it is nested past MAX_DEPTH, or when libcst cannot read it."""
    hint = "" if path.endswith((".py", ".pyw", ".pyi", "<string>")) else " (is this a Python file?)"
    tree = _compile(source, path, hint)
    depth, line = nesting(tree)
    if depth > MAX_DEPTH:
        raise ConvertError(path, line, f"code nested {depth:,} levels deep; ddpify reads at most {MAX_DEPTH:,}")
    try:
        return cst.parse_module(source)
    except cst.ParserSyntaxError as exc:  # CPython compiled it: a limit of libcst's parser
        at = re.search(r"error at (\d+):(\d+): (.*)", exc.message)  # its own line, which raw_line is not
        line, why = (int(at[1]), at[3]) if at else (exc.raw_line, exc.message)
        raise ConvertError(path, line, f"libcst cannot parse this valid Python ({why})") from None


def _compile(source: str, path: str, hint: str) -> ast.Module:
    """CPython's syntax tree, after CPython compiled it with the recursion limit `python` has."""
    raised = sys.getrecursionlimit()
    sys.setrecursionlimit(max(_DEFAULT_LIMIT, _depth_now() + 100))
    try:
        tree = quiet_compile(source, path, ast.PyCF_ONLY_AST)
        quiet_compile(tree, path)
        return tree
    except SyntaxError as exc:
        raise SyntaxProblem(path, exc.lineno or 1, f"syntax error: {exc.msg}{hint}", exc.offset or 1) from None
    except ValueError as exc:  # null bytes
        raise SyntaxProblem(path, 1, f"not Python source: {exc}{hint}") from None
    except (RecursionError, MemoryError) as exc:
        raise SyntaxProblem(path, 1, f"too deeply nested for Python to compile ({type(exc).__name__})") from None
    finally:
        sys.setrecursionlimit(raised)


def quiet_compile(source, path: str, flags: int = 0):
    """compile() without the SyntaxWarnings of the user's own code (`x is 0`): CPython prints
    them to stderr each time the code compiles, as if ddpify had something to say."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile(source, path, "exec", flags, dont_inherit=True)


def _depth_now() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


def nesting(tree: ast.AST) -> tuple[int, int]:
    """The deepest nesting of libcst nodes the tree will give, and its line. libcst nests
    `a and b and c` as `(a and b) and c`, so a boolean chain adds a level per term."""
    deepest, line = 0, 1
    todo: list[tuple[ast.AST, int]] = [(tree, 0)]
    while todo:
        node, depth = todo.pop()
        depth += len(node.values) - 1 if isinstance(node, ast.BoolOp) else 1
        if depth > deepest:
            deepest, line = depth, getattr(node, "lineno", line)
        todo.extend((child, depth) for child in ast.iter_child_nodes(node))
    return deepest, line


def runs_deep(func: Callable[..., T]) -> Callable[..., T]:
    """Run `func` on a thread with a STACK_BYTES stack and RECURSION_LIMIT (once: nested calls
    run where they are). Its result or exception comes back to the caller."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if getattr(_state, "deep", False):
            return func(*args, **kwargs)
        outcome: dict[str, object] = {}

        def run() -> None:
            _state.deep = True
            try:
                outcome["value"] = func(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
                outcome["error"] = exc

        previous_limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(previous_limit, RECURSION_LIMIT))
        try:
            previous_stack = threading.stack_size(STACK_BYTES)
            try:
                thread = threading.Thread(target=run, name=f"ddpify-{func.__name__}", daemon=True)
                thread.start()
            finally:
                threading.stack_size(previous_stack)
            thread.join()
        except (RuntimeError, ValueError, MemoryError):  # no room for such a stack (ulimit -v): run here
            sys.setrecursionlimit(previous_limit)
            return func(*args, **kwargs)
        finally:
            sys.setrecursionlimit(previous_limit)
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        return outcome["value"]  # type: ignore[return-value]

    return wrapper
