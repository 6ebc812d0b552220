"""Samplers a training DataLoader reaches through others, for shard_data.

    batch_sampler=Forever(BatchSampler(RandomSampler(ds), 8))   # the project's wrapper, cycling a torch sampler
    sampler=Endless(ds)                                         # the project's own sampler, drawing indices itself

A torch sampler at the bottom of a chain becomes a DistributedSampler, and a wrapper that starts
pass after pass over what it holds advances the sampler's epoch there (a new shuffle each pass,
the same on every rank). A sampler of the project's that draws its own indices over the loader's
dataset gets this rank's part of the dataset instead: whatever it draws (seeded or not, endless or
not), the ranks read disjoint items, and every rank's part has the same length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.script import Loader, ref_of
from ddpify.convert.context import Context

# What _existing_sampler returns where the held samplers take care of each pass themselves.
HELD = "<held>"

KNOWN = N.RANDOM_SAMPLER | N.SEQUENTIAL_SAMPLER | D.DISTRIBUTED_SAMPLER

# Before a wrapper's next pass over a sampler it holds (its BatchSampler's own sampler, if that is what it holds).
EPOCH_OF_HELD = (
    'epoch_sampler = getattr({held}, "sampler", {held})  # a BatchSampler\'s own sampler\n'
    "if isinstance(epoch_sampler, DistributedSampler):  # a new pass: a new shuffle, the same on every rank\n"
    "    epoch_sampler.set_epoch(epoch_sampler.epoch + 1)\n"
)
# This rank's part of a dataset, every part the same length (a remainder is left out).
RANK_PART = (
    "# this rank's part of {dataset}, the same length on every rank (its sampler draws from it alone)\n"
    "{part} = Subset({dataset}, range({rank}, len({dataset}) // {world} * {world}, {world}))\n"
)


@dataclass
class Chain:
    """One sampler the loader may draw from, from the top down: the project's wrappers on the way
    (each with whether a BatchSampler lies below it) and the torch sampler at the bottom (None: a
    sampler of another make, or the project's own that draws indices itself)."""

    base: cst.Call | None
    wrappers: list[cst.ClassDef] = field(default_factory=list)
    own: cst.Call | None = None  # the project's sampler that draws indices itself
    other: cst.Call | None = None  # a sampler of another make (`WeightedRandomSampler(...)`)


def assignments(ctx: Context, ref: str, loader: Loader) -> list[cst.Assign]:
    """Every `ref = ...` where the loader's code sees `ref` (its scope; every method for `self.x`)."""
    script = ctx.script
    return [
        a for scope in script.scopes_for(ref, loader.scope) for a in script.assigns.get(scope, [])
        if ref_of(a.targets[0].target) == ref
    ]  # fmt: skip


def bound_calls(ctx: Context, value: cst.BaseExpression, loader: Loader) -> list[cst.Call | None]:
    """The calls `value` may be: itself, both sides of `A if cond else B`, or every value
    assigned to the name it is (one per branch of an if/else); None for one that is no call."""
    if isinstance(value, cst.IfExp):
        return bound_calls(ctx, value.body, loader) + bound_calls(ctx, value.orelse, loader)
    if isinstance(value, cst.Call):
        return [value]
    ref = ref_of(value)
    if ref is None:
        return [None]
    found: list[cst.Call | None] = []
    for assign in assignments(ctx, ref, loader):
        found += bound_calls(ctx, assign.value, loader) if isinstance(assign.value, (cst.Call, cst.IfExp)) else [None]
    return found


def chains(ctx: Context, value: cst.BaseExpression, loader: Loader, above: tuple = ()) -> list[Chain]:
    """Every sampler `value` may draw from, through BatchSamplers and the project's sampler classes."""
    script, found = ctx.script, []
    for call in bound_calls(ctx, value, loader):
        cls = script.class_called(call) if call is not None else None
        if call is not None and script.is_call_to(call, KNOWN):
            found.append(Chain(call, list(above)))
        elif call is not None and (script.is_call_to(call, N.BATCH_SAMPLER) or cls is not None and _is_sampler(script, cls)):
            args = N.positional(call) or [a for a in [N.keyword(call, "sampler")] if a is not None]
            if not args:
                found.append(Chain(None, list(above)))
            elif cls is not None and not _holds_sampler(ctx, args[0].value, loader):
                found.append(Chain(None, list(above), own=call))  # `Endless(dataset)`: it draws indices itself
            else:
                found += chains(ctx, args[0].value, loader, above + ((cls,) if cls is not None else ()))
        else:
            found.append(Chain(None, list(above), other=call))
    return found


def _is_sampler(script, cls: cst.ClassDef) -> bool:
    """Is the project's class a sampler: a subclass of a `...Sampler`, or a class with `__iter__`
    that is no Dataset?"""
    bases = {script.module.code_for_node(b.value).rpartition(".")[2] for b in cls.bases}
    if any(b.endswith("Sampler") for b in bases):
        return True
    return "__iter__" in script.methods(cls) and not any(b.endswith("Dataset") for b in bases)


def _holds_sampler(ctx: Context, value: cst.BaseExpression, loader: Loader) -> bool:
    """Is `value` a sampler (of torch's or the project's), not a dataset or a length?"""
    script = ctx.script
    for call in bound_calls(ctx, value, loader):
        if call is None:
            continue
        cls = script.class_called(call)
        if script.is_call_to(call, KNOWN | N.BATCH_SAMPLER) or cls is not None and _is_sampler(script, cls):
            return True
    return False


def advance_in_wrapper(ctx: Context, cls: cst.ClassDef) -> bool:
    """Before each new pass the wrapper starts over what it holds (`while True: for b in
    self.sampler:`), advance the epoch of the DistributedSampler under it. False where it has none."""
    script, done = ctx.script, False
    method = script.methods(cls).get("__iter__")
    if method is None:
        return False
    for loop in script.nodes_in(method, cst.For):
        held = ref_of(loop.iter)
        if held is None or not held.startswith("self.") or not script.nodes_in(method, cst.While):
            continue
        if not any(loop in script.nodes_in(w, cst.For) for w in script.nodes_in(method, cst.While)):
            continue
        ctx.edits.insert_before(loop, EPOCH_OF_HELD.format(held=held))
        ctx.edits.change(loop, f"a new pass over `{held}`: its DistributedSampler's set_epoch(...) reshuffles the shards")
        done = True
    return done


def rank_part(ctx: Context, loader: Loader, own: cst.Call) -> bool:
    """`DataLoader(ds, sampler=Endless(ds))`: both read `ds_part`, this rank's part of `ds`.
    False (nothing edited) where the sampler and the loader name the dataset differently."""
    script, edits = ctx.script, ctx.edits
    args = N.positional(loader.call)
    data = args[0] if args else N.keyword(loader.call, "dataset")
    drawn = N.positional(own)[0]
    if data is None or ref_of(data.value) is None or ref_of(drawn.value) != ref_of(data.value):
        return False
    dataset = ref_of(data.value)
    part = dataset.rpartition(".")[2].removesuffix("_dataset").removesuffix("dataset") or "train"
    part = f"{part}_part" if not part.endswith("_") else f"{part}part"
    rank, world = ctx.rank_and_world(loader.stmt)
    edits.insert_before(loader.stmt, RANK_PART.format(part=part, dataset=dataset, rank=rank, world=world))
    edits.replace(data.value, edits.expression(part))
    edits.replace(drawn.value, edits.expression(part))
    edits.need_import(N.DATA_MODULE, "Subset")
    edits.change(
        loader.stmt,
        f"`{N.call_name(own)}` draws its own indices: it and the loader read `{part}`, this rank's part of `{dataset}` "
        "(disjoint between the ranks, the same length on each)",
    )
    return True


def is_rank_part(ctx: Context, loader: Loader) -> bool:
    """Does the loader read this rank's part of a dataset already (`RANK_PART`)?"""
    args = N.positional(loader.call)
    data = args[0] if args else N.keyword(loader.call, "dataset")
    if data is None:
        return False
    code = ctx.script.root_of(loader.call).code_for_node
    return any(
        c is not None and N.call_name(c) == "Subset" and ("RANK" in code(c) or "get_rank()" in code(c))
        for c in bound_calls(ctx, data.value, loader)
    )


def endless(ctx: Context, found: list[Chain]) -> bool:
    """Does a sampler of the project's in these chains never end (`while True` in its `__iter__`
    or in a function of the project that `__iter__` calls)? A loader that reads one is a
    training loader: nothing evaluates over an endless stream."""
    script = ctx.script
    for cls in [w for c in found for w in c.wrappers] + [script.class_called(c.own) for c in found if c.own is not None]:
        method = script.methods(cls).get("__iter__") if cls is not None else None
        bodies = [method] if method is not None else []
        bodies += [fn for c in (script.calls_in(method) if method is not None else []) if (fn := _project_function(script, c))]
        if any(_loops_forever(script, body) for body in bodies):
            return True
    return False


def _project_function(script, call: cst.Call) -> cst.FunctionDef | None:
    found = script.local_function(call) or script.project_definition(call.func)
    return found if isinstance(found, cst.FunctionDef) else None


def _loops_forever(script, fn: cst.FunctionDef) -> bool:
    return any(N.is_name(w.test, "True") or isinstance(w.test, cst.Integer) and w.test.value == "1" for w in script.nodes_in(fn, cst.While))
