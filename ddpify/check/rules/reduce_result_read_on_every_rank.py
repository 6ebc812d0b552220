import libcst as cst

from ddpify.analysis.index import iter_nodes
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import name_reads
from ddpify.check.rules._inplace import in_place_collectives, tensor_arg


class ReduceResultReadOnEveryRank(Rule):
    """The result of `dist.reduce` read on every rank.

    ## What it does
    Flags `dist.reduce(t, dst=...)` when `t` is read afterwards in the same function by code
    that every rank runs (not under a test of the rank), before it is bound again or broadcast.
    A function that also uses it under a rank-0 test after the reduce (`if rank == 0: losses /=
    world_size`, the `reduce_dict` idiom) knows where the sum is, and is left alone.

    ## Why is this bad?
    `reduce` leaves the sum on the destination rank only; on the others `t` holds an
    unspecified partial value (its own shard's, with gloo). A loss logged, compared with the best
    one, or fed to a scheduler on every rank then differs by rank: wrong numbers, and ranks that
    take different branches (one saves or stops early, the others do not).

    ## Example
    ```python
    dist.reduce(stats, dst=0)
    val_loss = (stats[0] / stats[1]).item()
    ```

    ## Use instead
    ```python
    dist.all_reduce(stats)
    val_loss = (stats[0] / stats[1]).item()
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/distributed.html#torch.distributed.reduce
    """

    CODE = "DDP161"
    NAME = "reduce-result-read-on-every-rank"
    MESSAGE = "`reduce` leaves the result on the destination rank only, and every rank reads it here; use `all_reduce`, or read it on that rank"
    VALID = [
        "import torch.distributed as dist\ndef report(stats):\n    dist.reduce(stats, dst=0)\n"
        "    if dist.get_rank() == 0:\n        print(stats[0] / stats[1])\n",
        "import torch.distributed as dist\ndef report(stats):\n    dist.all_reduce(stats)\n    print(stats[0] / stats[1])\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\ndef report(stats):\n    dist.reduce(stats, dst=0)\n"
                "    val_loss = (stats[0] / stats[1]).item()\n    return val_loss\n"),
    ]  # fmt: skip

    def check(self, ctx):
        for ci in in_place_collectives(ctx):
            tensor = tensor_arg(ci)
            if ci.name != "reduce" or not isinstance(tensor, cst.Name) or ci.func is None or ctx.under_rank_test(ci.node):
                continue
            if _read_after(ctx, ci, tensor.value):
                yield Report(ci.node)


def _read_after(ctx, ci, name: str) -> bool:
    """Is `name` read after the reduce by code every rank runs, before it is rebound or broadcast?"""
    line = ctx.line(ci.node)
    later = [
        ctx.line(n) for n in iter_nodes(ci.func.body)
        if isinstance(n, cst.AssignTarget) and name in {t.value for t in iter_nodes(n) if isinstance(t, cst.Name)}
        or isinstance(n, cst.Call) and n is not ci.node and ctx.code(n.func).endswith(("broadcast", "all_reduce", "reduce"))
        and n.args and isinstance(n.args[0].value, cst.Name) and n.args[0].value.value == name
    ]  # fmt: skip
    stop = min((x for x in later if x > line), default=1 << 30)
    reads = [n for n in name_reads(ci.func.body, name) if line < ctx.line(n) < stop]
    if any(ctx.in_rank0(n) for n in reads):
        return False  # `if rank == 0: losses /= world_size`: the author knows rank 0 alone holds the sum
    return any(not ctx.under_rank_test(n) for n in reads)
