import libcst as cst

from ddpify.analysis.index import iter_nodes
from ddpify.analysis.literals import int_value
from ddpify.check.rule import Invalid, Report, Rule


class AccumulationWithoutNoSync(Rule):
    """Gradient accumulation without `no_sync()`.

    ## What it does
    Flags a step loop with a DDP model where `optimizer.step()` runs under an `if` that uses
    `%` (accumulate every k micro-batches) while `backward()` runs every iteration, and the
    file never uses `no_sync()`. Also a loss-scaler helper that runs the backward and is told
    when to step (`loss_scaler(loss, optimizer, update_grad=(i + 1) % accum_iter == 0)`, timm's
    `NativeScaler`).

    ## Why is this bad?
    DDP all-reduces gradients on every backward, also for micro-batches whose gradients are
    only accumulated: k-1 of every k all-reduces are wasted.

    ## Example
    ```python
    loss.backward()
    if (i + 1) % accum == 0:
        optimizer.step()
        optimizer.zero_grad()
    ```

    ## Use instead
    ```python
    ctx = model.no_sync() if (i + 1) % accum else contextlib.nullcontext()
    with ctx:
        loss.backward()
    if (i + 1) % accum == 0:
        optimizer.step()
        optimizer.zero_grad()
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync
    """

    CODE = "DDP204"
    NAME = "accumulation-without-no-sync"
    DDP_ONLY = True
    MESSAGE = "gradient accumulation all-reduces on every micro-batch; wrap non-final backwards in `model.no_sync()`"
    SEVERITY = "warning"
    VALID = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
        "for i, x in enumerate(loader):\n    with model.no_sync():\n        model(x).sum().backward()\n"
        "    if i % 4 == 0:\n        opt.step()\n",
    ]
    INVALID = [
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
                "for i, x in enumerate(loader):\n    model(x).sum().backward()\n"
                "    if (i + 1) % 4 == 0:\n        opt.step()\n        opt.zero_grad()\n"),
    ]

    def _under_modulo_if(self, ctx, node, loop) -> bool:
        for p in ctx.ancestors(node):
            if p is loop:
                return False
            if isinstance(p, cst.If) and "%" in ctx.code(p.test) and not _every_step(ctx, p.test, loop):
                return True
        return False

    def check(self, ctx):
        if not ctx.ddp_bindings or ctx.method_calls("no_sync") or _no_sync_referenced(ctx):
            return
        yield from (Report(c.node) for c in ctx.calls if _scaler_told_when_to_step(ctx, c))
        for loop in ctx.step_loops:
            calls = [c for c in ctx.calls if c.loops and c.loops[-1] is loop]
            steps = [
                c
                for c in calls
                if c.name == "step" and c.receiver is not None
                and any(w in ctx.code(c.receiver).lower() for w in ("opt", "scaler"))
            ]
            if not steps or not all(self._under_modulo_if(ctx, s.node, loop) for s in steps):
                continue
            for b in calls:
                if ctx.is_backward(b) and not self._under_modulo_if(ctx, b.node, loop):
                    yield Report(b.node)


def _scaler_told_when_to_step(ctx, ci) -> bool:
    """`loss_scaler(loss, optimizer, update_grad=(i + 1) % accum_iter == 0)` in a loop (timm's
    `NativeScaler` and the copies in MAE-style engines): one call runs the backward on every
    micro-batch and steps only when the `%` test it is handed says so."""
    if not ci.loops or ci.receiver is not None or "scaler" not in ctx.code(ci.node.func).lower():
        return False
    loop = ci.loops[-1]
    return any("%" in ctx.code(a.value) and not _every_step(ctx, a.value, loop) for a in ci.node.args)


def _every_step(ctx, test: cst.BaseExpression, loop) -> bool:
    """`(i + 1) % interval == 0` where each modulus is 1 or a name its function binds to 1 only
    (`loss_interval = 1`): true at every step, so nothing accumulates."""
    func = ctx.enclosing_func(loop)
    moduli = [n.right for n in iter_nodes(test) if isinstance(n, cst.BinaryOperation) and isinstance(n.operator, cst.Modulo)]

    def one(value) -> bool:
        if int_value(value) == 1:
            return True
        values = [b.value for b in ctx.assignments if isinstance(value, cst.Name) and b.dotted == value.value and b.func is func]
        return bool(values) and all(int_value(v) == 1 for v in values)

    return bool(moduli) and all(one(m) for m in moduli)


def _no_sync_referenced(ctx) -> bool:
    """`ctx = model.no_sync if step % n else nullcontext`, then `with ctx():`: the bound method,
    stored and called later."""
    return any(isinstance(n, cst.Attribute) and n.attr.value == "no_sync" for n in iter_nodes(ctx.module))
