"""Sums a loop accumulates, and their all-reduce: what evaluation and training metrics share."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.analysis.script import ref_of
from ddpify.convert.context import Context
from ddpify.convert.emit import define_function


ALL_REDUCE_SUM = '''

def all_reduce_sum(value):
    """Sum a metric over all processes (each one saw its own part of the data)."""
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in dist.get_backend() else "cpu"
    total = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    dist.all_reduce(total)
    if isinstance(value, torch.Tensor):
        return total.to(value.device, value.dtype)
    return type(value)(total.item())
'''
# In a project's shared module, whose other callers may run without a process group.
ALL_REDUCE_SUM_SHARED = ALL_REDUCE_SUM.replace(
    '    """Sum a metric over all processes (each one saw its own part of the data)."""\n',
    '    """Sum a metric over all processes (each one saw its own part of the data)."""\n'
    "    if not dist.is_initialized():  # one process (a caller without a process group): nothing to add\n"
    "        return value\n",
)


def per_rank_denominator(ctx: Context, loop: cst.For) -> bool:
    """After the loop, does the code use `len(loader)` or the batch index (`batch_idx + 1`)?
    Those count this rank's batches only, so summed metrics would be divided wrongly."""
    script = ctx.script
    scope = script.scope_of(loop)
    loader = ref_of(loop.iter.args[0].value) if isinstance(loop.iter, cst.Call) and loop.iter.args else ref_of(loop.iter)
    index = None
    if isinstance(loop.iter, cst.Call) and N.call_name(loop.iter) == "enumerate" and isinstance(loop.target, cst.Tuple):
        index = ref_of(loop.target.elements[0].value)
    body = script.body_of(scope)
    counted = _counts_of(body, loader) if loader is not None else set()
    later = [node for node in _names_and_calls(body) if script.after(node, loop)]
    for node in later:
        if isinstance(node, cst.Call) and _is_len_of(node, loader):
            return loader is not None
        if isinstance(node, cst.Name) and (node.value == index or node.value in counted):
            return True
    return False


def _is_len_of(node: cst.Call, loader) -> bool:
    return N.call_name(node) == "len" and bool(node.args) and ref_of(node.args[0].value) == loader


def _counts_of(body: cst.CSTNode, loader) -> set[str]:
    """Names assigned from this rank's batch count: `steps_per_epoch = math.ceil(len(train_loader) / accum)`."""
    found = set()
    for node in iter_nodes(body):
        if isinstance(node, cst.Assign) and len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name):
            if any(isinstance(c, cst.Call) and _is_len_of(c, loader) for c in iter_nodes(node.value)):
                found.add(node.targets[0].target.value)
    return found



def _names_and_calls(node: cst.CSTNode) -> list[cst.CSTNode]:
    return [n for n in iter_nodes(node) if isinstance(n, (cst.Name, cst.Call))]



def reduce_after(ctx: Context, loop: cst.For) -> bool:
    """Sum the loop's `x += ...` accumulators over ranks right after it (those not summed yet);
    True when the script needs the `all_reduce_sum` helper."""
    edits = ctx.edits
    sums, appends = accumulators(loop)
    if appends:
        edits.todo(loop, loop, "this evaluation collects per-sample results: gather them from all ranks (dist.all_gather_object)")
    sums, reduced = unreduced(ctx, loop, sums)
    if not sums:
        return reduced
    edits.insert_after(loop, "".join(f"{name} = all_reduce_sum({name})\n" for name in sums))
    edits.change(loop, f"evaluation sums over all ranks: {', '.join(sums)}")
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
    for node in iter_nodes(loop.body):
        if isinstance(node, cst.AugAssign) and isinstance(node.operator, cst.AddAssign):
            name = ref_of(node.target)
            if name and name not in sums:
                sums.append(name)
        elif isinstance(node, cst.Call):
            appends = appends or N.call_name(node) in ("append", "extend")
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



def define_helper(ctx: Context, where: cst.CSTNode) -> None:
    """`all_reduce_sum` once, after the imports of the module that uses it at `where`."""
    module = ctx.script.root_of(where)
    if module is ctx.script.module and D.all_reduces(ctx.script, ctx.script.functions.get("all_reduce_sum")):
        return
    define_function(ctx, "all_reduce_sum", ALL_REDUCE_SUM if module is ctx.script.module else ALL_REDUCE_SUM_SHARED, where)

