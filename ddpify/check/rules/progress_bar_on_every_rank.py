import libcst as cst

from ddpify.check.context import dotted_name, kwarg
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import every_rank

TQDM = ("tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm", "tqdm.rich.tqdm", "tqdm.std.tqdm", "tqdm.trange", "tqdm.auto.trange")


class ProgressBarOnEveryRank(Rule):
    """Progress bar drawn by every rank.

    ## What it does
    Flags `tqdm(...)`/`trange(...)` without `disable=` outside a rank-0-only branch (a bar drawn
    into a stream chosen by the rank, `file=sys.stderr if rank == 0 else devnull`, is not flagged,
    nor any bar of a program that points `sys.stderr` somewhere itself).

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
        if ctx.stderr_redirected:
            return  # the bars draw where the program sends stderr (`sys.stderr = open(os.devnull, "w")` off rank 0)
        for ci in ctx.calls_to(*TQDM):
            if kwarg(ci.node, "disable") is None and not _drawn_by_rank(ctx, ci) and every_rank(ctx, ci.node):
                yield Report(ci.node)


def _drawn_by_rank(ctx, ci) -> bool:
    """`tqdm(..., file=out)` with a stream chosen by the rank (`out = sys.stderr if
    is_leader_process() else open(os.devnull, "w")`): the other ranks draw into nothing."""
    arg = kwarg(ci.node, "file")
    if arg is None:
        return False
    name = dotted_name(arg.value)
    values = [arg.value] + [b.value for b in ctx.assignments if b.dotted == name and b.func is ci.func]
    return any(ctx.reads_rank(v.test if isinstance(v, cst.IfExp) else v) for v in values)
