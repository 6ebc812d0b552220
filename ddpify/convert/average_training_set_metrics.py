"""A metric a helper computes over the training loader, outside the training step, is averaged.

    train_accuracy = calc_accuracy(train_loader, model, num_batches=5)
    train_accuracy = all_reduce_sum(train_accuracy) / dist.get_world_size()   # inserted

The training loader reads this rank's shard, so an evaluation helper handed it (a training
accuracy or loss after the epoch, `evaluate(model, train_loader, val_loader)`) reports one
shard. Every rank reads as many samples of its shard as the others (DistributedSampler evens
them out), so the mean of the ranks' results is the whole set's. A value the helper computed
from data every rank reads whole (a validation loss returned beside it) is the same on every
rank, and its mean is itself. A helper that all-reduces already, or a call only rank 0 makes,
is left as it is.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.script import param_receiving, ref_of
from ddpify.convert.context import RANK0, Context
from ddpify.convert.metrics import define_helper


def run(ctx: Context) -> None:
    script = ctx.script
    sharded = {(loader.name, loader.scope) for loader in script.train_loaders}
    sharded |= {(e.loader_expr, e.scope) for loops in script.epoch_loops.values() for e in loops}
    for call in script.calls:
        fn = script.local_function(call)
        if fn is None or fn in script.training_functions or D.all_reduces(script, fn):
            continue
        scope = script.scope_of(call)
        if not any((ref_of(a.value), scope) in sharded and _iterates(script, fn, call, a) for a in call.args):
            continue
        line = script.statement_line(call)
        names = _assigned(line, call)
        if not names or D.guarded_by_rank(script, call) or ctx.rank0_condition(line) != RANK0:
            continue
        if script.nodes_in(fn, cst.Yield) or any(_drawn_from(script, scope, name) for name in names):
            continue  # batches, not a metric: `batches = forever(train_loader)`, then `next(batches)`
        following = D.sibling(script, line, 1)
        if following is not None and D.reduction_of(script, following, names[0]):
            continue  # averaged already (a converted script)
        world = ctx.rank_and_world(line)[1]
        ctx.edits.insert_after(line, "".join(f"{name} = all_reduce_sum({name}) / {world}\n" for name in names))
        ctx.edits.change(line, f"{', '.join(names)} from this rank's shard of the training set: averaged over ranks")
        define_helper(ctx, line)


def _drawn_from(script, scope, name: str) -> bool:
    """Is `name` iterated in `scope` (`next(name)`, `iter(name)`, `for ... in name`)?"""
    return any(
        N.call_name(c) in ("next", "iter") and c.args and ref_of(c.args[0].value) == name for c in script.calls_in(scope)
    ) or any(ref_of(loop.iter) == name for loop in script.nodes_in(scope, cst.For))


def _iterates(script, fn: cst.FunctionDef, call: cst.Call, arg: cst.Arg, depth: int = 0) -> bool:
    """Does `fn` loop over the parameter that receives `arg`, or hand it to a function that does?"""
    param = param_receiving(fn, call, ref_of(arg.value))
    if param is None:
        return False
    if any(param in {n.value for n in script.nodes_in(loop.iter, cst.Name)} for loop in script.nodes_in(fn, cst.For)):
        return True
    return depth < 2 and any(
        (inner := script.local_function(c)) is not None and inner is not fn
        and any(ref_of(a.value) == param and _iterates(script, inner, c, a, depth + 1) for a in c.args)
        for c in script.calls_in(fn)
    )  # fmt: skip


def _assigned(line: cst.SimpleStatementLine | None, call: cst.Call) -> list[str]:
    """`x = f(...)` or `a, b = f(...)`: the names bound to what `f` returns."""
    if line is None or len(line.body) != 1 or not isinstance(line.body[0], cst.Assign) or line.body[0].value is not call:
        return []
    target = line.body[0].targets[0].target
    items = [e.value for e in target.elements] if isinstance(target, (cst.Tuple, cst.List)) else [target]
    return [i.value for i in items] if all(isinstance(i, cst.Name) for i in items) else []
