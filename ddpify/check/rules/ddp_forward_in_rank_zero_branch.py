from ddpify.check.rule import Invalid, Report, Rule


class DDPForwardInRankZeroBranch(Rule):
    """DDP model called on rank 0 only.

    ## What it does
    Flags a call of the DDP-wrapped model (a name bound to `DistributedDataParallel(...)`,
    or a parameter that receives one) inside a rank-0-only branch or a function only called
    from one, e.g. evaluation on rank 0 through the wrapper.

    ## Why is this bad?
    DDP's forward may broadcast buffers and, in training mode, prepares a gradient all-reduce
    that the other ranks never join: the next collective hangs or mismatches.

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
    MESSAGE = "DDP model forward on rank 0 only can hang; run it on every rank or call `model.module` on rank 0"
    VALID = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
        "if rank == 0:\n    out = model.module(x)\n",
    ]
    INVALID = [
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
                "if rank == 0:\n    out = model(x)\n"),
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\n"
                "def evaluate(m, data):\n    return m(data)\n"
                "def main():\n    model = DDP(net)\n    if rank == 0:\n        evaluate(model, data)\n"),
    ]

    def check(self, ctx):
        if not ctx.ddp_bindings:
            return
        for ci in ctx.calls:
            forward = ctx.is_ddp(ci.node.func) or (ci.name == "forward" and ctx.is_ddp(ci.receiver))
            if forward and ctx.in_rank0(ci.node):
                yield Report(ci.node)
