import libcst as cst

from ddpify.check.context import COLLECTIVES
from ddpify.check.rule import Invalid, Report, Rule


class CollectiveInRankZeroBranch(Rule):
    """Collective call that only rank 0 reaches.

    ## What it does
    Flags `barrier`, `all_reduce`, `broadcast`, `all_gather`, ... inside a rank-0-only branch
    (`if rank == 0:`, `if dist.get_rank() == 0:`, `if is_main_process():`, after
    `if rank != 0: return`), including in functions that are only called from such branches.

    ## Why is this bad?
    A collective completes only when every rank calls it. Rank 0 waits forever for the
    others: the job hangs until the NCCL timeout.

    ## Example
    ```python
    if rank == 0:
        dist.all_reduce(loss)
        print(loss.item())
    ```

    ## Use instead
    ```python
    dist.all_reduce(loss)
    if rank == 0:
        print(loss.item())
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/distributed.html#collective-functions
    """

    CODE = "DDP116"
    FOLLOWS_CALLS = True
    NAME = "collective-in-rank-zero-branch"
    MESSAGE = "collective inside a rank-0-only branch hangs the other ranks; call it on every rank, outside the branch"
    VALID = [
        "import torch.distributed as dist\ndist.all_reduce(t)\nif dist.get_rank() == 0:\n    print(t)\n",
        "import torch.distributed as dist\nif dist.get_rank() != 0:\n    dist.barrier()\nprepare()\n"
        "if dist.get_rank() == 0:\n    dist.barrier()\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nif dist.get_rank() == 0:\n    dist.barrier()\n"),
        Invalid("import torch.distributed as dist\ndef report(t):\n    dist.all_reduce(t)\n"
                "if args.local_rank in (-1, 0):\n    report(t)\n"),
    ]

    def check(self, ctx):
        collectives = ctx.calls_to(*COLLECTIVES)
        for ci in collectives:
            if ci.name not in ("destroy_process_group",) and ctx.in_rank0(ci.node) and not _paired(ctx, ci, collectives):
                yield Report(ci.node)


def _paired(ctx, ci, collectives) -> bool:
    """A barrier on rank 0 matched by one on the other ranks ("rank 0 first", e.g. downloads)."""
    return ci.name == "barrier" and any(
        other.name == "barrier" and other.func is ci.func and _off_rank0(ctx, other.node) for other in collectives
    )


def _off_rank0(ctx, node) -> bool:
    """Inside `if <not rank 0>:` (the branch the other ranks take)."""
    child = node
    for parent in ctx.ancestors(node):
        if isinstance(parent, cst.If) and child is parent.body and ctx.rank_test(parent.test) == -1:
            return True
        child = parent
    return False
