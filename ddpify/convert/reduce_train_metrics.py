"""Training metrics add up over ranks: each epoch's sums are all-reduced after the pass.

    epoch_loss = 0.0
    for x, y in train_loader:
        ...
        epoch_loss += loss.item() * x.size(0)
    epoch_loss = all_reduce_sum(epoch_loss)   # inserted: one collective per epoch
    epoch_loss /= len(train_loader.dataset)
    if epoch_loss < 0.1: break                # every rank decides the same

Each rank sums only its own shard, so without this rank 0 logs half the story and, worse,
a `break` or best-model decision taken on the sum differs between ranks (one stops, the other
waits in its next all-reduce forever). Only sums that are reset before the pass (per-epoch
metrics, not step counters that carry over) and read after it are reduced. When the code
after the pass divides by this rank's batch count (`len(train_loader)`, `batch_idx + 1`),
the sums are averaged over ranks instead, which keeps those averages right. Per-epoch lists
and meters (`losses.append(...)`, `top1.update(...)`) read after the pass get a TODO: ddpify
cannot reduce what they hold.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.script import ScopeNode, pick_training_test
from ddpify.convert.context import Context
from ddpify.convert.metrics import accumulators, define_helper, meters, per_rank_denominator, unreduced

COLLECTED = (
    "{names} collect this rank's share of the epoch only: average them over ranks (dist.all_reduce) "
    "before logging them or deciding on them (a scheduler step, an early stop), or the ranks disagree"
)


def run(ctx: Context) -> None:
    script = ctx.script
    done: set[cst.For] = set()
    for loader in script.train_loaders:
        for epoch in script.epoch_loops.get(loader.name, []):
            inner = epoch.inner
            if inner is None or inner in done:
                continue
            done.add(inner)
            added = accumulators(inner)[0]
            per_epoch = [
                name for name in added + _collected(ctx, inner)
                if _reset_before(ctx, name, inner, epoch.loop) and _read_after(ctx, name, inner)
            ]  # fmt: skip
            if sums := [name for name in per_epoch if name in added]:
                _reduce(ctx, inner, sums)
            if kept := [name for name in per_epoch if name not in added]:
                ctx.edits.todo(inner, inner, COLLECTED.format(names=", ".join(f"`{n}`" for n in kept)))


def _training_guard(ctx: Context, loop: cst.For) -> str | None:
    """`feed = self.fit_feed if not scoring else self.score_feed`, then `for ... in feed:` with every
    backward under `if not scoring:`: the test (`not scoring`) under which the pass trains."""
    script = ctx.script
    name = script.module.code_for_node(loop.iter) if isinstance(loop.iter, (cst.Name, cst.Attribute)) else None
    picks = [a.value for a in script.assigns.get(script.scope_of(loop), []) if script.root_of(a).code_for_node(a.targets[0].target) == name]
    if name is None or len(picks) != 1 or not isinstance(picks[0], cst.IfExp):
        return None
    return pick_training_test(script, loop, picks[0])


def _collected(ctx: Context, loop: cst.For) -> list[str]:
    """Lists the pass appends to and meters it updates (`losses.append(...)`, `top1.update(...)`)."""
    found = list(meters(ctx, loop))
    for call in ctx.script.calls_in(loop):
        owner = N.receiver(call)
        if N.call_name(call) in ("append", "extend") and isinstance(owner, cst.Name) and owner.value not in found:
            found.append(owner.value)
    return found


def _reduce(ctx: Context, loop: cst.For, sums: list[str]) -> None:
    sums, lost = unreduced(ctx, loop, sums)
    if lost:
        define_helper(ctx, loop)
    if not sums:
        return  # summed over ranks already
    average = per_rank_denominator(ctx, loop)
    world = ctx.rank_and_world(loop)[1]
    tail = f" / {world}" if average else ""
    reduced = "".join(f"{name} = all_reduce_sum({name}){tail}\n" for name in sums)
    if (guard := _training_guard(ctx, loop)) is not None:  # the same pass reads a whole held-out loader too
        reduced = f"if {guard}:  # the pass over the training loader (the other is whole on every rank)\n" + "".join(
            f"    {line}\n" for line in reduced.splitlines()
        )
    ctx.edits.insert_after(loop, reduced)
    how = "averaged" if average else "summed"
    ctx.edits.change(
        loop,
        f"training metrics {how} over all ranks after each pass: {', '.join(sums)} (every rank logs and decides on the same numbers)",
    )
    define_helper(ctx, loop)


def _reset_before(ctx: Context, name: str, loop: cst.For, epoch_loop: cst.For) -> bool:
    """`name = ...` runs before every pass: in the epoch loop's body, or earlier in the helper
    that holds the pass (the helper runs once an epoch)."""
    script = ctx.script
    scope: ScopeNode = script.scope_of(loop)
    for assign in script.assigns.get(scope, []):
        names = {n.value for target in assign.targets for n in _bound_names(target.target)}
        if name not in names or not script.before(assign, loop):
            continue
        if isinstance(scope, cst.FunctionDef) and scope is not script.scope_of(epoch_loop):
            return True
        if script.inside(assign, epoch_loop) and epoch_loop is not loop:
            return True
    return False


def _bound_names(target: cst.BaseExpression) -> list[cst.Name]:
    if isinstance(target, cst.Name):
        return [target]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for element in target.elements for n in _bound_names(element.value)]
    return []


def _read_after(ctx: Context, name: str, loop: cst.For) -> bool:
    """Is `name` used after the pass, in the same function (a log, a return, a decision)?"""
    script = ctx.script
    body = script.body_of(script.scope_of(loop))
    return any(script.after(found, loop) for found in script.nodes_in(body, cst.Name) if found.value == name)
