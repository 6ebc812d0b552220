"""A training step that runs the model only through its own methods still syncs its gradients.

    mu, logvar = model.module.encode(x)      # the model's own methods (DDP has none of them)
    recon = model.module.decode(z)
    loss.backward()
    average_gradients(model)                  # inserted: what DDP's backward would have done

DDP averages gradients only for a backward that follows its own forward (`model(x)`); a step
that calls `model.encode(...)` / `model.decode(...)` never enters it, so every rank would step
with its own gradients and the replicas drift apart silently. Such steps average the gradients
by hand right after backward, in one all-reduce over a flat buffer.

A model run with weights handed to it (a meta-learner's fast weights: analysis/functional.py) is
not wrapped at all (wrap_model); every backward of a function that runs it is followed by the same
averaging, and a model no backward in sight runs gets a TODO instead.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.functional import differentiates
from ddpify.analysis.script import mentions, ref_of
from ddpify.convert.context import Context
from ddpify.convert.emit import AVERAGE_GRADIENTS, define_function
from ddpify.convert.unwrapped import UNWRAPPED

CALL = "average_gradients({model})  # the step runs the model through its own methods, not DDP's forward\n"
UNWRAPPED_CALL = "average_gradients({model})  # run with weights passed in, outside DDP: its gradients are averaged here\n"
NO_BACKWARD = (
    "`{model}` is run with weights passed in and not wrapped in DDP (nor sharded), but no backward in sight runs it: "
    "average its gradients over the processes (dist.all_reduce, divided by the world size) before each optimizer step"
)


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
    _average_unwrapped(ctx)


def _average_unwrapped(ctx: Context) -> None:
    """After each backward of a function that runs a model of `run_with_weights` (under any of
    its names there), its gradients are averaged by hand; a model with no such backward: a TODO."""
    script, edits = ctx.script, ctx.edits
    averaged: set[str] = set()
    for backward in [c for c in script.calls if N.call_name(c) == "backward" and N.receiver(c) is not None]:
        scope = script.scope_of(backward)
        stmt = script.statement_line(backward)
        if stmt is None:
            continue
        for name, model in sorted(script.synced_by_hand.get(scope, {}).items()):
            if not any(mentions(call, name) for call in script.calls_in(scope)):
                continue  # a backward of another model's step
            averaged.add(model)
            if _averages_already(script, scope, name):
                if "average_gradients" not in script.functions:
                    define_function(ctx, "average_gradients", AVERAGE_GRADIENTS, stmt)
                continue
            edits.insert_after(stmt, UNWRAPPED_CALL.format(model=name))
            why = "'s parameters are differentiated with autograd.grad" if differentiates(script, script.run_with_weights[model]) else " is run with weights passed in"
            edits.change(stmt, f"`{name}`{why}: {UNWRAPPED[ctx.fsdp2]}; gradients averaged by hand after backward")
            define_function(ctx, "average_gradients", AVERAGE_GRADIENTS, stmt)
    for model in script.run_with_weights:
        where = ctx.wrap_after.get(model)
        if model not in averaged and where is not None:
            edits.todo(where, where, NO_BACKWARD.format(model=model))


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
