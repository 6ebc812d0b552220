"""Line and column of every node: libcst's ``PositionProvider``, computed about twice as fast.

The same code generation walk as libcst's provider (so the same ranges: syntactic, without
the surrounding whitespace), with a lighter state: positions are kept as tuples and turned
into ``CodeRange`` objects only when asked for, newlines are found without a regular
expression, and the syntactic-position hook is a plain context manager object.
``tests/test_check_index.py`` compares it with libcst's provider.
"""

from __future__ import annotations

from typing import Iterator, Optional

import libcst as cst
from libcst._nodes.internal import CodegenState
from libcst._position import CodePosition, CodeRange

from ddpify.analysis.index import _NODE_CLASSES, is_node_class, visit_order


class _Syntactic:
    __slots__ = ("state", "node", "start_node", "end_node", "start")

    def __init__(self, state: "_State", node, start_node, end_node) -> None:
        self.state = state
        self.node = node
        self.start_node = start_node
        self.end_node = end_node

    def __enter__(self) -> None:
        self.start = (self.state.line, self.state.column)

    def __exit__(self, *exc) -> None:
        state = self.state
        computed = state.computed
        start = computed[self.start_node][0] if self.start_node is not None else self.start
        end = computed[self.end_node][1] if self.end_node is not None else (state.line, state.column)
        computed[self.node] = (start, end)


class _State(CodegenState):
    def __init__(self, module: cst.Module) -> None:
        super().__init__(default_indent=module.default_indent, default_newline=module.default_newline)
        self.computed: dict[cst.CSTNode, tuple] = {}
        self.stack: list[tuple[int, int]] = []
        self.line = 1
        self.column = 0

    def add_indent_tokens(self) -> None:
        for token in self.indent_tokens:
            self.add_token(token)

    def add_token(self, value: str) -> None:
        if not self.tokens:  # Module reads it: whether anything was written
            self.tokens.append(value)
        if "\n" in value or "\r" in value:
            lines = value.replace("\r\n", "\n").replace("\r", "\n").split("\n")
            self.line += len(lines) - 1
            self.column = len(lines[-1])
        else:
            self.column += len(value)

    def before_codegen(self, node: cst.CSTNode) -> None:
        self.stack.append((self.line, self.column))

    def after_codegen(self, node: cst.CSTNode) -> None:
        start = self.stack.pop()
        if node not in self.computed:
            self.computed[node] = (start, (self.line, self.column))

    def record_syntactic_position(self, node, *, start_node=None, end_node=None) -> Iterator[None]:
        return _Syntactic(self, node, start_node, end_node)

    def pop_trailing_newline(self) -> None:
        pass


class Positions:
    """node -> ``CodeRange`` (1-based lines, 0-based columns), like libcst's provider's mapping."""

    def __init__(self, module: cst.Module) -> None:
        state = _State(module)
        module._codegen(state)
        self._raw = state.computed
        self.spans: dict[cst.CSTNode, tuple[tuple[int, int], tuple[int, int]]] = state.computed  # raw
        self._ranges: dict[cst.CSTNode, CodeRange] = {}

    def __getitem__(self, node: cst.CSTNode) -> CodeRange:
        found = self._ranges.get(node)
        if found is None:
            (sl, sc), (el, ec) = self._raw[node]
            found = self._ranges[node] = CodeRange(CodePosition(sl, sc), CodePosition(el, ec))
        return found

    def get(self, node: cst.CSTNode, default: Optional[CodeRange] = None) -> Optional[CodeRange]:
        return self[node] if node in self._raw else default

    def __contains__(self, node: object) -> bool:
        return node in self._raw

    def line(self, node: cst.CSTNode) -> int:
        return self._raw[node][0][0]


# -- start lines without code generation -----------------------------------------------------------
_ALL_FIELDS: dict[type, tuple[str, ...]] = {}
_LEADING = frozenset({"leading_lines", "decorators", "lines_after_decorators", "lpar"})


def _all_fields(cls: type) -> tuple[str, ...]:
    """Every field of a node class that may hold nodes, whitespace included, in libcst's
    visiting order (which is the order code generation writes them)."""
    found = _ALL_FIELDS.get(cls)
    if found is None:
        found = _ALL_FIELDS[cls] = visit_order(cls)
    return found


def start_lines(module: cst.Module) -> dict[cst.CSTNode, int]:
    """The line each node starts on, as ``Positions`` gives it (the syntactic start: after the
    node's blank lines, comments, decorators and opening parentheses), found by counting the
    newlines of the whitespace, newline and string nodes in the order they are written, about
    four times faster than generating the code. ``tests/test_check_index.py`` compares the two."""
    lines: dict[cst.CSTNode, int] = {}
    line = 1
    Newline, IndentedBlock = cst.Newline, cst.IndentedBlock
    node_classes = _NODE_CLASSES
    counted = (cst.SimpleWhitespace, cst.SimpleString, cst.FormattedStringText)
    fields_of = _ALL_FIELDS

    def walk(node: cst.CSTNode) -> None:
        nonlocal line
        cls = node.__class__
        lines[node] = line
        if cls is Newline:
            line += 1
            return
        if cls in counted:
            line += node.value.count("\n")
            return
        fields = fields_of.get(cls) or _all_fields(cls)
        for name in fields:
            value = getattr(node, name)
            vcls = value.__class__
            if vcls is tuple or vcls is list:
                for child in value:
                    walk(child)
                if name in _LEADING:  # (an expression's `lpar` is a list; `from x import (` is not its start)
                    lines[node] = line
            elif node_classes.get(vcls) or (vcls not in node_classes and is_node_class(vcls)):
                walk(value)
        if cls is IndentedBlock and node.body:
            lines[node] = lines[node.body[0]]

    walk(module)
    return lines
