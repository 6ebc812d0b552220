"""Give each training DataLoader a DistributedSampler and call `set_epoch` every epoch.

The sampler takes the loader's shuffle (a `shuffle=` argument, a `**kwargs` dict that may
hold one, or a RandomSampler/SequentialSampler it replaces); the loader keeps its batch
size, `drop_last` and workers. Evaluation loaders are left alone.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.script import Loader, PassStart, ref_of
from ddpify.check.fix import remove_arg
from ddpify.convert.context import RANK0, Context
from ddpify.convert.edits import append_arg, keyword_arg
from ddpify.convert.held_samplers import HELD, advance_in_wrapper, assignments, bound_calls, chains, endless, is_rank_part, rank_part
from ddpify.convert.samplers import BEFORE_INIT, loader_dataset, next_epoch, sampler_name, set_epoch, split_batch

SAMPLER = "{sampler} = DistributedSampler({dataset}, shuffle={shuffle}{extra})\n"
# A factory that makes the training loader and evaluation ones (`shuffle=False`) alike.
SAMPLER_IF_SHUFFLED = "{sampler} = DistributedSampler({dataset}, shuffle=True{extra}) if {shuffle} else None\n"
SPLIT_IF_SHUFFLED = (
    "this factory makes the training loader and others: the loaders it makes that shuffle are split between the "
    "ranks, those that do not (evaluation) read all of the data on every rank"
)
# Before the process group exists the sampler reads its place from torchrun's environment.


def _evaluation_sampler(call: cst.Call) -> bool:
    """Is the loader's sampler named for evaluation (`sampler=self.valid_sampler`)?"""
    arg = N.keyword(call, "sampler")
    name = (ref_of(arg.value) or "").lower() if arg is not None else ""
    return any(word in name for word in ("valid", "val_", "test", "eval"))


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    for call in script.unplaced_loaders:
        if _evaluation_sampler(call):
            continue  # `return DataLoader(sampler=self.valid_sampler, ...)`: a validation split, whole on every rank
        if _sharded(ctx, Loader("loader", call, script.statement_line(call), script.scope_of(call))):
            continue  # sharded already (`sampler=DistributedSampler(ds, shuffle=True) if shuffle else None`)
        if not script.train_loaders and ctx.ran("train_loader", call) and _sample_in_place(ctx, call):
            continue
        if _endless_sampler(ctx, call) and _held_in_place(ctx, Loader("loader", call, script.statement_line(call), script.scope_of(call))):
            continue  # `iter(DataLoader(ds, sampler=Endless(ds)))`: a stream nothing evaluates over
        stmt = script.top_statement(call, script.scope_of(call)) or script.statement_line(call)
        edits.todo(stmt, call, "give the training DataLoader built here a DistributedSampler and call its set_epoch(epoch) every epoch")
    from_run = [] if script.train_loaders else [loader for loader in script.loaders if ctx.ran("train_loader", loader.stmt)]
    if script.loaders and not script.train_loaders and not from_run and not any(_sharded(ctx, l) for l in script.loaders):
        first = script.loaders[0]
        edits.todo(first.stmt, first.stmt, "could not tell which DataLoader trains: give it a DistributedSampler and call set_epoch(epoch) every epoch")
    for loader in from_run:  # `convert --run` saw it feed the optimizer steps: where its passes begin, too
        script.epoch_loops[loader.name], script.pass_starts[loader.name] = [], _pass_starts_in_run(ctx)
    started: set[cst.CSTNode] = set()
    for loader in script.train_loaders or from_run:
        if _iterable(ctx, loader):
            edits.todo(
                loader.stmt,
                loader.stmt,
                f"`{loader.name}` streams an IterableDataset: give each rank its own part of the stream in "
                "__iter__ (e.g. itertools.islice(stream, dist.get_rank(), None, dist.get_world_size()))",
            )
            continue
        sampler = _existing_sampler(ctx, loader)
        if sampler is None:
            sampler = _fresh(ctx, sampler_name(loader.name), loader.name)
            dataset = loader_dataset(ctx, loader, sampler)
            shuffle = _take_shuffle(ctx, loader, sampler)
            if shuffle is None:
                continue
            extra = "" if ctx.rank0_condition(loader.stmt) == RANK0 else BEFORE_INIT
            made = SAMPLER_IF_SHUFFLED if loader.shuffle_picks else SAMPLER
            edits.insert_before(loader.stmt, made.format(sampler=sampler, dataset=dataset, shuffle=shuffle, extra=extra))
            if loader.shuffle_picks:
                edits.change(loader.stmt, SPLIT_IF_SHUFFLED)
        elif not sampler or sampler == HELD:
            continue
        edits.need_import(N.SAMPLER_MODULE, "DistributedSampler")
        edits.change(loader.stmt, f"`{loader.name}` reads this process's shard through `{sampler}`")
        if ctx.options.global_batch:
            split_batch(ctx, loader)
        for epoch in script.epoch_loops[loader.name]:
            if epoch.loop in started:
                continue  # one helper trains twice (`train_model(model_ft, ...)`, then `train_model(model_conv, ...)`)
            started.add(epoch.loop)
            set_epoch(ctx, epoch.loop, _sampler_in(ctx, epoch.scope, loader, sampler, epoch.loader_expr))
        for start in script.pass_starts[loader.name]:
            if start.stmt in started:
                continue  # one helper trains several loaders: `loader.sampler` serves them all
            started.add(start.stmt)
            shared = loader in from_run or _serves_other_loaders(ctx, start)
            next_epoch(ctx, start.stmt, _sampler_in(ctx, start.scope, loader, sampler, start.loader_expr), shared=shared)
            if not start.restarts:
                edits.todo(
                    start.stmt,
                    start.stmt,
                    f"each rank now holds 1/world_size of `{start.loader_expr}`'s batches: draw at most "
                    f"len({start.loader_expr}) batches from this iterator, or make it again on StopIteration",
                )


