import re

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import main_guard
from ddpify.check.context import DDP_CLASSES
from ddpify.check.rule import Invalid, Report, Rule


class DDPBeforeInitProcessGroup(Rule):
    """DDP model built before the process group exists.

    ## What it does
    Flags `DistributedDataParallel(...)` in a file that never calls
    `torch.distributed.init_process_group`, or that calls it later in the same function. A
    library module (functions and classes, no `if __name__ == "__main__":`) that wraps a model in
    a function leaves the process group to its caller, and is not flagged; so is a wrap under a
    test that the group is up (`if dist.is_initialized():`, a project's `is_enabled()` helper)
    in a file that never starts it. A call of a helper the analysis cannot see into whose name
    says it starts the group (`setup_dist(rank, world_size)` from another package,
    `init_distributed_mode(args)`, `ddp_setup()`) counts as the start, and so does handing the
    function that wraps to an imported launcher other than `mp.spawn` (detectron2's
    `launch(main, num_gpus)` starts the group before it calls `main`).

    ## Why is this bad?
    DDP broadcasts the parameters of rank 0 when it is constructed; without a default
    process group it raises `RuntimeError: Default process group has not been initialized`.

    ## Example
    ```python
    model = DDP(model, device_ids=[local_rank])
    dist.init_process_group("nccl")
    ```

    ## Use instead
    ```python
    dist.init_process_group("nccl")
    model = DDP(model, device_ids=[local_rank])
    ```

    ## Fix safety
    No automatic fix: where the process group is made is a decision about the script's start-up.

    ## References
    - https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html
    - https://pytorch.org/tutorials/intermediate/ddp_tutorial.html
    """

    CODE = "DDP101"
    NAME = "ddp-before-init-process-group"
    DDP_ONLY = True
    MESSAGE = "DDP model created before `init_process_group`; initialise the process group first"
    VALID = [
        "from icefall.dist import setup_dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "def run(rank, world_size):\n    setup_dist(rank, world_size)\n    model = DDP(net)\n\nif __name__ == '__main__':\n    run(0, 1)\n",
        "import torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "dist.init_process_group('gloo')\nmodel = DDP(model)\n",
        "import torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "def setup():\n    dist.init_process_group('gloo')\ndef main():\n    setup()\n    model = DDP(net)\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "class Trainer:\n    def __init__(self, net):\n        self.model = DDP(net)\n",
        "import torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "def main():\n    if dist.is_initialized():\n        model = DDP(net)\n"
        "if __name__ == '__main__':\n    main()\n",
    ]
    INVALID = [
        Invalid(
            "import torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
            "def main():\n    if not dist.is_initialized():\n        model = DDP(net)\n"
            "if __name__ == '__main__':\n    main()\n"
        ),
        Invalid("import torch\nmodel = torch.nn.parallel.DistributedDataParallel(net)\n"),
        Invalid(
            "import torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
            "def main():\n    model = DDP(net)\n    dist.init_process_group('gloo')\n"
        ),
    ]

    def check(self, ctx):
        inits = ctx.calls_to(*N.INIT_PROCESS_GROUP)
        # helpers named like setup functions that we cannot see into (imported) count as init
        helper = any((c.name == "setup" or _STARTS_GROUP.match(c.name or "")) and not ctx.local_callees(c) for c in ctx.calls)
        library = main_guard(ctx.module) is None  # a module of functions other programs call
        for ci in ctx.calls_to(*DDP_CLASSES):
            if not inits:
                if not helper and (ci.func is None or not library) and not _under_group_test(ctx, ci.node) \
                        and not _run_by_a_library_launcher(ctx, ci.func):  # fmt: skip
                    yield Report(ci.node)
                continue
            same = [i for i in inits if i.func is ci.func and ci.func is not None]
            if same and all(ctx.line(i.node) > ctx.line(ci.node) for i in same):
                yield Report(ci.node)


# `init_distributed_mode`, `setup_dist` (icefall), `ddp_setup`, `dist_init`, `init_process_group` of a project
_STARTS_GROUP = re.compile(
    r"^_?((setup|init|initialize|start)_?(dist|distributed|ddp|process_group|torch_distributed)(_mode|_env)?"
    r"|(dist|ddp|distributed)_?(setup|init|initialize))$"
)
GROUP_IS_UP = ("is_initialized", "is_enabled", "is_dist_avail_and_initialized")


def _run_by_a_library_launcher(ctx, func, depth: int = 0) -> bool:
    """Is the function (or one that calls it) handed to an imported launcher, not `mp.spawn`
    (detectron2's `launch(main, num_gpus, ...)`): the launcher may start the group before it
    calls it, and what it does is not in sight."""
    if func is None or depth > 3:
        return False
    name = func.name.value
    for c in ctx.calls:
        if ctx.local_callees(c) or c.qnames & N.SPAWN:
            continue
        if any(isinstance(a.value, cst.Name) and a.value.value == name for a in c.node.args):
            return True
    return any(_run_by_a_library_launcher(ctx, s.func, depth + 1) for s in ctx.call_sites(func) if s.func is not func)


def _under_group_test(ctx, node) -> bool:
    """Is `node` in the body of `if <group is up>():` (`dist.is_initialized()`, `distributed.is_enabled()`)?"""
    child = node
    for a in ctx.ancestors(node):
        test = ctx.code(a.test) if isinstance(a, cst.If) and child is a.body else ""
        if "not " not in test and any(f"{n}(" in test for n in GROUP_IS_UP):
            return True
        child = a
    return False
