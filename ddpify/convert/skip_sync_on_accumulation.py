"""Gradient accumulation: micro-steps that do not step the optimizer skip DDP's all-reduce.

    for i, (x, y) in enumerate(loader):
        with contextlib.nullcontext() if (i + 1) % accum == 0 else model.no_sync():
            loss = criterion(model(x), y) / accum
            loss.backward()
        if (i + 1) % accum == 0:
            optimizer.step()

The forward belongs inside `no_sync()` too: DDP decides at forward time whether the
next backward reduces gradients.
"""

from __future__ import annotations

import re

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.script import param_receiving, ref_of
from ddpify.convert.context import Context

HEADER = "with contextlib.nullcontext() if {sync} else {model}.no_sync():"
FSDP2_SYNC = "{model}.set_requires_gradient_sync({sync})  # FSDP2: reduce gradients on the step's last micro-step only\n"


def run(ctx: Context) -> None:
    script = ctx.script
    for scope, models in script.ddp_names.items():
        for call in script.calls_in(scope):
            if N.call_name(call) != "backward" or script.scope_of(call) is not scope:
                continue
            loop = script.enclosing_loop(call, scope)
            if loop is not None and isinstance(loop.body, cst.IndentedBlock):
                _accumulation(ctx, loop, call, models)


def _accumulation(ctx: Context, loop: cst.For, backward: cst.Call, models: set[str]) -> None:
    script, edits = ctx.script, ctx.edits
    optimizers = _optimizers(script)
    if any(_skips_sync(script, a) for a in script.ancestors(backward) if script.inside(a, loop)):
        return  # under `model.no_sync()` already
    if any(N.call_name(c) == "set_requires_gradient_sync" for c in script.calls_in(loop)):
        return  # FSDP2's switch is set already
    body = list(loop.body.body)
    last = _top(script, backward, body)
    step_if = next((s for s in body if isinstance(s, cst.If) and _steps(script, s, optimizers)), None)
    if last is None or step_if is None or body.index(step_if) < body.index(last):
        return
    if script.inside(backward, step_if):
        return  # backward runs only when the optimizer steps (`if len(memory) > 40: ... backward(); step()`): no accumulation
    if any(not isinstance(s, cst.If) and _steps_optimizer(script, s, optimizers) for s in body):
        return  # the optimizer steps every iteration: no accumulation (an `if` steps something else)
    first = next((s for s in body if _forward(script, s, models)), None)
    if first is None or body.index(first) > body.index(last):
        return
    model = next(ref_of(c.func) for c in script.calls_in(first) if ref_of(c.func) in models)
    sync = script.module.code_for_node(_through_module(step_if.test, models))
    if not isinstance(step_if.test, (cst.Comparison, cst.Name, cst.Attribute, cst.Call)):
        sync = f"({sync})"
    if ctx.fsdp2:
        sync = script.module.code_for_node(step_if.test)
        edits.insert_before(first, FSDP2_SYNC.format(sync=sync, model=model))
        edits.change(first, f"micro-steps that do not step the optimizer skip the gradient reduce-scatter (`{model}.set_requires_gradient_sync`)")
        return
    edits.enclose(first, last, HEADER.format(sync=sync, model=model))
    edits.need_import("contextlib")
    edits.change(first, f"micro-steps that do not step the optimizer run under `{model}.no_sync()`")


def _skips_sync(script, node: cst.CSTNode) -> bool:
    """A `with` whose context calls a model's `no_sync()`."""
    return isinstance(node, cst.With) and any(
        N.call_name(c) == "no_sync" for item in node.items for c in script.calls_in(item)
    )


def _top(script, node: cst.CSTNode, body: list) -> cst.CSTNode | None:
    return next((s for s in body if script.inside(node, s)), None)


def _steps(script, stmt: cst.If, optimizers: set[str]) -> bool:
    """An `if` (no else) that steps an optimizer: the accumulation boundary. An `if` that only
    steps an LR scheduler (`if epoch <= args.warm: warmup_scheduler.step()`) is not one."""
    return stmt.orelse is None and _steps_optimizer(script, stmt.body, optimizers)


def _steps_optimizer(script, node: cst.CSTNode, optimizers: set[str]) -> bool:
    """Does `node` call `optimizer.step()` (or `scaler.step(optimizer)`) on a torch.optim optimizer?"""
    for call in script.calls_in(node):
        owner = N.receiver(call)
        if N.call_name(call) != "step" or owner is None:
            continue
        if _is_optimizer(script, owner, optimizers):
            return True
        if any(_is_optimizer(script, a.value, optimizers) for a in N.positional(call)[:1]):
            return True  # `scaler.step(optimizer)`: a GradScaler steps the optimizer it is given
    return False


def _is_optimizer(script, node: cst.CSTNode, optimizers: set[str]) -> bool:
    """A name the analysis knows holds an optimizer; a name bound to something else (a scheduler,
    a GradScaler, an object of the script's own classes) is not one; a name bound nowhere the
    analysis can see (a parameter it cannot follow) is one when it is spelled like one."""
    ref = ref_of(node)
    if ref is None:
        return False
    if ref in optimizers:
        return True
    if any(ref_of(a.targets[0].target) == ref for assigns in script.assigns.values() for a in assigns):
        return False
    last = ref.rsplit(".", 1)[-1].lower()
    return "optim" in last or bool(re.fullmatch(r"opt(_\w+|\d*)|\w+_opt", last))


def _optimizers(script) -> set[str]:
    """Names bound to a torch.optim optimizer (`optimizer = optim.SGD(...)`, also of a subclass
    the script defines), then the parameters and `self.` attributes that receive one."""
    found: set[str] = set()
    assigns = [a for scope_assigns in script.assigns.values() for a in scope_assigns]
    for a in assigns:
        if isinstance(a.value, cst.Call) and _builds_optimizer(script, a.value) and ref_of(a.targets[0].target):
            found.add(ref_of(a.targets[0].target))
    for _ in range(3):
        before = len(found)
        for a in assigns:  # `self.optimizer = optimizer`
            if ref_of(a.value) in found and ref_of(a.targets[0].target):
                found.add(ref_of(a.targets[0].target))
        for call in script.calls:  # `train(model, optimizer, loader)`
            fn = script.local_function(call)
            if fn is None:
                continue
            for ref in list(found):
                param = param_receiving(fn, call, ref)
                if param is not None:
                    found.add(param)
        if len(found) == before:
            break
    return found


def _builds_optimizer(script, call: cst.Call) -> bool:
    names = set(script.names(call.func))
    cls = script.classes.get(call.func.value) if isinstance(call.func, cst.Name) else None
    if cls is not None:
        names |= {q for base in cls.bases for q in script.names(base.value)}
    return N.is_optimizer(names)


def _forward(script, stmt: cst.CSTNode, models: set[str]) -> bool:
    return any(ref_of(c.func) in models for c in script.calls_in(stmt))


def _through_module(test: cst.BaseExpression, models) -> cst.BaseExpression:
    """The step condition as the `with` reads it: an attribute of the model that DDP does not
    have (`model.hyperparams["subdivisions"]`) through `.module`, as unwrap_model writes it in
    the `if` (the `with` is new code: it gets the rewrite here)."""

    class Through(cst.CSTTransformer):
        def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
            if ref_of(original.value) in models and original.attr.value not in N.DDP_ATTRIBUTES:
                return updated.with_changes(value=cst.Attribute(value=updated.value, attr=cst.Name("module")))
            return updated

    return test.visit(Through())
