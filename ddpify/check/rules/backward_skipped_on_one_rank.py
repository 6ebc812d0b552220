from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import dotted_name, last_name
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import may_precede

NON_FINITE_TESTS = frozenset({"isnan", "isinf", "isfinite", "isneginf", "isposinf"})


def _non_finite_test(test: cst.BaseExpression) -> bool:
    """Does the `if` test call isnan/isinf/isfinite (torch, math or numpy, or the tensor method)?"""
    found = []

    class Visit(cst.CSTVisitor):
        def visit_Call(self, node):
            if last_name(node.func) in NON_FINITE_TESTS:
                found.append(node)

    test.visit(Visit())
    return bool(found)


def _leaves(body: cst.CSTNode) -> list[cst.CSTNode]:
    """`continue` / `break` statements in the body that leave the enclosing loop's iteration (not a nested loop's)."""
    found: list[cst.CSTNode] = []

    class Visit(cst.CSTVisitor):
        def visit_For(self, node):
            return False

        def visit_While(self, node):
            return False

        def visit_FunctionDef(self, node):
            return False

        def visit_Continue(self, node):
            found.append(node)

        def visit_Break(self, node):
            found.append(node)

    body.visit(Visit())
    return found


def _names(expr: cst.CSTNode) -> set[str]:
    names: set[str] = set()

    class Visit(cst.CSTVisitor):
        def visit_Name(self, node):
            names.add(node.value)

    expr.visit(Visit())
    return names


class BackwardSkippedOnOneRank(Rule):
    """A training step skipped by the rank whose loss is not finite.

    ## What it does
    Flags `if not torch.isfinite(loss): continue` (also `isnan`, `isinf`, `math.isnan`, and
    `break`) before the backward of a training loop in a DDP script, when the value tested
    was not all-reduced first: the decision is each rank's own.

    ## Why is this bad?
    Every backward of a DDP model all-reduces the gradients, and every rank must take part.
    The rank that drew the bad batch skips its backward while the others wait in theirs:
    the collectives pair up out of step, and the job hangs at the last one (or until the NCCL
    timeout), with no hint of the NaN that started it.

    ## Example
    ```python
    loss = criterion(model(x), y)
    if torch.isnan(loss):
        continue
    loss.backward()
    ```

    ## Use instead
    ```python
    bad = torch.tensor(float(not torch.isfinite(loss)), device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # every rank skips together
    if bad.item():
        continue
    loss.backward()
    ```

    ## Fix safety
    No automatic fix: the ranks have to agree (an all-reduce), or the bad samples be masked.

    ## References
    - https://pytorch.org/docs/stable/notes/ddp.html
    """

    CODE = "DDP142"
    NAME = "backward-skipped-on-one-rank"
    DDP_ONLY = True
    MESSAGE = "a rank whose loss is not finite skips its backward: the other ranks wait in their gradient all-reduce (hang); decide the skip together"
    VALID = [
        "import torch, torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "model = DDP(net)\nfor x in data:\n    loss = model(x).sum()\n    bad = torch.isnan(loss).float()\n"
        "    dist.all_reduce(bad)\n    if bad.item():\n        continue\n    loss.backward()\n",
    ]
    INVALID = [
        Invalid("import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
                "for x in data:\n    loss = model(x).sum()\n    if torch.isnan(loss):\n        continue\n"
                "    loss.backward()\n"),
    ]

    def check(self, ctx):
        if not ctx.ddp_calls:
            return
        backwards = [c for c in ctx.calls if ctx.is_backward(c)]
        reduced = {dotted_name(a.value) for c in ctx.calls if c.qnames & N.COLLECTIVES for a in c.node.args}
        done: set = set()
        for b in backwards:
            if not b.loops:
                continue
            for node in _ifs_in(ctx, b.loops[-1]):
                if node in done or not _non_finite_test(node.test) or _names(node.test) & reduced:
                    continue
                leaves = _leaves(node.body)
                if leaves and may_precede(ctx, node, b.node):
                    done.add(node)
                    yield Report(node.test, f"`if {ctx.code(node.test)}:` skips this rank's backward on its own "
                                 "(`continue`/`break`): the other ranks wait in their gradient all-reduce and the job "
                                 "hangs; all-reduce the flag so every rank skips together, or mask the bad samples")


def _ifs_in(ctx, loop: cst.CSTNode) -> list[cst.If]:
    """The `if` statements of the loop body (not of nested loops or functions)."""
    found: list[cst.If] = []

    class Visit(cst.CSTVisitor):
        def visit_For(self, node):
            return node is loop

        def visit_While(self, node):
            return node is loop

        def visit_FunctionDef(self, node):
            return False

        def visit_If(self, node):
            found.append(node)

    loop.visit(Visit())
    return found
