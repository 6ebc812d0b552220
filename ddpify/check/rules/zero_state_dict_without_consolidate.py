from ddpify.analysis import names as N
from ddpify.check.rule import Invalid, Report, Rule


class ZeroStateDictWithoutConsolidate(Rule):
    """`state_dict()` of a `ZeroRedundancyOptimizer` that is never consolidated.

    ## What it does
    Flags `optimizer.state_dict()` where `optimizer` is bound to a `ZeroRedundancyOptimizer`
    and the program never calls `consolidate_state_dict()`.

    ## Why is this bad?
    ZeRO shards the optimizer's state over the ranks. `state_dict()` returns the whole state
    only on the rank it was gathered to by `consolidate_state_dict(to=rank)`, a collective every
    rank must call first; without it the call raises ("Optimizer state has not been
    consolidated") and the checkpoint is never written, usually at the end of the first epoch.

    ## Example
    ```python
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
    ...
    if rank == 0:
        torch.save({"optimizer": optimizer.state_dict()}, path)
    ```

    ## Use instead
    ```python
    optimizer.consolidate_state_dict(to=0)  # on every rank
    if rank == 0:
        torch.save({"optimizer": optimizer.state_dict()}, path)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://github.com/Lightning-AI/pytorch-lightning/issues/10745
    - https://pytorch.org/docs/stable/distributed.optim.html#torch.distributed.optim.ZeroRedundancyOptimizer.consolidate_state_dict
    """

    CODE = "DDP165"
    NAME = "zero-state-dict-without-consolidate"
    DISTRIBUTED_ONLY = False
    MESSAGE = "`state_dict()` of a ZeroRedundancyOptimizer that is never consolidated raises; call `consolidate_state_dict(to=0)` on every rank first"
    VALID = [
        "from torch.distributed.optim import ZeroRedundancyOptimizer\nopt = ZeroRedundancyOptimizer(ps, optimizer_class=Adam)\n"
        "opt.consolidate_state_dict(to=0)\nstate = opt.state_dict()\n",
    ]
    INVALID = [
        Invalid("from torch.distributed.optim import ZeroRedundancyOptimizer\nopt = ZeroRedundancyOptimizer(ps, optimizer_class=Adam)\n"
                "state = opt.state_dict()\n"),
    ]

    def check(self, ctx):
        if ctx.program_method_calls("consolidate_state_dict"):
            return
        zero = ctx.index.bindings_of(N.ZERO_OPTIMIZERS)
        for ci in ctx.method_calls("state_dict"):
            if ctx.index.is_bound(ci.receiver, zero):
                yield Report(ci.node)
