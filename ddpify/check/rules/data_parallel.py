import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.rule import Invalid, Report, Rule


class DataParallel(Rule):
    """`nn.DataParallel` instead of DistributedDataParallel.

    ## What it does
    Flags `torch.nn.DataParallel(...)`, in any script, except as the other branch of an `if` that
    wraps the model in DistributedDataParallel (`if args.distributed: ... else:
    nn.DataParallel(model)`): there it is the fallback of a run without a process group. Files
    that shard with FSDP2's `fully_shard` are left alone: DDP is not their way forward, and
    their DataParallel is the fallback of the sharded run.

    ## Why is this bad?
    DataParallel runs one process with one thread per GPU: the GIL, a scatter/gather through
    GPU 0 every step and an unbalanced GPU 0 make it slower than DDP even on one machine,
    and it is not multi-node. PyTorch recommends DDP.

    ## Example
    ```python
    model = nn.DataParallel(model)
    ```

    ## Use instead
    ```python
    model = DDP(model.to(local_rank), device_ids=[local_rank])  # under torchrun
    ```

    ## Fix safety
    No automatic fix here; `ddpify convert` rewrites the script.

    ## References
    - https://pytorch.org/docs/stable/notes/cuda.html#cuda-nn-ddp-instead
    """

    CODE = "DDP201"
    NAME = "data-parallel"
    DDP_ONLY = True
    MESSAGE = "`nn.DataParallel` is slower than DDP and single-node only; use DistributedDataParallel (`ddpify convert`)"
    DISTRIBUTED_ONLY = False
    SEVERITY = "warning"
    VALID = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(net)\n",
        "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "if distributed:\n    m = DDP(net)\nelse:\n    m = torch.nn.DataParallel(net)\n",
        "import torch\nfrom torch.distributed.fsdp import fully_shard\n"
        "if distributed:\n    fully_shard(net)\nelse:\n    net = torch.nn.DataParallel(net)\n",
    ]
    INVALID = [Invalid("import torch.nn as nn\nm = nn.DataParallel(net)\n"),
               Invalid("from torch.nn import DataParallel as DP\nm = DP(net)\n")]

    def check(self, ctx):
        if ctx.is_fsdp2:
            return
        for ci in ctx.calls_to(*N.DATA_PARALLEL):
            if not _fallback_of_ddp(ctx, ci.node):
                yield Report(ci.node)


def _fallback_of_ddp(ctx, call: cst.Call) -> bool:
    """`if args.distributed: DDP(...) else: nn.DataParallel(...)` (either way round, `elif` too):
    the other branch of an `if` around the call wraps in DDP."""
    wraps = [ci.node for ci in ctx.ddp_calls]
    child = call
    for parent in ctx.ancestors(call):
        if isinstance(parent, cst.FunctionDef):
            return False
        if isinstance(parent, cst.If):
            other = parent.orelse if child is parent.body else parent.body
            if other is not None and any(other in set(ctx.ancestors(w)) for w in wraps):
                return True
        child = parent
    return False
