import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import dotted_name, iter_nodes
from ddpify.analysis.literals import int_value
from ddpify.check.context import kwarg
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import trains


class SetEpochAfterIteration(Rule):
    """`set_epoch` called after the epoch's data was already iterated.

    ## What it does
    Flags `sampler.set_epoch(epoch)` when, in the same epoch-loop body, a training loop (or
    a call to a training function) comes before it. A sampler whose own loader is iterated after
    the call, and not before it (`valid_loader.sampler.set_epoch(epoch)` right before the
    validation loop, or before `validate(valid_loader, model)`), is set in time.

    ## Why is this bad?
    The loader's iterator draws its indices when the iteration starts; setting the epoch
    afterwards shuffles the *next* epoch with this epoch's seed, so epoch 0 and 1 share an order.

    ## Example
    ```python
    for epoch in range(epochs):
        train_one_epoch(model, loader)
        sampler.set_epoch(epoch)
    ```

    ## Use instead
    ```python
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        train_one_epoch(model, loader)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler
    """

    CODE = "DDP113"
    NAME = "set-epoch-after-iteration"
    MESSAGE = "`set_epoch` after the loader was iterated has no effect this epoch; call it at the top of the epoch loop"
    VALID = [
        "import torch.distributed as dist\nfor epoch in range(3):\n    s.set_epoch(epoch)\n"
        "    for x in loader:\n        model(x).sum().backward()\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nfor epoch in range(3):\n"
                "    for x in loader:\n        model(x).sum().backward()\n    s.set_epoch(epoch)\n"),
    ]

    def _statement_trains(self, ctx, stmt) -> bool:
        for ci in ctx.calls:
            if trains(ctx, ci) and any(a is stmt for a in ctx.ancestors(ci.node)):
                return True
        return False

    def check(self, ctx):
        for ci in ctx.method_calls("set_epoch"):
            if not ci.loops or _next_epoch(ci.node):
                continue  # (`set_epoch(epoch + 1)` after the epoch: the next one's order, set ahead)
            loop = ci.loops[-1]
            stmt = ci.node
            for a in ctx.ancestors(ci.node):
                if ctx.parent(a) is loop.body:
                    stmt = a
                    break
                stmt = a
            body = list(loop.body.body)
            if stmt not in body:
                continue
            loaders = _loaders_of(ctx, ci.receiver)
            if loaders and _iterated_after_only(loop.body, ci.node, loaders):
                continue  # its own loader (`valid_loader.sampler`) is iterated after it: set in time
            if any(self._statement_trains(ctx, s) for s in body[: body.index(stmt)]):
                yield Report(ci.node)


def _loaders_of(ctx, sampler) -> set[str]:
    """The loaders that read this sampler: `valid_loader` of `valid_loader.sampler`, or each name
    bound to a `DataLoader(..., sampler=s)` of the sampler `s`."""
    if isinstance(sampler, cst.Attribute) and sampler.attr.value == "sampler" and dotted_name(sampler.value):
        return {dotted_name(sampler.value)}
    name = dotted_name(sampler) if sampler is not None else None
    found = set()
    for ci in ctx.calls_to(*N.DATALOADER):
        given = kwarg(ci.node, "sampler")
        parent = ctx.parent(ci.node)
        if name and given is not None and dotted_name(given.value) == name and isinstance(parent, cst.Assign):
            found |= {dotted_name(t.target) for t in parent.targets} - {None}
    return found


def _iterated_after_only(body, call, loaders: set[str]) -> bool:
    """In the epoch loop's body, in the order the code reads, is one of `loaders` read after
    `call` and none before it: a `for` over it (`for x in tqdm(valid_loader):`) or a call it is
    handed to (`validate(val_loader, model)`)?"""
    seen_call, after = False, False
    for node in iter_nodes(body):
        if node is call:
            seen_call = True
        elif _reads_loader(node, loaders):
            if not seen_call:
                return False
            after = True
    return after


def _reads_loader(node, loaders: set[str]) -> bool:
    if isinstance(node, cst.For):
        return any(dotted_name(n) in loaders for n in iter_nodes(node.iter))
    return isinstance(node, cst.Call) and any(dotted_name(a.value) in loaders for a in node.args)


def _next_epoch(call) -> bool:
    """`sampler.set_epoch(epoch + 1)`: the order of the coming epoch."""
    arg = call.args[0].value if call.args else None
    return isinstance(arg, cst.BinaryOperation) and isinstance(arg.operator, cst.Add) and int_value(arg.right) == 1
