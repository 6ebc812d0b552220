"""Wrap the trained model in DistributedDataParallel once it is on its device.

The wrap goes right after the last top-level statement that touches the model (builds,
moves, loads, freezes or re-heads it) before anything runs or trains it (inside the
if/with/try that both builds and trains it), and after the process group exists.
`device_ids` follows where the model's parameters are at run time (`next(model.parameters()).is_cuda`),
not the device the script names: a model left on the CPU on a GPU node gets none (DDP refuses
`device_ids` for a CPU module); a model this pass moves itself (`DDP(model.to(device), ...)`) is on
`device`. A model frozen on some runs only (`if args.freeze_encoder: encoder.requires_grad_(False)`,
analysis/frozen.py) is wrapped only where it has a parameter that trains, and a model frozen on
every run is never wrapped; unwrapped, its weights are rank 0's (`dist.broadcast`), as DDP's wrap
would make them. A model run with weights handed to it (a meta-learner's fast weights,
analysis/functional.py) is never wrapped either: DDP cannot follow such forwards, nor
`torch.autograd.grad` over its parameters. Every rank takes rank 0's weights right where the wrap
would go (the whole state dict: an overridden `parameters()` may leave some out), and
average_gradients averages its gradients after each backward. A wrapper module of the project built around the model (`model = LossWrapper(model)`) is a rebuild, not a run: DDP wraps the
module whose forward the training step calls, after its last rebinding.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.script import AnalysisError, kept_by_objects, mentions, ref_of
from ddpify.convert.context import LOCAL_RANK_ENV, Context
from ddpify.convert.unwrapped import send_unwrapped
from ddpify.convert.wrap_point import branch_points, moved_before, runs_model, statements_up_to, wrap_point

SYNC_BN = "{model} = torch.nn.SyncBatchNorm.convert_sync_batchnorm({model})\n"
WRAP = "{model} = DDP({model}, device_ids=[{index}] if next({model}.parameters()).is_cuda else None)\n"
TRAINS = "if any(p.requires_grad for p in {model}.parameters()):  # frozen on some runs: DDP refuses a module with nothing to train\n"
SEND_FROZEN = (
    "for tensor in [*{model}.parameters(), *{model}.buffers()]:  # frozen, not wrapped: rank 0's weights, as DDP sends them\n"
    "    dist.broadcast(tensor, src=0)\n"
)
MOVE_AND_WRAP = '{model} = DDP({model}.to({device}), device_ids=[{index}] if {device_type} == "cuda" else None)\n'


def run(ctx: Context) -> None:
    for model, scope in ctx.script.models.items():
        if model in ctx.script.run_with_weights:
            send_unwrapped(ctx, model, scope)
        else:
            _wrap(ctx, model, scope)
    for model, scope in ctx.script.sibling_models:  # another trainer's model of the same name
        _wrap(ctx, model, scope, sibling=True)
    for model, scope in ctx.script.frozen_models.items():
        _send_frozen(ctx, model, scope)


def _send_frozen(ctx: Context, model: str, scope) -> None:
    """A model an optimizer names but nothing in it trains (a probe's frozen backbone): no DDP,
    but every rank starts from rank 0's weights, as the wrap would have made it."""
    script = ctx.script
    if any(mentions(loop.iter, model) and any(N.call_name(c) == "broadcast" for c in script.calls_in(loop.body))
           for loop in script.nodes_in(script.block_of(scope), cst.For)):  # fmt: skip
        return  # sent already (a converted script)
    last = wrap_point(ctx, model, scope, list(script.block_of(scope).body), into_blocks=True)
    ctx.edits.insert_after(last, SEND_FROZEN.format(model=model))
    ctx.edits.need_import(N.DIST_MODULE, asname="dist")
    ctx.edits.change(last, f"`{model}` is frozen (no parameter requires a gradient): not wrapped in DDP, its weights are rank 0's")


def _wrap(ctx: Context, model: str, scope, sibling: bool = False) -> None:
    script, edits = ctx.script, ctx.edits
    body = list(script.block_of(scope).body)
    wrapped = _existing_wrap(ctx, model, scope)
    if wrapped is not None:
        if wrapped in body:
            _remember_wrap(ctx, model, scope, wrapped, sibling)
        return
    _returned_model(ctx, model, scope, body)
    last = wrap_point(ctx, model, scope, body, into_blocks=True)
    points = branch_points(script, model, last) or [last]  # built and trained in several branches: in each
    last = points[0]
    _remember_wrap(ctx, model, scope, last, sibling)
    synced = any(
        script.is_call_to(c, D.SYNC_BATCHNORM) and c.args and mentions(c.args[0].value, model) for c in script.calls
    )
    sync = ctx.options.sync_batchnorm and not synced
    if sync:
        edits.change(last, "BatchNorm layers become SyncBatchNorm (statistics over all processes)")
    elif _has_batchnorm(script):
        edits.change(last, "BatchNorm statistics stay per process: --sync-batchnorm syncs them")
    for point in points:
        if sync:
            edits.insert_after(point, SYNC_BN.format(model=model))
        _insert_wrap(ctx, model, scope, point)
    edits.need_import(N.DDP_MODULE, "DistributedDataParallel", "DDP")
    edits.change(last, f"`{model}` is wrapped in DistributedDataParallel (unwrapped: `{model}.module`)")


def _remember_wrap(ctx: Context, model: str, scope, stmt: cst.CSTNode, sibling: bool) -> None:
    """The statement the wrap follows, for the passes that ask whether code sees the wrapped model."""
    if sibling:
        ctx.sibling_wraps[(model, scope)] = stmt
    else:
        ctx.wrap_after[model] = stmt


def _insert_wrap(ctx: Context, model: str, scope, last: cst.CSTNode) -> None:
    """`model = DDP(model, ...)` right after `last` (and the object that kept the plain model
    before it takes the wrapped one)."""
    script, edits = ctx.script, ctx.edits
    if ctx.gpus_per_process > 1:
        edits.insert_after(last, f"{model} = DDP({model})  # spans several GPUs: no device_ids\n")
    else:
        if ctx.local_rank_visible(scope):
            index = ctx.local_rank
        elif ctx.device_visible(scope):
            index = f"{ctx.device_type.removesuffix('.type')}.index"
        else:  # a trainer of its own (another module, or a sibling of the one that sets up)
            index = LOCAL_RANK_ENV
            edits.need_import("os")
        wrap = WRAP
        if script.uses_gpu and not moved_before(script, statements_up_to(script, last, scope), model):  # `Trainer(model, ...)` moves it later
            wrap = MOVE_AND_WRAP
        if model in script.maybe_frozen:
            wrap = TRAINS + "    " + wrap + "else:\n" + "".join("    " + line + "\n" for line in SEND_FROZEN.splitlines())
        edits.insert_after(last, wrap.format(model=model, index=index, device=ctx.device, device_type=ctx.device_type))
    for alias in _aliases_before(script, model, scope, last):
        edits.insert_after(last, f"{alias} = {model}  # the object trains the wrapped model\n")


def _aliases_before(script, model: str, scope, last: cst.CSTNode) -> list[str]:
    """`self.net = net` in the function that wraps `net`, before the wrap: the object would keep
    the plain model (a trainer's constructor handed the model), so it takes the wrapped one."""
    found = []
    for assign in script.assigns.get(scope, []):
        target = assign.targets[0].target
        if (
            isinstance(target, cst.Attribute)
            and N.is_name(target.value, "self")
            and N.is_name(assign.value, model)
            and script.before(assign, last)
            and not script.inside(assign, last)
        ):
            found.append(ref_of(target))
    return found


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
    trains = scope in ctx.script.training_functions or any(runs_model(ctx.script, stmt, model) for stmt in body)
    for stmt in body:
        if not (isinstance(N.sole_statement(stmt), cst.Return) and stmt.body[0].value is not None):
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


def _has_batchnorm(script) -> bool:
    return any(script.is_call_to(c, N.BATCHNORMS) for c in script.calls)
