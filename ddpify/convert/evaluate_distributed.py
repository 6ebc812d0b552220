"""Evaluation runs on every rank over its own slice, and the metrics are summed.

Each evaluation loader reads `range(rank, len(dataset), world_size)`: a slice per rank
with no padding, so summed counts are exact (a DistributedSampler would repeat samples
to even the shards out). After each evaluation loop, the sums it accumulated with `+=`
(losses, correct counts, sample counts) are all-reduced, so every rank sees the same
metrics and makes the same early-stopping and best-model decisions. Helpers get the
unwrapped `model.module`, so evaluation never needs DDP's collectives. Loops whose averages
divide by this rank's batch count, that collect per-sample results (`preds.append(...)`), or
that keep metrics in objects (`top1.update(acc, n)` on an AverageMeter) evaluate the whole set
on every rank instead: slower, but their numbers and decisions stay right.

With `--eval-on-rank0` evaluation runs on rank 0 only instead (see guard_rank_zero).
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.script import Loader
from ddpify.check.fix import remove_arg
from ddpify.convert.context import Context
from ddpify.convert.edits import append_arg, keyword_arg
from ddpify.convert.metrics import accumulators, define_helper, meters, per_rank_denominator, reduce_after
from ddpify.convert.samplers import SLICE, loader_dataset, sampler_name



def run(ctx: Context) -> None:
    script = ctx.script
    if ctx.options.eval_on_rank0:
        return
    reduced, done = None, set()  # a loop whose sums are all-reduced (the helper goes to its module)
    for loader in script.loaders:
        loops = script.eval_loops.get(loader.name)
        if loader in script.train_loaders or not loops:
            continue
        why = None
        if any(per_rank_denominator(ctx, loop) for loop in loops):
            why = "its averages divide by batch counts"
        elif any(accumulators(loop)[1] for loop in loops):
            why = "it collects per-sample results"
        elif any(meters(ctx, loop) for loop in loops):
            why = "it keeps its metrics in objects of the script's own classes"
        if why:
            ctx.edits.change(loader.stmt, f"`{loader.name}`: every rank evaluates the whole set ({why})")
            continue
        _slice(ctx, loader)
        for loop in loops:
            if loop not in done:  # one helper may evaluate several loaders (`test(model, val_loader)`)
                done.add(loop)
                if reduce_after(ctx, loop):
                    reduced = loop
    if reduced:
        define_helper(ctx, reduced)


def _slice(ctx: Context, loader: Loader) -> None:
    script, edits = ctx.script, ctx.edits
    call = loader.call
    sampler = N.keyword(call, "sampler")
    slot = sampler if sampler is not None and N.is_name(sampler.value, "None") else None  # `sampler=None`: no sampler
    sampler = None if slot is not None else sampler
    if sampler is not None and (
        D.reads_rank(script, sampler.value) or D.calls_to(script, sampler.value, D.DISTRIBUTED_SAMPLER)
    ):
        return  # each rank reads its own slice already
    if sampler is not None and isinstance(sampler.value, cst.Call) and script.is_call_to(sampler.value, N.SEQUENTIAL_SAMPLER):
        rank, world = ctx.rank_and_world(loader.stmt)
        dataset = script.module.code_for_node(N.positional(sampler.value)[0].value) if N.positional(sampler.value) else None
        if dataset is not None:  # `sampler=SequentialSampler(ds)`: in order, so a slice per rank reads the same
            edits.replace(sampler.value, edits.expression(SLICE.format(rank=rank, world=world, dataset=dataset)))
            edits.change(call, f"`{loader.name}` gives each rank its own slice (no padding)")
            for module in N.DATA_MODULES:
                edits.drop_import_if_unused(module, "SequentialSampler")
            return
    if sampler is not None or N.keyword(call, "batch_sampler") is not None:
        edits.todo(loader.stmt, call, f"`{loader.name}` has its own sampler: give each rank a slice of it")
        return
    dataset = loader_dataset(ctx, loader, sampler_name(loader.name))
    rank, world = ctx.rank_and_world(loader.stmt)
    code = SLICE.format(rank=rank, world=world, dataset=dataset)
    star = next((a for a in call.args if a.star == "**"), None)
    if star is not None:  # the kwargs dict may hold a shuffle, which a sampler excludes
        kwargs = script.module.code_for_node(star.value)
        edits.replace(star.value, edits.expression(f'{{**{kwargs}, "shuffle": False}}'))
    shuffle = N.keyword(call, "shuffle")
    if slot is not None:  # the slice takes the place of `sampler=None`
        edits.replace(slot.value, edits.expression(code))
        if shuffle is not None:  # order does not matter for sums; a sampler excludes shuffle
            edits.rewrite(call, lambda updated: remove_arg(updated, N.keyword(updated, "shuffle")))
    elif shuffle is not None:  # order does not matter for sums; a sampler excludes shuffle
        edits.rewrite(shuffle, lambda updated: updated.with_changes(keyword=cst.Name("sampler"), value=edits.expression(code)))
    else:
        edits.rewrite(call, lambda updated: append_arg(updated, keyword_arg("sampler", edits.expression(code))))
    edits.change(call, f"`{loader.name}` gives each rank its own slice (no padding)")
