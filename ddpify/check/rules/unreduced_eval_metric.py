from __future__ import annotations

from typing import Iterator

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.check.context import DATALOADER, dotted_name, kwarg
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import before, mentions_rank, may_precede

_WRAPPERS = ("enumerate", "tqdm", "iter", "track", "trange")
_REPORT_METHODS = frozenset({"info", "warning", "debug", "log", "add_scalar", "add_scalars", "write"})
# What a metric may go through on its way to the output without being reduced.
_PLAIN = frozenset({"float", "int", "round", "str", "len", "max", "min", "abs", "format", "repr", "item", "tolist",
                    "cpu", "numpy", "mean", "sum", "tensor", "as_tensor", "append", "print"})  # fmt: skip


class UnreducedEvalMetric(Rule):
    """An evaluation metric printed without reducing it over the ranks.

    ## What it does
    Flags the `print(...)` or log call that reports a metric summed in an evaluation loop (no
    backward) over a loader sharded by a `DistributedSampler`, when nothing reduces it between
    the loop and the output: no collective (`all_reduce`, `all_gather`, `reduce`,
    `all_gather_object`, ...), no helper of the project that calls one, no `.compute()`. The
    metric is what the loop accumulates with `+=` (`correct += ...`, `total += ...`,
    `loss_sum += ...`) and what is computed from it after the loop (`acc = correct / total`); a
    value the function returns counts where its caller prints it. A `ReduceLROnPlateau`'s
    `step(metric)` counts as a report too, and a worse one: each rank cuts its learning rate at
    its own epoch, and the replicas part ways.

    It is conservative: a metric passed to a function it cannot see (`reduce_tensor(acc)`),
    meters updated by method (`top1.update(...)`), and output that names the rank (`print(f"rank
    {rank}: ...")`) are left alone; so is a loop over a loader without a `DistributedSampler`
    (rank 0, or every rank, evaluates the whole set). A rank-0 guard around the print does not
    make it right: rank 0 reports its own shard.

    ## Why is this bad?
    The `DistributedSampler` gives each rank 1/N of the evaluation set, so each rank's sums
    cover its shard only. With 2 processes on 10 samples (torch 2.15, gloo) the two ranks print
    accuracies 1.00 and 0.40 for a set whose accuracy is 0.70: the reported number depends on
    which samples the shard got, and rank 0's log (the one people read) is wrong.

    ## Example
    ```python
    for x, y in val_loader:  # sampler=DistributedSampler(val_set, shuffle=False)
        correct += (model(x).argmax(1) == y).sum().item()
        total += y.numel()
    print(f"accuracy {correct / total:.3f}")
    ```

    ## Use instead
    ```python
    counts = torch.tensor([correct, total], device=device)
    dist.all_reduce(counts)
    correct, total = counts.tolist()
    if rank == 0:
        print(f"accuracy {correct / total:.3f}")
    ```

    ## Fix safety
    No automatic fix: which values are sums and which are averages is the script's to say.

    ## References
    - https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler
    - https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce
    - https://github.com/pytorch/examples/blob/main/imagenet/main.py (`all_reduce` of the meters)
    """

    CODE = "DDP128"
    NAME = "unreduced-eval-metric"
    MESSAGE = "each rank reports the metric of its own shard of the evaluation set: all_reduce the sums before reporting"
    VALID = [
        "import torch.distributed as dist\nfrom torch.utils.data import DataLoader, DistributedSampler\n"
        "loader = DataLoader(ds, sampler=DistributedSampler(ds, shuffle=False))\ncorrect = 0\n"
        "for x, y in loader:\n    correct += (model(x) == y).sum()\ndist.all_reduce(correct)\nprint(correct)\n",
        "import torch.distributed as dist\nfrom torch.utils.data import DataLoader\nloader = DataLoader(ds)\n"
        "correct = 0\nfor x, y in loader:\n    correct += (model(x) == y).sum()\nprint(correct)\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nfrom torch.utils.data import DataLoader, DistributedSampler\n"
                "loader = DataLoader(ds, sampler=DistributedSampler(ds, shuffle=False))\ncorrect = 0\n"
                "for x, y in loader:\n    correct += (model(x) == y).sum()\nprint(correct)\n"),
    ]

    def check(self, ctx):
        sharded = _sharded_loaders(ctx)
        if not sharded:
            return
        done: set[cst.Call] = set()
        for loop in ctx.loops:
            if not isinstance(loop, cst.For) or not ctx.index.is_bound(_iterated(loop.iter), sharded):
                continue
            sites = _sharded_sites(ctx, loop, sharded)
            if sites is not None and not sites:
                continue
            calls = ctx.index.calls_under(loop)
            if loop in ctx.step_loops or any(ctx.is_backward(ci) for ci in calls):
                continue  # training, not evaluation
            metrics = {
                name for node in iter_nodes(loop.body)
                if isinstance(node, cst.AugAssign) and (name := dotted_name(node.target)) is not None
            }  # fmt: skip
            if not metrics:
                continue
            for out in _reported(ctx, loop, metrics, sites):
                if out.node not in done and not mentions_rank(ctx, out.node):
                    done.add(out.node)
                    yield Report(out.node, _PLATEAU_MESSAGE if _plateau_step(ctx, out) else None)


