from ddpify.analysis import names as N
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import every_rank


class SaveOnEveryRank(Rule):
    """Checkpoint written by every rank.

    ## What it does
    Flags `torch.save(...)` outside a rank-0-only branch in a distributed script (unless the
    path mentions the rank, i.e. per-rank files on purpose).

    ## Why is this bad?
    N processes write the same file at once: wasted I/O, and a corrupt or truncated
    checkpoint when writes interleave.

    ## Example
    ```python
    torch.save(model.module.state_dict(), "model.pt")
    ```

    ## Use instead
    ```python
    if rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/tutorials/intermediate/ddp_tutorial.html#save-and-load-checkpoints
    """

    CODE = "DDP301"
    NAME = "save-on-every-rank"
    MESSAGE = "`torch.save` on every rank writes the same file N times; guard it with `if rank == 0:`"
    VALID = [
        "import torch, torch.distributed as dist\nif dist.get_rank() == 0:\n    torch.save(sd, 'm.pt')\n",
        "import torch, torch.distributed as dist\ntorch.save(sd, f'm_rank{rank}.pt')\n",
    ]
    INVALID = [Invalid("import torch, torch.distributed as dist\ntorch.save(sd, 'm.pt')\n")]

    def check(self, ctx):
        for ci in ctx.calls_to(*N.TORCH_SAVE):
            if every_rank(ctx, ci.node):
                yield Report(ci.node)
