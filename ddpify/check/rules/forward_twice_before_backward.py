from ddpify.check.context import DDP_CLASSES, is_true, kwarg
from ddpify.check.rule import Invalid, Report, Rule


class ForwardTwiceBeforeBackward(Rule):
    """DDP model called twice before one backward.

    ## What it does
    Flags a second forward of the same DDP model in a training step before `backward()`,
    unless DDP was built with `static_graph=True`. Forwards under `torch.no_grad()` are ignored.

    ## Why is this bad?
    DDP prepares one gradient reduction per forward. Two forwards before a backward raise
    "Expected to mark a variable ready only once" or "modified by an inplace operation"
    (seed 003), errors single-GPU and DataParallel runs never show.

    ## Example
    ```python
    out1 = model(x1)
    out2 = model(x2)
    (loss_fn(out1) + loss_fn(out2)).backward()
    ```

    ## Use instead
    ```python
    out1, out2 = model(x1, x2)  # one forward that handles both inputs
    (loss_fn(out1) + loss_fn(out2)).backward()
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html (static_graph)
    - seeds/003
    """

    CODE = "DDP119"
    NAME = "forward-twice-before-backward"
    MESSAGE = "DDP model called twice before backward; combine the inputs into one forward or set `static_graph=True`"
    VALID = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
        "for x in data:\n    out = model(x)\n    out.sum().backward()\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net, static_graph=True)\n"
        "for x, y in data:\n    a = model(x)\n    b = model(y)\n    (a + b).sum().backward()\n",
    ]
    INVALID = [
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
                "for x, y in data:\n    a = model(x)\n    b = model(y)\n    (a + b).sum().backward()\n"),
    ]

    def check(self, ctx):
        if any((k := kwarg(c.node, "static_graph")) and is_true(k.value) for c in ctx.calls_to(*DDP_CLASSES)):
            return
        groups: dict = {}
        for ci in ctx.calls:
            scope = (ci.func, ci.loops[-1] if ci.loops else None)
            if ctx.is_backward(ci):
                groups.setdefault(scope, {"fwd": {}, "bwd": []})["bwd"].append(ctx.line(ci.node))
            elif not ci.in_no_grad and ctx.is_ddp(ci.node.func):
                g = groups.setdefault(scope, {"fwd": {}, "bwd": []})
                g["fwd"].setdefault(ci.dotted, []).append(ci)
        for g in groups.values():
            if not g["bwd"]:
                continue
            first_bwd = min(g["bwd"])
            for calls in g["fwd"].values():
                before = [c for c in calls if ctx.line(c.node) < first_bwd]
                for c in before[1:]:
                    yield Report(c.node)
