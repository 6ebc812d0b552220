"""Wrap the trained model in DistributedDataParallel once it is on its device.

The wrap goes right after the last top-level statement that touches the model (builds,
moves, loads, freezes or re-heads it) before anything runs or trains it, and after the
process group exists; `device_ids` is passed only for CUDA. A wrapper module of the project
built around the model (`model = LossWrapper(model)`) is a rebuild, not a run: DDP wraps the
module whose forward the training step calls, after its last rebinding.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.script import AnalysisError, kept_by_objects, mentions, ref_of
from ddpify.convert.context import Context

SYNC_BN = "{model} = torch.nn.SyncBatchNorm.convert_sync_batchnorm({model})\n"
WRAP = '{model} = DDP({model}, device_ids=[{index}] if {device_type} == "cuda" else None)\n'


def run(ctx: Context) -> None:
    for model, scope in ctx.script.models.items():
        _wrap(ctx, model, scope)


def _wrap(ctx: Context, model: str, scope) -> None:
    script, edits = ctx.script, ctx.edits
    body = list(script.block_of(scope).body)
    wrapped = _existing_wrap(ctx, model, scope)
    if wrapped is not None:
        if wrapped in body:
            ctx.wrap_after[model] = wrapped
        return
    _returned_model(ctx, model, scope, body)
    last = None
    for stmt in body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            continue  # a definition runs nothing
        if last is not None and _runs(script, stmt, model):
            break  # (before the model is built, what runs trains something else)
        if mentions(stmt, model):
            last = stmt  # built, moved, loaded, frozen, given a new head...: not run yet
    if last is None:
        raise AnalysisError(script.line(script.optimizer_stmt), f"cannot find where `{model}` is built at the top level of its function")
    if scope is ctx.setup_scope and body.index(last) < ctx.init_index - 1:
        last = body[ctx.init_index - 1]  # the process group (and the device) must exist first
    ctx.wrap_after[model] = last
    synced = any(
        script.is_call_to(c, D.SYNC_BATCHNORM) and c.args and mentions(c.args[0].value, model) for c in script.calls
    )
    if ctx.options.sync_batchnorm and not synced:
        edits.insert_after(last, SYNC_BN.format(model=model))
        edits.change(last, "BatchNorm layers become SyncBatchNorm (statistics over all processes)")
    elif _has_batchnorm(script):
        edits.change(last, "BatchNorm statistics stay per process: --sync-batchnorm syncs them")
    if ctx.gpus_per_process > 1:
        edits.insert_after(last, f"{model} = DDP({model})  # spans several GPUs: no device_ids\n")
    else:
        index = ctx.local_rank if ctx.local_rank_visible(scope) else f"{ctx.device_type.removesuffix('.type')}.index"
        wrap = WRAP.format(model=model, index=index, device_type=ctx.device_type)
        if script.uses_gpu and not _moved(script, body[: body.index(last) + 1], model):  # `Trainer(model, ...)` moves it later
            wrap = wrap.replace(f"DDP({model},", f"DDP({model}.to({ctx.device}),", 1)
        edits.insert_after(last, wrap)
    edits.need_import(N.DDP_MODULE, "DistributedDataParallel", "DDP")
    edits.change(last, f"`{model}` is wrapped in DistributedDataParallel (unwrapped: `{model}.module`)")


def _existing_wrap(ctx: Context, model: str, scope) -> cst.CSTNode | None:
    """`model = DDP(model, ...)` already in the script: the statement of `scope` that holds it
    (or, for a model handed to an object that wraps what it keeps, `self.model = DDP(self.model)`
    in its constructor, that statement)."""
    script = ctx.script
    for attr, init in kept_by_objects(script, model, scope):
        found = _existing_wrap(ctx, attr, init) if attr != model else None
        if found is not None:
            return found
    for call in script.calls:
        if not script.is_call_to(call, D.DDP):
            continue
        args = N.positional(call) or [a for a in call.args if a.keyword is not None and a.keyword.value == "module"]
        assign = script.parent(call)
        if (
            args
            and (mentions(args[0].value, model) or model.startswith("self."))  # `self.net = DDP(net.to(gpu))`
            and isinstance(assign, cst.Assign)
            and assign.value is call
            and ref_of(assign.targets[0].target) == model
        ):
            return script.top_statement(call, scope) or script.statement_line(call) or assign
    return None


def _returned_model(ctx: Context, model: str, scope, body: list[cst.CSTNode]) -> None:
    """`return model` from the function that builds the model: when the function trains it
    (`main()` trains, then returns the model to a caller that saves it), the caller gets
    `model.module`, the plain model; a factory that only builds it is followed by the analysis
    to where it lands, so one that is not (called twice, unpacked oddly) is refused here."""
    if not isinstance(scope, cst.FunctionDef):
        return
    trains = scope in ctx.script.training_functions or any(_runs(ctx.script, stmt, model) for stmt in body)
    for stmt in body:
        if not (m.matches(stmt, m.SimpleStatementLine(body=[m.Return()])) and stmt.body[0].value is not None):
            continue
        value = stmt.body[0].value
        if not mentions(value, model):
            continue
        if not trains:
            raise AnalysisError(
                ctx.script.line(stmt),
                f"`{model}` is built in `{scope.name.value}()` and returned to more than one caller (or unpacked "
                "in a way ddpify cannot follow): call the factory once, where the model trains, or wrap it "
                "there by hand with DistributedDataParallel",
            )
        items = [e.value for e in value.elements] if isinstance(value, cst.Tuple) else [value]
        for item in items:
            if ref_of(item) == model:
                ctx.edits.replace(item, ctx.edits.expression(f"{model}.module"))
                ctx.edits.change(stmt, f"returns `{model}.module`: the caller gets the plain model")


def _moved(script, stmts: list[cst.CSTNode], model: str) -> bool:
    """Is the model put on a device before the wrap (`.to(...)`/`.cuda()` in a statement that
    names it)? DDP with `device_ids` needs the module on that GPU already."""
    return any(
        mentions(stmt, model) and any(N.call_name(c) in ("to", "cuda") for c in script.calls_in(stmt)) for stmt in stmts
    )


def _runs(script, stmt: cst.CSTNode, model: str) -> bool:
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


def _has_batchnorm(script) -> bool:
    return any(script.is_call_to(c, N.BATCHNORMS) for c in script.calls)
