import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import may_precede


class InitProcessGroupTwice(Rule):
    """The process group set up more than once.

    ## What it does
    Flags `init_process_group(...)` that can run twice in one process: inside a loop, in a
    function called from a loop or twice in a row (a setup helper run before each stage), or
    after the group was already started earlier in the same function (`init_process_group`,
    then a helper that starts it again), unless a test of `dist.is_initialized()` guards it. Calls in the two branches of an `if`
    (torchrun or `mp.spawn`) are alternatives, not repeats.

    ## Why is this bad?
    The second call raises `RuntimeError: trying to initialize the default process group twice!`,
    often only where the script builds a second trainer (an evaluation run, a second stage).

    ## Example
    ```python
    def setup():
        dist.init_process_group("nccl")

    setup()
    pretrain(model)
    setup()
    finetune(model)
    ```

    ## Use instead
    ```python
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/distributed.html#torch.distributed.init_process_group
    """

    CODE = "DDP126"
    NAME = "init-process-group-twice"
    MESSAGE = "`init_process_group` can run twice in this process (RuntimeError); call it once, or guard it with `if not dist.is_initialized():`"
    VALID = [
        "import torch.distributed as dist\ndef setup():\n    dist.init_process_group('gloo')\nsetup()\n",
        "import torch.distributed as dist\nfor stage in range(2):\n    if not dist.is_initialized():\n"
        "        dist.init_process_group('gloo')\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\ndef setup():\n    dist.init_process_group('gloo')\n"
                "def main():\n    dist.init_process_group('gloo')\n    setup()\n"),
        Invalid("import torch.distributed as dist\nfor stage in range(2):\n    dist.init_process_group('gloo')\n"),
        Invalid("import torch.distributed as dist\ndef setup():\n    dist.init_process_group('gloo')\nsetup()\nsetup()\n"),
    ]

    def check(self, ctx):
        for ci in ctx.calls_to(*N.INIT_PROCESS_GROUP):
            if _guarded(ctx, ci.node):
                continue
            if ci.loops or _runs_twice(ctx, ci.func, depth=0):
                yield Report(ci.node)
        yield from _started_again(ctx)


def _started_again(ctx):
    """A call that starts the group (`init_process_group`, or a helper that reaches it
    unguarded) after another one earlier in the same function, on the same path."""
    starts = [c for c in ctx.calls if not _guarded(ctx, c.node) and _starts_unguarded(ctx, c)]
    for later in starts:
        if any(
            earlier is not later and earlier.func is later.func and may_precede(ctx, earlier.node, later.node)
            and not set(ctx.local_callees(earlier)) & set(ctx.local_callees(later))  # one helper twice: said at its init
            for earlier in starts
        ):
            yield Report(later.node)


def _starts_unguarded(ctx, ci, depth: int = 0) -> bool:
    if ci.qnames & N.INIT_PROCESS_GROUP:
        return True
    if depth > 2:
        return False
    return any(
        c.func is callee and not _guarded(ctx, c.node) and _starts_unguarded(ctx, c, depth + 1)
        for callee in ctx.local_callees(ci) for c in ctx.calls
    )  # fmt: skip


def _guarded(ctx, node: cst.CSTNode) -> bool:
    """Under `if not dist.is_initialized():` (or a test naming it), or in a function that asks
    it (an early return on it)."""
    if any(isinstance(p, (cst.If, cst.IfExp)) and "is_initialized" in ctx.code(p.test) for p in ctx.ancestors(node)):
        return True
    func = ctx.enclosing_func(node)
    return func is not None and func in _asking_initialized(ctx)


def _asking_initialized(ctx) -> set:
    """The functions that call `is_initialized()`."""
    found = ctx.__dict__.get("_asking_initialized")
    if found is None:
        found = ctx.__dict__["_asking_initialized"] = {c.func for c in ctx.calls if c.name == "is_initialized"}
    return found


def _runs_twice(ctx, func, depth: int) -> bool:
    """Is `func` called from a loop, or twice in one block (one after the other, not in the two
    branches of an `if`, not one per process as with `mp.spawn`)? Followed up through callers."""
    if func is None or depth > 3:
        return False
    sites = [s for s in ctx.call_sites(func) if not _guarded(ctx, s.node)]
    if any(s.loops for s in sites):
        return True
    blocks = [_block_of(ctx, s.node) for s in sites]
    if any(b is not None and blocks.count(b) > 1 for b in blocks):
        return True
    return any(_runs_twice(ctx, s.func, depth + 1) for s in sites)


def _block_of(ctx, node: cst.CSTNode):
    """The block (an indented body, or the module) whose statement holds `node`."""
    for p in ctx.ancestors(node):
        if isinstance(p, (cst.IndentedBlock, cst.Module)):
            return p
    return None
