import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import _group_starters, exclusive, starts_group

# torch.distributed calls that need the default process group
NEEDS_GROUP = N.GLOBAL_RANK_CALLS | N.COLLECTIVES | N.spelled({"torch.distributed.get_world_size"})


class RankCallWithoutProcessGroup(Rule):
    """A rank query or collective in a mode of the script that never starts the process group.

    ## What it does
    Flags `dist.get_rank()`, `dist.get_world_size()`, `dist.barrier()` and the other calls
    that need the default process group inside a function that does not start the group
    itself, when every call of that function is in another branch than the calls that start
    it (`if training: train() else: test()`, with `init_process_group` in `train()`). A call
    under `if dist.is_initialized():` is left alone.

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
        starters = _group_starters(ctx)
        group_calls = [ci for ci in ctx.calls if starts_group(ctx, ci)]
        if not group_calls:
            return
        for ci in ctx.calls:
            func = ci.func
            if not ci.qnames & NEEDS_GROUP or func is None or func in starters or _checks_group(ctx, ci.node):
                continue
            if ctx.index.root_of(ci.node) is not ctx.module:
                continue
            sites = ctx.call_sites(func)
            if not sites or not all(_apart(ctx, site, group_calls) for site in sites):
                continue
            yield Report(ci.node, self.MESSAGE.format(call=ctx.code(ci.node.func), func=func.name.value, line=ctx.line(sites[0].node)))


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
