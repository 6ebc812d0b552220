import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.analysis.rank import rank_analysis
from ddpify.check.context import kwarg
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import every_rank

_SEED_HELPERS = ("set_seed", "seed_everything", "set_random_seed", "fix_random_seed", "setup_seed", "seed_all")


class SameSeedRandomDraws(Rule):
    """Every rank seeded alike, then batches drawn at random in the training step.

    ## What it does
    Flags a seed call (`torch.manual_seed(args.seed)`, `np.random.seed(...)`, `random.seed(...)`,
    an imported `set_seed(...)`) that every rank runs with the same value, in a DDP program whose
    training step picks its samples from the same generator: indices drawn by
    `torch.randint`/`randperm`, numpy's `randint`/`choice`/`permutation` or `random.sample`/...
    that index the data (`data[ix]`, `for i in ix: data[i : i + n]`), in the step loop or in a
    function it calls. (Noise drawn alike on every rank, `torch.randn`, is left alone.) Left alone: a seed that reads the rank anywhere in the program (also
    through a seed helper's callers), draws from a generator of the script's own, and a program
    that draws nothing in its step.

    ## Why is this bad?
    The generators of all ranks start from one state and make the same calls, so every rank
    draws the same indices: it trains on the same samples as the others, and N GPUs do the work
    of one.

    ## Example
    ```python
    torch.manual_seed(1337)
    for step in range(max_steps):
        ix = torch.randint(len(data) - block, (batch_size,))
    ```

    ## Use instead
    ```python
    torch.manual_seed(1337 + rank)
    ```

    ## Fix safety
    No automatic fix (`ddpify convert` seeds by rank before training when it shards such batches).

    ## References
    - https://github.com/karpathy/nanoGPT/blob/master/train.py (`torch.manual_seed(1337 + seed_offset)`)
    """

    CODE = "DDP162"
    NAME = "same-seed-random-draws"
    MESSAGE = "every rank seeds this generator with the same value and the training step draws from it at random: the ranks draw the same batches; add the rank to the seed"
    VALID = [
        "import torch, torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "dist.init_process_group('nccl')\ntorch.manual_seed(1337 + dist.get_rank())\nmodel = DDP(net)\n"
        "for step in range(10):\n    ix = torch.randint(100, (8,))\n    model(data[ix]).sum().backward()\n",
        "import torch, torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "dist.init_process_group('nccl')\ntorch.manual_seed(1337)\nmodel = DDP(net)\n"
        "for x in loader:\n    model(x).sum().backward()\n",
    ]
    INVALID = [
        Invalid("import torch, torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
                "dist.init_process_group('nccl')\ntorch.manual_seed(1337)\nmodel = DDP(net)\n"
                "def get_batch():\n    ix = torch.randint(100, (8,))\n    return data[ix]\n"
                "for step in range(10):\n    model(get_batch()).sum().backward()\n"),
    ]  # fmt: skip

    def check(self, ctx):
        if not ctx.ddp_calls:
            return
        drawn = {_module(q) for ci in _step_draws(ctx) for q in ci.qnames & N.RANDOM_INDEX_DRAWS}
        if not drawn:
            return
        ranks = rank_analysis(ctx.index)
        seeds = [ci for ci in ctx.calls if ci.qnames & N.SEEDS or ci.name in _SEED_HELPERS]
        if any(_by_rank(ctx, ranks, ci) for ci in seeds):
            return
        for ci in seeds:
            if _seeded(ctx, ci) & drawn and ci.node.args and every_rank(ctx, ci.node) and not _seeds_a_parameter(ctx, ci):
                yield Report(ci.node)


def _seeded(ctx, ci) -> set[str]:
    """The modules whose generator the call seeds: its own, those a helper of the program seeds
    inside, all three for a library's `set_seed` (transformers', Lightning's)."""
    if ci.qnames & N.SEEDS:
        return {_module(q) for q in ci.qnames & N.SEEDS}
    callees = ctx.local_callees(ci)
    if not callees:
        return {"torch", "numpy", "random"}
    return {_module(q) for f in callees for inner in ctx.index.calls_under(f) for q in inner.qnames & N.SEEDS}


def _module(qname: str) -> str:
    return qname.split(".")[0]


def _step_draws(ctx) -> list:
    """Draws of indices from a global generator that pick the data (`ix = torch.randint(...)`,
    then `data[i] for i in ix`), in the training step or in a function a step calls."""
    found = []
    for ci in ctx.calls:
        if not ci.qnames & N.RANDOM_INDEX_DRAWS or kwarg(ci.node, "generator") is not None or not _indexes(ctx, ci):
            continue
        if ctx.in_step(ci.node) or ci.func is not None and any(ctx.in_step(s.node) for s in ctx.call_sites(ci.func)):
            found.append(ci)
    return found


def _indexes(ctx, ci) -> bool:
    """Is the draw, or the name bound to it, read inside a subscript (`data[ix]`, `data[i : i + n]`)?"""
    if any(isinstance(p, cst.SubscriptElement) for p in ctx.ancestors(ci.node)):
        return True
    parent = ctx.parent(ci.node)
    if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0].target, cst.Name)):
        return False
    name = parent.targets[0].target.value
    scope = ci.func.body if ci.func is not None else ctx.module
    return any(
        isinstance(n, cst.Name) and n.value == name and any(isinstance(p, cst.SubscriptElement) for p in ctx.ancestors(n))
        for n in iter_nodes(scope)
    ) or any(
        isinstance(n, (cst.For, cst.CompFor)) and isinstance(n.iter, cst.Name) and n.iter.value == name for n in iter_nodes(scope)
    )  # fmt: skip


def _by_rank(ctx, ranks, ci, depth: int = 0) -> bool:
    """Does this seed call read the rank, or (a seed helper's inner call) do its callers pass one?"""
    if any(ranks.per_rank(a.value, ci.func) for a in ci.node.args):
        return True
    if ci.func is None or depth > 2:
        return False
    params = ctx.index.param_names(ci.func)
    if not any(isinstance(a.value, cst.Name) and a.value.value in params for a in ci.node.args):
        return False
    return any(_by_rank(ctx, ranks, site, depth + 1) for site in ctx.call_sites(ci.func))


def _seeds_a_parameter(ctx, ci) -> bool:
    """`torch.manual_seed(seed)` inside `def set_seed(seed):`: its callers are the seed calls."""
    return ci.func is not None and any(
        isinstance(a.value, cst.Name) and a.value.value in ctx.index.param_names(ci.func) for a in ci.node.args
    )
