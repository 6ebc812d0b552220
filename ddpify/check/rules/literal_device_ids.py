import libcst as cst

from ddpify.check.context import DDP_CLASSES, int_value, kwarg
from ddpify.check.rule import Invalid, Report, Rule


class LiteralDeviceIds(Rule):
    """`device_ids` or `output_device` of DDP given as a constant.

    ## What it does
    Flags `DistributedDataParallel(model, device_ids=[0])` and `output_device=0`.

    ## Why is this bad?
    Each process must name its own GPU. A constant disagrees with the device the model was
    moved to on every rank but one: DDP raises, or NCCL reports invalid usage (seed 003).

    ## Example
    ```python
    model = DDP(model, device_ids=[0])
    ```

    ## Use instead
    ```python
    model = DDP(model, device_ids=[local_rank])
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html
    """

    CODE = "DDP107"
    NAME = "literal-device-ids"
    DDP_ONLY = True
    MESSAGE = "DDP `device_ids`/`output_device` is a constant; pass `[local_rank]` so each rank uses its own GPU"
    VALID = ["from torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(m, device_ids=[local_rank])\n"]
    INVALID = [
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(m, device_ids=[0])\n"),
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(m, device_ids=[rank], output_device=0)\n"),
    ]

    def check(self, ctx):
        for ci in ctx.calls_to(*DDP_CLASSES):
            ids = kwarg(ci.node, "device_ids")
            if ids is not None and isinstance(ids.value, (cst.List, cst.Tuple)):
                if any(int_value(e.value) is not None for e in ids.value.elements):
                    yield Report(ids)
            out = kwarg(ci.node, "output_device")
            if out is not None and int_value(out.value) is not None:
                yield Report(out)
