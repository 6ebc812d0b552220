from __future__ import annotations

from typing import Optional

import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import kwarg, positional
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import before, dominates, may_precede

# Helpers of libraries that seed torch's global generator with the value they are given.
SEED_HELPERS = frozenset({"transformers.set_seed", "transformers.trainer_utils.set_seed"})


class UnseededRandomSplit(Rule):
    """`random_split` without a generator after torch was seeded with the rank.

    ## What it does
    Flags `torch.utils.data.random_split(...)` without `generator=` (nor a third positional
    argument) in a file that seeds torch's global generator differently on each rank:
    `torch.manual_seed(seed + rank)`, `+ local_rank`, `+ dist.get_rank()`, or a helper of the
    file (`set_seed(args.seed + rank)`, `transformers.set_seed`) that passes its argument to
    `torch.manual_seed`. The split is flagged when it may run after that seeding: later in the
    same function (not in the other branch of an `if`), or later in a function that calls both
    (the split inside `build_data()` called after `seed_all(rank)`). Only seedings whose order
    with the split is known count; when none is known (no function of the file is seen to run
    both: a worker started by `mp.spawn` that builds a class which splits, say), the split is
    flagged: per-rank seeding normally happens first. A split after a later seeding with the same value on every rank
    (`torch.manual_seed(seed)` again) is left alone, as is a split before the per-rank seeding
    (every process starts from the same default seed and draws the same split).

    ## Why is this bad?
    `random_split` draws its permutation from torch's global generator, which each rank has
    seeded differently: every rank gets a different split, so samples one rank validates on
    are in another rank's training set, and the `DistributedSampler` shards a different
    training set on each rank. With 2 processes (torch 2.15, gloo), `torch.manual_seed(42 +
    rank)` then `random_split(range(20), [15, 5])` gives validation indices `[5, 9, 12, 16,
    19]` on rank 0 and `[1, 2, 3, 5, 7]` on rank 1: rank 1 trains on four of rank 0's five
    validation samples. Nothing fails; the validation score is optimistic.

    ## Example
    ```python
    torch.manual_seed(args.seed + rank)
    train_set, val_set = random_split(dataset, [n_train, n_val])
    ```

    ## Use instead
    ```python
    torch.manual_seed(args.seed + rank)
    split_rng = torch.Generator().manual_seed(args.seed)  # the same on every rank
    train_set, val_set = random_split(dataset, [n_train, n_val], generator=split_rng)
    ```

    ## Fix safety
    No automatic fix: the split's seed is the script's choice (and changes which samples
    each set holds).

    ## References
    - https://pytorch.org/docs/stable/data.html#torch.utils.data.random_split
    - https://pytorch.org/docs/stable/notes/randomness.html
    """

    CODE = "DDP129"
    NAME = "unseeded-random-split"
    MESSAGE = "`random_split` draws from torch's generator, which is seeded with the rank: each rank gets a different split (one rank's validation samples are another's training samples); pass `generator=torch.Generator().manual_seed(seed)`"
    VALID = [
        "import torch, torch.distributed as dist\nfrom torch.utils.data import random_split\n"
        "torch.manual_seed(0 + dist.get_rank())\ntr, va = random_split(ds, [8, 2], generator=torch.Generator().manual_seed(0))\n",
        "import torch, torch.distributed as dist\nfrom torch.utils.data import random_split\n"
        "torch.manual_seed(0)\ntr, va = random_split(ds, [8, 2])\n",
        "import torch, torch.distributed as dist\nfrom torch.utils.data import random_split\n"
        "tr, va = random_split(ds, [8, 2])\ntorch.manual_seed(0 + dist.get_rank())\n",
    ]
    INVALID = [
        Invalid("import torch, torch.distributed as dist\nfrom torch.utils.data import random_split\n"
                "torch.manual_seed(0 + dist.get_rank())\ntr, va = random_split(ds, [8, 2])\n"),
    ]

    def check(self, ctx):
        splits = [
            ci for ci in ctx.calls_to(*N.RANDOM_SPLIT)
            if kwarg(ci.node, "generator") is None and len(positional(ci.node)) < 3 and not any(a.star for a in ci.node.args)
        ]  # fmt: skip
        if not splits:
            return
        by_rank, same = _seedings(ctx)
        if not by_rank:
            return
        for split in splits:
            order = [_may_run_before(ctx, seed, split.node) for seed in by_rank]
            known = [o for o in order if o is not None]
            if not (any(known) if known else True):  # unclear only: per-rank seeding normally comes first
                continue
            if any(
                dominates(ctx, s, split.node) and all(not may_precede(ctx, split.node, r) for r in by_rank)
                and any(before(ctx, r, s) or ctx.enclosing_func(r) is not ctx.enclosing_func(s) for r in by_rank)
                for s in same
            ):  # fmt: skip
                continue  # seeded again with one value on every rank just before
            yield Report(split.node)


def _seed_argument(ctx, ci) -> Optional[cst.BaseExpression]:
    """What a call seeds torch's global generator with: `torch.manual_seed(x)`, a library's
    `set_seed(x)`, or a function of the file that hands its parameter to one of those."""
    args = positional(ci.node) or [a for a in ci.node.args if a.keyword is not None and a.keyword.value == "seed"]
    if not args:
        return None
    if ci.qnames & (N.TORCH_SEED | SEED_HELPERS):
        return args[0].value
    for fn in ctx.local_callees(ci):
        param = ctx.index.param_for(fn, 0, args[0])
        if param and any(
            c.qnames & N.TORCH_SEED and c.node.args and param in ctx.code(c.node.args[0].value)
            for c in ctx.index.calls_under(fn.body)
        ):
            return args[0].value
    return None


def _seedings(ctx) -> tuple[list[cst.Call], list[cst.Call]]:
    """The calls that seed torch with the rank, and those that seed it with one value everywhere."""
    by_rank, same = [], []
    for ci in ctx.calls:
        if ci.name not in ("manual_seed", "set_seed") and not ctx.local_callees(ci):
            continue
        value = _seed_argument(ctx, ci)
        if value is None:
            continue
        if isinstance(ci.node.func, cst.Attribute) and "Generator" in ctx.code(ci.node.func.value):
            continue  # `torch.Generator().manual_seed(0)`: a generator of its own
        (by_rank if ctx.reads_rank(value) else same).append(ci.node)
    helpers = {fn for ci in ctx.calls for fn in ctx.local_callees(ci) if _seed_argument(ctx, ci) is not None}
    same = [s for s in same if ctx.enclosing_func(s) not in helpers]  # the helper's own manual_seed(seed)
    return by_rank, same


def _anchors(ctx, node: cst.CSTNode, depth: int = 0) -> list[tuple[Optional[cst.FunctionDef], cst.CSTNode]]:
    """`node` in its function, then the calls of that function in theirs, and so on up."""
    func = ctx.enclosing_func(node)
    found = [(func, node)]
    if func is not None and depth < 4:
        for site in ctx.call_sites(func):
            if site.func is not func:
                found += _anchors(ctx, site.node, depth + 1)
    return found


def _may_run_before(ctx, seed: cst.Call, split: cst.Call) -> Optional[bool]:
    """Can the seeding run before the split? Judged in the lowest functions that run both; None
    when no function is seen to run both (the order is unclear)."""
    pairs = [
        (a, b) for fa, a in _anchors(ctx, seed) for fb, b in _anchors(ctx, split)
        if fa is fb and a is not b
    ]  # fmt: skip
    if not pairs:
        return None
    return any(may_precede(ctx, a, b) for a, b in pairs)
