import libcst as cst

from ddpify.check.context import dotted_name
from ddpify.check.rule import Invalid, Report, Rule

WRAPPERS = {"enumerate", "tqdm", "iter", "trange"}


class BatchesByHandOnEveryRank(Rule):
    """Hand-made batches that every rank takes from the whole data.

    ## What it does
    Flags the training loop of a DDP program when it cuts its batches by hand without the
    rank: `for i in range(0, n, batch_size):` that slices the data with `i` (`x[i:i + bs]`,
    `data[:, i:i + steps]`), or `for x, y in get_batches(...)` where `get_batches` is a
    generator of the program that yields slices of what it is handed. A range, a slice or an
    argument that reads the rank (`range(rank * bs, n, world * bs)`, `x[rank::world]`) is a
    split and is left alone, and so is cutting a batch a loader already gave this rank
    (`batch = next(data)`, `for batch in loader`, also through the callers' arguments): that is
    micro-batching.

    ## Why is this bad?
    No `DistributedSampler` is involved, so nothing splits the data: every rank walks all of
    it, an epoch costs N times the work of one process, and where the order is the same on
    every rank (no shuffle, or one seed) each step averages N copies of one batch.

    ## Example
    ```python
    for i in range(0, data.size(1) - steps, steps):
        x, y = data[:, i : i + steps], data[:, i + 1 : i + 1 + steps]
        loss = criterion(model(x), y)
    ```

    ## Use instead
    ```python
    for i in range(rank * steps, data.size(1) - steps, world_size * steps):  # this rank's stretches
        x, y = data[:, i : i + steps], data[:, i + 1 : i + 1 + steps]
        loss = criterion(model(x), y)
    ```

    ## Fix safety
    No automatic fix: every rank must still take the same number of steps.

    ## References
    - https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler
    """

    CODE = "DDP155"
    NAME = "batches-by-hand-on-every-rank"
    MESSAGE = (
        "{how}: every rank walks all of the data (the same batches where the order is the same on every rank); "
        "give each rank its own part (a stride by the rank, or a DistributedSampler)"
    )
    VALID = [
        "import torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
        "for i in range(rank * bs, n, world * bs):\n    model(x[i : i + bs]).sum().backward()\n",
        "import torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
        "for x, y in loader:\n    model(x).sum().backward()\n",
    ]
    INVALID = [
        Invalid(
            "import torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
            "for i in range(0, n, bs):\n    model(x[i : i + bs]).sum().backward()\n"
        ),
    ]

    def check(self, ctx):
        if not ctx.ddp_calls:
            return
        for loop in ctx.step_loops:
            if not isinstance(loop, cst.For) or ctx.in_rank0(loop) or ctx.index.root_of(loop) is not ctx.module:
                continue
            how = _strided_slices(ctx, loop) or _generator_slices(ctx, loop)
            if how:
                yield Report(loop.iter, self.MESSAGE.format(how=how))


def _strided_slices(ctx, loop: cst.For) -> str | None:
    """`for i in range(0, n, bs)` whose body slices with `i`."""
    it, target = loop.iter, dotted_name(loop.target)
    if not (isinstance(it, cst.Call) and dotted_name(it.func) == "range" and len(it.args) == 3 and target):
        return None
    if any(ctx.reads_rank(a.value) for a in it.args):
        return None
    func = ctx.enclosing_func(loop)
    names = [name for a in it.args for name in _names(a.value)]
    names += [n for name in names for b in ctx.assignments if b.dotted == name.value and b.func is func for n in _names(b.value)]
    if any(_a_batch(ctx, name, func, own=loop) for name in names):
        return None  # `range(0, batch.shape[0], micro)` (also through `size = batch["x"].shape[0]`): micro-batches of this rank's batch
    for sliced in _slices(loop.body, target):
        if not _sharded(ctx, sliced, loop) and not _a_batch(ctx, sliced, ctx.enclosing_func(loop), own=loop):
            return f"`{ctx.code(sliced)}[...{target}...]` cuts batches from the whole data by `{ctx.code(it)}`"
    return None


