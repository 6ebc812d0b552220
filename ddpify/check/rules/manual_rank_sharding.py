import re

import libcst as cst

from ddpify.check.rule import Invalid, Report, Rule

_RANK = re.compile(r"rank", re.IGNORECASE)
_SPLIT = ("array_split", "chunk", "tensor_split", "split")
_TIMES_WORLD = re.compile(r"\*\s*[\w.]*world_size\b", re.IGNORECASE)


class ManualRankSharding(Rule):
    """Data split by hand into per-rank shards of different sizes.

    ## What it does
    Flags `data[rank::world_size]`, `np.array_split(data, world_size)[rank]`-style shards and
    contiguous ranges of indices (`Subset(data, range(rank * per, (rank + 1) * per))`) unless
    their size is a floor division (`per = len(data) // world_size`: equal shards, the
    remainder dropped), or a strided pick from parts whose count is a multiple of the world size
    (`parts = seeds.tensor_split(n * world_size)`: every rank the same number of parts). A
    slice of a tensor by rank (a chunk of optimizer state) is not a shard
    of the data and is left alone.

    ## Why is this bad?
    When the dataset size is not a multiple of the world size, ranks get different numbers of
    batches. The rank with more batches waits in DDP's gradient all-reduce for peers that have
    stopped: training hangs at the end of the epoch.

    ## Example
    ```python
    shard = samples[rank::world_size]
    ```

    ## Use instead
    ```python
    sampler = DistributedSampler(dataset)  # pads to equal length
    # or wrap the loop in torch.distributed.algorithms.Join([model])
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/tutorials/advanced/generic_join.html
    """

    CODE = "DDP114"
    NAME = "manual-rank-sharding"
    MESSAGE = "hand-made per-rank shards can have uneven batch counts (hang); use DistributedSampler or `Join`"
    VALID = [
        "import torch.distributed as dist\nfirst = data[0::2]\n",
        "import torch.distributed as dist\nn = (len(seeds) // 64 + 1) * world_size\n"
        "parts = seeds.tensor_split(n)\nmine = parts[rank::world_size]\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nshard = data[rank::world_size]\n"),
        Invalid("import numpy as np, torch.distributed as dist\nshard = np.array_split(data, world_size)[rank]\n"),
        Invalid("import torch.distributed as dist\nshard = Subset(ds, range(rank * per, min((rank + 1) * per, n)))\n"),
    ]

    def check(self, ctx):
        for node in ctx.subscripts:
            if len(node.slice) != 1:
                continue
            s = node.slice[0].slice
            if isinstance(s, cst.Slice) and s.lower is not None and s.step is not None:
                if _RANK.search(ctx.code(s.lower)) and "world" in ctx.code(s.step).lower() + "size":
                    if not _parts_per_rank_equal(ctx, node.value):
                        yield Report(node)
            elif isinstance(s, cst.Index) and _RANK.search(ctx.code(s.value)):
                v = node.value
                if isinstance(v, cst.Call) and ctx.info(v).name in _SPLIT:
                    yield Report(node)
        for ci in ctx.calls:  # `range(rank * per, min((rank + 1) * per, n))`: a contiguous shard of indices
            if ci.name == "range" and ci.receiver is None and len(ci.node.args) >= 2:
                low, high = ci.node.args[0].value, ci.node.args[1].value
                if _RANK.search(ctx.code(low)) and _RANK.search(ctx.code(high)) and "*" in ctx.code(low) and not _even(ctx, low):
                    yield Report(ci.node)


def _even(ctx, low: cst.BaseExpression) -> bool:
    """Is the shard's size a floor division (`per = len(data) // world`): every rank the same
    number of samples, the remainder dropped?"""
    sizes = {n.value for n in _names(low)}
    return any(b.dotted in sizes and "//" in ctx.code(b.value) for b in ctx.assignments) or "//" in ctx.code(low)


def _parts_per_rank_equal(ctx, value: cst.BaseExpression) -> bool:
    """`parts = x.tensor_split(n)` with `n = (...) * world_size`: a strided pick gives every rank
    n / world_size parts."""
    if not isinstance(value, cst.Name):
        return False
    counts = {
        n.value
        for b in ctx.assignments
        if b.dotted == value.value and isinstance(b.value, cst.Call) and ctx.info(b.value).name in _SPLIT
        for a in b.value.args for n in _names(a.value)
    }
    return any(b.dotted in counts and _TIMES_WORLD.search(ctx.code(b.value)) for b in ctx.assignments)


def _names(node: cst.CSTNode) -> list[cst.Name]:
    found: list[cst.Name] = []

    class _Names(cst.CSTVisitor):
        def visit_Name(self, name: cst.Name) -> None:
            found.append(name)

    node.visit(_Names())
    return found