def _fresh(ctx: Context, name: str, loader: str) -> str:
    """The sampler's name, unless the program binds it already (`sampler = Sampler(model)` of its
    own): then one it does not bind."""
    taken = set().union(*ctx.script.bound.values()) | {ref_of(a.targets[0].target) for v in ctx.script.assigns.values() for a in v}
    if name not in taken:
        return name
    prefix = name.rpartition(".")[0] + "." if "." in name else ""
    base = loader.rpartition(".")[2]
    for candidate in (f"{prefix}{base}_sampler", f"{prefix}distributed_sampler"):
        if candidate not in taken:
            return candidate
    return next(f"{name}_{i}" for i in range(2, 100) if f"{name}_{i}" not in taken)


def _serves_other_loaders(ctx: Context, start: PassStart) -> bool:
    """Is the pass start in a function the script calls from more than one place (a generator
    that cycles the training and the validation loader alike), or in a method of a class it makes
    more than one object of?"""
    fn, script = start.scope, ctx.script
    if not isinstance(fn, cst.FunctionDef):
        return False
    cls = script.class_of(fn)
    if cls is not None and sum(script.class_called(c) is cls for c in script.calls) > 1:
        return True  # a method of a class the script makes several of (a prefetcher per loader)
    return sum(script.local_function(c) is fn for c in script.calls) > 1


def _sample_in_place(ctx: Context, call: cst.Call) -> bool:
    """`return DataLoader(dataset, shuffle=shuffle, ...)` that `convert --run` saw train: the
    sampler is made in the call (`sampler=DistributedSampler(dataset, shuffle=shuffle)`), and
    set_epoch goes where the run began each pass, through the loader's `.sampler`."""
    script, edits = ctx.script, ctx.edits
    args = N.positional(call)
    data = args[0] if args else N.keyword(call, "dataset")
    stmt = script.statement_line(call)
    if data is None or stmt is None:
        return False
    if N.keyword(call, "sampler") or N.keyword(call, "batch_sampler"):
        return _held_in_place(ctx, Loader("loader", call, stmt, script.scope_of(call)))
    shuffle = N.keyword(call, "shuffle")
    if N.keyword(call, "batch_sampler") or shuffle is None and any(a.star for a in call.args):
        return False  # a `**kwargs` that may hold the shuffle: the TODO says what to do
    extra = "" if ctx.rank0_condition(stmt) == RANK0 else BEFORE_INIT
    code = script.root_of(call).code_for_node
    loader = Loader("loader", call, stmt, script.scope_of(call))
    dataset = loader_dataset(ctx, loader, _fresh(ctx, "train_sampler", "loader"))  # named first where it is made inline
    if shuffle is not None and not (isinstance(shuffle.value, cst.Name) and shuffle.value.value in ("True", "False")):
        # The factory makes evaluation loaders too, which do not shuffle: only the shuffled ones are split.
        sampler = f"DistributedSampler({dataset}, shuffle=True{extra}) if {code(shuffle.value)} else None"
        said = SPLIT_IF_SHUFFLED
    else:
        sampler = f"DistributedSampler({dataset}, shuffle={code(shuffle.value) if shuffle else 'False'}{extra})"
        said = "the DataLoader made here (the run saw it train) reads this process's shard through its own DistributedSampler"
    _take_shuffle(ctx, loader, sampler)
    edits.need_import(N.SAMPLER_MODULE, "DistributedSampler")
    edits.change(call, said)
    for start in _pass_starts_in_run(ctx):
        next_epoch(ctx, start.stmt, f"{start.loader_expr}.sampler", shared=True)
    return True


