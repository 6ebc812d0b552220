from ddpify.analysis.multinode import output_once_per_node
from ddpify.check.rule import SEVERITY_WARNING, Invalid, Report, Rule

TORCHRUN = "import os, torch, torch.distributed as dist\ndist.init_process_group('nccl')\n"


class OutputOnEveryNode(Rule):
    """Checkpoint, log or results file guarded by the local rank: written once per node.

    ## What it does
    Flags a rank-0 guard that tests only the local rank (`if local_rank == 0:`,
    `if int(os.environ["LOCAL_RANK"]) == 0:`, `if args.local_rank != 0: return`,
    `if args.local_rank in [-1, 0]:`, `if rank % ngpus_per_node == 0:`) around
    output meant once per job: `torch.save` (also through a local helper, or a
    `save_checkpoint(...)`-like call), `print`, logging, a TensorBoard/W&B/MLflow tracker and
    its calls, a results or figure file, and the use of anything made under such a guard (a
    log file opened there). Guards around per-node data preparation (a download, an
    `extractall`, `os.makedirs`, a cache file) are right and not flagged, nor is output that
    names the node or host. Only scripts launched by torchrun are checked (an `mp.spawn` worker's
    local rank is its rank). Under torchrun `local_rank` is never -1, so `local_rank in (-1, 0)`
    is a local-rank guard too.

    ## Why is this bad?
    The local rank is 0 once on every node: on N nodes the guarded code runs N times, so every
    log line appears N times, trackers start N runs, and N processes write the same checkpoint
    on a shared filesystem at once (a corrupt or truncated file).

    ## Example
    ```python
    if local_rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
    ```

    ## Use instead
    ```python
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), "model.pt")
    ```

    ## Fix safety
    No automatic fix: writing to a node-local disk on every node can be on purpose.

    ## References
    - https://pytorch.org/docs/stable/elastic/run.html (torchrun: `LOCAL_RANK` and `RANK`)
    """

    CODE = "DDP307"
    NAME = "output-on-every-node"
    MESSAGE = "`local_rank == 0` tests the local rank: this runs once per node, N times on N nodes; guard job-wide output with `dist.get_rank() == 0`"
    SEVERITY = SEVERITY_WARNING
    VALID = [
        "import os, torch, torch.distributed as dist\nlocal_rank = int(os.environ['LOCAL_RANK'])\n"
        "if dist.get_rank() == 0:\n    torch.save(sd, 'm.pt')\n",
        # per-node data preparation: the local rank is the right guard
        "import os, torch.distributed as dist\nif int(os.environ['LOCAL_RANK']) == 0:\n"
        "    print('downloading')\n    MNIST('data', download=True)\ndist.barrier()\n",
        "import os, torch.distributed as dist\nlocal_rank = int(os.environ['LOCAL_RANK'])\n"
        "if local_rank == 0:\n    print(f'node {node_rank} ready')\n",
        # mp.spawn: one node, the local rank is the rank
        "import torch, torch.distributed as dist, torch.multiprocessing as mp\ndef worker(local_rank, n):\n"
        "    dist.init_process_group('gloo', rank=local_rank, world_size=n)\n    if local_rank == 0:\n"
        "        torch.save(sd, 'm.pt')\nmp.spawn(worker, args=(2,), nprocs=2)\n",
    ]
    INVALID = [
        Invalid("import os, torch, torch.distributed as dist\nlocal_rank = int(os.environ['LOCAL_RANK'])\n"
                "if local_rank == 0:\n    torch.save(sd, 'm.pt')\n"),
        Invalid("import os, torch.distributed as dist\nif int(os.environ['LOCAL_RANK']) == 0:\n    print('epoch', e)\n"),
        Invalid("import torch, torch.distributed as dist\ndef save(args, sd):\n    if args.local_rank != 0:\n"
                "        return\n    torch.save(sd, 'm.pt')\ndist.init_process_group('nccl')\n"),
        # the Hugging Face idiom: -1 means "not distributed", never the case under torchrun
        Invalid(TORCHRUN + "if args.local_rank in [-1, 0]:\n    logger.info('saving')\n    torch.save(sd, 'm.pt')\n"),
        # the rank within its node: true on every node's first GPU
        Invalid(TORCHRUN + "ngpus = torch.cuda.device_count()\nif dist.get_rank() % ngpus == 0:\n    print('epoch', e)\n"),
    ]

    def check(self, ctx):
        reported = set()
        for guards in output_once_per_node(ctx.index):
            test = guards[0].test
            if ctx.rank0_or_idle(test):
                continue  # in a helper nothing calls (a call left commented out) or only rank 0 calls
            if test not in reported:
                reported.add(test)
                code = " ".join(ctx.code(test).split())
                code = code if len(code) <= 50 else code[:47] + "..."
                yield Report(test, self.MESSAGE.replace("`local_rank == 0`", f"`{code}`", 1))
