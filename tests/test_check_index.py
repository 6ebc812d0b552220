"""The shared file index (ddpify/analysis/index.py) agrees with libcst's own metadata.

The index resolves qualified names from the bindings its one traversal records, and computes
positions with a lighter code-generation state, instead of libcst's ScopeProvider,
QualifiedNameProvider and PositionProvider (together ten times the cost of the parse). These
tests hold it to libcst's answers on every bundled script.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider, QualifiedNameProvider

from ddpify.analysis import names as N
from ddpify.analysis.index import FileIndex, index_of, iter_nodes, visit_order
from ddpify.analysis.positions import Positions, start_lines

ROOT = Path(__file__).resolve().parent.parent
def _parses(path: Path) -> bool:
    try:
        compile(path.read_text(encoding="utf-8"), str(path), "exec")
    except SyntaxError:
        return False  # a fixture that does not parse on purpose (the linter's, a project's broken module)
    return True


FILES = sorted(
    p
    for pattern in ("fixtures/**/*.py", "examples/*.py")
    for p in ROOT.glob(pattern)
    if "syntax" not in p.name and "parse" not in p.parent.name and _parses(p)
)


def _module(path: Path) -> cst.Module:
    """Every file in FILES parses (the linter's unparsable fixtures are filtered out above)."""
    return cst.parse_module(path.read_text(encoding="utf-8"))


class _All(cst.CSTVisitor):
    def __init__(self) -> None:
        self.nodes: list[cst.CSTNode] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.nodes.append(node)
        return True


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_index_matches_libcst(path):
    module = _module(path)
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    qualified = wrapper.resolve(QualifiedNameProvider)
    positions = wrapper.resolve(PositionProvider)
    index = FileIndex(module)
    starred = any(isinstance(n, cst.ImportStar) for n in iter_nodes(module))
    visitor = _All()
    module.visit(visitor)
    walked = set(iter_nodes(module))
    # every name and attribute libcst visits is indexed, with libcst's qualified names
    for node in visitor.nodes:
        if isinstance(node, (cst.Name, cst.Attribute)):
            assert node in walked
            theirs = qualified.get(node, ())
            theirs = {q.name for q in (theirs() if callable(theirs) else theirs)}
            if not theirs and starred:
                continue  # libcst does not follow `from X import *`; the index does (names of X)
            ours = set(index.qnames(node))
            if theirs & index._loader_classes():
                ours -= N.DATALOADER  # the file's own DataLoader subclass: the index reads its calls as DataLoader calls
            assert ours == theirs, module.code_for_node(node)
    # calls in libcst's visiting order
    assert [c.node for c in index.calls] == [n for n in visitor.nodes if isinstance(n, cst.Call)]
    # parents of every walked node
    for node in walked:
        if node is not module:
            assert node in [*index.parents[node].children], module.code_for_node(node)
    # positions of every node
    mine = Positions(module)
    for node, span in positions.items():
        assert mine[node] == span
    _same_start_lines(module, positions)


# Tokens and whitespace: libcst records their start inconsistently (before or after their own
# whitespace); nothing asks for their line.
TOKENS = (
    cst.BaseParenthesizableWhitespace, cst.TrailingWhitespace, cst.EmptyLine, cst.Newline, cst.Comma, cst.Dot,
    cst.LeftParen, cst.RightParen, cst.LeftSquareBracket, cst.RightSquareBracket, cst.LeftCurlyBrace,
    cst.RightCurlyBrace, cst.AssignEqual, cst.Colon, cst.Semicolon, cst.BaseBinaryOp, cst.BaseBooleanOp,
    cst.BaseCompOp, cst.BaseUnaryOp, cst.BaseAugOp, cst.ImportStar, cst.Asynchronous,
)  # fmt: skip


def _same_start_lines(module: cst.Module, positions) -> int:
    """Start lines counted without code generation (`start_lines`) are libcst's, node by node."""
    lines = start_lines(module)
    checked = 0
    for node, span in positions.items():
        if not isinstance(node, TOKENS):
            assert lines[node] == span.start.line, (type(node).__name__, module.code_for_node(node))
            checked += 1
    return checked


TRICKY = "\n".join(
    [
        "import os",
        "from x import (",
        "    a,",
        "    b,",
        ")",
        "",
        "# a comment",
        "@decorator(",
        "    1)",
        "def f(",
        "    p,",
        "):",
        '    """doc',
        '    string"""',
        "    y = p + \\",
        "        2",
        "    z = (",
        "        'a'",
        "        'b'",
        "    )",
        "    w = f'''{y}",
        "{z}'''",
        "    return [",
        "        y,",
        "    ][0]",
        "",
    ]
)


def test_start_lines_of_tricky_layouts():
    """Continuation lines, strings over several lines, decorators, comments, parenthesised
    imports and expressions."""
    module = cst.parse_module(TRICKY)
    assert _same_start_lines(module, MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)) > 40


def test_visit_order_is_the_order_of_the_visit_calls_in_libcst_source():
    """visit_order reads the field names from the code object; the source of every node class
    of the installed libcst names the same fields in the same order."""
    import inspect
    import re

    classes = [c for c in vars(cst).values() if isinstance(c, type) and issubclass(c, cst.CSTNode) and not inspect.isabstract(c)]
    assert len(classes) > 100
    for cls in classes:
        source = inspect.getsource(cls._visit_and_replace_children)
        expected = tuple(dict.fromkeys(re.findall(r"visit_\w+\(\s*self,\s*\"(\w+)\"", source)))
        assert visit_order(cls) == expected, cls.__name__


def test_index_is_shared_per_module():
    module = cst.parse_module("import torch\ntorch.save(1, 'x')\n")
    assert index_of(module) is index_of(module)
    assert index_of(cst.parse_module("x = 1\n")) is not index_of(module)


def test_convert_and_check_share_one_index():
    """A module converted and then checked is indexed once (the converter's index is reused)."""
    from ddpify.analysis.script import analyze
    from ddpify.check.runner import check_source

    source = (ROOT / "examples" / "mnist_ddp.py").read_text(encoding="utf-8")
    module = cst.parse_module(source)
    script = analyze(module)
    assert index_of(module) is script.index
    assert check_source(source, "mnist_ddp.py", module=module).findings == []
    assert index_of(module) is script.index


def test_qualified_names_follow_scopes():
    source = (
        "import torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "print = print\n"
        "def main():\n"
        "    import numpy as dist\n"
        "    dist.save()\n"
        "    DDP(model)\n"
        "class C:\n"
        "    save = 1\n"
        "    def f(self):\n"
        "        save()\n"
        "        dist.barrier()\n"
    )
    index = FileIndex(cst.parse_module(source))
    by_code = {index.code(c.node.func): set(c.qnames) for c in index.calls}
    assert by_code["dist.save"] == {"numpy.save"}
    assert by_code["DDP"] == {"torch.nn.parallel.DistributedDataParallel"}
    assert by_code["save"] == set()  # methods do not see the class's names
    assert by_code["dist.barrier"] == {"torch.distributed.barrier"}
