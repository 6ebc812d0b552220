import libcst as cst

from ddpify.analysis.index import iter_nodes
from ddpify.check.context import DISTRIBUTED_SAMPLER, is_false, kwarg
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import class_of_call


class MissingSetEpoch(Rule):
    """Shuffling `DistributedSampler` without `set_epoch`.

    ## What it does
    Flags a `DistributedSampler` that shuffles (the default) in a program that never calls
    `set_epoch`: not in the file, the project modules it imports, nor elsewhere in the programs
    that import it (a `datasets.py` builds the sampler, the training script sets its epoch).
    When no file of the project imports it, a sampler made by a builder function that hands its
    result back and that nothing in the file calls (a `build_loader()` in a data module) is left
    alone: its caller, out of sight, owns the epochs (`loader.sampler.set_epoch(epoch)`). A
    sampler built anew in the epoch loop with a seed that reads the loop's counter
    (`DistributedSampler(ds, seed=seed + epoch)`) shuffles anew each epoch and is left alone too.

    ## Why is this bad?
    The sampler seeds its shuffle with the epoch number; without `set_epoch(epoch)` every
    epoch uses the same order, which hurts convergence.

    ## Example
    ```python
    for epoch in range(epochs):
        for x, y in loader:
            ...
    ```

    ## Use instead
    ```python
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            ...
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler
    """

    CODE = "DDP112"
    NAME = "missing-set-epoch"
    MESSAGE = "DistributedSampler shuffles the same way every epoch; call `sampler.set_epoch(epoch)` at the top of each epoch"
    VALID = [
        "from torch.utils.data import DistributedSampler\ns = DistributedSampler(ds)\n"
        "for epoch in range(3):\n    s.set_epoch(epoch)\n",
        "from torch.utils.data import DistributedSampler\ns = DistributedSampler(ds, shuffle=False)\n",
    ]
    INVALID = [Invalid("from torch.utils.data import DistributedSampler\ns = DistributedSampler(ds)\n")]

    def check(self, ctx):
        if ctx.program_method_calls("set_epoch") or (ctx.project is not None and ctx.project.truncated):
            return  # (a program too large to read whole may call it where the check does not look)
        for ci in [*ctx.calls_to(*DISTRIBUTED_SAMPLER), *_own_epoch_samplers(ctx)]:
            shuffle = kwarg(ci.node, "shuffle")
            if shuffle is not None and is_false(shuffle.value):
                continue
            if _seeded_by_loop(ctx, ci):
                continue  # built anew in the epoch loop with a seed that reads its counter: a new order each epoch
            func = ctx.enclosing_func(ci.node)
            if func is not None and not ctx.has_importers and not ctx.call_sites(func) and _returns_value(func):
                continue  # a builder for other modules: the caller sets the epoch
            yield Report(ci.node)


def _own_epoch_samplers(ctx) -> list:
    """Calls that make a sampler class of the program which shuffles by an epoch it is told
    (it defines `set_epoch` and `__iter__`: a copy of DistributedSampler, MagFace's
    `ParallelDistributedSampler`)."""
    found = []
    for ci in ctx.calls:
        cls = class_of_call(ctx, ci.node) if not ci.qnames & DISTRIBUTED_SAMPLER else None
        methods = {s.name.value for s in cls.body.body if isinstance(s, cst.FunctionDef)} if cls is not None else set()
        if {"set_epoch", "__iter__"} <= methods:
            found.append(ci)
    return found


def _seeded_by_loop(ctx, ci) -> bool:
    """`DistributedSampler(ds, seed=base + epoch)` inside `for epoch in ...:`."""
    seed = kwarg(ci.node, "seed")
    if seed is None:
        return False
    read = {n.value for n in iter_nodes(seed.value) if isinstance(n, cst.Name)}
    counters = {n.value for loop in ci.loops if isinstance(loop, cst.For) for n in iter_nodes(loop.target) if isinstance(n, cst.Name)}
    return bool(read & counters)


def _returns_value(func: cst.FunctionDef) -> bool:
    found = []

    class _Returns(cst.CSTVisitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is func  # a nested function's return is not this one's

        def visit_Return(self, node: cst.Return) -> None:
            if node.value is not None:
                found.append(node)

    func.visit(_Returns())
    return bool(found)
