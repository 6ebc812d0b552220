from ddpify.check.context import kwarg
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import every_rank

TQDM = ("tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm", "tqdm.rich.tqdm", "tqdm.std.tqdm", "tqdm.trange", "tqdm.auto.trange")


class ProgressBarOnEveryRank(Rule):
    """Progress bar drawn by every rank.

    ## What it does
    Flags `tqdm(...)`/`trange(...)` without `disable=` outside a rank-0-only branch.

    ## Why is this bad?
    N bars fight over the same terminal lines, flooding the log of every job.

    ## Example
    ```python
    for x, y in tqdm(loader):
        ...
    ```

    ## Use instead
    ```python
    for x, y in tqdm(loader, disable=rank != 0):
        ...
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://tqdm.github.io/docs/tqdm/
    """

    CODE = "DDP304"
    NAME = "progress-bar-on-every-rank"
    MESSAGE = "progress bar drawn by every rank; pass `disable=rank != 0`"
    SEVERITY = "warning"
    VALID = ["import torch.distributed as dist\nfrom tqdm import tqdm\nfor x in tqdm(loader, disable=rank != 0):\n    pass\n"]
    INVALID = [Invalid("import torch.distributed as dist\nfrom tqdm import tqdm\nfor x in tqdm(loader):\n    pass\n")]

    def check(self, ctx):
        for ci in ctx.calls_to(*TQDM):
            if kwarg(ci.node, "disable") is None and every_rank(ctx, ci.node):
                yield Report(ci.node)
