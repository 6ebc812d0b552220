import re

import libcst as cst

from ddpify.analysis.flow import flow
from ddpify.analysis.index import iter_nodes
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import name_reads

_RANK = re.compile(r"rank", re.IGNORECASE)
_SPLIT = ("array_split", "chunk", "tensor_split", "split")
_TIMES_WORLD = re.compile(r"\*\s*[\w.]*world_size\b", re.IGNORECASE)


class ManualRankSharding(Rule):
    """Data split by hand into per-rank shards of different sizes.

    ## What it does
    Flags `data[rank::world_size]`, `np.array_split(data, world_size)[rank]`-style shards and
    contiguous ranges of indices (`Subset(data, range(rank * per, (rank + 1) * per))`) unless
    their size is a floor division (`per = len(data) // world_size`: equal shards, the
    remainder dropped; `t.split(len(t) // world_size)[rank]`, torch's chunk size), or a strided
    pick from parts whose count is a multiple of the world size (`parts =
    seeds.tensor_split(n * world_size)`: every rank the same number of parts). A slice of a
    tensor by rank (a chunk of optimizer state) is not a shard of the data and is left alone,
    and so is a shard no use of which is followed to code that talks to the other ranks per
    batch (a training loop with a backward, a collective; also through a helper that returns
    the shard): uneven counts only hang where each batch syncs, and a shard stored into a
    buffer of fixed size or handed on where it cannot be followed proves nothing.

    ## Why is this bad?
    When the dataset size is not a multiple of the world size, ranks get different numbers of
    batches. The rank with more batches waits in DDP's gradient all-reduce for peers that have
    stopped: training hangs at the end of the epoch.

    ## Example
    ```python
    shard = samples[rank::world_size]
    for batch in DataLoader(shard, batch_size=32):
        model(batch).sum().backward()
    ```

    ## Use instead
    ```python
    sampler = DistributedSampler(dataset)  # pads to equal length
    # or wrap the loop in torch.distributed.algorithms.Join([model])
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/tutorials/advanced/generic_join.html
    """

    CODE = "DDP114"
    NAME = "manual-rank-sharding"
    MESSAGE = "hand-made per-rank shards can have uneven batch counts (hang); use DistributedSampler or `Join`"
    VALID = [
        "import torch.distributed as dist\nfirst = data[0::2]\n",
        "import torch.distributed as dist\nn = (len(seeds) // 64 + 1) * world_size\n"
        "parts = seeds.tensor_split(n)\nmine = parts[rank::world_size]\n",
        # torch's split takes the chunk size: a floor division gives equal chunks
        "import torch.distributed as dist\nidx = idx.split(idx.size(0) // world_size)[rank]\n",
        # a shard only an evaluation without a per-batch collective reads
        "import torch.distributed as dist\n\ndef evaluate(loader, model):\n    return sum(model(x).sum() for x in [1])\n\n"
        "def run(rank, world_size, model, data):\n    val = data.split(-(-len(data) // world_size) + 1)[rank]\n"
        "    loader = DataLoader(val)\n    acc = evaluate(loader, model)\n    for batch in loader:\n        print(model(batch))\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nshard = data[rank::world_size]\nfor x in shard:\n    model(x).sum().backward()\n"),
        Invalid("import numpy as np, torch.distributed as dist\nshard = np.array_split(data, world_size)[rank]\n"
                "for x in DataLoader(shard):\n    model(x).sum().backward()\n"),
        Invalid("import torch.distributed as dist\nshard = Subset(ds, range(rank * per, min((rank + 1) * per, n)))\n"
                "for x in DataLoader(shard):\n    model(x).sum().backward()\n"),
        Invalid("import torch.distributed as dist\nfrom math import ceil\n\ndef run(rank, world_size, model, opt, data):\n"
                "    idx = data.split(ceil(len(data) / world_size))[rank]\n    for x in DataLoader(idx):\n"
                "        model(x).sum().backward()\n        opt.step()\n"),
        # a shard returned by a helper, iterated by the training loop of its caller
        Invalid("import torch.distributed as dist\n\ndef my_part(data, rank, world_size):\n    return data[rank::world_size]\n\n"
                "def run(rank, world_size, model, data):\n    for x in my_part(data, rank, world_size):\n"
                "        model(x).sum().backward()\n"),
    ]

    def check(self, ctx):
        for report in self._shards(ctx):
            if not _divisibility_checked(ctx, report.node):
                yield report

    def _shards(self, ctx):
        for node in ctx.subscripts:
            if len(node.slice) != 1:
                continue
            s = node.slice[0].slice
            if isinstance(s, cst.Slice) and s.lower is not None and s.step is not None:
                if _RANK.search(ctx.code(s.lower)) and "world" in ctx.code(s.step).lower() + "size":
                    if not _parts_per_rank_equal(ctx, node.value) and not _cut_to_multiple(ctx, node) and _feeds_training(ctx, node):
                        yield Report(node)
            elif isinstance(s, cst.Index) and _RANK.search(ctx.code(s.value)):
                v = node.value
                if isinstance(v, cst.Call) and ctx.info(v).name in _SPLIT and not _equal_chunks(ctx, ctx.info(v)):
                    if _feeds_training(ctx, node):
                        yield Report(node)
        for ci in ctx.calls:  # `range(rank * per, min((rank + 1) * per, n))`: a contiguous shard of indices
            if ci.name == "range" and ci.receiver is None and len(ci.node.args) >= 2:
                low, high = ci.node.args[0].value, ci.node.args[1].value
                if _RANK.search(ctx.code(low)) and _RANK.search(ctx.code(high)) and "*" in ctx.code(low) and not _even(ctx, low):
                    if _feeds_training(ctx, ci.node):
                        yield Report(ci.node)


