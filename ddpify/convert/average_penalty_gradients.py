"""A gradient penalty's forward runs outside DDP, and its gradients are averaged by hand.

    out = D.module(interpolated)              # was D(interpolated): DDP's reducer cannot follow it
    grad = torch.autograd.grad(outputs=out, inputs=interpolated, create_graph=True)[0]
    penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
    penalty.backward()
    average_gradients(D)                      # inserted: what DDP's backward would have done

WGAN-GP, DRAGAN and R1 penalise the gradient of the critic's output with respect to its input:
`torch.autograd.grad(..., create_graph=True)` and then a backward through that gradient. Some of
the critic's parameters (the last layer's bias) get no gradient from it, so DDP's reducer waits
for them forever: the next forward fails with "Expected to have finished reduction in the prior
iteration", on one process as on many. The penalty's forward goes through the model itself, and
the gradients are averaged right after the backward that follows.

Under `--to fsdp2` such a model is replicated in place (`replicate(D)`: DDP's reducer in its
forward hooks, no `.module`): the penalty's forward is `D.forward(interpolated)`, which skips them.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import names_in
from ddpify.analysis.script import ref_of
from ddpify.convert.context import Context
from ddpify.convert.emit import AVERAGE_GRADIENTS, define_function

CALL = "average_gradients({model})  # the penalty's forward ran outside {outside}: its gradients are averaged here\n"


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    for grad in script.calls:
        if not script.is_call_to(grad, N.AUTOGRAD_GRAD) or not _creates_graph(grad):
            continue
        scope = script.scope_of(grad)
        outputs = N.keyword(grad, "outputs") or next(iter(N.positional(grad)), None)
        if outputs is None:
            continue
        for name in sorted(names_in(outputs.value)):
            forward = _forward_of(ctx, name, scope, grad)
            if forward is None:
                continue
            model = ref_of(forward.func)
            replicated = model in ctx.replicated  # `--to fsdp2` replicated it in place: DDP's reducer in its hooks
            backward = _next_backward(ctx, grad, scope)
            if backward is None or (ctx.fsdp2 and not replicated):
                stmt = script.statement_line(forward) or script.top_statement(forward, scope) or forward
                edits.todo(stmt, forward, f"`{model}`'s output feeds a gradient penalty (autograd.grad with create_graph=True), which DDP's reducer cannot follow: run it as `{model}.module(...)` and average its gradients after the backward")
                continue
            outside = "replicate's hooks" if replicated else "DDP"
            edits.replace(forward.func, edits.expression(f"{model}.forward" if replicated else f"{model}.module"))
            edits.insert_after(backward, CALL.format(model=model, outside=outside))
            edits.change(forward, f"`{model}` runs outside {outside} for the gradient penalty (DDP's reducer cannot follow autograd.grad with create_graph): its gradients are averaged by hand after the backward")
            define_function(ctx, "average_gradients", AVERAGE_GRADIENTS, forward)


def _creates_graph(call: cst.Call) -> bool:
    arg = N.keyword(call, "create_graph")
    return arg is not None and not (isinstance(arg.value, cst.Name) and arg.value.value in ("False", "None"))


def _forward_of(ctx: Context, name: str, scope, before: cst.CSTNode) -> cst.Call | None:
    """The DDP model's call whose result the last assignment of `name` before `before` binds
    (`out = D(x)`, `out, _, _ = D(x)`, `out = D(x).view(-1)`)."""
    script = ctx.script
    models = script.ddp_names.get(scope, ())
    found = None
    for assign in script.assigns.get(scope, []):
        if script.before(assign, before) and name in names_in(assign.targets[0].target):
            found = next((c for c in script.calls_in(assign.value) if ref_of(c.func) in models), None)
    return found


def _next_backward(ctx: Context, after: cst.CSTNode, scope) -> cst.SimpleStatementLine | None:
    """The first `loss.backward()` statement after `after` in the same function."""
    script = ctx.script
    for call in script.calls_in(scope):
        if N.call_name(call) == "backward" and N.receiver(call) is not None and script.before(after, call):
            return script.statement_line(call)
    return None
