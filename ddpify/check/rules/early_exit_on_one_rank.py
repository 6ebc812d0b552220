import libcst as cst

from ddpify.check.context import COLLECTIVES
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import single_process_branch, trains


class EarlyExitOnOneRank(Rule):
    """Training loop left on rank 0 only.

    ## What it does
    Flags `break` (and `return`) inside a rank-0-only branch within a loop that trains or
    calls collectives, e.g. early stopping decided on rank 0.

    ## Why is this bad?
    The other ranks keep training and wait in the next gradient all-reduce for a rank that
    has left the loop: the job hangs.

    ## Example
    ```python
    for epoch in range(epochs):
        train_one_epoch()
        if rank == 0 and val_loss > best:
            break
    ```

    ## Use instead
    ```python
    for epoch in range(epochs):
        train_one_epoch()
        stop = torch.tensor(int(rank == 0 and val_loss > best), device=device)
        dist.broadcast(stop, src=0)
        if stop.item():
            break
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/tutorials/advanced/generic_join.html
    """

    CODE = "DDP118"
    NAME = "early-exit-on-one-rank"
    MESSAGE = "loop left on rank 0 only: the other ranks hang in the next all-reduce; broadcast the decision to all ranks"
    VALID = [
        "import torch.distributed as dist\nfor epoch in range(9):\n    train(model)\n"
        "    dist.broadcast(stop, src=0)\n    if stop.item():\n        break\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nfor x in loader:\n    model(x).sum().backward()\n"
                "    if rank == 0 and done:\n        break\n"),
    ]

    def _loop_syncs(self, ctx, loop) -> bool:
        return any(
            loop in ci.loops and (trains(ctx, ci) or ci.qnames & COLLECTIVES or ctx.is_ddp(ci.node.func))
            for ci in ctx.calls
        )

    def check(self, ctx):
        for loop in ctx.loops:
            if ctx.in_rank0(loop) or not self._loop_syncs(ctx, loop):
                continue
            for node in _exits(loop):
                if ctx.in_rank0(node) and not single_process_branch(ctx, node):
                    yield Report(node)  # (`if local_rank == -1 and ...: return` has no other rank to leave behind)


def _exits(loop):
    """``break``/``return`` statements that leave ``loop`` (not nested loops' breaks)."""
    out = []

    class V(cst.CSTVisitor):
        def __init__(self):
            self.depth = 0

        def visit_For(self, node):
            self.depth += 1

        def leave_For(self, node):
            self.depth -= 1

        def visit_While(self, node):
            self.depth += 1

        def leave_While(self, node):
            self.depth -= 1

        def visit_FunctionDef(self, node):
            return False

        def visit_Break(self, node):
            if self.depth == 0:
                out.append(node)

        def visit_Return(self, node):
            out.append(node)

    loop.body.visit(V())
    return out
