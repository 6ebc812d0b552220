"""A model run with weights handed to it (analysis/functional.py) is never wrapped: what wrap_model,
shard_model and average_gradients share about it.

    for tensor in net.state_dict().values():  # where the wrap would go: rank 0's weights everywhere
        dist.broadcast(tensor, src=0)

The whole state dict is sent, as DDP's wrap sends it: an overridden `parameters()` (MAML's
learner returns its fast-weight list) may leave entries out. The statement it follows counts as
the model's wrap for the passes after (`ctx.wrap_after`: re-seeding by rank, copies taken before).
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.functional import differentiates
from ddpify.analysis.script import mentions
from ddpify.convert.context import Context
from ddpify.convert.wrap_point import wrap_point

SEND_UNWRAPPED = (
    "for tensor in {model}.state_dict().values():  # run with weights passed in, not wrapped: rank 0's weights, as DDP sends them\n"
    "    dist.broadcast(tensor, src=0)\n"
)
UNWRAPPED = {False: "not wrapped in DDP", True: "not sharded with FSDP2 (each rank holds it whole)"}  # by ctx.fsdp2


def send_unwrapped(ctx: Context, model: str, scope) -> None:
    """A model run with weights handed to it: no DDP (nor FSDP2), but every rank starts from rank
    0's weights where the wrap would go; that point counts as its wrap for the passes after."""
    script = ctx.script
    last = wrap_point(ctx, model, scope, list(script.block_of(scope).body), into_blocks=True)
    ctx.wrap_after[model] = last
    sent = any(
        mentions(loop.iter, model) and any(N.call_name(c) == "broadcast" for c in script.calls_in(loop.body))
        for loop in script.nodes_in(script.block_of(scope), cst.For)
    )
    if not sent:  # (a converted script sends them already)
        ctx.edits.insert_after(last, SEND_UNWRAPPED.format(model=model))
        ctx.edits.need_import(N.DIST_MODULE, asname="dist")
    ctx.edits.change(last, f"{unwrapped_because(ctx, model)}: {UNWRAPPED[ctx.fsdp2]}; every rank starts from rank 0's weights")


def unwrapped_because(ctx: Context, model: str) -> str:
    """Why `model` is not wrapped, as the summary says it: the call that shows it."""
    script = ctx.script
    evidence = script.run_with_weights[model]
    code = script.root_of(evidence).code_for_node(evidence)
    code = code if len(code) <= 60 and "\n" not in code else script.root_of(evidence).code_for_node(evidence.func) + "(...)"
    if differentiates(script, evidence):
        return f"`{model}`'s parameters are differentiated with `{code}`, which DDP does not support"
    return f"`{model}` is run with weights passed in (`{code}`)"
