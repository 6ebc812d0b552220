"""Every rank trains with the same randomly drawn schedule: rank 0's.

    lr = random.random() * 0.0005
    epochs = random.choice([100, 150, 200])
    ... (the process group is set up here)
    drawn_by_rank0 = [lr, epochs]  # drawn at random: every rank trains with rank 0's draws
    dist.broadcast_object_list(drawn_by_rank0)
    lr, epochs = drawn_by_rank0

Each process draws its own value, so without this the ranks train with different learning
rates and different step counts, and the first to finish leaves the others hanging in a
collective. Every rank still draws (its generator advances as before); rank 0's values are
broadcast once the process group exists, before the first use. Seeding every rank alike before
the draw was the other choice; it would make every run draw the same schedule, which defeats a
random search. Which draws count is `ddpify.analysis.schedule`: values that reach an optimizer
or scheduler setting, the bounds of a loop that trains, a batch size, or a function that
trains; never per-step randomness. Where no statement between the draws and their first use
runs after the process group exists, a TODO says what to share.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.schedule import ScheduleDraws, schedule_draws
from ddpify.convert.context import RANK0, Context

SHARED = "drawn_by_rank0"
SHARE = (
    "{shared} = [{refs}]  # drawn at random: every rank trains with rank 0's draws\n"
    "dist.broadcast_object_list({shared})\n"
    "{targets} = {shared}\n"
)


def run(ctx: Context) -> None:
    for draws in schedule_draws(ctx.script):
        if draws.shared:
            continue
        names = ", ".join(f"`{ref}`" for ref in draws.refs)
        at = _after_setup(ctx, draws) if draws.first_use is not None else None
        if at is None:
            ctx.edits.todo(
                draws.first_use or draws.last, draws.last,
                f"{names}: drawn at random, a different value on every rank; share rank 0's draws "
                "(dist.broadcast_object_list) once the process group exists, before they are used",
            )  # fmt: skip
            continue
        refs = ", ".join(draws.refs)
        targets = refs if len(draws.refs) > 1 else f"[{refs}]"
        ctx.edits.insert_before(at, SHARE.format(shared=SHARED, refs=refs, targets=targets))
        ctx.edits.need_import(N.DIST_MODULE, asname="dist")
        ctx.edits.change(
            draws.last, f"{names} drawn at random: every rank uses rank 0's draws (dist.broadcast_object_list)"
        )


def _after_setup(ctx: Context, draws: ScheduleDraws) -> cst.BaseStatement | None:
    """The first statement after the draws, up to their first use, that runs once the process
    group exists (the broadcast goes before it); None if there is none."""
    body = list(ctx.script.block_of(draws.scope).body)
    candidates = body[body.index(draws.last) + 1 : body.index(draws.first_use) + 1]
    return next((stmt for stmt in candidates if ctx.rank0_condition(stmt) == RANK0), None)
