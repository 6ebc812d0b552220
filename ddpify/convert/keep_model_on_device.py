"""The wrapped model stays on its device while it still trains.

    net.eval().cpu()                                   net.eval()
    torch.save(net.module.state_dict(), path)    ->    torch.save(net.module.state_dict(), path)
    net.to(device).train()                             net.train()

A loop that moves the model to the CPU (to save it) and back moves the DDP object: its gradient
buckets stay where they were made, and on GPUs the ranks' updates drift apart without an error
(seen on an H100). Inside the training loop, after the wrap, statements that only move the model
(and switch its mode) keep the switch and drop the move; `torch.load` later takes `map_location`.
A move after training ends (inference on the CPU) stays.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.script import ref_of
from ddpify.convert.context import Context

MOVES = frozenset({"cpu", "cuda", "to"})
MODES = frozenset({"eval", "train"})


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    for model, scope in script.models.items():
        wrapped = ctx.wrap_after.get(model)
        if wrapped is None or ctx.fsdp2 or model in script.run_with_weights:  # (no DDP object to break)
            continue
        for stmt in script.nodes_of(cst.SimpleStatementLine):
            if script.scope_of(stmt) is not scope or not script.ends_before(wrapped, stmt):
                continue
            if script.enclosing_loop(stmt, scope) is None or not script.in_training_loop(stmt, scope):
                continue  # after training: the move is the script's own business
            expr = stmt.body[0].value if len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr) else None
            chain = _chain(expr, model)
            if chain is None or not any(name in MOVES for name in chain):
                continue
            modes = [name for name in chain if name in MODES]
            if modes:
                edits.replace(expr, edits.expression(model + "".join(f".{m}()" for m in modes)))
            else:
                edits.remove(stmt)
            edits.change(stmt, f"`{model}` stays on its device: moving the DDP model mid-training breaks its gradient sync")


def _chain(expr: cst.BaseExpression | None, model: str) -> list[str] | None:
    """`net.eval().cpu()` -> ["eval", "cpu"] when every call is a mode switch or a move of `model`
    with no arguments but a device (`.to(device)`); None otherwise."""
    names: list[str] = []
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        name = expr.func.attr.value
        if name not in MOVES | MODES or (name in MODES and expr.args) or (name == "to" and len(expr.args) != 1):
            return None
        names.append(name)
        expr = expr.func.value
    return names[::-1] if names and ref_of(expr) == model else None
