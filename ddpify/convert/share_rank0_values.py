"""Values each process computes differently but every rank must agree on are rank 0's.

    lr = random.random() * 0.0005
    epochs = random.choice([100, 150, 200])
    folder = run_folder() if int(os.environ.get("RANK", 0)) == 0 else None
    ... (the process group is set up here)
    drawn_by_rank0 = [lr, epochs]  # drawn at random: every rank trains with rank 0's draws
    dist.broadcast_object_list(drawn_by_rank0)
    lr, epochs = drawn_by_rank0
    folder_of_rank0 = [folder]  # named by the clock: every rank takes rank 0's
    dist.broadcast_object_list(folder_of_rank0)
    [folder] = folder_of_rank0

Schedules drawn at random: each process draws its own value, so the ranks would train with
different learning rates and step counts, and the first to finish leaves the others hanging in
a collective. Every rank still draws (its generator advances as before); rank 0's values are
broadcast once the process group exists, before their first use. Seeding every rank alike
before the draw was the other choice; it would make every run draw the same schedule, which
defeats a random search.

A per-run folder named by the clock: each rank reads its own time, and a helper that makes the
folder (`os.makedirs(path, exist_ok=False)`) races the others to it. Rank 0 alone calls the
helper; the other ranks take its name.

A name read from the clock inside a function that keeps it (a settings class's `__init__`
making `root / run_id`, never returning the name) is shared where it is read: rank 0's is
broadcast right there when a process group exists, rank 0 alone makes the folders and the
others wait at a barrier; setup_process_group puts the group before the `__main__` block
builds such an object.

Which values count is `ddpify.analysis.schedule`. Where no statement between the values and
their first use runs after the process group exists, or other functions read them (a global,
an attribute), Python's `random` draws come from one generator seeded by torchrun's job id
(`job_random`: every rank of a job draws the same values, every job its own; lj_unet drew its
learning rate and epoch count before its solver made the group); other draws get a TODO that
says what to share.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.schedule import RANDOM, ScheduleDraws, clock_names_in_place, rank0_values
from ddpify.analysis.script import ref_of

PYTHON_RANDOM = frozenset(q for q in N.RANDOM_VALUES if q.startswith("random."))
from ddpify.convert.context import RANK0, Context

SHARE = (
    "{shared} = [{refs}]  # {kind}: every rank takes rank 0's\n"
    "dist.broadcast_object_list({shared})\n"
    "{targets} = {shared}\n"
)


SHARE_IN_PLACE = (
    "if dist.is_initialized():  # named by the clock: every rank takes rank 0's\n"
    "    {shared} = [{ref}]\n"
    "    dist.broadcast_object_list({shared})\n"
    "    [{ref}] = {shared}\n"
)
MADE = "if dist.is_initialized():\n    dist.barrier()  # rank 0 has made the run's folders\n"


def run(ctx: Context) -> None:
    _share_in_place(ctx)
    for values in rank0_values(ctx.script):
        if values.shared:
            continue
        names = ", ".join(f"`{ref}`" for ref in values.refs)
        at = _after_setup(ctx, values) if values.first_use is not None else None
        if at is None and values.kind == RANDOM and _draw_alike(ctx, values):
            continue
        if at is None:
            ctx.edits.todo(
                values.first_use or values.last, values.last,
                f"{names}: {values.kind}, a different value on every rank; share rank 0's "
                "(dist.broadcast_object_list) once the process group exists, before they are used",
            )  # fmt: skip
            continue
        if values.rank0_call is not None and not _rank0_only(ctx, values.rank0_call):
            condition = ctx.rank0_condition(values.last)
            test = ctx.edits.expression(condition)
            ctx.edits.rewrite(values.rank0_call, lambda updated: cst.IfExp(test=test, body=updated, orelse=cst.Name("None")))
            if "os.environ" in condition:
                ctx.edits.need_import("os")
        for made in values.made_at:
            if isinstance(made, cst.SimpleStatementLine):  # not under a rank test yet
                ctx.edits.guard(made, ctx.rank0_condition(made))
                ctx.edits.need_import("os")
        refs = ", ".join(values.refs)
        targets = refs if len(values.refs) > 1 else f"[{refs}]"
        shared = "drawn_by_rank0" if values.kind == RANDOM else f"{values.refs[0].replace('.', '_')}_of_rank0"
        ctx.edits.insert_before(at, SHARE.format(shared=shared, refs=refs, kind=values.kind, targets=targets))
        ctx.edits.need_import(N.DIST_MODULE, asname="dist")
        maker = ", made by rank 0 alone" if values.rank0_call is not None or values.made_at else ""
        ctx.edits.change(values.last, f"{names} {values.kind}{maker}: every rank takes rank 0's (dist.broadcast_object_list)")


JOB_RANDOM = (
    'job_random = random.Random(os.environ.get("TORCHELASTIC_RUN_ID"))  '
    "# seeded by torchrun's job id: every rank draws the same values, each job its own\n"
)


def _draw_alike(ctx: Context, values: ScheduleDraws) -> bool:
    """Draws made before any process group exists (nothing to broadcast with yet): the
    `random.*` calls that make them draw from one generator seeded by the job's id, which
    torchrun gives every rank alike (as one process: seeded from the system, as before). False
    when a draw is not Python's `random` (numpy's, torch's): a TODO says what to share."""
    script, edits = ctx.script, ctx.edits
    body = list(script.block_of(values.scope).body)
    end = body.index(values.last) + 1
    draws, first = [], None
    for stmt in body[:end]:
        found = [c for c in script.calls_in(stmt) if script.is_call_to(c, N.RANDOM_VALUES)]
        if found and (stmt is values.last or set(_bound_by(script, stmt)) & set(values.refs)):
            first = first or stmt
            draws += found
    if not draws or any(not isinstance(c.func, cst.Attribute) or not script.is_call_to(c, PYTHON_RANDOM) for c in draws):
        return False
    edits.insert_before(first, JOB_RANDOM)
    for call in draws:
        edits.replace(call.func.value, cst.Name("job_random"))
    edits.need_import("os")
    edits.need_import("random")
    names = ", ".join(f"`{ref}`" for ref in values.refs)
    edits.change(first, f"{names}: drawn at random before the process group exists: drawn from `job_random`, seeded by torchrun's job id, so every rank draws the same")
    return True


