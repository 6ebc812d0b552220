"""Where a model is ready to be wrapped (DDP) or sharded (FSDP2) in the function that builds it.

After the last top-level statement that touches the model (builds, moves, loads, freezes or
re-heads it) before anything runs or trains it, and after the process group exists.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.script import AnalysisError, mentions, ref_of
from ddpify.convert.context import Context


def wrap_point(ctx: Context, model: str, scope, body: list[cst.CSTNode], into_blocks: bool = False) -> cst.CSTNode:
    """The statement of `scope`'s `body` after which `model` is wrapped. `into_blocks`: where one
    if/with/try both builds and trains the model, the statement inside it (`ctx.after_wrap`
    follows); else that whole statement."""
    script = ctx.script
    last = _last_before_run(script, model, body, into_blocks)
    if last is None:
        raise AnalysisError(script.line(script.optimizer_stmt), f"cannot find where `{model}` is built at the top level of its function")
    top = script.top_statement(last, scope) or last
    if scope is ctx.setup_scope and top in body and body.index(top) < ctx.init_index - 1:
        last = body[ctx.init_index - 1]  # the process group (and the device) must exist first
    return last


def _last_before_run(script, model: str, body, into_blocks: bool) -> cst.CSTNode | None:
    """The last statement of `body` that touches `model` before one runs it; descends into the
    block that builds and trains it (`if not args.eval_only: model = ...; train(model)`)."""
    last = None
    for stmt in body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            continue  # a definition runs nothing
        if last is not None and runs_model(script, stmt, model):
            break  # (before the model is built, what runs trains something else)
        if mentions(stmt, model):
            if last is None and into_blocks and runs_model(script, stmt, model):
                inner = _block_building(stmt, model)
                found = _last_before_run(script, model, inner, True) if inner is not None else None
                return found or stmt
            last = stmt  # built, moved, loaded, frozen, given a new head...: not run yet
    return last


def branch_points(script, model: str, stmt: cst.CSTNode) -> list[cst.CSTNode]:
    """Where an if/elif/else builds and trains `model` in several branches (`if args.small:
    model = Small(); fit(model)` `else: model = Big(); fit(model)`): the point in each branch
    after which it is wrapped. Empty when `stmt` is no such `if`."""
    if not (isinstance(stmt, cst.If) and runs_model(script, stmt, model)):
        return []
    points, branch = [], stmt
    while branch is not None:
        body = branch.body.body if isinstance(branch, (cst.If, cst.Else)) else ()
        if mentions(branch.body, model):
            found = _last_before_run(script, model, list(body), True)
            if found is None:
                return []
            points.append(found)
        branch = branch.orelse if isinstance(branch, cst.If) else None
    return points if len(points) > 1 else []


def _block_building(stmt: cst.CSTNode, model: str) -> list[cst.CSTNode] | None:
    """The statements of the one branch of an if/with/try that names `model` (None: a loop,
    or several branches do)."""
    if isinstance(stmt, cst.With):
        return list(stmt.body.body)
    if isinstance(stmt, cst.Try):
        return list(stmt.body.body)
    if isinstance(stmt, cst.If):
        branches, branch = [], stmt
        while isinstance(branch, cst.If):
            branches.append(branch.body)
            branch = branch.orelse
        if branch is not None:
            branches.append(branch.body)
        naming = [b for b in branches if mentions(b, model)]
        return list(naming[0].body) if len(naming) == 1 else None
    return None


def statements_up_to(script, last: cst.CSTNode, scope) -> list[cst.CSTNode]:
    """`last` and the statements that run before it in `scope`'s ordered block, through every
    block around it (the statements above an `if` that holds it, then those above it inside)."""
    found, child, stop = [last], last, script.block_of(scope)
    for anc in script.ancestors(last):
        body = getattr(anc, "body", None)
        if isinstance(body, (list, tuple)) and child in body:
            found = list(body[: body.index(child)]) + found
            if anc is stop:
                break
        if isinstance(anc, cst.BaseStatement):
            child = anc
    return found


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