def _generator_slices(ctx, loop: cst.For) -> str | None:
    """`for x, y in get_batches(...)`: a generator of the program that yields slices."""
    it = loop.iter
    while isinstance(it, cst.Call) and dotted_name(it.func) in WRAPPERS and it.args:
        it = it.args[0].value
    if not isinstance(it, cst.Call) or it not in ctx.call_info:
        return None
    ci = ctx.info(it)
    if any(ctx.reads_rank(a.value) or _sharded(ctx, a.value, loop) for a in it.args):
        return None
    if any(_a_batch(ctx, a.value, ctx.enclosing_func(loop), own=loop) for a in it.args):
        return None  # micro-batches of a batch a loader gave this rank
    callees = ctx.local_callees(ci) or ctx.index.functions.get(ci.name, [])
    if len(callees) != 1 or not _yields(callees[0]) or _mentions_rank(ctx, callees[0]):
        return None
    if not _slices(callees[0].body, None):
        return None
    return f"`{ctx.code(it.func)}(...)` yields batches cut from all of what it is handed"


def _slices(body: cst.CSTNode, index: str | None) -> list[cst.BaseExpression]:
    """The values subscripted with a slice (that reads `index`, when given)."""
    found = []

    class Collect(cst.CSTVisitor):
        def visit_Subscript(self, node: cst.Subscript) -> None:
            for element in node.slice:
                part = element.slice
                if isinstance(part, cst.Slice) and (index is None or _reads(part, index)):
                    found.append(node.value)
                    return

    body.visit(Collect())
    return found


def _reads(node: cst.CSTNode, name: str) -> bool:
    found = []

    class Collect(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            if n.value == name:
                found.append(n)

    node.visit(Collect())
    return bool(found)


def _yields(func: cst.FunctionDef) -> bool:
    found = []

    class Collect(cst.CSTVisitor):
        def visit_Yield(self, node: cst.Yield) -> None:
            found.append(node)

        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is func

    func.visit(Collect())
    return bool(found)


def _mentions_rank(ctx, func: cst.FunctionDef) -> bool:
    text = ctx.index.code(func)
    return any(word in text for word in ("rank", "world_size", "num_replicas"))


def _sharded(ctx, value: cst.BaseExpression, site: cst.CSTNode) -> bool:
    """Does the value (or what its name is bound to in the function) read the rank?"""
    name = dotted_name(value)
    if ctx.reads_rank(value):
        return True
    if name is None:
        return False
    func = ctx.enclosing_func(site)
    return any(ctx.reads_rank(b.value) for b in ctx.assignments if b.dotted == name and b.func is func)


def _a_batch(ctx, value, func, depth: int = 0, own: cst.For | None = None) -> bool:
    """Is the value a batch already drawn (`batch = next(loader)`, `for batch in loader`), here
    or in what the callers of its function hand it: cutting it is micro-batching, not a split."""
    if isinstance(value, cst.Call) and _reads(value, "next"):
        return True  # `self.step(self.prepare(next(data)))`: what the call makes of a drawn batch
    name = dotted_name(value)
    if name is None or func is None or depth > 3:
        return False
    for assign in _assigns(func):
        if _reads(assign.value, "next") and any(_reads(t.target, name.split(".")[0]) for t in assign.targets):
            return True  # `batch = next(data)`, `batch, cond = next(self.data)`
    for node in _loop_targets(func):
        if node is not own and _reads(node.target, name.split(".")[0]) and not (isinstance(node.iter, cst.Call) and dotted_name(node.iter.func) == "range"):
            return True
    if name not in ctx.index.param_names(func):
        return False
    for site in ctx.call_sites(func):
        for index, arg in enumerate(a for a in site.node.args if a.keyword is None):
            if ctx.index.param_for(func, index, arg) == name and _a_batch(ctx, arg.value, site.func, depth + 1):
                return True
        for arg in site.node.args:
            if arg.keyword is not None and arg.keyword.value == name and _a_batch(ctx, arg.value, site.func, depth + 1):
                return True
    return False


def _names(expr) -> list[cst.Name]:
    found = []

    class Collect(cst.CSTVisitor):
        def visit_Name(self, node: cst.Name) -> None:
            found.append(node)

    expr.visit(Collect())
    return found


def _assigns(func: cst.FunctionDef) -> list[cst.Assign]:
    found = []

    class Collect(cst.CSTVisitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            found.append(node)

    func.body.visit(Collect())
    return found


def _loop_targets(func: cst.FunctionDef) -> list[cst.For]:
    found = []

    class Collect(cst.CSTVisitor):
        def visit_For(self, node: cst.For) -> None:
            found.append(node)

    func.body.visit(Collect())
    return found
