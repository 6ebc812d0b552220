import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import last_name
from ddpify.analysis.multinode import env_read, env_writes
from ddpify.analysis.options import option_dests
from ddpify.check.context import kwarg, positional
from ddpify.check.rule import Invalid, Report, Rule

class GroupRankFromLocalRank(Rule):
    """The process group's rank given as the local rank.

    ## What it does
    Flags `init_process_group(..., rank=X)` where `X` is this process's index on its own node:
    `int(os.environ["LOCAL_RANK"])`, `dist.get_node_local_rank()`, the `--local_rank` option
    that `torch.distributed.launch` fills in, or a name every binding of which is one of these.
    A script that sets `LOCAL_RANK` itself (its own one-machine launcher) is left alone.

    ## Why is this bad?
    The local rank restarts at 0 on every node. On one machine it equals the global rank and
    the script works; on two nodes, two processes claim rank 0, two rank 1, and the group
    never forms (a rendezvous error or a hang), or ranks collide on collectives.

    ## Example
    ```python
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl", rank=local_rank, world_size=int(os.environ["WORLD_SIZE"]))
    ```

    ## Use instead
    ```python
    dist.init_process_group("nccl")  # torchrun's RANK and WORLD_SIZE
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/elastic/run.html#environment-variables
    """

    CODE = "DDP157"
    NAME = "group-rank-from-local-rank"
    DISTRIBUTED_ONLY = False
    MESSAGE = "the group's rank is the local rank, which restarts at 0 on every node: two nodes claim the same ranks; pass the global rank (RANK) or leave it to torchrun"
    VALID = [
        "import os, torch.distributed as dist\ndist.init_process_group('nccl', rank=int(os.environ['RANK']))\n",
        "import torch.distributed as dist\ndef worker(rank, world):\n    dist.init_process_group('gloo', rank=rank, world_size=world)\n",
        # its own launcher sets LOCAL_RANK for the processes of this machine
        "import os, torch.distributed as dist\nos.environ['LOCAL_RANK'] = '0'\n"
        "dist.init_process_group('gloo', rank=int(os.environ['LOCAL_RANK']), world_size=1)\n",
        # rebound to the global rank before use
        "import os, torch.distributed as dist\nlocal_rank = int(os.environ['LOCAL_RANK'])\nlocal_rank = int(os.environ['RANK'])\n"
        "dist.init_process_group('nccl', rank=local_rank)\n",
    ]
    INVALID = [
        Invalid("import os, torch.distributed as dist\nlocal_rank = int(os.environ['LOCAL_RANK'])\n"
                "dist.init_process_group('nccl', rank=local_rank, world_size=int(os.environ['WORLD_SIZE']))\n"),
        Invalid("import argparse, torch.distributed as dist\np = argparse.ArgumentParser()\n"
                "p.add_argument('--local_rank', type=int, default=0)\nargs = p.parse_args()\n"
                "dist.init_process_group(backend='nccl', init_method='env://', world_size=2, rank=args.local_rank)\n"),
    ]  # fmt: skip

    def check(self, ctx):
        index = ctx.index
        if any(name == "LOCAL_RANK" for name, _, _ in env_writes(index)):
            return
        for ci in ctx.calls_to(*N.INIT_PROCESS_GROUP):
            rank = kwarg(ci.node, "rank") or next(iter(positional(ci.node)[4:5]), None)
            if rank is not None and _node_local(ctx, rank.value, set()):
                yield Report(rank.value)


def _node_local(ctx, value: cst.BaseExpression, seen: set[str]) -> bool:
    """Is `value` this process's index on its node, by every binding of it?"""
    index = ctx.index
    if isinstance(value, cst.Call):
        if last_name(value.func) == "int" and value.args:
            return _node_local(ctx, value.args[0].value, seen)
        return bool(index.qnames(value.func) & N.NODE_LOCAL_RANK_CALLS) or env_read(index, value) == "LOCAL_RANK"
    if isinstance(value, cst.Subscript):
        return env_read(index, value) == "LOCAL_RANK"
    if not isinstance(value, (cst.Name, cst.Attribute)):
        return False
    dotted = index.code(value)
    if dotted in seen:
        return False
    seen.add(dotted)
    func = index.enclosing_func(value)
    if isinstance(value, cst.Name) and func is not None and dotted in index.param_names(func):
        return False  # the caller's value (`def main(local_rank=None)`, an `mp.spawn` worker's index)
    bindings = [b for b in index.assignments if b.dotted == dotted and (isinstance(value, cst.Attribute) or b.func in (func, None))]
    option = isinstance(value, cst.Attribute) and isinstance(value.value, cst.Name) and _launch_option(ctx, value.attr.value)
    if not bindings:
        return option
    return all(_node_local(ctx, b.value, seen) for b in bindings)


def _launch_option(ctx, dest: str) -> bool:
    """`--local_rank` / `--local-rank`: the option `torch.distributed.launch` fills with the local rank."""
    return dest == "local_rank" and dest in option_dests(ci.node for ci in ctx.index.calls if ci.name == "add_argument")
