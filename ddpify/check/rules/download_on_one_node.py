from ddpify.analysis import names as N
from ddpify.analysis.multinode import GLOBAL, fetches, guard_kind, launched_by_torchrun, rank0_paths
from ddpify.analysis.rank import rank_analysis
from ddpify.check.context import kwarg
from ddpify.check.rule import SEVERITY_WARNING, Invalid, Report, Rule


class DownloadOnOneNode(Rule):
    """Data downloaded by global rank 0 only: the other nodes never get it.

    ## What it does
    Flags a download or unpack (`download=True`, `urlretrieve`, `requests.get`,
    `download_url`, `extractall`, ...) guarded by the global rank (`if dist.get_rank() == 0:`,
    `if rank == 0:`, `os.environ["RANK"]`) in a torchrun script that then waits at a
    `barrier()` (`mp.spawn` scripts run on one node).
    Opinionated (off by default): it is right when the data folder is on a filesystem every
    node shares.

    ## Why is this bad?
    With nodes that have their own disks, only the first node gets the files: after the
    barrier the ranks of every other node find no data (`FileNotFoundError`, or a dataset that
    downloads again on every rank at once).

    ## Example
    ```python
    if dist.get_rank() == 0:
        datasets.MNIST("data", download=True)
    dist.barrier()
    ```

    ## Use instead
    ```python
    if int(os.environ["LOCAL_RANK"]) == 0:  # each node prepares its own copy
        datasets.MNIST("data", download=True)
    dist.barrier()
    ```

    ## Fix safety
    No automatic fix: a shared data folder needs the global rank.

    ## References
    - https://pytorch.org/docs/stable/elastic/run.html (torchrun: `LOCAL_RANK` and `RANK`)
    """

    CODE = "DDP906"
    NAME = "download-on-one-node"
    MESSAGE = "download on global rank 0 only: nodes with their own disks never get the data; guard it with `LOCAL_RANK == 0` unless the folder is shared"
    SEVERITY = SEVERITY_WARNING
    DEFAULT = False
    VALID = [
        "import os, torch.distributed as dist\nif int(os.environ['LOCAL_RANK']) == 0:\n"
        "    MNIST('d', download=True)\ndist.barrier()\n",
        "import os, torch.distributed as dist\nrank = int(os.environ['RANK'])\nif rank == 0:\n"
        "    torch.save(sd, 'm.pt')\ndist.barrier()\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\ndist.init_process_group('nccl')\nif dist.get_rank() == 0:\n"
                "    MNIST('d', download=True)\ndist.barrier()\n"),
        Invalid("import os, urllib.request, torch.distributed as dist\nrank = int(os.environ['RANK'])\nif rank == 0:\n"
                "    urllib.request.urlretrieve(URL, 'd.tar')\ndist.barrier()\n"),
    ]

    def check(self, ctx):
        barriers = [ctx.line(c.node) for c in ctx.calls_to(*N.BARRIERS)]
        if not barriers or not launched_by_torchrun(ctx.index):
            return  # no barrier, or mp.spawn: one node
        rank = rank_analysis(ctx.index)
        reported = set()
        for ci in ctx.calls:
            if not fetches(ci) or not ctx.in_rank0(ci.node):
                continue
            paths = rank0_paths(rank, ci.node)
            if not paths or not all(any(guard_kind(rank, g.test) == GLOBAL for g in guards) for guards, _ in paths):
                continue
            for _, at in paths:  # the fetch, or the call of a helper that fetches
                if at not in reported and ctx.line(at) <= max(barriers):
                    reported.add(at)
                    yield Report((kwarg(at, "download") or at) if at is ci.node else at)
