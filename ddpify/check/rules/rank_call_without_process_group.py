import re

import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import group_starters, before, dominates, exclusive, starts_group

# torch.distributed calls that need the default process group
NEEDS_GROUP = N.GLOBAL_RANK_CALLS | N.COLLECTIVES | N.GET_WORLD_SIZE


class RankCallWithoutProcessGroup(Rule):
    """A rank query or collective in a mode of the script that never starts the process group.

    ## What it does
    Flags `dist.get_rank()`, `dist.get_world_size()`, `dist.barrier()` and the other calls
    that need the default process group inside a function that does not start the group
    itself, when every call of that function is in another branch than the calls that start
    it (`if training: train() else: test()`, with `init_process_group` in `train()`); and such a
    call after an `if` that starts the group in one branch only (`if args.model == "GAN": model =
    GAN(args)`, whose `__init__` starts it; `elif ...: model = DCGAN(args)` does not). A call
    under `if dist.is_initialized():` is left alone, and so are a conditional call after the
    `if` and an `if` that reads like a switch to one process (`if distributed:`, `if
    world_size > 1:`).

    ## Why is this bad?
    In that mode no process group exists: the call raises `ValueError: Default process group
    has not been initialized`, so the evaluation mode of a converted script crashes, even as
    one process.

    ## Example
    ```python
    def test(path):
        ...
        if dist.get_rank() == 0:
            print(f"EER {eer:.3f}")

    if args.training:
        train(path)  # calls dist.init_process_group
    else:
        test(path)
    ```

    ## Use instead
    ```python
    def test(path):
        ...
        if int(os.environ.get("RANK", 0)) == 0:  # holds with or without a process group
            print(f"EER {eer:.3f}")
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/distributed.html#torch.distributed.is_initialized
    """

    CODE = "DDP156"
    NAME = "rank-call-without-process-group"
    MESSAGE = (
        "`{call}` needs the process group, but `{func}()` runs only where the group is never started "
        "(line {line} calls it in another branch than the setup): 'Default process group has not been initialized'; "
        "read the rank from the environment (`int(os.environ.get('RANK', 0))`) or check `dist.is_initialized()`"
    )
    VALID = [
        "import torch.distributed as dist\ndef train():\n    dist.init_process_group('gloo')\n    dist.get_rank()\n"
        "def test():\n    if dist.is_initialized() and dist.get_rank() == 0:\n        print(1)\n"
        "if training:\n    train()\nelse:\n    test()\n",
        "import torch.distributed as dist\ndef train():\n    dist.init_process_group('gloo')\n    test()\n"
        "def test():\n    dist.get_rank()\ntrain()\n",
    ]
    INVALID = [
        Invalid(
            "import torch.distributed as dist\ndef train():\n    dist.init_process_group('gloo')\n"
            "def test():\n    dist.get_rank()\nif training:\n    train()\nelse:\n    test()\n"
        ),
    ]

    def check(self, ctx):
        starters = group_starters(ctx)
        group_calls = [ci for ci in ctx.calls if _starts(ctx, ci)]
        if not group_calls:
            return
        for ci in ctx.calls:
            func = ci.func
            if not ci.qnames & NEEDS_GROUP or _checks_group(ctx, ci.node) or ctx.index.root_of(ci.node) is not ctx.module:
                continue
            branch = _started_in_some_branches(ctx, ci, group_calls)
            if branch is not None:
                yield Report(ci.node, BRANCH_MESSAGE.format(call=ctx.code(ci.node.func), start=ctx.code(branch.node), line=ctx.line(branch.node)))
                continue
            if func is None or func in starters:
                continue
            sites = ctx.call_sites(func)
            if not sites or not all(_apart(ctx, site, group_calls) for site in sites):
                continue
            yield Report(ci.node, self.MESSAGE.format(call=ctx.code(ci.node.func), func=func.name.value, line=ctx.line(sites[0].node)))


BRANCH_MESSAGE = (
    "`{call}` needs the process group, which only `{start}` (line {line}) starts, in one branch of an `if`: "
    "after another branch 'Default process group has not been initialized'; start the group before the `if`"
)


