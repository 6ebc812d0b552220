import libcst as cst

from ddpify.check.context import dotted_name, positional
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import assigned_name, before, may_precede, trains


class WrapAfterTraining(Rule):
    """A model wrapped in DDP only after it was trained.

    ## What it does
    Flags `DDP(model)` when, earlier in the same function, `model` was handed to a call that
    trains (a function of the program that runs backward passes), and nothing trains the
    wrapped model after the wrap.

    ## Why is this bad?
    The training ran on the bare module: no gradient was averaged, every rank trained its own
    replica, and code inside the training that expects the wrapper (`model.module`) fails with
    `AttributeError`. The wrap at the end only costs a broadcast.

    ## Example
    ```python
    model = Net().to(device)
    train_and_evaluate(model, loader, optimizer)
    model = DDP(model, device_ids=[local_rank])
    ```

    ## Use instead
    ```python
    model = DDP(Net().to(device), device_ids=[local_rank])
    train_and_evaluate(model, loader, optimizer)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/tutorials/intermediate/ddp_tutorial.html
    """

    CODE = "DDP154"
    NAME = "wrap-after-training"
    DDP_ONLY = True
    MESSAGE = (
        "`{name}` is wrapped in DDP after `{call}(...)` trained it (line {line}): that training ran unwrapped "
        "(no gradient averaged); wrap the model right after it is built"
    )
    VALID = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\ndef fit(m):\n    for x in data:\n"
        "        m(x).sum().backward()\nmodel = DDP(model)\nfit(model)\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\ndef fit(m):\n    for x in data:\n"
        "        m(x).sum().backward()\nfit(model)\nmodel = DDP(model)\nfit(model)\n",
    ]
    INVALID = [
        Invalid(
            "from torch.nn.parallel import DistributedDataParallel as DDP\ndef fit(m):\n    for x in data:\n"
            "        m(x).sum().backward()\nfit(model)\nmodel = DDP(model)\n"
        ),
    ]

    def check(self, ctx):
        for wrap in ctx.ddp_calls:
            args = positional(wrap.node)
            name = dotted_name(args[0].value) if args else None
            if name is None:
                continue
            wrapped = assigned_name(ctx, wrap.node) or name
            trained = [ci for ci in ctx.calls if _hands(ci, name) and may_precede(ctx, ci.node, wrap.node) and _trains(ctx, ci)]
            if not trained or not _last_in_loops(ctx, wrap.node, trained):
                continue
            if any(_hands(ci, wrapped) and before(ctx, wrap.node, ci.node) and _trains(ctx, ci) for ci in ctx.calls if ci.func is wrap.func):
                continue  # the wrapped model trains after (a fine-tuning after a pre-training)
            first = trained[0]
            yield Report(wrap.node, self.MESSAGE.format(name=name, call=ctx.code(first.node.func), line=ctx.line(first.node)))


def _hands(ci, name: str) -> bool:
    """Is `name` one of the call's arguments?"""
    return any(dotted_name(a.value) == name for a in ci.node.args)


def _trains(ctx, ci, depth: int = 0) -> bool:
    """Does the call run backward passes, itself or a few calls down the program's functions?"""
    if trains(ctx, ci):
        return True
    return depth < 3 and any(
        _trains(ctx, inner, depth + 1) for f in ctx.local_callees(ci) for inner in ctx.calls if inner.func is f
    )


def _last_in_loops(ctx, wrap, trained) -> bool:
    """No loop holds both the training and the wrap (a wrap in a loop runs before the next pass)."""
    loops = [p for p in ctx.ancestors(wrap) if isinstance(p, (cst.For, cst.While))]
    return not any(any(q is loop for q in ctx.ancestors(ci.node)) for loop in loops for ci in trained)
