import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import is_true, kwarg
from ddpify.check.rule import Invalid, Report, Rule


class DownloadOnEveryRank(Rule):
    """Every rank downloads the dataset.

    ## What it does
    Flags `download=True` outside a rank-0 branch in a distributed script, unless the file
    also downloads on rank 0 first (the guarded pattern), or a `barrier()` in an earlier
    statement of the same block holds the other ranks back while rank 0 downloads
    (`if rank != 0: dist.barrier()`, the "rank 0 first" pattern).

    ## Why is this bad?
    All processes write the same files at once: corrupt archives, `EOFError`/`BadZipFile`,
    and N times the traffic.

    ## Example
    ```python
    train_set = datasets.MNIST("data", train=True, download=True)
    ```

    ## Use instead
    ```python
    if rank == 0:
        datasets.MNIST("data", train=True, download=True)
    dist.barrier()
    train_set = datasets.MNIST("data", train=True, download=False)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://github.com/pytorch/examples/tree/main/distributed/ddp-tutorial-series
    """

    CODE = "DDP115"
    NAME = "download-on-every-rank"
    MESSAGE = "every rank downloads the dataset at once; download on rank 0, `dist.barrier()`, then load"
    VALID = [
        "import torch.distributed as dist\nif rank == 0:\n    MNIST('d', download=True)\ndist.barrier()\n"
        "ds = MNIST('d', download=True)\n",
        "import torch.distributed as dist\nif dist.get_rank() != 0:\n    dist.barrier()\n"
        "ds = MNIST('d', download=True)\nif dist.get_rank() == 0:\n    dist.barrier()\n",
    ]
    INVALID = [Invalid("import torch.distributed as dist\nds = MNIST('d', train=True, download=True)\n")]

    def check(self, ctx):
        calls = [c for c in ctx.calls if (k := kwarg(c.node, "download")) is not None and is_true(k.value)]
        if any(ctx.in_rank0(c.node) for c in calls):
            return
        for ci in calls:
            if not _after_barrier(ctx, ci.node) and not ctx.launcher_only(ci.node):
                yield Report(kwarg(ci.node, "download"))  # (not in the launcher process, before it spawns the workers)


def _after_barrier(ctx, node) -> bool:
    """Is there a `barrier()` call in an earlier statement of the block that holds `node`?"""
    child = node
    for parent in ctx.ancestors(node):
        if isinstance(parent, (cst.Module, cst.IndentedBlock)):
            earlier = parent.body[: parent.body.index(child)]
            return any(
                c.node is not None and c.qnames & N.BARRIERS and any(_inside(ctx, c.node, s) for s in earlier)
                for c in ctx.calls
            )
        child = parent
    return False


def _inside(ctx, node, outer) -> bool:
    return node is outer or any(a is outer for a in ctx.ancestors(node))