def _bound_by(script, stmt: cst.CSTNode) -> list[str]:
    """The names a statement binds (`lr = ...`)."""
    return [r for a in script.nodes_in(stmt, cst.Assign) for t in a.targets if (r := ref_of(t.target))]


def _after_setup(ctx: Context, values: ScheduleDraws) -> cst.BaseStatement | None:
    """The first statement after the values, up to their first use, that runs once the process
    group exists (the broadcast goes before it); None if there is none."""
    body = list(ctx.script.block_of(values.scope).body)
    candidates = body[body.index(values.last) + 1 : body.index(values.first_use) + 1]
    return next((stmt for stmt in candidates if ctx.rank0_condition(stmt) == RANK0), None)


def _rank0_only(ctx: Context, call: cst.Call) -> bool:
    """`run_folder() if rank == 0 else None` already (a converted script)."""
    parent = ctx.script.parent(call)
    return isinstance(parent, cst.IfExp) and parent.body is call


def _share_in_place(ctx: Context) -> None:
    """A name read from the clock where it is made (`run_id = datetime.now().strftime(...)` in a
    config class's `__init__`): rank 0's is broadcast right there (once the process group exists;
    a caller without one keeps its own), rank 0 alone makes the folders it names, and the other
    ranks wait for them."""
    edits = ctx.edits
    for found in clock_names_in_place(ctx.script):
        if found.shared:
            continue
        shared = f"{found.ref.replace('.', '_')}_of_rank0"
        edits.insert_after(found.stmt, SHARE_IN_PLACE.format(shared=shared, ref=found.ref))
        for line in found.makes:
            edits.guard(line, ctx.rank0_condition(line))
        edits.insert_after(found.makes[-1], MADE)
        edits.need_import(N.DIST_MODULE, asname="dist")
        edits.need_import("os")
        edits.change(found.stmt, f"`{found.ref}` named by the clock: every rank takes rank 0's, rank 0 alone makes its folders")
