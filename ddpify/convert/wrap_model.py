"""Wrap the trained model in DistributedDataParallel once it is on its device.

The wrap goes right after the last top-level statement that builds, moves or loads
the model and before anything runs it; `device_ids` is passed only for CUDA.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from ddpify.analysis.script import AnalysisError, ref_of
from ddpify.convert.context import Context

SYNC_BN = "{model} = torch.nn.SyncBatchNorm.convert_sync_batchnorm({model})\n"
WRAP = '{model} = DDP({model}, device_ids=[{index}] if {device_type} == "cuda" else None)\n'


def run(ctx: Context) -> None:
    for model, scope in ctx.script.models.items():
        _wrap(ctx, model, scope)


def _wrap(ctx: Context, model: str, scope) -> None:
    script, edits = ctx.script, ctx.edits
    last = None
    for stmt in script.block_of(scope).body:
        if _prepares(stmt, model):
            last = stmt
        elif last is not None and _runs(script, stmt, model):
            break
    if last is None:
        raise AnalysisError(script.line(script.optimizer_stmt), f"cannot find where `{model}` is built at the top level of its function")
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


def _prepares(stmt: cst.CSTNode, model: str) -> bool:
    """`model = ...` or `model.to(...)`/`model.cuda()`/`model.load_state_dict(...)` as a statement."""
    is_model = m.MatchIfTrue(lambda node: ref_of(node) == model)
    assigns = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=is_model)])])
    method = m.SimpleStatementLine(body=[m.Expr(m.Call(func=m.Attribute(value=is_model)))])
    return m.matches(stmt, assigns | method)


def _runs(script, stmt: cst.CSTNode, model: str) -> bool:
    """Does `stmt` loop, call the model, or hand it to another function?"""
    if isinstance(stmt, (cst.For, cst.While)):
        return True
    for call in script.calls_in(stmt):
        if ref_of(call.func) == model or any(ref_of(a.value) == model for a in call.args):
            return True
    return False


def _has_batchnorm(script) -> bool:
    return any(
        any(q.startswith(("torch.nn.BatchNorm", "torch.nn.modules.batchnorm")) for q in script.names(c.func))
        for c in script.calls
    )
