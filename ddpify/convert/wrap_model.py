"""Wrap the trained model in DistributedDataParallel once it is on its device.

The wrap goes right after the last top-level statement that touches the model (builds,
moves, loads, freezes or re-heads it) before anything runs or trains it, and after the
process group exists; `device_ids` is passed only for CUDA.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.script import AnalysisError, mentions, ref_of
from ddpify.convert.context import Context

SYNC_BN = "{model} = torch.nn.SyncBatchNorm.convert_sync_batchnorm({model})\n"
WRAP = '{model} = DDP({model}, device_ids=[{index}] if {device_type} == "cuda" else None)\n'


def run(ctx: Context) -> None:
    for model, scope in ctx.script.models.items():
        _wrap(ctx, model, scope)


def _wrap(ctx: Context, model: str, scope) -> None:
    script, edits = ctx.script, ctx.edits
    body = list(script.block_of(scope).body)
    last = None
    for stmt in body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            continue  # a definition runs nothing
        if _runs(script, stmt, model):
            break
        if mentions(stmt, model):
            last = stmt  # built, moved, loaded, frozen, given a new head...: not run yet
    if last is None:
        raise AnalysisError(script.line(script.optimizer_stmt), f"cannot find where `{model}` is built at the top level of its function")
    if scope is ctx.setup_scope and body.index(last) < ctx.init_index - 1:
        last = body[ctx.init_index - 1]  # the process group (and the device) must exist first
    ctx.wrap_after[model] = last
    if ctx.options.sync_batchnorm:
        edits.insert_after(last, SYNC_BN.format(model=model))
        edits.change(script.line(last), "BatchNorm layers become SyncBatchNorm (statistics over all processes)")
    elif _has_batchnorm(script):
        edits.change(script.line(last), "BatchNorm statistics stay per process: --sync-batchnorm syncs them")
    if ctx.gpus_per_process > 1:
        edits.insert_after(last, f"{model} = DDP({model})  # spans several GPUs: no device_ids\n")
    else:
        index = ctx.local_rank if ctx.local_rank_visible(scope) else f"{ctx.device}.index"
        edits.insert_after(last, WRAP.format(model=model, index=index, device_type=ctx.device_type))
    edits.need_import("torch.nn.parallel", "DistributedDataParallel", "DDP")
    edits.change(script.line(last), f"`{model}` is wrapped in DistributedDataParallel (unwrapped: `{model}.module`)")


def _runs(script, stmt: cst.CSTNode, model: str) -> bool:
    """Does `stmt` train or call the model (directly, or by handing it to a training function)?"""
    for call in script.calls_in(stmt):
        if ref_of(call.func) == model or N.call_name(call) == "backward":
            return True
        if script.local_function(call) in script.training_functions:
            return True  # a training helper (it may use the model as a global)
    return False


def _has_batchnorm(script) -> bool:
    return any(
        any(q.startswith(("torch.nn.BatchNorm", "torch.nn.modules.batchnorm")) for q in script.names(c.func))
        for c in script.calls
    )