def _endless_sampler(ctx: Context, call: cst.Call) -> bool:
    """Does the loader draw from a sampler of the project's that never ends?"""
    arg = N.keyword(call, "batch_sampler") or N.keyword(call, "sampler")
    if arg is None or ctx.script.statement_line(call) is None:
        return False
    loader = Loader("loader", call, ctx.script.statement_line(call), ctx.script.scope_of(call))
    return endless(ctx, chains(ctx, arg.value, loader))


def _held_in_place(ctx: Context, loader: Loader) -> bool:
    """`iter(DataLoader(ds, batch_sampler=Forever(BatchSampler(RandomSampler(ds), 8))))` that
    `convert --run` saw train: its sampler is sharded where it is made (a TODO where it cannot
    be), and a pass the run began over the loader reshuffles it."""
    sampler = _existing_sampler(ctx, loader)
    if sampler and sampler != HELD:
        ctx.edits.need_import(N.SAMPLER_MODULE, "DistributedSampler")
        ctx.edits.change(loader.stmt, f"the DataLoader made here (the run saw it train) reads this process's shard through `{sampler}`")
        held = ".batch_sampler.sampler" if N.keyword(loader.call, "batch_sampler") else ".sampler"
        for start in _pass_starts_in_run(ctx):
            next_epoch(ctx, start.stmt, f"{start.loader_expr}{held}", shared=True)
    return True


def _sharded(ctx: Context, loader: Loader) -> bool:
    """Does the loader read through a DistributedSampler already (one `convert --run` gave it, or
    one a sampler of the project's holds), or this rank's part of its dataset?"""
    arg = N.keyword(loader.call, "batch_sampler") or N.keyword(loader.call, "sampler")
    found = chains(ctx, arg.value, loader) if arg is not None else []
    if any(c.base is not None and ctx.script.is_call_to(c.base, D.DISTRIBUTED_SAMPLER) for c in found):
        return True
    return any(c.own is not None for c in found) and is_rank_part(ctx, loader)

def _pass_starts_in_run(ctx: Context) -> list[PassStart]:
    """Where the run began each pass over the training loader: a `for` over it, or `iter(...)`
    of it (the loader as that code names it: `self.data_loader`)."""
    script, found = ctx.script, []
    for module in script.index.roots:
        lines = ctx.run_sites("pass_start", module)
        if not lines:
            continue
        for loop in script.nodes_of(cst.For):
            if script.root_of(loop) is module and script.line(loop) in lines and _iterated(loop.iter):
                found.append(PassStart(loop, script.scope_of(loop), _iterated(loop.iter)))
        for call in script.calls:
            if N.is_name(call.func, "iter") and call.args and ref_of(call.args[0].value) and script.root_of(call) is module:
                stmt = script.statement_line(call)
                if stmt is not None and script.line(stmt) in lines:
                    found.append(PassStart(stmt, script.scope_of(call), ref_of(call.args[0].value)))
    return found


def _iterated(expr: cst.BaseExpression) -> str | None:
    """The loader a `for` reads, through wrappers that take it first: `enumerate(tqdm(loader))`."""
    while isinstance(expr, cst.Call) and expr.args and not expr.args[0].keyword:
        expr = expr.args[0].value
    return ref_of(expr)


