"""Shard the batches a script cuts by hand from a tensor, without a DataLoader.

* Plain sequential indexing, as in pytorch/examples' word language model:
  `for i in range(0, train_data.size(0) - 1, bptt): data, targets = get_batch(train_data, i)`
  over a tensor the script binds (`train_data = batchify(corpus.train, batch_size)`): each rank
  keeps its own contiguous block of the tensor's rows (or a list's items), every block the same
  length, so every process takes the same number of steps.
* Random batches, as in nanoGPT: `torch.randint(len(data) - block_size, (batch_size,))` in the
  training loop or a helper it calls. Each process draws its own batches: torch is re-seeded
  with its seed + rank right before training, so data and weights made before (after the
  script's own seed) are still the same on every rank. A script that never seeds torch starts
  each process from its own seed: tensors it draws at random before training (a regression
  target) are replaced by rank 0's (`dist.broadcast_object_list`).
* Batches, episodes or environment steps drawn where the static view cannot follow (a replay
  buffer's `random.sample` in another module, `env.step`), known from `convert --run`: the run
  took its steps without a DataLoader, on inputs that changed from step to step. Every rank
  would replay one run, so torch is re-seeded with its seed + rank once the models are wrapped
  (they start alike: DDP sends rank 0's weights), and the numpy, random and environment seeds
  the script sets are offset by the rank.
* Full-batch training (each step on all the data, e.g. a GCN over one graph): left replicated,
  which is correct (every rank computes the same gradient), and said so in the summary.
* Anything else (custom indexing): a TODO says what to do.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes, names_in
from ddpify.analysis.script import ScopeNode, ref_of
from ddpify.convert.context import Context
from ddpify.convert.reseed import offset_by_rank, seed_after_wrap

TODO = (
    "the data is not read through a DataLoader, so every process trains on all of it: give each "
    "rank its own slice (e.g. indices[dist.get_rank()::dist.get_world_size()]) with equal step "
    "counts, or keep full-batch training replicated"
)
SHARD_ROWS = (
    "{rows} = len({data}) // {world}  # the same number of steps on every process\n"
    "{data} = {data}[{rank} * {rows} : ({rank} + 1) * {rows}]\n"
)
SHARD_COLUMNS = (
    "{cols} = {data}.size(1) // {world}  # the same number of steps on every process\n"
    "{data} = {data}[:, {rank} * {cols} : ({rank} + 1) * {cols}]\n"
)
FULL_BATCH = (
    "full-batch training: every process takes the same step on all the data (DDP averages identical "
    "gradients), which is correct but no faster with more processes"
)
GLOBAL_BATCH = (
    "--global-batch: this script cuts its own batches, so divide its batch size by "
    "dist.get_world_size() where it is set"
)
SHARE_RANDOM_DATA = (
    "_shared = {listed}\n"
    "dist.broadcast_object_list(_shared, src=0)  # made at random without a seed: use rank 0's on every rank\n"
    "{listed} = _shared\n"
)
SEED_BEFORE_TRAINING = "torch.manual_seed(torch.initial_seed() + {rank})  # each process draws its own batches\n"


def run(ctx: Context) -> None:
    script = ctx.script
    if script.loaders or script.unplaced_loaders or script.split_loaders:
        return
    backward = next((c for c in script.calls if N.call_name(c) == "backward" and N.receiver(c) is not None), None)
    if backward is None:
        return
    scope = script.scope_of(backward)
    loop = script.enclosing_loop(backward, scope)
    if loop is not None:
        if _shard_rows(ctx, loop, scope):
            _global_batch_todo(ctx, loop)
            return
        if _random_draws(ctx, loop):
            _seed_by_rank(ctx, loop)
            _global_batch_todo(ctx, loop)
            return
    stmt = loop or script.statement_line(backward)
    if loop is None and _drawn_by_helpers(ctx, scope) and seed_after_wrap(ctx, DRAWN_BY_HELPERS):
        return
    if _full_batch(ctx, loop, scope):
        run = ctx.options.run
        drawn_in_run = run is not None and run.loaderless and run.drawn  # the run says otherwise: a new batch each step
        if drawn_in_run or _drawn_by_objects(ctx, loop or scope):
            if not seed_after_wrap(ctx, DRAWN_IN_RUN if drawn_in_run else DRAWN_BY_OBJECTS):
                ctx.edits.todo(stmt, stmt, DRAWN_TODO)
            return
        ctx.edits.note(stmt, FULL_BATCH)  # nothing changes: a note
        return
    ctx.edits.todo(stmt, stmt, TODO)


def _global_batch_todo(ctx: Context, loop: cst.For) -> None:
    """--global-batch divides DataLoader batch sizes; hand-made batches are the script's own."""
    if ctx.options.global_batch:
        ctx.edits.todo(loop, loop, GLOBAL_BATCH)


