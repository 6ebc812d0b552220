"""Shard a dict of per-split DataLoaders, the shape of the PyTorch fine-tuning tutorial:

    dataloaders = {x: DataLoader(image_datasets[x], shuffle=True, ...) for x in ["train", "val"]}
    for epoch in ...:
        for phase in ["train", "val"]:
            for inputs, labels in dataloaders[phase]: ...

The training split reads through a DistributedSampler (with `set_epoch` every epoch), the
other splits read a slice per rank with no padding, and the sums the shared loop accumulates
are added up over ranks after it, so every rank prints and decides on the same metrics.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.index import names_in
from ddpify.analysis.script import Loader, SplitLoaders, ref_of
from ddpify.convert.context import RANK0, Context
from ddpify.convert.edits import append_arg, keyword_arg
from ddpify.convert.metrics import define_helper, per_rank_denominator, reduce_after
from ddpify.convert.samplers import BEFORE_INIT, SLICE, loader_dataset, sampler_name, set_epoch, split_batch

SAMPLER = "DistributedSampler({dataset}, shuffle={shuffle}{extra})"


def run(ctx: Context) -> None:
    for split in ctx.script.split_loaders:
        _shard(ctx, split)


def _shard(ctx: Context, split: SplitLoaders) -> None:
    edits = ctx.edits
    train = split.train_key
    line = split.stmt
    own = any(N.keyword(c, k) is not None for c in split.calls.values() for k in ("sampler", "batch_sampler"))
    if train is not None and train in split.calls and split.epoch_loops and _sharded(ctx, split, split.calls[train]):
        _per_epoch(ctx, split, train, None, reduce=_walked(split))  # sharded already: what each epoch needs, if it lacks it
        return
    if train is None or train not in split.calls or not split.epoch_loops or own:
        edits.todo(
            split.stmt,
            line,
            f"`{split.name}` holds a DataLoader per split: give the training one a DistributedSampler "
            "(set_epoch every epoch) and the others a slice per rank",
        )
        return
    rank, world = ctx.rank_and_world(split.stmt)
    extra = "" if ctx.rank0_condition(split.stmt) == RANK0 else BEFORE_INIT
    samplers = {}
    walked = _walked(split)
    for key, call in split.calls.items():
        if key != train and not walked:
            continue  # `evaluate(loaders["test"], ...)` in a helper: read whole on every rank (no sums to add up here)
        dataset = _dataset(ctx, call, split.key_var, split.keys[key])
        loader = _named_loader(ctx, call)
        if dataset is None and loader is not None:  # hoisted: `train_dataset = ...` above the loader
            dataset = loader_dataset(ctx, loader, sampler_name(loader.name))
        if dataset is None and split.key_var is None:  # `{"train": DataLoader(TensorDataset(...), ...)}`
            dataset = _hoist_dataset(ctx, split, call, key)
        if dataset is None:
            edits.todo(split.stmt, call, f"shard the `{split.name}` loaders by rank: their dataset is built inline")
            return
        shuffle_arg = N.keyword(call, "shuffle")
        shuffle = _for_split(ctx, shuffle_arg.value, split.key_var, split.keys[key]) if shuffle_arg is not None else "False"
        if key == train:
            samplers[key] = SAMPLER.format(dataset=dataset, shuffle=shuffle, extra=extra)
        else:
            samplers[key] = SLICE.format(rank=rank, world=world, dataset=dataset)
    if split.key_var is None:
        train_sampler = f"{split.name}[{split.keys[train]}].sampler"
        for key, call in split.calls.items():
            if key not in samplers:
                continue  # read whole
            loader = _named_loader(ctx, call)
            if key == train and loader is not None:  # `train_loader = DataLoader(...)`: its sampler gets a name
                train_sampler = sampler_name(loader.name)
                edits.insert_before(loader.stmt, f"{train_sampler} = {samplers[key]}\n")
                samplers[key] = train_sampler
            _set_sampler(ctx, call, samplers[key])
    else:  # one call builds every split: it picks its sampler from a dict made just before
        name = _free_name(ctx, split, "samplers")
        entries = "".join(f"    {split.keys[key]}: {code},\n" for key, code in samplers.items())
        edits.insert_before(split.stmt, f"{name} = {{\n{entries}}}\n")
        _set_sampler(ctx, split.calls[train], f"{name}[{split.key_var}]")
        train_sampler = f"{name}[{split.keys[train]}]"
    if ctx.options.global_batch:
        split_batch(ctx, _named_loader(ctx, split.calls[train]) or Loader(split.name, split.calls[train], split.stmt, split.scope))
    edits.need_import(N.SAMPLER_MODULE, "DistributedSampler")
    others = "the other splits a slice per rank" if walked else "the other splits are read whole on every rank"
    edits.change(line, f"`{split.name}[{split.keys[train]}]` reads this process's shard; {others}")
    _per_epoch(ctx, split, train, train_sampler, reduce=walked)


def _walked(split: SplitLoaders) -> bool:
    """Is the dict walked split by split in one shared loop (`for x in loaders[phase]`), whose
    sums can be added up over ranks after it, rather than used item by item (`loaders["train"]`)?"""
    return split.key_var is not None or any(
        e.inner is not None and isinstance(N.sole_index(e.inner.iter), cst.Name) and N.is_name(e.inner.iter.value, e.loader_expr)
        for e in split.epoch_loops
    )


def _sharded(ctx: Context, split: SplitLoaders, call: cst.Call) -> bool:
    """Does the training split read through a DistributedSampler already (`sampler=samplers[x]`
    over a dict that holds one, or a name bound to one)?"""
    script = ctx.script
    arg = N.keyword(call, "sampler")
    if arg is None:
        return False
    if D.calls_to(script, arg.value, D.DISTRIBUTED_SAMPLER):
        return True
    names = script.nodes_in(arg.value, cst.Name)
    used = {n.value for n in names}
    if used and all(not script.names(n) and not any(n.value in b for b in script.bound.values()) for n in names if n.value != split.key_var):
        # `sampler=samplers[x]` with no `samplers` left (a partly converted script): say so
        ctx.edits.todo(split.stmt, split.stmt, f"`{script.module.code_for_node(arg.value)}` is not defined: give the training split a DistributedSampler and the others a slice per rank")
        return True
    return any(
        ref_of(a.targets[0].target) in used and D.calls_to(script, a.value, D.DISTRIBUTED_SAMPLER)
        for a in script.assigns.get(split.scope, [])
    )


def _per_epoch(ctx: Context, split: SplitLoaders, train: str, train_sampler: str | None, reduce: bool = True) -> None:
    """`set_epoch` every epoch, and (`reduce`) the sums of the shared loop added up over ranks after it."""
    edits = ctx.edits
    reduced = None  # a loop whose sums are all-reduced
    for epoch in split.epoch_loops:
        visible = epoch.scope is split.scope and train_sampler is not None
        set_epoch(ctx, epoch.loop, train_sampler if visible else f"{epoch.loader_expr}[{split.keys[train]}].sampler")
        if epoch.inner is None or not reduce:
            continue
        if _divides_by_batches(ctx, epoch.inner, epoch.loader_expr):
            edits.todo(
                epoch.inner,
                epoch.inner,
                "the metrics of this loop divide by this rank's batch count: sum them and their counts over ranks (dist.all_reduce) before reporting",
            )
        elif reduce_after(ctx, epoch.inner):
            reduced = epoch.inner
    if reduced:
        define_helper(ctx, reduced)


def _dataset(ctx: Context, call: cst.Call, key_var: str | None, key: str) -> str | None:
    """The loader's dataset for one split (`image_datasets[x]` -> `image_datasets["val"]`), when
    it is a name or an item of one (safe to name twice); None when it is built inline."""
    args = N.positional(call)
    arg = args[0] if args else N.keyword(call, "dataset")
    if arg is None:
        return None
    value = arg.value
    if key_var is not None and N.is_name(N.sole_index(value), key_var):
        value = value.with_changes(slice=[cst.SubscriptElement(cst.Index(cst.parse_expression(key)))])
    named = (cst.Name, cst.Attribute)
    if not (isinstance(value, named) or (isinstance(value, cst.Subscript) and isinstance(value.value, named))):
        return None
    if key_var is not None and key_var in names_in(value):
        return None
    return ctx.script.module.code_for_node(value)


def _for_split(ctx: Context, value: cst.BaseExpression, key_var: str | None, key: str) -> str:
    """A comprehension's per-split value for one split: `shuffle=(x == "train")` reads the split's
    key where the comprehension variable stood (the sampler is made outside the comprehension)."""
    if key_var is not None:
        value = value.visit(_Substitute(key_var, cst.parse_expression(key)))
    return ctx.script.module.code_for_node(value)


class _Substitute(cst.CSTTransformer):
    """Every Name `name` replaced by a copy of the expression `new`."""

    def __init__(self, name: str, new: cst.BaseExpression) -> None:
        super().__init__()
        self.name, self.new = name, new

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.BaseExpression:
        return self.new.deep_clone() if updated_node.value == self.name else updated_node


def _named_loader(ctx: Context, call: cst.Call) -> Loader | None:
    """The `name = DataLoader(...)` statement the call is, if it is one."""
    script = ctx.script
    assign = script.parent(call)
    line = script.parent(assign)
    if isinstance(assign, cst.Assign) and ref_of(assign.targets[0].target) and isinstance(line, cst.SimpleStatementLine):
        return Loader(ref_of(assign.targets[0].target), call, line, script.scope_of(call))
    return None


def _hoist_dataset(ctx: Context, split: SplitLoaders, call: cst.Call, key: str) -> str | None:
    """A split's dataset built inline in a dict literal, bound to a name above the dict (the
    sampler and the loader both read it)."""
    args = N.positional(call)
    arg = args[0] if args else N.keyword(call, "dataset")
    if arg is None or not key.isidentifier():
        return None
    name = _free_name(ctx, split, f"{key}_dataset")
    ctx.edits.insert_before(split.stmt, f"{name} = {ctx.script.module.code_for_node(arg.value)}\n")
    ctx.edits.replace(arg.value, ctx.edits.expression(name))
    return name


def _free_name(ctx: Context, split: SplitLoaders, name: str) -> str:
    """`name`, unless the loaders' scope already binds it."""
    taken = ctx.script.bound.get(split.scope, set())
    return name if name not in taken else f"{split.name}_{name}"


def _set_sampler(ctx: Context, call: cst.Call, code: str) -> None:
    """`shuffle=...` becomes `sampler=...` (a sampler excludes shuffle), or the sampler is added."""
    edits = ctx.edits
    shuffle = N.keyword(call, "shuffle")
    if shuffle is not None:
        edits.rewrite(shuffle, lambda updated: updated.with_changes(keyword=cst.Name("sampler"), value=edits.expression(code)))
    else:
        edits.rewrite(call, lambda updated: append_arg(updated, keyword_arg("sampler", edits.expression(code))))


def _divides_by_batches(ctx: Context, loop: cst.For, loaders: str) -> bool:
    """Does the code after the pass divide by `len(loaders[phase])` or a batch index? Those
    count this rank's batches only, so sums over ranks would be divided wrongly."""
    script = ctx.script
    scope = script.scope_of(loop)
    lengths = [N.len_arg(c) for c in script.calls_in(script.body_of(scope)) if script.after(c, loop)]
    per_batch = any(isinstance(x, cst.Subscript) and N.is_name(x.value, loaders) for x in lengths)  # `len(loaders[phase])`
    return per_batch or per_rank_denominator(ctx, loop)
