"""DistributedSampler code the data passes share: the sampler's name, the dataset it samples,
`set_epoch` at the top of each epoch (or each new pass), per-rank slices, --global-batch."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.script import AnalysisError, Loader
from ddpify.convert.context import Context


BEFORE_INIT = ', num_replicas=int(os.environ.get("WORLD_SIZE", 1)), rank=int(os.environ.get("RANK", 0))'



SET_EPOCH = "{sampler}.set_epoch({epoch})\n"



NEXT_EPOCH = "{sampler}.set_epoch({sampler}.epoch + 1)  # a new pass: a new shuffle, the same on every rank\n"
# Where the same code starts passes over other loaders too (a prefetcher wrapping the training
# and the validation loader): only a DistributedSampler is told the epoch.
NEXT_EPOCH_IF_SHARDED = (
    "if isinstance({sampler}, DistributedSampler):  # a new pass: a new shuffle, the same on every rank\n"
    "    {sampler}.set_epoch({sampler}.epoch + 1)\n"
)



SLICE = "range({rank}, len({dataset}), {world})"



def split_batch(ctx: Context, loader: Loader) -> None:
    """--global-batch: each process takes batch_size // world_size of the script's batch."""
    script, edits = ctx.script, ctx.edits
    args = N.positional(loader.call)
    arg = N.keyword(loader.call, "batch_size") or (args[1] if len(args) > 1 else None)
    if arg is None:
        edits.todo(loader.stmt, loader.stmt, "divide this loader's batch size by the world size (dist.get_world_size())")
        return
    if D.reads_world_size(script, arg.value):
        return  # divided already
    code = script.module.code_for_node(arg.value)
    if not isinstance(arg.value, (cst.Name, cst.Attribute, cst.Integer, cst.Subscript, cst.Call)):
        code = f"({code})"
    world = ctx.rank_and_world(loader.stmt)[1]
    edits.replace(arg.value, edits.expression(f"{code} // {world}"))
    edits.change(
        loader.stmt,
        f"per-process batch is {code} // world size (a remainder is dropped: pick a divisible batch size)",
    )



def sampler_name(loader: str) -> str:
    """`train_loader` -> `train_sampler`, `dataloader` -> `sampler`, `self.loader` -> `self.sampler`."""
    if loader.endswith("loader"):
        prefix = loader[: -len("loader")]
        return (prefix[: -len("data")] if prefix.endswith("data") else prefix) + "sampler"
    return f"{loader}_sampler"



def loader_dataset(ctx: Context, loader: Loader, sampler: str) -> str:
    """The loader's dataset as a name both sampler and loader can use (hoisted if built inline)."""
    args = N.positional(loader.call)
    arg = args[0] if args else N.keyword(loader.call, "dataset")
    if arg is None:
        raise AnalysisError(ctx.script.line(loader.call), f"cannot find the dataset of `{loader.name}`")
    code = ctx.script.module.code_for_node(arg.value)
    if isinstance(arg.value, (cst.Name, cst.Attribute)):
        return code
    name = sampler[: -len("sampler")] + "dataset"
    ctx.edits.insert_before(loader.stmt, f"{name} = {code}\n")
    ctx.edits.replace(arg.value, ctx.edits.expression(name))
    return name



def set_epoch(ctx: Context, loop: cst.For, sampler: str) -> None:
    """`sampler.set_epoch(epoch)` as the first statement of the epoch loop."""
    edits = ctx.edits
    if _sets_epoch_always(ctx, loop):
        return  # the loop reshuffles already (a call under `if distributed:` may never run: add ours)
    target = loop.target
    if isinstance(target, cst.Name) and target.value == "_":
        edits.replace(target, cst.Name("epoch"))
        epoch = "epoch"
    elif isinstance(target, cst.Name):
        epoch = target.value
    elif _enumerated(loop) is not None:
        epoch = _enumerated(loop)  # `for i, epoch in enumerate(range(1, n + 1)):`: `i` counts the passes
    else:
        edits.todo(loop, loop, f"call `{sampler}.set_epoch(epoch)` at the top of this loop")
        return
    body = loop.body.body if isinstance(loop.body, cst.IndentedBlock) else None
    if body is None:
        edits.todo(loop, loop, f"call `{sampler}.set_epoch({epoch})` at the top of this loop")
        return
    edits.insert_before(body[0], SET_EPOCH.format(sampler=sampler, epoch=epoch))
    edits.change(loop, f"`{sampler}.set_epoch({epoch})` reshuffles the shards every epoch")



def _enumerated(loop: cst.For) -> str | None:
    """`i` of `for i, x in enumerate(...):`: the pass number, from 0."""
    target, it = loop.target, loop.iter
    if isinstance(target, (cst.Tuple, cst.List)) and len(target.elements) == 2 and isinstance(target.elements[0].value, cst.Name):
        if isinstance(it, cst.Call) and N.call_name(it) == "enumerate" and isinstance(it.func, cst.Name):
            return target.elements[0].value.value
    return None


def next_epoch(ctx: Context, stmt: cst.CSTNode, sampler: str, shared: bool = False) -> None:
    """Step-based training has no epoch number: every new pass advances the sampler's own.
    `shared`: the statement may start passes over other loaders too (known from a run)."""
    if sets_epoch(ctx, D.sibling(ctx.script, stmt, -1)):
        return
    ctx.edits.insert_before(stmt, (NEXT_EPOCH_IF_SHARDED if shared else NEXT_EPOCH).format(sampler=sampler))
    ctx.edits.change(stmt, f"a new pass over the data: `{sampler}.set_epoch(...)` reshuffles the shards")



def sets_epoch(ctx: Context, node: cst.CSTNode | None, depth: int = 0) -> bool:
    """Does `node` call a sampler's `set_epoch(...)`, itself or in a helper it calls
    (`self._run_epoch(epoch)`)?"""
    if node is None or depth > 2:
        return False
    for call in ctx.script.calls_in(node):
        if N.call_name(call) == "set_epoch" and N.receiver(call) is not None:
            return True
        fn = ctx.script.local_function(call)
        if fn is not None and fn is not node and sets_epoch(ctx, fn.body, depth + 1):
            return True
    return False



def _sets_epoch_always(ctx: Context, loop: cst.For) -> bool:
    """Does every pass of the epoch loop call a sampler's `set_epoch(...)` (not under an `if`)?"""
    script = ctx.script
    return any(
        (
            (N.call_name(c) == "set_epoch" and N.receiver(c) is not None)
            or (script.local_function(c) is not None and sets_epoch(ctx, script.local_function(c).body, 1))
        )  # also in a helper the loop calls (`self._run_epoch(epoch)`)
        and not any(isinstance(a, (cst.If, cst.IfExp)) for a in _between(script, c, loop))
        for c in script.calls_in(loop.body)
    )



def _between(script, node: cst.CSTNode, outer: cst.CSTNode) -> list[cst.CSTNode]:
    found = []
    for anc in script.ancestors(node):
        if anc is outer:
            break
        found.append(anc)
    return found