def _full_batch(ctx: Context, loop: cst.For | None, scope: ScopeNode) -> bool:
    """Each step trains on all the data: the loop around backward (or around the calls of the
    function holding it) picks nothing with its variable: no `x[i]`, no `next(...)`, no random
    draw, nothing handed to a helper."""
    script = ctx.script
    if loop is not None:
        return _picks_nothing(ctx, loop, loop.body)
    if not isinstance(scope, cst.FunctionDef):
        return True
    if _indexes_with(scope.body, {p.name.value for p in scope.params.params}):
        return False  # `def train(i): x = data[i]`
    return all(_picks_nothing(ctx, outer, outer.body, skip=scope) for outer in _driving_loops(ctx, scope))


def _driving_loops(ctx: Context, scope: ScopeNode) -> list[cst.For]:
    """The loops that call the function holding backward: as a function (`train(i)`), or as the
    forward or a method of an object of its class (`learner(*draw())`, `learner.step(x)`)."""
    script = ctx.script
    cls = script.class_of(scope)
    owners = {name for name, kind in script.objects().items() if kind is cls} if cls is not None else set()
    found = []
    for call in script.calls:
        by_object = isinstance(call.func, cst.Name) and call.func.value in owners
        by_method = isinstance(call.func, cst.Attribute) and ref_of(call.func.value) in owners
        if script.local_function(call) is scope or by_object or by_method:
            outer = script.enclosing_loop(call, script.scope_of(call))
            if isinstance(outer, cst.For):
                found.append(outer)
    return found


def _drawn_by_helpers(ctx: Context, scope: ScopeNode) -> bool:
    """Does a loop that drives the training call a helper of the script that draws at random
    (`learner(*draw())`, `draw()` picking classes and shots with `np.random.choice`)?"""
    script = ctx.script
    for loop in _driving_loops(ctx, scope):
        helpers = [fn for c in script.calls_in(loop.body) if (fn := script.local_function(c)) not in (None, scope)]
        if any(_draws(script, c) for fn in helpers for c in script.calls_in(fn)):
            return True
    return False


def _picks_nothing(ctx: Context, loop: cst.For, body: cst.CSTNode, skip: cst.FunctionDef | None = None) -> bool:
    script = ctx.script
    targets = names_in(loop.target)
    if _indexes_with(body, targets) or any(N.is_call_of(n, "next") or _dunder_next(n) for n in iter_nodes(body)):
        return False  # `next(batches)`, `batches.__next__()`: a batch drawn each step
    calls = script.calls_in(body)
    if any(script.is_call_to(c, N.RANDOM_DRAWS) for c in calls):
        return False
    if not N.is_call_of(loop.iter, "range"):
        return False  # `for x, y in batches`: the loop itself hands out data
    helpers = [c for c in calls if script.local_function(c) not in (None, skip)]
    if any(_draws(script, c) for h in helpers for c in script.calls_in(script.local_function(h))):
        return False  # `draw()`: a helper that draws the batch at random
    return not any(names_in(arg) & targets for call in helpers for arg in call.args)


