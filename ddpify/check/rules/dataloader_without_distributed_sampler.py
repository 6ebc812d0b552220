import re

import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import DATALOADER, has_star_kwargs, is_true, iter_nodes, kwarg
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import (
    assigned_name, class_of_call, dataset_classes, is_iterable_dataset, iterated_name, name_reads, single_process_branch,
)

_LOCAL_SAMPLERS = N.RANDOM_SAMPLER | N.SEQUENTIAL_SAMPLER
_TRAINING_NAME = re.compile(r"train|(^|[._])tr_")  # `train_loader`, `tr_loader`, `self.tr_dl`


class DataLoaderWithoutDistributedSampler(Rule):
    """Training DataLoader without a `DistributedSampler`.

    ## What it does
    Flags a training `DataLoader` (shuffled, named like a training loader (`train_loader`, `tr_loader`), or iterated by the
    step loop) with no sampler, or with a `RandomSampler`/`SequentialSampler`, in a
    distributed script; any loader with a `RandomSampler`. Loaders used on rank 0 only,
    in-order (`SequentialSampler`) loaders that do not look like training, and loaders over a
    dataset sharded by hand (`Subset(data, range(rank, n, world))`: each rank reads its own
    part) are not flagged; nor is a shuffled loader that evaluates or draws samples (named
    `val_loader`/`test_...`/`sample_...`, or built in an `evaluate()` or under `no_grad`).

    ## Why is this bad?
    Every rank iterates the whole dataset: an epoch does N times the work and the model sees
    each sample N times per step, so results differ from the single-GPU run.

    ## Example
    ```python
    loader = DataLoader(dataset, batch_size=32, shuffle=True)
    ```

    ## Use instead
    ```python
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    ```

    ## Fix safety
    No automatic fix (`ddpify convert` does this conversion).

    ## References
    - https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler
    """

    CODE = "DDP110"
    NAME = "dataloader-without-distributed-sampler"
    MESSAGE = "training DataLoader without DistributedSampler: every rank trains on all data; pass `sampler=DistributedSampler(dataset)`"
    VALID = [
        "import torch.distributed as dist\nfrom torch.utils.data import DataLoader, DistributedSampler\n"
        "train_loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds))\n",
        "import torch.distributed as dist\nfrom torch.utils.data import DataLoader, SequentialSampler\n"
        "eval_loader = DataLoader(ds, batch_size=8, sampler=SequentialSampler(ds))\n",
        "import torch.distributed as dist\nfrom torch.utils.data import DataLoader\n"
        "test_loader = DataLoader(ds, batch_size=8, shuffle=False)\n",
        "from torch.utils.data import DataLoader\ntrain_loader = DataLoader(ds, batch_size=8, shuffle=True)\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nfrom torch.utils.data import DataLoader\n"
                "loader = DataLoader(ds, batch_size=8, shuffle=True)\n"),
        Invalid("import torch.distributed as dist\nfrom torch.utils.data import DataLoader, RandomSampler\n"
                "loader = DataLoader(ds, sampler=RandomSampler(ds))\n"),
    ]

    def _local_sampler(self, ctx, expr, func=None) -> str | None:
        """"RandomSampler" or "SequentialSampler" (also inside a BatchSampler, or bound to a name
        the function gives no distributed sampler: `train_sampler = RandomSampler(data)` in the
        branch a config picks), else None."""
        if isinstance(expr, cst.Name):
            values = [b.value for b in ctx.assignments if b.dotted == expr.value and b.func is func]
            if any(ctx.is_distributed_sampler(v) for v in values):
                return None
            return next((found for v in values if (found := self._local_sampler(ctx, v))), None)
        if isinstance(expr, cst.Call):
            q = ctx.info(expr).qnames
            if q & _LOCAL_SAMPLERS:
                return next(iter(q & _LOCAL_SAMPLERS)).rsplit(".", 1)[-1]
            if any(x.endswith("BatchSampler") for x in q) and expr.args:
                return self._local_sampler(ctx, expr.args[0].value)
        return None

    def check(self, ctx):
        step_iterated = {iterated_name(l) for l in ctx.step_loops if isinstance(l, cst.For)}
        for ci in ctx.calls_to(*DATALOADER):
            call = ci.node
            if has_star_kwargs(call):
                continue
            sampler = kwarg(call, "sampler") or kwarg(call, "batch_sampler")
            if sampler is None and len(call.args) > 3 and call.args[3].keyword is None:
                sampler = call.args[3]
            name = assigned_name(ctx, call) or ""
            trains = bool(_TRAINING_NAME.search(name.lower())) or (name and name in step_iterated)
            if sampler is not None:
                local = self._local_sampler(ctx, sampler.value, ctx.enclosing_func(call))
                if local == "RandomSampler" or (local and trains):  # in-order evaluation is fine
                    yield Report(sampler)
                continue
            if ctx.in_rank0(call) or _sharded_by_hand(ctx, call) or single_process_branch(ctx, call):
                continue  # rank 0 alone, split already, or the branch that runs without a group
            shuffle = kwarg(call, "shuffle")
            if not (name in step_iterated) and _only_looked_at(ctx, call, name):
                continue  # read only by loops that never train (a one-batch sanity check, a plot)
            if trains or (shuffle is not None and is_true(shuffle.value) and not _evaluates(ctx, call, name)):
                message = _ITERABLE_MESSAGE if _over_iterable(ctx, call) else self.MESSAGE
                if not (name and name in step_iterated):
                    message += _assumed(name)
                yield Report(call, None if message == self.MESSAGE else message)