def _sharded_loaders(ctx):
    found = []
    for b in ctx.index.bindings_of(DATALOADER):
        sampler = kwarg(b.value, "sampler")
        if sampler is None:
            continue
        value = sampler.value
        options = [value.body, value.orelse] if isinstance(value, cst.IfExp) else [value]
        if any(ctx.is_distributed_sampler(v) for v in options):
            found.append(b)
    return ctx.index.propagate(found) if found else []


def _iterated(expr: cst.BaseExpression) -> cst.BaseExpression:
    while isinstance(expr, cst.Call) and expr.args and (dotted_name(expr.func) or "").split(".")[-1] in _WRAPPERS:
        expr = expr.args[0].value
    return expr


def _names_in(node: cst.CSTNode) -> set[str]:
    return {d for n in iter_nodes(node) if isinstance(n, (cst.Name, cst.Attribute)) and (d := dotted_name(n))}


def _reduces(ctx, ci, depth: int = 0) -> bool:
    """A collective, a `.compute()` (a metric object syncs there), or a function of the project
    that calls one."""
    if ci.qnames & N.COLLECTIVES or ci.name in ("compute", "synchronize_between_processes", "sync"):
        return True
    if depth < 3:
        for fn in ctx.local_callees(ci):
            if any(_reduces(ctx, c, depth + 1) for c in ctx.index.calls_under(fn.body)):
                return True
    return False


def _hides(ctx, ci, metrics: set[str]) -> bool:
    """A call that takes a metric and may reduce it: one we cannot see into."""
    if not any(_names_in(a.value) & metrics for a in ci.node.args) and not (
        ci.receiver is not None and _names_in(ci.receiver) & metrics and ci.name not in _PLAIN
    ):
        return False
    if ctx.local_callees(ci):
        return False  # seen: `_reduces` answers for it
    return not (ci.name in _PLAIN or any(q.startswith(("builtins.", "math.", "numpy.")) for q in ci.qnames))


_PLATEAU_MESSAGE = (
    "each rank steps ReduceLROnPlateau with the metric of its own shard: the ranks cut their learning rates at"
    " different epochs and their models part ways; all_reduce the sums first"
)


def _plateau_step(ctx, ci) -> bool:
    """`scheduler.step(val_loss)` of a ReduceLROnPlateau: the metric decides this rank's learning rate."""
    return ci.name == "step" and ci.receiver is not None and ctx.index.is_bound(ci.receiver, ctx.index.bindings_of(N.PLATEAU_SCHEDULERS))


def _is_report(ctx, ci) -> bool:
    if ci.qnames & (N.PRINT | N.LOGGING_CALLS) or ci.is_("wandb.log") or _plateau_step(ctx, ci):
        return True
    return ci.name in _REPORT_METHODS and ci.receiver is not None and any(
        w in ctx.code(ci.receiver).lower() for w in ("log", "writer", "tb", "board")
    )


