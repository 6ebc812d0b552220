import re

import libcst as cst

from ddpify.check.rule import Invalid, Report, Rule

_RANK = re.compile(r"rank", re.IGNORECASE)
_SPLIT = ("array_split", "chunk", "tensor_split", "split")


class ManualRankSharding(Rule):
    """Data split by hand into per-rank shards of different sizes.

    ## What it does
    Flags `data[rank::world_size]` and `np.array_split(data, world_size)[rank]`-style shards.

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
    VALID = ["import torch.distributed as dist\nfirst = data[0::2]\n"]
    INVALID = [
        Invalid("import torch.distributed as dist\nshard = data[rank::world_size]\n"),
        Invalid("import numpy as np, torch.distributed as dist\nshard = np.array_split(data, world_size)[rank]\n"),
    ]

    def check(self, ctx):
        for node in ctx.subscripts:
            if len(node.slice) != 1:
                continue
            s = node.slice[0].slice
            if isinstance(s, cst.Slice) and s.lower is not None and s.step is not None:
                if _RANK.search(ctx.code(s.lower)) and "world" in ctx.code(s.step).lower() + "size":
                    yield Report(node)
            elif isinstance(s, cst.Index) and _RANK.search(ctx.code(s.value)):
                v = node.value
                if isinstance(v, cst.Call) and ctx.info(v).name in _SPLIT:
                    yield Report(node)