def _dunder_next(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "__next__"


def _indexes_with(node: cst.CSTNode, names: set[str]) -> bool:
    """Does `node` index anything with one of these names (`x[i]`, `x[i : i + n]`)?"""
    return any(isinstance(n, cst.SubscriptElement) and names_in(n.slice) & names for n in iter_nodes(node))


def _shard_rows(ctx: Context, loop: cst.For, scope: ScopeNode) -> bool:
    """`for i in range(0, data.size(0) - 1, step)`: give each rank a block of `data`'s rows."""
    script, edits = ctx.script, ctx.edits
    steps = loop.iter
    if N.is_call_of(steps, "enumerate") and steps.args:
        steps = steps.args[0].value
    if not N.is_call_of(steps, "range"):
        return False
    names = {N.length_of(node) for node in iter_nodes(steps)} - {None}  # `x.size(0)`, `len(x)`, `x.shape[0]`
    columns = {_columns_of(node) for node in iter_nodes(steps)} - {None}  # `x.size(1)`: time steps of (batch, time)
    if len(names) + len(columns) != 1:
        return False
    by_columns, data = bool(columns), next(iter(names or columns))
    bound = _last_binding(ctx, data, scope, loop)
    if bound is None:
        return False
    if D.reads_rank(script, bound):
        return True  # `data = data[rank * rows : (rank + 1) * rows]` already
    rank, world = ctx.rank_and_world(bound)
    taken = set().union(*script.bound.values())
    if by_columns:  # `inputs = data[:, i : i + steps]`: each rank walks its own stretch of every row
        cols = next(n for n in ("steps_per_rank", f"{data}_steps_per_rank", f"_{data}_steps") if n not in taken)
        edits.insert_after(bound, SHARD_COLUMNS.format(cols=cols, data=data, rank=rank, world=world))
        edits.change(bound, f"`{data}`'s columns are cut into one stretch per rank, all the same length (the remainder is dropped)")
        return True
    rows = next(n for n in ("rows_per_rank", f"{data}_rows_per_rank", f"_{data}_rows") if n not in taken)
    edits.insert_after(bound, SHARD_ROWS.format(rows=rows, data=data, rank=rank, world=world))
    edits.change(
        bound,
        f"`{data}` is cut into one block per rank, all the same length (the remainder is dropped)",
    )
    return True


def _columns_of(node: cst.CSTNode) -> str | None:
    """The name `x` whose second dimension `x.size(1)` or `x.shape[1]` reads; else None."""
    if isinstance(node, cst.Call) and N.is_method_call(node, "size") and len(node.args) == 1:
        x = N.receiver(node) if isinstance(node.args[0].value, cst.Integer) and node.args[0].value.value == "1" else None
    elif isinstance(node, cst.Subscript) and isinstance(node.value, cst.Attribute) and node.value.attr.value == "shape":
        index = N.sole_index(node)
        x = node.value.value if isinstance(index, cst.Integer) and index.value == "1" else None
    else:
        return None
    return x.value if isinstance(x, cst.Name) else None


def _last_binding(ctx: Context, name: str, scope: ScopeNode, loop: cst.For) -> cst.SimpleStatementLine | None:
    """The statement that last binds `name` (a plain `name = ...`) before the loop runs: in the
    loop's own function, or at module level for a global."""
    script = ctx.script
    if name in script.bound.get(scope, set()) and not isinstance(scope, cst.Module):
        where = scope
    else:
        where = script.module
    found = None
    for assign in script.assigns.get(where, []):
        if ref_of(assign.targets[0].target) == name and (where is not scope or script.before(assign, loop)):
            found = assign
    if found is None or any(
        isinstance(p, cst.Param) and p.name.value == name for p in getattr(scope, "params", cst.Parameters()).params
    ):
        return None
    stmt = script.parent(found)
    return stmt if isinstance(stmt, cst.SimpleStatementLine) else None


def _random_draws(ctx: Context, loop: cst.For) -> bool:
    """Does the loop (or a helper of the script it calls) draw indices at random?"""
    script = ctx.script
    calls = list(script.calls_in(loop))
    for call in list(calls):
        fn = script.local_function(call)
        if fn is not None:
            calls += script.calls_in(fn)
    return any(_draws(script, c) for c in calls) or bool(_generators_drawn(script, calls))


def _generators_drawn(script, calls: list[cst.Call]) -> list[cst.Call]:
    """The script's own generators (`rng = random.Random(0)`) whose methods the calls draw from
    (`rng.sample(memory, 32)`): the calls that make them."""
    made = {
        ref_of(a.targets[0].target): a.value for assigns in script.assigns.values() for a in assigns
        if isinstance(a.value, cst.Call) and script.is_call_to(a.value, N.GENERATOR_MAKERS)
    }  # fmt: skip
    used = {ref_of(c.func.value) for c in calls if isinstance(c.func, cst.Attribute)} & set(made)
    return [made[name] for name in sorted(used)]


def _draws(script, call: cst.Call) -> bool:
    """A random draw from the global generator (not a `generator=` of the script's own)."""
    return script.is_call_to(call, N.RANDOM_DRAWS) and N.keyword(call, "generator") is None


def _seed_by_rank(ctx: Context, loop: cst.For) -> None:
    """Each process draws its own batches: torch is re-seeded with its seed + rank just before the
    training starts (data and weights made earlier stay the same on every rank), and numpy's or
    random's seeds, if the script sets them, are offset by the rank."""
    script, edits = ctx.script, ctx.edits
    calls = list(script.calls_in(loop))
    calls += [c for call in list(calls) if (fn := script.local_function(call)) for c in script.calls_in(fn)]
    draws = {name.split(".")[0] for c in calls if _draws(script, c) for name in script.names(c.func) & N.RANDOM_DRAWS}
    seeded_by_rank = [c for c in script.calls if script.is_call_to(c, N.SEEDS) and D.reads_rank(script, c)]
    if "torch" in draws and not any(script.is_call_to(c, N.TORCH_SEED) for c in seeded_by_rank):
        start = _runs_once_before(ctx, loop)
        if start is None:
            edits.todo(loop, loop, "seed each process differently (torch.manual_seed(seed + rank)) so ranks draw different batches")
        else:
            rank = ctx.rank_and_world(start)[0]
            if shared := _made_at_random_unseeded(ctx, start):
                names = ", ".join(shared)
                edits.insert_before(start, SHARE_RANDOM_DATA.format(names=names, listed=f"[{names}]"))
                edits.change(start, f"{names}: made at random without a seed, rank 0's copy is used on every rank")
            edits.insert_before(start, SEED_BEFORE_TRAINING.format(rank=rank))
            edits.change(loop, "batches are drawn at random: torch is seeded with its seed + rank before training")
    for made in _generators_drawn(script, calls):
        if len(made.args) == 1 and not made.args[0].keyword and not D.reads_rank(script, made):
            offset_by_rank(ctx, made, "the generator's seed is offset by the rank: each process draws its own random batches")
    for call in script.calls:
        seeds_module = {name.split(".")[0] for name in script.names(call.func) & N.SEEDS} - {"torch"}
        if not seeds_module & draws or len(call.args) != 1 or call in seeded_by_rank:
            continue
        offset_by_rank(ctx, call, "the seed is offset by the rank: each process draws its own random batches")


DRAWN_TODO = (
    "the run drew a new batch each step without a DataLoader, and no model wrap was found to seed each process "
    "after: seed what draws the batches and episodes with seed + rank once the model is wrapped"
)
DRAWN_IN_RUN = (
    "the run drew a new batch each step without a DataLoader: torch is re-seeded with its seed + rank once the "
    "model is wrapped, so each process draws its own batches and episodes"
)


DRAWN_BY_HELPERS = (
    "each step draws its batch or episode through a helper that samples at random (`np.random.choice`): torch is "
    "re-seeded with its seed + rank once the model is wrapped, and the seeds the script sets are offset by the rank, "
    "so each process draws its own"
)
DRAWN_BY_OBJECTS = (
    "the training step draws its batch through an object's method that samples at random (a replay buffer's "
    "`sample`): torch is re-seeded with its seed + rank once the model is wrapped, so each process draws its own "
    "batches and episodes"
)


def _drawn_by_objects(ctx: Context, where: cst.CSTNode) -> bool:
    """Does `where` call a method (`memory.sample(n)`) that every class of the project defining a
    method of that name, models aside, implements with a random draw (`random.sample(self.buffer, n)`)?"""
    script = ctx.script
    methods: dict[str, list[cst.FunctionDef]] = {}
    for cls in script.index.classes:
        if script.optimizer_summaries.is_module(cls):
            continue  # a policy's own `sample` draws actions, not the data
        for name, fn in script.methods(cls).items():
            methods.setdefault(name, []).append(fn)
    for call in script.calls_in(where):
        func = call.func
        if not isinstance(func, cst.Attribute) or N.is_name(func.value, "self"):
            continue
        found = methods.get(func.attr.value, [])
        if found and all(any(_draws(script, c) for c in script.calls_in(fn)) for fn in found):
            return True
    return False


def _made_at_random_unseeded(ctx: Context, start: cst.CSTNode) -> list[str]:
    """Tensors the script draws at random before training, in the scope where training starts,
    when it never seeds torch: each process drew its own (torch seeds every process differently),
    so targets made this way (`W_target = torch.randn(4, 1)`) differ between ranks."""
    script = ctx.script
    if any(script.is_call_to(c, N.TORCH_SEED) for c in script.calls):
        return []
    scope = script.scope_of(start)
    found = []
    for assign in script.assigns.get(scope, []):
        name = ref_of(assign.targets[0].target)
        if (
            name and name not in found and name not in script.models and script.before(assign, start)
            and any(_draws(script, c) and "torch" in {q.split(".")[0] for q in script.names(c.func)} for c in script.calls_in(assign.value))
        ):  # fmt: skip
            found.append(name)
    return found


def _runs_once_before(ctx: Context, node: cst.CSTNode, depth: int = 0) -> cst.CSTNode | None:
    """The statement right before which code runs once, just before `node` does: the outermost
    loop around it in its function, or the function's call when it runs more than once."""
    script = ctx.script
    scope = script.scope_of(node)
    while (outer := script.enclosing_loop(node, scope)) is not None:
        node = outer
    if isinstance(scope, cst.Module) or _runs_once(ctx, scope):
        start = node if isinstance(node, cst.For) else script.statement_line(node)
        return _first_draw_before(ctx, start)
    callers = [c for c in script.calls if script.local_function(c) is scope]
    return _runs_once_before(ctx, callers[0], depth + 1) if len(callers) == 1 and depth < 5 else None


def _first_draw_before(ctx: Context, start: cst.CSTNode | None) -> cst.CSTNode | None:
    """nanoGPT draws its first batch just above the loop: start there (not above a seed call)."""
    script = ctx.script
    block = script.parent(start) if start is not None else None
    body = list(getattr(block, "body", ()))
    if start not in body:
        return start
    for stmt in reversed(body[: body.index(start)]):
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            continue  # defined here, run later
        calls = script.calls_in(stmt)
        if any(script.is_call_to(c, N.SEEDS) for c in calls):
            break
        helpers = [fn for c in calls if (fn := script.local_function(c))]
        if any(_draws(script, d) for fn in helpers for d in script.calls_in(fn)):
            start = stmt  # e.g. `X, Y = get_batch("train")`
    return start


def _runs_once(ctx: Context, fn: cst.FunctionDef, depth: int = 0) -> bool:
    """Is `fn` called from exactly one place, outside any loop, by code that runs once?"""
    script = ctx.script
    callers = [c for c in script.calls if script.local_function(c) is fn]
    if len(callers) != 1 or depth > 5:
        return False
    caller = script.scope_of(callers[0])
    if script.enclosing_loop(callers[0], caller) is not None:
        return False
    return isinstance(caller, cst.Module) or _runs_once(ctx, caller, depth + 1)