_ITERABLE_MESSAGE = (
    "training DataLoader over an IterableDataset that does not split its items: every rank trains on all data; "
    "keep this rank's items in its `__iter__` (a DataLoader over an iterable dataset takes no sampler)"
)


def _over_iterable(ctx, call: cst.Call) -> bool:
    data = kwarg(call, "dataset") or next((a for a in call.args if a.keyword is None), None)
    return data is not None and any(
        is_iterable_dataset(ctx, cls) for cls in dataset_classes(ctx, data.value, ctx.enclosing_func(call))
    )


def _only_looked_at(ctx, call, name: str) -> bool:
    """Is every read of the loader's name the iterable of a loop that never syncs (no backward,
    no collective: `for batch in train_loader: show(batch); break`)? Then nothing here trains on it."""
    if not name or "." in name:
        return False
    reads = name_reads(ctx.enclosing_func(call) or ctx.module, name)
    loops = [next((a for a in ctx.ancestors(r) if isinstance(a, (cst.For, cst.BaseSmallStatement, cst.BaseCompoundStatement))), None) for r in reads]
    return bool(reads) and all(isinstance(l, cst.For) and iterated_name(l) == name and not ctx.syncs(l) for l in loops)


def _assumed(name: str) -> str:
    """The premise the finding rests on when no loop that trains is seen iterating the loader."""
    why = "its name says so" if "train" in name.lower() else "it shuffles"
    return f" (assumed the training loader: {why}; no loop here that calls backward iterates it)"


def _sharded_by_hand(ctx, call: cst.Call) -> bool:
    """`DataLoader(Subset(data, range(rank, n, world)))`, or a dataset built from such a value a
    few assignments back (`split_dataset_by_node(data, rank=rank, world_size=ws)`, then
    `Stream(data)`), or an iterable dataset of the program whose `__iter__` keeps this rank's
    items: each rank reads its own part already (DDP111 says whether the parts are even)."""
    args = [a for a in call.args if a.keyword is None]
    dataset = args[0].value if args else getattr(kwarg(call, "dataset"), "value", None)
    if dataset is None:
        return False
    func = ctx.enclosing_func(call)
    values, names = [dataset], {ctx.code(dataset)}
    for _ in range(3):  # `dataset = TokenStream(data)` after `data = split_dataset_by_node(data, rank=rank, ...)`
        found = [b.value for b in ctx.assignments if b.dotted in names and b.func is func and b.value not in values]
        if not found:
            break
        values += found
        names = {n.value for v in found for n in iter_nodes(v) if isinstance(n, cst.Name)}
    return any(ctx.reads_rank(value) or _splits_itself(ctx, value) for value in values)


def _splits_itself(ctx, value: cst.BaseExpression) -> bool:
    """`StreamingDataset(lines, fn)`: an iterable dataset of the program whose `__iter__` keeps
    this rank's items itself (`if i % dist.get_world_size() != dist.get_rank(): continue`)."""
    cls = class_of_call(ctx, value) if isinstance(value, cst.Call) else None
    return cls is not None and any(
        isinstance(method, cst.FunctionDef) and method.name.value == "__iter__"
        and any(isinstance(n, cst.BaseExpression) and ctx.reads_rank(n) for n in iter_nodes(method.body))
        for method in cls.body.body
    )  # fmt: skip


EVAL_WORDS = ("val", "test", "eval", "sample", "valid")


def _evaluates(ctx, call: cst.Call, name: str) -> bool:
    """A shuffled loader for evaluation or samples (`val_dataloader`, built in an `evaluate()`
    under `torch.no_grad`/`inference_mode`): shuffled to pick random examples, not to train."""
    func = ctx.enclosing_func(call)
    words = [name.lower(), func.name.value.lower() if func is not None else ""]
    return any(word in text for word in EVAL_WORDS for text in words) or ctx.info(call).in_no_grad
