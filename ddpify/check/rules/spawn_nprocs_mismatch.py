import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import kwarg
from ddpify.check.rule import Invalid, Report, Rule


class SpawnNprocsMismatch(Rule):
    """`mp.spawn` starts a different number of processes than the world size.

    ## What it does
    Flags `torch.multiprocessing.spawn(fn, args=(..., world_size, ...), nprocs=...)` when
    `nprocs` is missing (it defaults to 1) or is a different expression from the world size
    passed to the workers, unless the world size is a product with `nprocs` among its factors
    (`num_machines * gpus_per_machine`: each machine spawns its share).

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
        # each machine spawns its own share of the world
        "import torch.multiprocessing as mp\nworld_size = num_machines * gpus\nmp.spawn(main, args=(world_size, machine_rank), nprocs=gpus)\n",
        "import torch.multiprocessing as mp\nargs.world_size = args.gpus * args.nodes\nmp.spawn(main, args=(args.world_size,), nprocs=args.gpus)\n",
    ]
    INVALID = [
        Invalid("import torch.multiprocessing as mp\nmp.spawn(main, args=(world_size,), nprocs=2)\n"),
        Invalid("import torch.multiprocessing as mp\nmp.spawn(main, args=(world_size,))\n"),
        Invalid("import torch.multiprocessing as mp\nworld_size = num_machines * gpus\nmp.spawn(main, args=(world_size,), nprocs=4)\n"),
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
            elif not any(ctx.code(s) == ctx.code(nprocs.value) or _per_machine(ctx, s, nprocs.value) for s in sizes):
                yield Report(nprocs)


def _per_machine(ctx, size: cst.BaseExpression, nprocs: cst.BaseExpression) -> bool:
    """The world size is a product with `nprocs` among its factors (`world_size = num_machines *
    num_gpus_per_machine`, then `nprocs=num_gpus_per_machine`): each machine spawns its share of
    the processes, so all of them join (a multi-machine launcher)."""
    values = [size] + [b.value for b in ctx.assignments if b.dotted == ctx.code(size)]
    for value in values:
        if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Multiply):
            factors = [value.left, value.right]
            while factors:
                f = factors.pop()
                if isinstance(f, cst.BinaryOperation) and isinstance(f.operator, cst.Multiply):
                    factors += [f.left, f.right]
                elif ctx.code(f) == ctx.code(nprocs):
                    return True
    return False
