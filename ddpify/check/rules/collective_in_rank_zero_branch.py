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
    NAME = "collective-in-rank-zero-branch"
    MESSAGE = "collective inside a rank-0-only branch hangs the other ranks; call it on every rank, outside the branch"
    VALID = ["import torch.distributed as dist\ndist.all_reduce(t)\nif dist.get_rank() == 0:\n    print(t)\n"]
    INVALID = [
        Invalid("import torch.distributed as dist\nif dist.get_rank() == 0:\n    dist.barrier()\n"),
        Invalid("import torch.distributed as dist\ndef report(t):\n    dist.all_reduce(t)\n"
                "if args.local_rank in (-1, 0):\n    report(t)\n"),
    ]

    def check(self, ctx):
        for ci in ctx.calls_to(*COLLECTIVES):
            if ci.name not in ("destroy_process_group",) and ctx.in_rank0(ci.node):
                yield Report(ci.node)
