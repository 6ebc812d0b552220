from __future__ import annotations

from ddpify.analysis import names as N
from ddpify.check.context import is_true, kwarg
from ddpify.check.rule import Invalid, Report, Rule



class ReentrantCheckpointWithUnusedSearch(Rule):
    """Reentrant activation checkpointing in a DDP model that searches for unused parameters.

    ## What it does
    Flags `torch.utils.checkpoint.checkpoint(..., use_reentrant=True)` (and
    `checkpoint_sequential`) in a file that wraps a model in DDP with
    `find_unused_parameters=True` and without `static_graph=True`. A call that leaves
    `use_reentrant` out is not flagged: what it means depends on the torch version.

    ## Why is this bad?
    Reentrant checkpointing runs the block's backward in a nested autograd pass. With the
    unused-parameter search on, DDP has already marked the block's parameters ready (they were
    not in the graph it traversed), and the nested backward marks them again: the first
    backward fails with `Expected to mark a variable ready only once`.

    ## Example
    ```python
    x = checkpoint(self.block, x, use_reentrant=True)
    ...
    model = DDP(net, find_unused_parameters=True)
    ```

    ## Use instead
    ```python
    x = checkpoint(self.block, x, use_reentrant=False)
    ```

    ## Fix safety
    No automatic fix: non-reentrant checkpointing keeps other tensors alive, and
    `static_graph=True` needs a graph that does not change.

    ## References
    - https://pytorch.org/docs/stable/checkpoint.html
    - https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html (`static_graph`)
    """

    CODE = "DDP143"
    NAME = "reentrant-checkpoint-with-unused-search"
    DDP_ONLY = True
    MESSAGE = "reentrant checkpoint under DDP's unused-parameter search: the block's parameters are marked ready twice (RuntimeError); pass `use_reentrant=False`"
    VALID = [
        "from torch.utils.checkpoint import checkpoint\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "def f(x):\n    return checkpoint(block, x, use_reentrant=False)\nmodel = DDP(net, find_unused_parameters=True)\n",
        "from torch.utils.checkpoint import checkpoint\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "def f(x):\n    return checkpoint(block, x, use_reentrant=True)\nmodel = DDP(net)\n",
    ]
    INVALID = [
        Invalid("from torch.utils.checkpoint import checkpoint\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
                "def f(x):\n    return checkpoint(block, x, use_reentrant=True)\n"
                "model = DDP(net, find_unused_parameters=True)\n"),
    ]

    def check(self, ctx):
        searching = []
        for wrap in ctx.ddp_calls:
            k, static = kwarg(wrap.node, "find_unused_parameters"), kwarg(wrap.node, "static_graph")
            if k is not None and is_true(k.value) and not (static is not None and is_true(static.value)):
                searching.append(wrap)
        if not searching:
            return
        wrap = searching[0]
        for ci in ctx.calls_to(*N.ACTIVATION_CHECKPOINTS):
            k = kwarg(ci.node, "use_reentrant")
            if k is not None and is_true(k.value):
                yield Report(ci.node, f"`{ctx.code(ci.node.func)}(..., use_reentrant=True)` under "
                             f"`{ctx.code(wrap.node.func)}(..., find_unused_parameters=True)` (line "
                             f"{ctx.line(wrap.node)}): the nested backward marks the block's parameters ready a "
                             "second time (RuntimeError: Expected to mark a variable ready only once); pass "
                             "`use_reentrant=False`")