_DIVIDES = re.compile(r"(%|//)[^%/]*world|world[^%/]*(%|//)", re.IGNORECASE)


def _divisibility_checked(ctx, node: cst.CSTNode) -> bool:
    """Does the function stop first unless the count divides by the world size (`if n // world *
    world != n: raise ...`, `assert n % world_size == 0`)? Every shard is then the same size."""
    func = ctx.enclosing_func(node)
    if func is None:
        return False
    paths, line = flow(ctx.index), ctx.line(node)
    return any(
        (isinstance(stmt, cst.If) and paths.block_ends(stmt.body) or isinstance(stmt, cst.Assert))
        and _DIVIDES.search(ctx.code(stmt.test)) and ctx.line(stmt) < line
        for stmt in iter_nodes(func.body)
    )


def _equal_chunks(ctx, ci) -> bool:
    """`t.split(len(t) // world_size)[rank]`: torch's `split` takes the chunk *size*; a floor
    division gives every rank's chunk the same size (the remainder is a chunk no rank takes)."""
    if ci.name != "split" or ci.receiver is None or ci.qnames & {"numpy.split"} or not ci.node.args:
        return False
    size = ci.node.args[0].value
    if ci.node.args[0].keyword is not None and ci.node.args[0].keyword.value not in ("split_size", "split_size_or_sections"):
        return False
    return _even(ctx, size)


def _feeds_training(ctx, shard: cst.CSTNode) -> bool:
    """Can the shard reach code that talks to the other ranks per batch (a backward, a
    collective), where uneven counts hang?

    Follows the names bound from it in its function (`loader = DataLoader(shard)`, through library
    calls) to where they are consumed: iterated by a loop, or passed to a local function, that
    syncs is; a loop or local functions that do not (an evaluation without a per-batch
    collective) are not; nor is a use that cannot be followed (stored into a buffer of a fixed
    size, tested, handed on, a name never read): the premise is not proven there. A shard
    returned is followed to the loops of the callers in this file."""
    scope = ctx.enclosing_func(shard) or ctx.module
    uses: list[cst.CSTNode] = [shard]
    followed: set[str] = set()
    while uses:
        verdict = _consumer(ctx, uses.pop())
        if verdict is True:
            return True
        if isinstance(verdict, str) and verdict not in followed:
            followed.add(verdict)
            uses += name_reads(scope, verdict)
    return False


def _consumer(ctx, use: cst.CSTNode):
    """What takes this value: True (code that syncs, or not known), False (code that does not),
    or the name it is bound to (to follow)."""
    prev, node = use, ctx.parent(use)
    while node is not None:
        if isinstance(node, cst.Call) and prev is not node.func:
            callees = ctx.local_callees(ctx.info(node))
            if callees:
                return any(ctx.syncs(f) for f in callees)
        elif isinstance(node, cst.For) and prev is node.iter:
            return ctx.syncs(node)
        elif isinstance(node, cst.Assign) and prev is node.value:
            targets = [t.target for t in node.targets]
            return targets[0].value if len(targets) == 1 and isinstance(targets[0], cst.Name) else False
        elif isinstance(node, cst.Return) and (func := ctx.enclosing_func(node)) is not None:
            return any(_consumer(ctx, site.node) is True for site in ctx.call_sites(func))
        elif isinstance(node, (cst.BaseSmallStatement, cst.BaseCompoundStatement, cst.Lambda, cst.BaseComp)):
            return False
        prev, node = node, ctx.parent(node)
    return False


def _even(ctx, low: cst.BaseExpression) -> bool:
    """Is the shard's size a floor division (`per = len(data) // world`): every rank the same
    number of samples, the remainder dropped?"""
    sizes = {n.value for n in _names(low)}
    return any(b.dotted in sizes and "//" in ctx.code(b.value) for b in ctx.assignments) or "//" in ctx.code(low)


def _cut_to_multiple(ctx, shard: cst.Subscript) -> bool:
    """`batches = batches[: len(batches) - len(batches) % world]` before `batches[rank::world]`:
    the list was cut to a multiple of the world size, so every rank takes as many items."""
    value, line = shard.value, ctx.line(shard)
    if not isinstance(value, cst.Name):
        return False
    func = ctx.enclosing_func(shard)
    bound = [b for b in ctx.assignments if b.dotted == value.value and b.func is func and b._node is not None and b.line < line]
    last = max(bound, key=lambda b: b.line, default=None)
    cut = last.value if last is not None else None
    return (
        isinstance(cut, cst.Subscript) and len(cut.slice) == 1 and isinstance(cut.slice[0].slice, cst.Slice)
        and cut.slice[0].slice.upper is not None and bool(_DIVIDES.search(ctx.code(cut.slice[0].slice.upper)))
    )  # fmt: skip


def _parts_per_rank_equal(ctx, value: cst.BaseExpression) -> bool:
    """`parts = x.tensor_split(n)` with `n = (...) * world_size`: a strided pick gives every rank
    n / world_size parts."""
    if not isinstance(value, cst.Name):
        return False
    counts = {
        n.value
        for b in ctx.assignments
        if b.dotted == value.value and isinstance(b.value, cst.Call) and ctx.info(b.value).name in _SPLIT
        for a in b.value.args for n in _names(a.value)
    }
    return any(b.dotted in counts and _TIMES_WORLD.search(ctx.code(b.value)) for b in ctx.assignments)


def _names(node: cst.CSTNode) -> list[cst.Name]:
    found: list[cst.Name] = []

    class _Names(cst.CSTVisitor):
        def visit_Name(self, name: cst.Name) -> None:
            found.append(name)

    node.visit(_Names())
    return found

