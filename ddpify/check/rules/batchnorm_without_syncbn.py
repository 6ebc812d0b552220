from ddpify.analysis import names as N
from ddpify.check.context import DDP_CLASSES
from ddpify.check.rule import Invalid, Report, Rule


class BatchNormWithoutSyncBatchNorm(Rule):
    """BatchNorm statistics computed per GPU.

    ## What it does
    Flags BatchNorm layers in a DDP script that never calls
    `SyncBatchNorm.convert_sync_batchnorm`. Off by default: per-GPU statistics are fine
    with large per-GPU batches.

    ## Why is this bad?
    Each rank normalises with the statistics of its own B samples, not the N×B of the
    global batch. It matters when the per-GPU batch is small (a handful of images per GPU, as
    in detection and segmentation): the statistics get noisy and accuracy drops. With dozens
    of samples per GPU, per-GPU statistics are fine, and SyncBatchNorm's extra all-reduce every
    layer only costs time.

    ## Example
    ```python
    model = DDP(model, device_ids=[local_rank])
    ```

    ## Use instead
    ```python
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    ```

    ## Fix safety
    No automatic fix (`ddpify convert --sync-batchnorm` adds it).

    ## References
    - https://pytorch.org/docs/stable/generated/torch.nn.SyncBatchNorm.html
    """

    CODE = "DDP904"
    NAME = "batchnorm-without-syncbn"
    MESSAGE = (
        "BatchNorm uses per-GPU statistics under DDP: with a small per-GPU batch (a few samples) convert with "
        "`nn.SyncBatchNorm.convert_sync_batchnorm(model)`; with dozens per GPU it does not matter"
    )
    DEFAULT = False
    SEVERITY = "warning"
    VALID = ["from torch import nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nbn = nn.BatchNorm2d(3)\n"
             "m = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(net))\n"]
    INVALID = [Invalid("from torch import nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nbn = nn.BatchNorm2d(3)\nm = DDP(net)\n")]

    def check(self, ctx):
        if not ctx.calls_to(*DDP_CLASSES) or ctx.method_calls("convert_sync_batchnorm"):
            return
        for ci in ctx.calls_to(*N.BATCHNORMS):
            yield Report(ci.node)
