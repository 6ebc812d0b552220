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
from ddpify.analysis.script import Loader, ref_of
from ddpify.convert.context import Context
from ddpify.convert.emit import define_function
from ddpify.convert.edits import append_arg, keyword_arg
from ddpify.convert.shard_data import loader_dataset, sampler_name

ALL_REDUCE_SUM = '''

def all_reduce_sum(value):
    """Sum a metric over all processes (each one saw its own part of the data)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    total = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    dist.all_reduce(total)
    if isinstance(value, torch.Tensor):
        return total.to(value.device, value.dtype)
    return type(value)(total.item())
'''
SLICE = "range({rank}, len({dataset}), {world})"


def run(ctx: Context) -> None:
    script = ctx.script
    if ctx.options.eval_on_rank0:
        return
    reduced, done = False, set()
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
            ctx.edits.change(script.line(loader.stmt), f"`{loader.name}`: every rank evaluates the whole set ({why})")
            continue
        _slice(ctx, loader)
        for loop in loops:
            if loop not in done:  # one helper may evaluate several loaders (`test(model, val_loader)`)
                done.add(loop)
                reduced |= reduce_after(ctx, loop)
    if reduced:
        define_helper(ctx)


def per_rank_denominator(ctx: Context, loop: cst.For) -> bool:
    """After the loop, does the code use `len(loader)` or the batch index (`batch_idx + 1`)?
    Those count this rank's batches only, so summed metrics would be divided wrongly."""
    script = ctx.script
    scope = script.scope_of(loop)
    end = script.positions[loop].end.line
    loader = ref_of(loop.iter.args[0].value) if isinstance(loop.iter, cst.Call) and loop.iter.args else ref_of(loop.iter)
    index = None
    if isinstance(loop.iter, cst.Call) and N.call_name(loop.iter) == "enumerate" and isinstance(loop.target, cst.Tuple):
        index = ref_of(loop.target.elements[0].value)
    later = [node for node in _names_and_calls(script.body_of(scope)) if script.line(node) > end]
    for node in later:
        if isinstance(node, cst.Call) and N.call_name(node) == "len" and node.args and ref_of(node.args[0].value) == loader:
            return loader is not None
        if isinstance(node, cst.Name) and index is not None and node.value == index:
            return True
    return False


def _names_and_calls(node: cst.CSTNode) -> list[cst.CSTNode]:
    found: list[cst.CSTNode] = []

    class _Collect(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            found.append(n)

        def visit_Call(self, n: cst.Call) -> None:
            found.append(n)

    node.visit(_Collect())
    return found


def _slice(ctx: Context, loader: Loader) -> None:
    script, edits = ctx.script, ctx.edits
    call = loader.call
    sampler = N.keyword(call, "sampler")
    if sampler is not None and (
        D.reads_rank(script, sampler.value) or D.calls_to(script, sampler.value, D.DISTRIBUTED_SAMPLER)
    ):
        return  # each rank reads its own slice already
    if sampler is not None and isinstance(sampler.value, cst.Call) and script.is_call_to(sampler.value, N.SEQUENTIAL_SAMPLER):
        rank, world = ctx.rank_and_world(loader.stmt)
        dataset = script.module.code_for_node(N.positional(sampler.value)[0].value) if N.positional(sampler.value) else None
        if dataset is not None:  # `sampler=SequentialSampler(ds)`: in order, so a slice per rank reads the same
            edits.replace(sampler.value, edits.expression(SLICE.format(rank=rank, world=world, dataset=dataset)))
            edits.change(script.line(call), f"`{loader.name}` gives each rank its own slice (no padding)")
            for module in ("torch.utils.data", "torch.utils.data.sampler"):
                edits.drop_import_if_unused(module, "SequentialSampler")
            return
    if sampler is not None or N.keyword(call, "batch_sampler") is not None:
        edits.todo(loader.stmt, script.line(call), f"`{loader.name}` has its own sampler: give each rank a slice of it")
        return
    dataset = loader_dataset(ctx, loader, sampler_name(loader.name))
    rank, world = ctx.rank_and_world(loader.stmt)
    code = SLICE.format(rank=rank, world=world, dataset=dataset)
    star = next((a for a in call.args if a.star == "**"), None)
    if star is not None:  # the kwargs dict may hold a shuffle, which a sampler excludes
        kwargs = script.module.code_for_node(star.value)
        edits.replace(star.value, edits.expression(f'{{**{kwargs}, "shuffle": False}}'))
    shuffle = N.keyword(call, "shuffle")
    if shuffle is not None:  # order does not matter for sums; a sampler excludes shuffle
        edits.rewrite(shuffle, lambda updated: updated.with_changes(keyword=cst.Name("sampler"), value=edits.expression(code)))
    else:
        edits.rewrite(call, lambda updated: append_arg(updated, keyword_arg("sampler", edits.expression(code))))
    edits.change(script.line(call), f"`{loader.name}` gives each rank its own slice (no padding)")


def reduce_after(ctx: Context, loop: cst.For) -> bool:
    """Sum the loop's `x += ...` accumulators over ranks right after it (those not summed yet);
    True when the script needs the `all_reduce_sum` helper."""
    script, edits = ctx.script, ctx.edits
    sums, appends = accumulators(loop)
    if appends:
        edits.todo(loop, script.line(loop), "this evaluation collects per-sample results: gather them from all ranks (dist.all_gather_object)")
    sums, reduced = unreduced(ctx, loop, sums)
    if not sums:
        return reduced
    edits.insert_after(loop, "".join(f"{name} = all_reduce_sum({name})\n" for name in sums))
    edits.change(script.line(loop), f"evaluation sums over all ranks: {', '.join(sums)}")
    return True


def unreduced(ctx: Context, loop: cst.CSTNode, sums: list[str]) -> tuple[list[str], bool]:
    """The sums no statement after `loop` all-reduces yet, and whether a reduction that is there
    calls a helper the script lacks (it must be defined again)."""
    found = {name: D.reduced_after(ctx.script, loop, name) for name in sums}
    lost = any(D.missing_helper(ctx.script, call) for call in found.values())
    return [name for name in sums if found[name] is None], lost


def accumulators(loop: cst.For) -> tuple[list[str], bool]:
    """The names the loop adds to with `+=`, and whether it appends to lists."""
    sums: list[str] = []
    appends = False

    class _Accumulators(cst.CSTVisitor):
        def visit_AugAssign(self, node: cst.AugAssign) -> None:
            if isinstance(node.operator, cst.AddAssign) and ref_of(node.target) and ref_of(node.target) not in sums:
                sums.append(ref_of(node.target))

        def visit_Call(self, node: cst.Call) -> None:
            nonlocal appends
            appends = appends or N.call_name(node) in ("append", "extend")

    loop.body.visit(_Accumulators())
    return sums, appends


def meters(ctx: Context, loop: cst.For) -> list[str]:
    """`top1.update(acc, n)` in the loop on `top1 = AverageMeter(...)`: an object of the script's
    own classes that sums what it is given, out of reach of the all-reduce of plain sums."""
    script = ctx.script
    made = script.objects(script.scope_of(loop))
    found = []
    for call in script.calls_in(loop):
        owner = ref_of(N.receiver(call)) if N.receiver(call) is not None else None
        if N.call_name(call) == "update" and owner in made and owner not in found:
            found.append(owner)
    return found


def define_helper(ctx: Context) -> None:
    """`all_reduce_sum` once, after the imports."""
    if D.all_reduces(ctx.script, ctx.script.functions.get("all_reduce_sum")):
        return
    define_function(ctx, "all_reduce_sum", ALL_REDUCE_SUM)
