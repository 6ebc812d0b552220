from ddpify.analysis import names as N
from ddpify.analysis.literals import is_false, is_true
from ddpify.check.context import kwarg
from ddpify.check.rule import Invalid, Report, Rule


class DDPForwardInRankZeroBranch(Rule):
    """DDP model called on rank 0 only.

    ## What it does
    Flags a call of the DDP-wrapped model (a name bound to `DistributedDataParallel(...)`,
    or a parameter that receives one) inside a rank-0-only branch or a function only called
    from one, e.g. evaluation on rank 0 through the wrapper.

    Not flagged when every DDP wrap turns both collectives of the forward off
    (`broadcast_buffers=False`, no `find_unused_parameters=True`).

    ## Why is this bad?
    When the model has buffers (BatchNorm's running statistics), DDP's forward broadcasts them
    from rank 0, a collective the other ranks never join: the next collective hangs or
    mismatches (checked under torchrun: a model without buffers evaluated this way under
    `torch.no_grad()` runs fine, one with BatchNorm does not). With `find_unused_parameters=True`
    the forward also starts a search the next backward expects to finish.

    ## Example
    ```python
    if rank == 0:
        evaluate(ddp_model, test_loader)
    ```

    ## Use instead
    ```python
    if rank == 0:
        evaluate(ddp_model.module, test_loader)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/notes/ddp.html
    """

    CODE = "DDP117"
    NAME = "ddp-forward-in-rank-zero-branch"
    DDP_ONLY = True
    MESSAGE = (
        "DDP model forward on rank 0 only: it hangs when the model has buffers to broadcast (BatchNorm) or DDP "
        "searches for unused parameters; run it on every rank or call `model.module` on rank 0"
    )
    VALID = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
        "if rank == 0:\n    out = model.module(x)\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net, broadcast_buffers=False)\n"
        "if rank == 0:\n    out = model(x)\n",
    ]
    INVALID = [
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
                "if rank == 0:\n    out = model(x)\n"),
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\n"
                "def evaluate(m, data):\n    return m(data)\n"
                "def main():\n    model = DDP(net)\n    if rank == 0:\n        evaluate(model, data)\n"),
    ]

    def check(self, ctx):
        if not ctx.ddp_bindings or all(_no_forward_collectives(ci.node) for ci in ctx.ddp_calls):
            return
        for ci in ctx.calls:
            forward = ctx.is_ddp(ci.node.func) or (ci.name == "forward" and ctx.is_ddp(ci.receiver))
            if forward and ctx.in_rank0(ci.node):
                yield Report(ci.node, None if _forward_collectives_seen(ctx) else self.MESSAGE + _ASSUMED)


_ASSUMED = " (assumed: no BatchNorm, buffer or `find_unused_parameters=True` is in sight, the model's classes may have them)"


def _forward_collectives_seen(ctx) -> bool:
    """Does the file show why this forward talks to the other ranks: a BatchNorm layer or a
    registered buffer (broadcast before each forward), or the search for unused parameters?"""
    return bool(ctx.calls_to(*N.BATCHNORMS)) or bool(ctx.method_calls("register_buffer")) or any(
        (kw := kwarg(ci.node, "find_unused_parameters")) is not None and is_true(kw.value) for ci in ctx.ddp_calls
    )


def _no_forward_collectives(call) -> bool:
    """`DDP(model, broadcast_buffers=False)` without `find_unused_parameters=True`."""
    buffers = kwarg(call, "broadcast_buffers")
    unused = kwarg(call, "find_unused_parameters")
    return buffers is not None and is_false(buffers.value) and (unused is None or is_false(unused.value))
