import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.analysis.rank import rank_analysis
from ddpify.check.context import kwarg, positional
from ddpify.check.rule import Invalid, Report, Rule

_CLOCK = N.spelled({"time.time", "time.time_ns", "time.perf_counter", "datetime.datetime.now"})


class SamplerSeedPerRank(Rule):
    """`DistributedSampler` seeded differently on each rank.

    ## What it does
    Flags `DistributedSampler(..., seed=X)` where `X` differs by process: it reads the rank
    (`seed=args.seed + rank`), or the clock (`int(time.time())`), also through a name bound to
    such a value.

    ## Why is this bad?
    Every rank shuffles the whole dataset with the sampler's seed and keeps its own slice of
    that permutation. With a seed per rank, each rank slices a different permutation: the
    slices overlap (some samples trained twice an epoch, others never), and the split is no
    longer a partition. The seed must be the same on every rank; `set_epoch` varies it by epoch.

    ## Example
    ```python
    sampler = DistributedSampler(dataset, seed=args.seed + rank)
    ```

    ## Use instead
    ```python
    sampler = DistributedSampler(dataset, seed=args.seed)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler
    """

    CODE = "DDP158"
    NAME = "sampler-seed-per-rank"
    DISTRIBUTED_ONLY = False
    MESSAGE = "the sampler's seed differs by rank: each rank slices another permutation, so the shards overlap; use one seed on every rank"
    VALID = [
        "from torch.utils.data import DistributedSampler\nsampler = DistributedSampler(ds, seed=args.seed)\n",
        "import torch.distributed as dist\nfrom torch.utils.data import DistributedSampler\n"
        "torch.manual_seed(args.seed + dist.get_rank())\nsampler = DistributedSampler(ds, seed=args.seed)\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nfrom torch.utils.data import DistributedSampler\n"
                "rank = dist.get_rank()\nsampler = DistributedSampler(ds, seed=args.seed + rank)\n"),
        Invalid("import time\nfrom torch.utils.data import DistributedSampler\nseed = int(time.time())\n"
                "sampler = DistributedSampler(ds, shuffle=True, seed=seed)\n"),
    ]  # fmt: skip

    def check(self, ctx):
        ranks = rank_analysis(ctx.index)
        for ci in ctx.calls_to(*N.DISTRIBUTED_SAMPLER):
            seed = kwarg(ci.node, "seed") or next(iter(positional(ci.node)[4:5]), None)
            if seed is not None and (ranks.per_rank(seed.value, ci.func) or _reads_clock(ctx, seed.value, ci.func)):
                yield Report(seed.value)


def _reads_clock(ctx, value: cst.BaseExpression, func) -> bool:
    """Does the value call the clock, here or in the binding of a name it reads?"""
    names = {n.value for n in iter_nodes(value) if isinstance(n, cst.Name)}
    values = [value] + [b.value for b in ctx.assignments if b.dotted in names and b.func in (func, None)]
    return any(isinstance(n, cst.Call) and ctx.qnames(n.func) & _CLOCK for v in values for n in iter_nodes(v))
