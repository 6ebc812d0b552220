"""Where a model is ready to be wrapped (DDP) or sharded (FSDP2) in the function that builds it.

After the last top-level statement that touches the model (builds, moves, loads, freezes or
re-heads it) before anything runs or trains it, and after the process group exists.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.script import AnalysisError, mentions, ref_of
from ddpify.convert.context import Context


def wrap_point(ctx: Context, model: str, scope, body: list[cst.CSTNode]) -> cst.CSTNode:
    """The statement of `scope`'s `body` after which `model` is wrapped."""
    script = ctx.script
    last = None
    for stmt in body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            continue  # a definition runs nothing
        if last is not None and runs_model(script, stmt, model):
            break  # (before the model is built, what runs trains something else)
        if mentions(stmt, model):
            last = stmt  # built, moved, loaded, frozen, given a new head...: not run yet
    if last is None:
        raise AnalysisError(script.line(script.optimizer_stmt), f"cannot find where `{model}` is built at the top level of its function")
    if scope is ctx.setup_scope and body.index(last) < ctx.init_index - 1:
        last = body[ctx.init_index - 1]  # the process group (and the device) must exist first
    return last


def moved_before(script, stmts: list[cst.CSTNode], model: str) -> bool:
    """Is the model put on a device before the wrap (`.to(...)`/`.cuda()` in a statement that
    names it)? DDP with `device_ids` needs the module on that GPU already."""
    return any(
        mentions(stmt, model) and any(N.call_name(c) in ("to", "cuda") for c in script.calls_in(stmt)) for stmt in stmts
    )


def runs_model(script, stmt: cst.CSTNode, model: str) -> bool:
    """Does `stmt` train or call the model (directly, by handing it to a training function, or
    by giving it to an object of the script's own classes, e.g. `Trainer(model, ...)`)?"""
    if isinstance(stmt, (cst.For, cst.While)) and _trains_inside(script, stmt):
        return True  # a training loop, whatever it calls: the wrap is never after it
    for call in script.calls_in(stmt):
        if ref_of(call.func) == model or N.call_name(call) == "backward":
            return True
        if (script.local_function(call) or script.method_of_object(call)) in script.training_functions:
            return True  # a training helper (it may use the model as a global)
        cls = script.class_called(call)
        if cls is not None and any(ref_of(a.value) == model for a in call.args):
            if _rebuilds(script, call, cls, model):
                continue  # `model = LossWrapper(model)`: the model is the wrapper now, wrapped after it
            return True  # the object keeps the model and trains it later: it must get the DDP one
    return False


def _trains_inside(script, loop: cst.For | cst.While) -> bool:
    """Does a loop step an optimizer or iterate a training loader (an epoch or step loop)?"""
    train = {loader.name for loader in script.train_loaders}
    if any(N.call_name(c) in ("backward", "step") and N.receiver(c) is not None for c in script.calls_in(loop)):
        return True
    return any(isinstance(f, cst.For) and any(mentions(f.iter, name) for name in train) for f in script.nodes_in(loop, cst.For))


def _rebuilds(script, call: cst.Call, cls: cst.ClassDef, model: str) -> bool:
    """`model = LossWrapper(model)`: an nn.Module built around the model under its own name; the
    training step calls the wrapper's forward, so the wrapper is what DDP wraps."""
    assign = script.parent(call)
    return (
        isinstance(assign, cst.Assign)
        and assign.value is call
        and ref_of(assign.targets[0].target) == model
        and script.optimizer_summaries.is_module(cls) is True
    )
