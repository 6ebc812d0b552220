import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import kwarg
from ddpify.check.rule import Invalid, Report, Rule


class SpawnNprocsMismatch(Rule):
    """`mp.spawn` starts a different number of processes than the world size.

    ## What it does
    Flags `torch.multiprocessing.spawn(fn, args=(..., world_size, ...), nprocs=...)` when
    `nprocs` is missing (it defaults to 1) or is a different expression from the world size
    passed to the workers.

    ## Why is this bad?
    `init_process_group(world_size=N)` waits until N processes have joined. Spawning fewer
    hangs forever without an error message (seed 003).

    ## Example
    ```python
    mp.spawn(main, args=(world_size, args), nprocs=2)
    ```

    ## Use instead
    ```python
    mp.spawn(main, args=(world_size, args), nprocs=world_size)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/multiprocessing.html#spawning-subprocesses
    - seeds/003 (DDP pitfalls: spawn hangs when nprocs differs from world_size)
    """

    CODE = "DDP103"
    NAME = "spawn-nprocs-mismatch"
    MESSAGE = "`mp.spawn` nprocs differs from the world size passed to workers (hangs); pass `nprocs=world_size`"
    VALID = [
        "import torch.multiprocessing as mp\nmp.spawn(main, args=(world_size,), nprocs=world_size)\n",
        "import torch.multiprocessing as mp\nmp.spawn(main, args=(args.world_size, args), nprocs=args.world_size)\n",
    ]
    INVALID = [
        Invalid("import torch.multiprocessing as mp\nmp.spawn(main, args=(world_size,), nprocs=2)\n"),
        Invalid("import torch.multiprocessing as mp\nmp.spawn(main, args=(world_size,))\n"),
    ]

    def check(self, ctx):
        for ci in ctx.calls_to(*N.SPAWN):
            args = kwarg(ci.node, "args")
            if args is None and len(ci.node.args) > 1 and ci.node.args[1].keyword is None:
                args = ci.node.args[1]
            if args is None or not isinstance(args.value, cst.Tuple):
                continue
            sizes = [
                el.value
                for el in args.value.elements
                if "world_size" in ctx.code(el.value).lower() or "nprocs" in ctx.code(el.value).lower()
            ]
            if not sizes:
                continue
            nprocs = kwarg(ci.node, "nprocs")
            if nprocs is None and len(ci.node.args) > 2 and ci.node.args[2].keyword is None:
                nprocs = ci.node.args[2]
            if nprocs is None:
                yield Report(ci.node, "`mp.spawn` without `nprocs` starts 1 process but workers expect the world size (hangs); pass `nprocs=world_size`")
            elif all(ctx.code(s) != ctx.code(nprocs.value) for s in sizes):
                yield Report(nprocs)
