"""A training step that runs the model only through its own methods still syncs its gradients.

    mu, logvar = model.module.encode(x)      # the model's own methods (DDP has none of them)
    recon = model.module.decode(z)
    loss.backward()
    average_gradients(model)                  # inserted: what DDP's backward would have done

DDP averages gradients only for a backward that follows its own forward (`model(x)`); a step
that calls `model.encode(...)` / `model.decode(...)` never enters it, so every rank would step
with its own gradients and the replicas drift apart silently. Such steps average the gradients
by hand right after backward, in one all-reduce over a flat buffer.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.script import ref_of
from ddpify.convert.context import Context
from ddpify.convert.emit import AVERAGE_GRADIENTS, define_function

CALL = "average_gradients({model})  # the step runs the model through its own methods, not DDP's forward\n"


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    done: set[cst.CSTNode] = set()
    for backward in [c for c in script.calls if N.call_name(c) == "backward" and N.receiver(c) is not None]:
        scope = script.scope_of(backward)
        step = next(iter(script.loops_around(backward, scope)), scope)
        stmt = script.statement_line(backward)
        if stmt is None or stmt in done:
            continue
        for model in sorted(script.ddp_names.get(scope, ())):
            if not _runs_own_methods_only(script, step, model):
                continue
            if _averages_already(script, step, model):
                if "average_gradients" not in script.functions:  # the call is there, its helper lost
                    define_function(ctx, "average_gradients", AVERAGE_GRADIENTS, stmt)
                continue
            done.add(stmt)
            if ctx.fsdp2 and ctx.model_class(model) is not None:
                continue  # the submodules its methods run are FSDP2 units of their own (shard_model): they reduce
            if ctx.fsdp2:
                edits.todo(stmt, stmt, f"`{model}` runs through its own methods here: FSDP2 gathers a unit's parameters in its forward only; call `{model}(...)` (or fully_shard the submodules these methods run)")
                continue
            edits.insert_after(stmt, CALL.format(model=model))
            edits.change(
                stmt,
                f"`{model}` runs through its own methods here, which DDP cannot sync: its gradients are averaged by hand",
            )
            define_function(ctx, "average_gradients", AVERAGE_GRADIENTS, stmt)


def _runs_own_methods_only(script, step: cst.CSTNode, model: str) -> bool:
    """The step calls `model.method(...)` for a method DDP does not answer, and never `model(...)`."""
    own = called = False
    for call in script.calls_in(step):
        if ref_of(call.func) == model:
            called = True
        elif isinstance(call.func, cst.Attribute) and (ref_of(call.func.value) == model or _unwrapped(call.func.value, model)):
            own = own or call.func.attr.value not in N.DDP_ATTRIBUTES
    return own and not called


def _unwrapped(node: cst.CSTNode, model: str) -> bool:
    """`model.module` (a converted step calls the model's own methods through it)."""
    return isinstance(node, cst.Attribute) and node.attr.value == "module" and ref_of(node.value) == model


def _averages_already(script, step: cst.CSTNode, model: str) -> bool:
    return any(
        isinstance(call.func, cst.Name) and call.func.value == "average_gradients" for call in script.calls_in(step)
    )