def _iterable(ctx: Context, loader: Loader) -> bool:
    """Is the loader's dataset one of the script's IterableDataset classes?"""
    script = ctx.script
    args = N.positional(loader.call)
    arg = args[0] if args else N.keyword(loader.call, "dataset")
    if arg is None or not script.iterable_datasets:
        return False
    value = arg.value
    if ref_of(value) is not None:
        bound = [a.value for a in script.assigns.get(loader.scope, []) if ref_of(a.targets[0].target) == ref_of(value)]
        value = bound[-1] if bound else value
    return isinstance(value, cst.Call) and N.call_name(value) in script.iterable_datasets


def _existing_sampler(ctx: Context, loader: Loader) -> str | None:
    """Turn the RandomSampler/SequentialSampler the loader already draws from (directly, inside a
    BatchSampler, or held by the project's own sampler classes) into a DistributedSampler.
    Returns the sampler's name, "" when a TODO was left instead, HELD when the samplers that hold
    it start each new pass themselves, or None when the loader has no sampler of its own."""
    script, edits = ctx.script, ctx.edits
    call = loader.call
    batch = N.keyword(call, "batch_sampler")
    arg = batch if batch is not None else N.keyword(call, "sampler")
    if arg is None or N.is_name(arg.value, "None"):
        return None  # `sampler=None` is no sampler: _take_shuffle puts the new one there
    inner = arg.value
    if batch is None and _fill_placeholder(ctx, loader, inner):
        return ref_of(inner)
    # Every sampler the loader may get: one per branch (`if args.shuffle: sampler = RandomSampler(ds)
    # else: sampler = SequentialSampler(ds)`, or `A if cond else B`); each branch is sharded.
    found = chains(ctx, inner, loader)
    lost = ref_of(inner)
    if not found and lost is not None and not script.names(inner) and not any(lost in b for b in script.bound.values()):
        # `sampler=train_sampler` with no `train_sampler` left (a partly converted script)
        edits.todo(loader.stmt, call, f"`{lost}` is not defined: make it `DistributedSampler(<dataset>, shuffle=...)` above this loader")
        return lost
    owns = [c.own for c in found if c.own is not None]
    if len(found) == 1 and owns and rank_part(ctx, loader, owns[0]):
        return HELD
    if not found or not any(c.base is not None for c in found) or owns:
        edits.todo(loader.stmt, call, f"`{loader.name}` has a custom sampler: shard it by rank before training on several processes")
        return ""
    for chain in found:
        if chain.base is None:
            where = chain.other if chain.other is not None else call
            edits.todo(script.statement_line(where) or loader.stmt, where, "this sampler is not split between the ranks: shard it by rank")
        elif not script.is_call_to(chain.base, D.DISTRIBUTED_SAMPLER):
            source = N.positional(chain.base) or [N.keyword(chain.base, "data_source")]
            dataset = script.root_of(chain.base).code_for_node(source[0].value)
            shuffle = "True" if script.is_call_to(chain.base, N.RANDOM_SAMPLER) else "False"
            made = script.statement_line(chain.base) or loader.stmt
            extra = "" if ctx.rank0_condition(made) == RANK0 else BEFORE_INIT  # made before the group exists
            edits.replace(chain.base, edits.expression(f"DistributedSampler({dataset}, shuffle={shuffle}{extra})"))
    wrappers = list(dict.fromkeys(w for c in found for w in c.wrappers))
    if wrappers:
        edits.need_import(N.SAMPLER_MODULE, "DistributedSampler")
        if not all(advance_in_wrapper(ctx, w) for w in wrappers):
            edits.todo(loader.stmt, call, f"call set_epoch on the DistributedSampler that `{loader.name}`'s sampler holds at each new pass")
        return HELD
    bases = [c.base for c in found if c.base is not None]
    assign = script.parent(bases[0]) if len(bases) == 1 else None
    if batch is not None and isinstance(assign, cst.Assign) and ref_of(assign.targets[0].target):
        return ref_of(assign.targets[0].target)  # `sampler = RandomSampler(ds)`, then `BatchSampler(sampler, 8)`
    if batch is None and ref_of(inner) is not None:
        return ref_of(inner)
    return f"{loader.name}.batch_sampler.sampler" if batch is not None else f"{loader.name}.sampler"