def _sharded_sites(ctx, loop: cst.For, sharded) -> "list | None":
    """When the loop iterates a parameter of its function (`def evaluate(loader):`), the calls
    that pass it a sharded loader (a helper may evaluate sharded and unsharded loaders alike);
    None when the loader is the function's own."""
    func = ctx.loop_func.get(loop)
    name = dotted_name(_iterated(loop.iter))
    if func is None or name is None or name not in ctx.index.param_names(func):
        return None
    if any(b.dotted == name and b.func is func and b._node is not func for b in sharded if b._node is not None):
        return None  # rebound to a sharded loader in the function itself
    found = []
    for site in ctx.call_sites(func):
        for i, arg in enumerate(site.node.args):
            if not arg.star and ctx.index.param_for(func, i, arg) == name and ctx.index.is_bound(arg.value, sharded):
                found.append(site)
    return found


def _reported(ctx, loop: cst.For, metrics: set[str], sites=None, depth: int = 0) -> Iterator:
    """The output calls after `loop` in its function that show a metric no reduction reached;
    where the function returns one, the output of its callers."""
    func = ctx.loop_func.get(loop)
    scope = func.body if func is not None else ctx.module
    later = [ci for ci in ctx.index.calls_under(scope) if ci.func is func and not before(ctx, ci.node, loop)]
    inside = set(ctx.index.calls_under(loop))
    reducing = [ci for ci in later if _reduces(ctx, ci)]
    derived = set(metrics)
    for b in sorted(
        (b for b in ctx.assignments if b.func is func and b._node is not None and not before(ctx, b._node, loop)),
        key=lambda b: ctx.index.source_order()[0][b._node],
    ):
        if _names_in(b.value) & derived:
            derived.add(b.dotted)
    for ci in later:
        if ci in inside or not _is_report(ctx, ci) or not may_precede(ctx, loop, ci.node):
            continue
        if not any(_names_in(a.value) & derived for a in ci.node.args):
            continue
        if _blocked(ctx, loop, ci.node, reducing, later, derived):
            continue
        yield ci
    if func is None or depth > 1:
        return
    returned = [
        n for n in iter_nodes(func.body)
        if isinstance(n, cst.Return) and n.value is not None and _names_in(n.value) & derived
        and ctx.enclosing_func(n) is func and not before(ctx, n, loop)
        and not _blocked(ctx, loop, n, reducing, later, derived)
    ]  # fmt: skip
    if not returned:
        return
    for site in ctx.call_sites(func) if sites is None else sites:
        yield from _printed_result(ctx, site, depth)


def _blocked(ctx, loop, out: cst.CSTNode, reducing, later, derived) -> bool:
    """Is there a reduction, or a call we cannot see into that takes the metric, between the
    loop's start and `out`?"""
    if any(before(ctx, loop, r.node) and before(ctx, r.node, out) for r in reducing):
        return True
    return any(
        before(ctx, loop, ci.node) and before(ctx, ci.node, out) and ci.node is not out
        and not any(p is ci.node for p in ctx.ancestors(out)) and not any(p is out for p in ctx.ancestors(ci.node))
        and _hides(ctx, ci, derived)
        for ci in later
    )  # fmt: skip


def _printed_result(ctx, site, depth: int) -> Iterator:
    """`print(evaluate(...))`, or `acc = evaluate(...)` then `print(acc)` in the caller with
    nothing that reduces between."""
    parent = ctx.parent(site.node)
    while isinstance(parent, cst.Arg):
        call = ctx.parent(parent)
        if isinstance(call, cst.Call) and _is_report(ctx, ctx.info(call)):
            yield ctx.info(call)
            return
        parent = ctx.parent(call) if isinstance(call, cst.Call) else None
    if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1):
        return
    target = parent.targets[0].target
    names = [target] if not isinstance(target, (cst.Tuple, cst.List)) else [e.value for e in target.elements]
    held = {dotted_name(n) for n in names} - {None}
    if not held:
        return
    func = site.func
    scope = func.body if func is not None else ctx.module
    later = [ci for ci in ctx.index.calls_under(scope) if ci.func is func and before(ctx, site.node, ci.node)]
    reducing = [ci for ci in later if _reduces(ctx, ci)]
    for ci in later:
        if not _is_report(ctx, ci) or not may_precede(ctx, site.node, ci.node):
            continue
        if not any(_names_in(a.value) & held for a in ci.node.args):
            continue
        if any(before(ctx, r.node, ci.node) for r in reducing):
            continue
        if any(before(ctx, c.node, ci.node) and c is not ci and _hides(ctx, c, held) for c in later):
            continue
        yield ci
