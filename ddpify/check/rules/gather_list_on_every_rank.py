import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import kwarg, positional
from ddpify.check.rule import Invalid, Report, Rule

class GatherListOnEveryRank(Rule):
    """`dist.gather`/`scatter` given its list on every rank.

    ## What it does
    Flags `dist.gather(t, gather_list, dst=0)` (also `gather_object`, `scatter`,
    `scatter_object_list`) whose list is passed by every rank: not under a test of the rank, and
    not `None` (or `[]`), nor `lst if rank == dst else None` (a test that reads the rank).

    ## Why is this bad?
    Only the destination (or source) rank may pass the list: every other rank raises
    `ValueError: Argument ``gather_list`` must NOT be specified on non-destination ranks`, and
    the destination waits for peers that are gone (an error, or a hang until the timeout).

    ## Example
    ```python
    gathered = [torch.zeros_like(preds) for _ in range(world_size)]
    dist.gather(preds, gathered, dst=0)
    ```

    ## Use instead
    ```python
    gathered = [torch.zeros_like(preds) for _ in range(world_size)] if rank == 0 else None
    dist.gather(preds, gathered, dst=0)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/distributed.html#torch.distributed.gather
    """

    CODE = "DDP159"
    NAME = "gather-list-on-every-rank"
    DISTRIBUTED_ONLY = False
    MESSAGE = "every rank passes the gather/scatter list, which only the destination rank may give: the others raise; pass it on that rank and None elsewhere"
    VALID = [
        "import torch.distributed as dist\nbufs = [t.clone() for _ in range(n)] if dist.get_rank() == 0 else None\n"
        "dist.gather(t, bufs, dst=0)\n",
        "import torch.distributed as dist\nif dist.get_rank() == 0:\n    dist.gather(t, gather_list=bufs, dst=0)\nelse:\n"
        "    dist.gather(t, dst=0)\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nbufs = [t.clone() for _ in range(n)]\ndist.gather(t, bufs, dst=0)\n"),
    ]

    def check(self, ctx):
        for qnames, keyword, position in N.DESTINATION_LISTS:
            for ci in ctx.calls_to(*qnames):
                given = kwarg(ci.node, keyword) or next(iter(positional(ci.node)[position : position + 1]), None)
                if given is None or ctx.under_rank_test(ci.node) or _per_rank_value(ctx, given.value, ci.func):
                    continue
                yield Report(ci.node)


def _per_rank_value(ctx, value: cst.BaseExpression, func) -> bool:
    """`None`, `lst if rank == 0 else None`, or a name every binding of which is one of them or
    is made under a test of the rank."""
    if isinstance(value, cst.Name) and value.value == "None" or isinstance(value, cst.List) and not value.elements:
        return True  # (an empty list is no list to torch)
    if isinstance(value, cst.IfExp) and (ctx.rank_test(value.test) != 0 or ctx.reads_rank(value.test)):
        return True  # `lst if rank == 0 else None`, `chunks if i == my_rank else []` with `src=i`
    if isinstance(value, cst.Name):
        bindings = [b for b in ctx.assignments if b.dotted == value.value and b.func is func]
        return any(
            _per_rank_value(ctx, b.value, func) or (b._node is not None and ctx.under_rank_test(b._node)) for b in bindings
        )
    return False
