"""Re-seed each process when the training set's items are drawn at random.

A dataset class of the script whose `__getitem__` draws from a global generator (a window of a
long sequence starting at `torch.randint(...)`, whatever the index) hands every rank the same
items when the ranks share a seed, whichever indices their DistributedSampler gives them: torch
is re-seeded with its seed + rank once the model is wrapped (DDP sends rank 0's weights, so the
models still start alike), and the numpy or random seeds the script sets are offset by the rank.
A script that never seeds draws differently in each process already: nothing changes.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.script import Loader
from ddpify.convert.context import Context
from ddpify.convert.reseed import seed_after_wrap

TODO = (
    "`{name}` draws its items at random: seed each process differently (torch.manual_seed(seed + rank)) "
    "once the model is wrapped, or every rank trains on the same items"
)


def run(ctx: Context) -> None:
    script = ctx.script
    if not any(script.is_call_to(c, N.SEEDS) for c in script.calls):
        return
    for loader in script.train_loaders:
        cls = _dataset_class(ctx, loader)
        if cls is None or not _draws_items(ctx, cls):
            continue
        name = cls.name.value
        message = f"`{name}` draws its items at random: torch is re-seeded with its seed + rank once the model is wrapped, so each process draws its own"
        if not seed_after_wrap(ctx, message):
            ctx.edits.todo(loader.stmt, loader.stmt, TODO.format(name=name))
        return


def _dataset_class(ctx: Context, loader: Loader) -> cst.ClassDef | None:
    """The script's class whose object the loader reads: `DataLoader(Windows(...))`, or a name
    bound to one in the loader's function (`train_set, test_set = Windows(a), Windows(b)`)."""
    script = ctx.script
    args = N.positional(loader.call)
    arg = args[0] if args else N.keyword(loader.call, "dataset")
    if arg is None:
        return None
    value = arg.value
    if isinstance(value, cst.Name):
        bound = [v for a in script.assigns.get(loader.scope, []) if script.before(a, loader.call) for v in _values_of(a, value.value)]
        value = bound[-1] if bound else value
    return script.class_called(value) if isinstance(value, cst.Call) else None


def _values_of(assign: cst.Assign, name: str) -> list[cst.BaseExpression]:
    """What `assign` binds to `name`: its value, or the matching item of a tuple unpacked."""
    target, value = assign.targets[0].target, assign.value
    if N.is_name(target, name):
        return [value]
    if isinstance(target, (cst.Tuple, cst.List)) and isinstance(value, (cst.Tuple, cst.List)) and len(target.elements) == len(value.elements):
        return [v.value for t, v in zip(target.elements, value.elements) if N.is_name(t.value, name)]
    return []


def _draws_items(ctx: Context, cls: cst.ClassDef) -> bool:
    """Does the class's `__getitem__` (or a method of its own that it calls) draw at random from
    a global generator (not a `generator=` the class keeps)?"""
    script = ctx.script
    methods = script.methods(cls)
    getitem = methods.get("__getitem__")
    if getitem is None:
        return False
    calls = list(script.calls_in(getitem))
    for call in list(calls):
        func = call.func
        if isinstance(func, cst.Attribute) and N.is_name(func.value, "self") and func.attr.value in methods:
            calls += script.calls_in(methods[func.attr.value])
    return any(script.is_call_to(c, N.RANDOM_DRAWS) and N.keyword(c, "generator") is None for c in calls)