def _fill_placeholder(ctx: Context, loader: Loader, inner: cst.BaseExpression) -> bool:
    """`train_sampler = None` ... `DataLoader(ds, shuffle=(train_sampler is None), sampler=train_sampler)`:
    a slot for a sampler the script never fills (the loader shuffles itself). The `None` becomes
    `DistributedSampler(ds, shuffle=...)` with the loader's shuffle, whose test then reads False.
    True when done; False (nothing edited) for any other sampler, a shuffle it cannot carry over,
    or a dataset bound after the placeholder."""
    script, ref = ctx.script, ref_of(inner)
    if ref is None:
        return False
    bindings = assignments(ctx, ref, loader)
    if not bindings or not all(N.is_name(a.value, "None") for a in bindings):
        return False
    shuffle_arg = N.keyword(loader.call, "shuffle")
    if shuffle_arg is None or N.is_name(shuffle_arg.value, "False"):
        shuffle = "False"
    elif _is_none_test(shuffle_arg.value, ref):
        shuffle = "True"
    else:
        return False
    args = N.positional(loader.call)
    dataset = args[0] if args else N.keyword(loader.call, "dataset")
    data = ref_of(dataset.value) if dataset is not None else None
    if data is None:
        return False
    first = min(script.line(a) for a in bindings)
    if any(script.line(a) > first for a in assignments(ctx, data, loader)):
        return False
    for assign in bindings:
        extra = "" if ctx.rank0_condition(assign) == RANK0 else BEFORE_INIT  # made before the group exists
        ctx.edits.replace(assign.value, ctx.edits.expression(f"DistributedSampler({data}, shuffle={shuffle}{extra})"))
        if extra:
            ctx.edits.need_import("os")
    return True


def _is_none_test(node: cst.BaseExpression, ref: str) -> bool:
    """`ref is None` (in parentheses or not)."""
    return (
        isinstance(node, cst.Comparison)
        and ref_of(node.left) == ref
        and len(node.comparisons) == 1
        and isinstance(node.comparisons[0].operator, cst.Is)
        and N.is_name(node.comparisons[0].comparator, "None")
    )


def _take_shuffle(ctx: Context, loader: Loader, sampler: str) -> str | None:
    """Move the loader's shuffle into the sampler: return it as code and rewrite the call (the
    sampler takes the place of a `sampler=None`, else of `shuffle=`, else comes last)."""
    script, edits = ctx.script, ctx.edits
    call = loader.call
    sampler_arg = keyword_arg("sampler", edits.expression(sampler))
    shuffle_arg = N.keyword(call, "shuffle")
    slot = N.keyword(call, "sampler")
    if slot is not None:
        edits.replace(slot.value, edits.expression(sampler))
    if shuffle_arg is not None:
        if slot is not None:
            edits.rewrite(call, lambda updated: remove_arg(updated, N.keyword(updated, "shuffle")))
        else:
            edits.rewrite(
                shuffle_arg, lambda updated: updated.with_changes(keyword=cst.Name("sampler"), value=edits.expression(sampler))
            )
        return script.module.code_for_node(shuffle_arg.value)
    star = next((a for a in call.args if a.star == "**"), None)
    if star is not None:
        # The kwargs dict may carry a shuffle (e.g. `cuda_kwargs = {"shuffle": True}`): the
        # sampler takes it and the loader gets the dict without it.
        kwargs = script.module.code_for_node(star.value)
        edits.replace(star.value, edits.expression(f'{{**{kwargs}, "shuffle": False}}'))
        if slot is None:
            edits.rewrite(call, lambda updated: append_arg(updated, sampler_arg))
        return f'{kwargs}.get("shuffle", False)'
    if slot is None:
        edits.rewrite(call, lambda updated: append_arg(updated, sampler_arg))
    return "False"


def _sampler_in(ctx: Context, scope, loader: Loader, sampler: str, loader_expr: str) -> str:
    """The sampler as `scope` can name it: its own name where visible (a global of the same
    module, or an attribute of the same class's object), else `<loader>.sampler`
    (`self.data.train_loader.sampler` where another class's object holds the loader)."""
    script = ctx.script
    generator = isinstance(scope, cst.FunctionDef) and scope is not loader.scope and script.nodes_in(scope, cst.Yield)
    if generator and loader_expr in {p.name.value for p in scope.params.params}:
        return f"{loader_expr}.sampler"  # `def endless(loader)`: whichever loader it is handed
    module_global = isinstance(loader.scope, cst.Module) and script.root_of(scope) is loader.scope
    same_object = sampler.startswith("self.") and script.class_of(scope) is script.class_of(loader.scope)
    visible = scope is loader.scope or same_object or module_global
    return sampler if visible else f"{loader_expr}.sampler"










