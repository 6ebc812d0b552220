import re

from ddpify.analysis import names as N
from ddpify.analysis.multinode import LOCAL, guard_kind, launched_by_torchrun, prepares_data, rank0_paths
from ddpify.analysis.rank import rank_analysis
from ddpify.check.context import kwarg, positional, string_value
from ddpify.check.rule import SEVERITY_WARNING, Invalid, Report, Rule
from ddpify.check.rules._common import mentions_rank

# Output meant once per job: checkpoints, messages, trackers, result files.
ONCE = (
    N.PRINT | N.TORCH_SAVE | N.LOGGING_CALLS | N.SIDE_EFFECTS | N.SUMMARY_WRITERS
    | {"wandb.init", "mlflow.start_run", "torch.serialization.save"}
)  # fmt: skip
ONCE_METHODS = frozenset({"savefig", "to_csv", "to_json", "writerow", "writerows", "save_pretrained", "addHandler"})
LOG_METHODS = frozenset({"debug", "info", "warning", "error", "critical", "exception", "log"})
SAVE_HELPER = re.compile(r"^_?save_?(checkpoint|ckpt|model|state|weights)s?$|^save_on_(master|main)$", re.IGNORECASE)
_PER_NODE = re.compile(r"node|host|cache|preprocess|processed|token|vocab", re.IGNORECASE)


class OutputOnEveryNode(Rule):
    """Checkpoint, log or results file guarded by the local rank: written once per node.

    ## What it does
    Flags a rank-0 guard that tests only the local rank (`if local_rank == 0:`,
    `if int(os.environ["LOCAL_RANK"]) == 0:`, `if args.local_rank != 0: return`) around
    output meant once per job: `torch.save` (also through a local helper, or a
    `save_checkpoint(...)`-like call), `print`, logging, a TensorBoard/W&B/MLflow tracker, a
    results or figure file. Guards around per-node data preparation (a download, an
    `extractall`, `os.makedirs`, a cache file) are right and not flagged, nor is output that
    names the node or host. Only scripts launched by torchrun are checked (an `mp.spawn` worker's
    local rank is its rank), and `local_rank in (-1, 0)` is taken as a single-node script.

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
    MESSAGE = "`local_rank == 0` is true once per node: N nodes write this N times; guard job-wide output with `dist.get_rank() == 0`"
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
    ]

    def check(self, ctx):
        if not launched_by_torchrun(ctx.index):
            return  # mp.spawn: one node, where the local rank is the rank
        rank = rank_analysis(ctx.index)
        loggers = {b.dotted for b in ctx.assignments if b.value in ctx.call_info and ctx.info(b.value).is_("logging.getLogger")}
        reported = set()
        for ci in ctx.calls:
            if not _once(ctx, ci, loggers) or not ctx.in_rank0(ci.node) or mentions_rank(ctx, ci.node):
                continue
            if _PER_NODE.search(" ".join(ctx.code(a.value) for a in ci.node.args)):
                continue
            for guards, _ in rank0_paths(rank, ci.node):
                if not guards or any(guard_kind(rank, g.test) != LOCAL for g in guards):
                    continue
                if any(prepares_data(ctx.index, c) for g in guards for c in ctx.index.calls_under(g.region)):
                    continue  # per-node data preparation
                if guards[0].test not in reported:
                    reported.add(guards[0].test)
                    yield Report(guards[0].test)


def _once(ctx, ci, loggers) -> bool:
    """Output meant once per job."""
    if ci.qnames & ONCE or (ci.receiver is not None and ci.name in ONCE_METHODS):
        return True
    if ci.receiver is not None and ci.name in LOG_METHODS and ctx.code(ci.receiver) in loggers:
        return True
    if ci.qnames & N.OPEN:
        mode = kwarg(ci.node, "mode") or (positional(ci.node)[1] if len(positional(ci.node)) > 1 else None)
        return mode is not None and any(m in (string_value(mode.value) or "") for m in "wax")
    return not ctx.local_callees(ci) and bool(SAVE_HELPER.match(ci.name))
