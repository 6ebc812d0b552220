from ddpify.check.context import is_true, kwarg
from ddpify.check.rule import Invalid, Report, Rule


class DownloadOnEveryRank(Rule):
    """Every rank downloads the dataset.

    ## What it does
    Flags `download=True` outside a rank-0 branch in a distributed script, unless the file
    also downloads on rank 0 first (the guarded pattern).

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
    ]
    INVALID = [Invalid("import torch.distributed as dist\nds = MNIST('d', train=True, download=True)\n")]

    def check(self, ctx):
        calls = [c for c in ctx.calls if (k := kwarg(c.node, "download")) is not None and is_true(k.value)]
        if any(ctx.in_rank0(c.node) for c in calls):
            return
        for ci in calls:
            yield Report(kwarg(ci.node, "download"))
