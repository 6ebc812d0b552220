from typing import Optional

import libcst as cst

from ddpify.analysis.literals import int_value
from ddpify.check.context import dotted_name
from ddpify.check.rule import Invalid, Report, Rule


class NoSyncOffTheStep(Rule):
    """Gradient accumulation that syncs on another micro-batch than the one before the step.

    ## What it does
    In a loop that accumulates with `model.no_sync()` chosen by a `%` test (`ctx =
    nullcontext() if sync else model.no_sync()`) and steps the optimizer under another `%`
    test of the same counter and modulus, flags the `no_sync()` when the two pick different
    micro-batches (`batch_idx % k == 0` to sync, `(batch_idx + 1) % k == 0` to step).

    ## Why is this bad?
    DDP all-reduces the gradients *accumulated so far* in the one backward run outside
    `no_sync()`. That must be the last micro-batch before `optimizer.step()`: synced earlier,
    the later micro-batches' gradients stay on their rank, each rank steps with its own sum,
    and the replicas drift apart.

    ## Example
    ```python
    sync = i % accum == 0
    with (nullcontext() if sync else model.no_sync()):
        loss.backward()
    if (i + 1) % accum == 0:
        optimizer.step()
    ```

    ## Use instead
    ```python
    sync = (i + 1) % accum == 0
    with (nullcontext() if sync else model.no_sync()):
        loss.backward()
    if sync:
        optimizer.step()
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://github.com/modelscope/FunASR/pull/3472
    - https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync
    """

    CODE = "DDP168"
    NAME = "no-sync-off-the-step"
    MESSAGE = "`no_sync()` is chosen by another `%` test than the optimizer step: the all-reduce runs on another micro-batch than the one before `step()`, and the later gradients stay on their rank; sync on the step's micro-batch"
    VALID = [
        "import torch.distributed as dist\nfor i, x in enumerate(loader):\n"
        "    with (nullcontext() if (i + 1) % k == 0 else model.no_sync()):\n        model(x).sum().backward()\n"
        "    if (i + 1) % k == 0:\n        opt.step()\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nfor i, x in enumerate(loader):\n"
                "    with (nullcontext() if i % k == 0 else model.no_sync()):\n        model(x).sum().backward()\n"
                "    if (i + 1) % k == 0:\n        opt.step()\n"),
    ]

    def check(self, ctx):
        for ci in ctx.method_calls("no_sync"):
            if not ci.loops:
                continue
            choice = ctx.parent(ci.node)
            if not isinstance(choice, cst.IfExp):
                continue
            synced = _residue(ctx, choice.test, ci.func)
            if synced is None:
                continue
            if ci.node is choice.body:
                synced = (*synced[:3], not synced[3])  # `model.no_sync() if t else nullcontext()`: syncs when not t
            steps = [_residue(ctx, t, ci.func) for t in _step_tests(ctx, ci.loops[-1])]
            if any(s is not None and s[:2] == synced[:2] and s != synced for s in steps):
                yield Report(ci.node)


_Residue = tuple  # (counter, modulus code, residue, true when equal)


def _residue(ctx, test: cst.BaseExpression, func, depth: int = 0) -> Optional[_Residue]:
    """`(i + c) % k == d` as (i, k, d - c, True); `!=` as (..., False); a name bound to such a
    test in the function, followed."""
    if isinstance(test, cst.Name) and depth < 2:
        values = [b.value for b in ctx.assignments if b.dotted == test.value and b.func is func]
        found = {_residue(ctx, v, func, depth + 1) for v in values}
        return found.pop() if len(found) == 1 else None
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        inner = _residue(ctx, test.expression, func, depth)
        return (*inner[:3], not inner[3]) if inner is not None else None
    if not isinstance(test, cst.Comparison) or len(test.comparisons) != 1:
        return None
    comp = test.comparisons[0]
    d = int_value(comp.comparator)
    mod = test.left
    if d is None or not isinstance(comp.operator, (cst.Equal, cst.NotEqual)):
        return None
    if not isinstance(mod, cst.BinaryOperation) or not isinstance(mod.operator, cst.Modulo):
        return None
    counter, c = mod.left, 0
    if isinstance(counter, cst.BinaryOperation) and isinstance(counter.operator, (cst.Add, cst.Subtract)):
        shift = int_value(counter.right)
        if shift is None:
            return None
        c = shift if isinstance(counter.operator, cst.Add) else -shift
        counter = counter.left
    name = dotted_name(counter)
    if name is None:
        return None
    return (name, ctx.code(mod.right), d - c, isinstance(comp.operator, cst.Equal))


def _step_tests(ctx, loop) -> list[cst.BaseExpression]:
    """The tests of the `if`s, in the loop, around an optimizer's (or scaler's) `step()`."""
    tests = []
    for ci in ctx.calls:
        if ci.name != "step" or ci.receiver is None or not ci.loops or ci.loops[-1] is not loop:
            continue
        if not any(w in ctx.code(ci.receiver).lower() for w in ("opt", "scaler")):
            continue
        for p in ctx.ancestors(ci.node):
            if p is loop:
                break
            if isinstance(p, cst.If):
                tests.append(p.test)
    return tests
