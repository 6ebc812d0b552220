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

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.script import ref_of
from ddpify.convert.context import Context

HEADER = "with contextlib.nullcontext() if {sync} else {model}.no_sync():"


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
    body = list(loop.body.body)
    last = _top(script, backward, body)
    step_if = next((s for s in body if isinstance(s, cst.If) and _steps(script, s)), None)
    if last is None or step_if is None or body.index(step_if) < body.index(last):
        return
    first = next((s for s in body if _forward(script, s, models)), None)
    if first is None or body.index(first) > body.index(last):
        return
    model = next(ref_of(c.func) for c in script.calls_in(first) if ref_of(c.func) in models)
    sync = script.module.code_for_node(step_if.test)
    if not isinstance(step_if.test, (cst.Comparison, cst.Name, cst.Attribute, cst.Call)):
        sync = f"({sync})"
    edits.enclose(first, last, HEADER.format(sync=sync, model=model))
    edits.need_import("contextlib")
    edits.change(script.line(first), f"micro-steps that do not step the optimizer run under `{model}.no_sync()`")


def _top(script, node: cst.CSTNode, body: list) -> cst.CSTNode | None:
    return next((s for s in body if script.inside(node, s)), None)


def _steps(script, stmt: cst.If) -> bool:
    """An `if` (no else) that steps an optimizer: the accumulation boundary."""
    return stmt.orelse is None and any(N.call_name(c) == "step" for c in script.calls_in(stmt.body))


def _forward(script, stmt: cst.CSTNode, models: set[str]) -> bool:
    return any(ref_of(c.func) in models for c in script.calls_in(stmt))
