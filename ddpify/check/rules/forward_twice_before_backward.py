import libcst as cst

from ddpify.analysis.literals import is_false
from ddpify.check.context import DDP_CLASSES, is_true, kwarg
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import may_precede


class ForwardTwiceBeforeBackward(Rule):
    """DDP model called twice before one backward.

    ## What it does
    Flags a second forward of the same DDP model in a training step before `backward()` when
    DDP searches for unused parameters (`find_unused_parameters=True`, or a value set at run
    time), unless it was built with `static_graph=True`. Forwards under `torch.no_grad()` are
    ignored, and so are forwards in different branches of an `if` (one runs per step). Without the search, two forwards and one backward reduce fine (each parameter's
    gradient is ready once).

    ## Why is this bad?
    With `find_unused_parameters=True` DDP prepares its search at every forward: forwards that
    use different parameters (two heads, a discriminator on real and fake inputs through
    different branches) raise "Expected to mark a variable ready only once" (seed 003), an
    error single-GPU and DataParallel runs never show.

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
    DDP_ONLY = True
    MESSAGE = "DDP model called twice before backward while it searches for unused parameters; combine the inputs into one forward, set `static_graph=True`, or drop `find_unused_parameters`"
    VALID = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net, find_unused_parameters=True)\n"
        "for x in data:\n    if two:\n        out = model(x)\n    else:\n        out = model(x * 2)\n    out.sum().backward()\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
        "for x in data:\n    out = model(x)\n    out.sum().backward()\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net, static_graph=True)\n"
        "for x, y in data:\n    a = model(x)\n    b = model(y)\n    (a + b).sum().backward()\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
        "for x, y in data:\n    a = model(x)\n    b = model(y)\n    (a + b).sum().backward()\n",
    ]
    INVALID = [
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net, find_unused_parameters=True)\n"
                "for x, y in data:\n    a = model(x)\n    b = model(y)\n    (a + b).sum().backward()\n"),
    ]

    def check(self, ctx):
        ddps = ctx.calls_to(*DDP_CLASSES)
        if any((k := kwarg(c.node, "static_graph")) and is_true(k.value) for c in ddps):
            return
        if not any(_searches_unused(ctx, c) for c in ddps):
            return  # without the unused-parameter search, two forwards and one backward reduce fine
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
                for i, c in enumerate(before):
                    if any(may_precede(ctx, p.node, c.node) for p in before[:i]):  # not the other branch of an `if`
                        yield Report(c.node)


def _searches_unused(ctx, ddp) -> bool:
    """Is `DDP(..., find_unused_parameters=x)` given a value that may be true: not `False`, nor a
    name its function binds to `False` only (`find_unused = False` ... `find_unused_parameters=find_unused`)?"""
    k = kwarg(ddp.node, "find_unused_parameters")
    if k is None or is_false(k.value):
        return False
    if isinstance(k.value, cst.Name):
        values = [b.value for b in ctx.assignments if b.dotted == k.value.value and b.func is ddp.func]
        return not (values and all(is_false(v) for v in values))
    return True
