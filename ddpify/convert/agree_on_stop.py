"""Every rank stops the step loop at the same step: a per-step stop test reads the mean over ranks.

    for step in count(1):
        loss = criterion(model(x), y)          # x, y: this rank's own batch
        ...
        loss_value = loss.item()
        loss_value = all_reduce_sum(loss_value) / dist.get_world_size()   # inserted
        if loss_value < 1e-3:
            break

Each rank computes its loss on its own batch, so a `break` (or `return`) decided on it is taken
at different steps by different ranks: the one that stops leaves the others waiting in DDP's
next all-reduce forever. The mean over ranks is the loss of the global batch, the number a
single process with the whole batch would have tested. One collective per step, only where the
script's own control flow needs it.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.convert.context import Context
from ddpify.convert.metrics import define_helper

MEAN = "{name} = all_reduce_sum({name}) / {world}\n"


def run(ctx: Context) -> None:
    script = ctx.script
    for backward in [c for c in script.calls if N.call_name(c) == "backward" and N.receiver(c) is not None]:
        scope = script.scope_of(backward)
        loops = script.loops_around(backward, scope)
        if not loops:
            continue
        loop = loops[0]
        for stop in _stop_tests(loop):
            names = _per_step_values(script, loop, stop)
            if not names:
                continue
            if _already_reduced(script, loop, stop, names):
                body = list(loop.body.body)
                calls = [c for stmt in body[: body.index(stop)] for c in script.calls_in(stmt)]
                if any(D.missing_helper(script, c) and N.call_name(c) == "all_reduce_sum" for c in calls):
                    define_helper(ctx, stop)  # the averaging is there, its helper lost
                continue
            world = ctx.rank_and_world(stop)[1]
            ctx.edits.insert_before(stop, "".join(MEAN.format(name=n, world=world) for n in names))
            ctx.edits.change(
                stop,
                f"the stop test reads the mean of {', '.join(f'`{n}`' for n in names)} over ranks: every rank stops at the same step",
            )
            define_helper(ctx, stop)


def _stop_tests(loop: cst.For | cst.While) -> list[cst.If]:
    """`if ...: break` / `return` statements directly in the loop's body (not in a nested loop)."""
    found = []
    for stmt in loop.body.body:
        if isinstance(stmt, cst.If) and any(isinstance(n, (cst.Break, cst.Return)) for n in iter_nodes(stmt.body)):
            found.append(stmt)
    return found


def _per_step_values(script, loop, stop: cst.If) -> list[str]:
    """Names the test reads that the loop body binds, before the test, from a `.item()` value."""
    tested = {n.value for n in iter_nodes(stop.test) if isinstance(n, cst.Name)}
    found: list[str] = []
    for stmt in loop.body.body:
        if stmt is stop:
            break
        for assign in iter_nodes(stmt):
            if not (isinstance(assign, cst.Assign) and len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Name)):
                continue
            name = assign.targets[0].target.value
            if name in tested and name not in found and any(N.call_name(c) == "item" and isinstance(c.func, cst.Attribute) for c in script.calls_in(assign.value)):
                found.append(name)
    return found


def _already_reduced(script, loop, stop: cst.If, names: list[str]) -> bool:
    """The loop already averages the value before the test (a converted script)."""
    body = list(loop.body.body)
    before = body[: body.index(stop)]
    return any(
        N.call_name(c) in ("all_reduce_sum", "all_reduce") for stmt in before for c in script.calls_in(stmt)
        if any(isinstance(n, cst.Name) and n.value in names for n in iter_nodes(stmt))
    )
