"""Give each rank its own part of a training split made with `SubsetRandomSampler`.

pytorch-template's `BaseDataLoader` (a DataLoader subclass) splits its dataset into training and
validation indices and samples each with `SubsetRandomSampler`: under DDP every rank would
train on all the training indices. The training sampler gets this rank's slice of them
(`train_idx[rank::world]`): disjoint shards that together cover the split, each reshuffled by
the sampler every epoch. The validation sampler stays whole: every rank evaluates the whole
split, so its numbers are the single process's.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.script import ref_of
from ddpify.convert.context import Context

SUBSET_RANDOM_SAMPLER = N.SUBSET_RANDOM_SAMPLER
SLICE = '{indices}[int(os.environ.get("RANK", 0)) :: int(os.environ.get("WORLD_SIZE", 1))]'


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    for call in script.calls:
        if not script.is_call_to(call, SUBSET_RANDOM_SAMPLER) or not N.positional(call):
            continue
        assign = script.parent(call)
        target = ref_of(assign.targets[0].target) if isinstance(assign, cst.Assign) else None
        cls = script.class_of(call)
        if target is None or "train" not in target or cls is None or not _is_loader_class(script, cls):
            continue
        indices = N.positional(call)[0].value
        if isinstance(indices, cst.Subscript) and "RANK" in script.index.code(indices):
            continue  # sliced by rank already
        code = script.index.code(indices)
        edits.replace(indices, edits.expression(SLICE.format(indices=code)))
        edits.need_import("os")
        edits.change(call, f"`{target}` samples this rank's slice of `{code}` (the split's training indices)")
        _no_split(ctx, script.scope_of(call))


def _no_split(ctx: Context, fn) -> None:
    """`if split == 0.0: return None, None` in the function that splits: the loader then samples
    the whole dataset on every rank, which this pass cannot shard from here: a TODO says so."""
    script = ctx.script
    if not isinstance(fn, cst.FunctionDef):
        return
    for ret in script.nodes_in(fn.body, cst.Return):
        value = ret.value
        items = [e.value for e in value.elements] if isinstance(value, cst.Tuple) else [value]
        if value is None or not all(isinstance(i, cst.Name) and i.value == "None" for i in items):
            continue
        line = script.statement_line(ret)
        ctx.edits.todo(
            line, line,
            "without a split the loader samples the whole dataset on every rank: give it a "
            "DistributedSampler here (and call its set_epoch(epoch) every epoch)",
        )  # fmt: skip


def _is_loader_class(script, cls: cst.ClassDef, depth: int = 0) -> bool:
    """A DataLoader subclass, directly or through the project's own base classes."""
    for base in cls.bases:
        if script.names(base.value) & N.DATALOADER:
            return True
        parent = script.project_definition(base.value) if depth < 4 else None
        if isinstance(parent, cst.ClassDef) and _is_loader_class(script, parent, depth + 1):
            return True
    return False
