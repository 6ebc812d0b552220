"""A model split over several GPUs (model parallelism) gets its own set of GPUs per process.

A script that names `cuda:0` and `cuda:1` (say) places layers on two GPUs. Each process
then takes GPUs `2 * LOCAL_RANK` and `2 * LOCAL_RANK + 1`; DDP wraps the model without
`device_ids` (required for multi-device modules); launch with half as many processes as
GPUs. `width(script)` is how many GPUs one copy of the model uses.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.analysis.script import Script
from ddpify.convert.context import Context

PER_PROCESS = 'f"cuda:{{{width} * int(os.environ.get(\'LOCAL_RANK\', 0)) + {index}}}"'


def width(script: Script) -> int:
    """The number of GPUs the script's model spans (1 unless it names several indices); in a
    converted script, the width its per-process devices (`f"cuda:{2 * LOCAL_RANK + 1}"`) use."""
    indices = {index for _, index in _indexed_devices(script)}
    if len(indices) > 1:
        return max(indices) + 1
    spread = {w for w in map(_per_process_width, script.nodes_of(cst.FormattedString)) if w}
    return max(spread) if spread else 1


def _per_process_width(node: cst.FormattedString) -> int | None:
    """W in `f"cuda:{W * int(os.environ.get('LOCAL_RANK', 0)) + i}"` (what this pass writes)."""
    parts = node.parts
    if len(parts) != 2 or not (isinstance(parts[0], cst.FormattedStringText) and parts[0].value == "cuda:"):
        return None
    expr = getattr(parts[1], "expression", None)
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add) and isinstance(expr.right, cst.Integer):
        expr = expr.left
    if (
        isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Multiply) and isinstance(expr.left, cst.Integer)
        and any(isinstance(n, cst.SimpleString) and "LOCAL_RANK" in n.value for n in iter_nodes(expr.right))
    ):  # fmt: skip
        return int(expr.left.value)
    return None


def run(ctx: Context) -> None:
    if ctx.gpus_per_process == 1:
        return
    script, edits = ctx.script, ctx.edits
    for node, index in _indexed_devices(script):
        if ctx.device_stmt is not None and script.inside(node, ctx.device_stmt):
            continue
        edits.replace(node, edits.expression(PER_PROCESS.format(width=ctx.gpus_per_process, index=index)))
    edits.need_import("os")
    edits.change(
        1,
        f"the model spans {ctx.gpus_per_process} GPUs: process LOCAL_RANK uses GPUs "
        f"{ctx.gpus_per_process}*LOCAL_RANK and up; launch with --nproc-per-node=<GPUs / {ctx.gpus_per_process}>",
    )


def _indexed_devices(script: Script) -> list[tuple[cst.BaseExpression, int]]:
    """Every `"cuda:i"` literal and its index."""
    found = []
    for call in script.calls:
        for arg in call.args:
            value = arg.value
            if isinstance(value, cst.SimpleString) and N.is_cuda_string(value) and ":" in value.evaluated_value:
                index = value.evaluated_value.split(":", 1)[1]
                if index.isdigit():
                    found.append((value, int(index)))
    return found
