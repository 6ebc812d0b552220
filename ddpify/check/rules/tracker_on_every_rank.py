from ddpify.analysis import names as N
from ddpify.check.context import kwarg
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import every_rank, library_code

TRACKERS = N.SUMMARY_WRITERS | {"wandb.init", "mlflow.start_run"}


class TrackerOnEveryRank(Rule):
    """Experiment tracker started by every rank.

    ## What it does
    Flags `SummaryWriter(...)`, `wandb.init(...)` and `mlflow.start_run(...)` outside a
    rank-0-only branch (`wandb.init(mode=...)` is left alone).

    A tracker made in a helper module's function or class that nothing in the file calls is
    left alone: the training script decides on which rank it is made.

    ## Why is this bad?
    Each rank creates its own run or event file: N duplicated curves, N times the uploads.

    ## Example
    ```python
    writer = SummaryWriter("runs/exp")
    ```

    ## Use instead
    ```python
    writer = SummaryWriter("runs/exp") if rank == 0 else None
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/tensorboard.html
    """

    CODE = "DDP305"
    NAME = "tracker-on-every-rank"
    MESSAGE = "experiment tracker created by every rank (N duplicate runs); create it on rank 0 only"
    SEVERITY = "warning"
    VALID = [
        "import torch.distributed as dist\nfrom torch.utils.tensorboard import SummaryWriter\n"
        "writer = SummaryWriter() if rank == 0 else None\n",
    ]
    INVALID = [Invalid("import torch.distributed as dist\nfrom torch.utils.tensorboard import SummaryWriter\nwriter = SummaryWriter()\n")]

    def check(self, ctx):
        for ci in ctx.calls_to(*TRACKERS):
            if ci.name == "init" and kwarg(ci.node, "mode") is not None:
                continue
            if every_rank(ctx, ci.node) and not library_code(ctx, ci.node):
                yield Report(ci.node)