def _starts(ctx, ci) -> bool:
    """Does the call start the group: `init_process_group`, a function that reaches it, or a
    class of the program whose `__init__` does (`model = GAN(args)`)?"""
    if starts_group(ctx, ci):
        return True
    definitions = ctx.index.definitions()
    inits = [definitions.get(q + ".__init__") for q in ci.qnames]
    inits += [f for f in ctx.index.functions.get("__init__", []) if _class_name(ctx, f) == ci.name]
    return any(f is not None and f in group_starters(ctx) for f in inits)


def _class_name(ctx, func) -> str | None:
    parent = next((p for p in ctx.ancestors(func) if isinstance(p, cst.ClassDef)), None)
    return parent.name.value if parent is not None else None


def _started_in_some_branches(ctx, ci, group_calls):
    """A call that starts the group earlier in the same function, inside one branch of an `if`
    whose other branches go on without starting it (and none before the `if` does): the first
    such call, else None."""
    here = [g for g in group_calls if g.func is ci.func and g is not ci and before(ctx, g.node, ci.node)]
    if not here or any(dominates(ctx, _statement(ctx, g.node), ci.node) for g in here):
        return None
    if any(isinstance(p, (cst.If, cst.IfExp, cst.BooleanOperation)) for p in _within_function(ctx, ci.node)):
        return None  # a call under a test of its own (`if distributed:`): it knows when the group exists
    for g in here:
        branch_if = next((p for p in ctx.ancestors(g.node) if isinstance(p, cst.If)), None)
        if branch_if is None or any(p is branch_if for p in ctx.ancestors(ci.node)):
            continue
        if _DISTRIBUTED_SWITCH.search(ctx.code(branch_if.test)):
            continue  # `if distributed:` / `if world_size > 1:`: a single-process run on purpose
        if any(not _starts_or_ends(ctx, block, group_calls) for block in _branches(branch_if)):
            return g
    return None


_DISTRIBUTED_SWITCH = re.compile(r"distributed|\bddp\b|world|rank|WORLD_SIZE|RANK|is_initialized|is_available|cuda|gpu", re.IGNORECASE)


def _within_function(ctx, node):
    """The nodes above `node`, up to its function."""
    for p in ctx.ancestors(node):
        if isinstance(p, (cst.FunctionDef, cst.ClassDef)):
            return
        yield p


def _statement(ctx, node):
    return next((p for p in ctx.ancestors(node) if isinstance(p, cst.SimpleStatementLine)), node)


def _branches(node: cst.If) -> list[cst.CSTNode]:
    """The blocks of an if/elif/else chain; an `if` without `else` has an empty way around it."""
    blocks = [node.body]
    orelse = node.orelse
    while isinstance(orelse, cst.If):
        blocks.append(orelse.body)
        orelse = orelse.orelse
    blocks.append(orelse.body if isinstance(orelse, cst.Else) else None)
    return blocks


def _starts_or_ends(ctx, block, group_calls) -> bool:
    """Does this branch start the group, or leave (`exit()`, `raise`, `return`)?"""
    if block is None:
        return False
    code = ctx.code(block)
    if any(any(p is block for p in ctx.ancestors(g.node)) for g in group_calls):
        return True
    return bool(re.search(r"\b(exit|raise|return)\b", code))


def _apart(ctx, site, group_calls) -> bool:
    """Is this call site at the top level, in another branch than every call that starts the
    group in its scope (and is there one in its scope at all)?"""
    if site.func is not None:
        return False  # called from a function: its own callers decide
    here = [g for g in group_calls if g.func is None and g is not site]
    return bool(here) and all(exclusive(ctx, site.node, g.node) for g in here)


def _checks_group(ctx, node) -> bool:
    for p in ctx.ancestors(node):
        if isinstance(p, (cst.If, cst.IfExp)) and "is_initialized" in ctx.code(p.test):
            return True
        if isinstance(p, cst.FunctionDef):
            return False
    return False
