import re

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.literals import string_value
from ddpify.check.context import DDP_CLASSES, kwarg
from ddpify.check.rule import Invalid, Report, Rule

GLOBAL_NAMES = re.compile(r"^(global|world)_?rank$", re.IGNORECASE)


class DeviceFromGlobalRank(Rule):
    """This process's GPU chosen by its global rank.

    ## What it does
    Flags `torch.cuda.set_device(...)` and DDP's `device_ids=[...]` given the global rank:
    `dist.get_rank()`, `int(os.environ["RANK"])`, a name `global_rank`/`world_rank`, or a name
    every binding of which is one of these (`local_rank = int(os.environ["RANK"])`). (A plain
    `rank` parameter is left alone: in a one-node `mp.spawn` script it is the local rank.)

    ## Why is this bad?
    The global rank counts the processes of every node: on the second node of two with 8 GPUs
    it is 8 to 15, and `cuda:8` does not exist (`invalid device ordinal`), while one node alone
    runs fine.

    ## Example
    ```python
    torch.cuda.set_device(dist.get_rank())
    ```

    ## Use instead
    ```python
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    ```

    ## Fix safety
    No automatic fix: the local rank may have a name of its own in the script.

    ## References
    - https://pytorch.org/docs/stable/elastic/run.html#environment-variables
    """

    CODE = "DDP125"
    NAME = "device-from-global-rank"
    DISTRIBUTED_ONLY = False  # it reads the rank: distributed whatever the imports
    MESSAGE = "the GPU is chosen by the global rank, which exceeds the GPU count from the second node on; use LOCAL_RANK"
    VALID = [
        "import os, torch\ntorch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n",
        "import torch\ndef main(rank, world):\n    torch.cuda.set_device(rank)\n",
    ]
    INVALID = [
        Invalid("import torch, torch.distributed as dist\ntorch.cuda.set_device(dist.get_rank())\n"),
        Invalid("import os, torch\ntorch.cuda.set_device(int(os.environ['RANK']))\n"),
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net, device_ids=[global_rank])\n"),
        Invalid("import os, torch\nlocal_rank = int(os.environ['RANK'])\ntorch.cuda.set_device(local_rank)\n"),
    ]

    def check(self, ctx):
        for ci in ctx.calls_to(*N.SET_DEVICE):
            if ci.node.args and _global_rank(ctx, ci.node.args[0].value):
                yield Report(ci.node.args[0].value)
        for ci in ctx.calls_to(*DDP_CLASSES):
            ids = kwarg(ci.node, "device_ids")
            if ids is not None and isinstance(ids.value, (cst.List, cst.Tuple)):
                for element in ids.value.elements:
                    if _global_rank(ctx, element.value):
                        yield Report(element.value)


def _global_rank(ctx, value: cst.BaseExpression, seen: frozenset[str] = frozenset()) -> bool:
    if isinstance(value, cst.Call) and value.args and (ctx.code(value.func) == "int"):
        value = value.args[0].value
    if isinstance(value, cst.Call) and ctx.qnames(value.func) & N.GLOBAL_RANK_CALLS:
        return True
    if isinstance(value, cst.Subscript) and len(value.slice) == 1 and isinstance(value.slice[0].slice, cst.Index):
        return string_value(value.slice[0].slice.value) == "RANK" and "environ" in ctx.code(value.value)
    if isinstance(value, cst.Call) and ctx.code(value.func).endswith(("environ.get", "getenv")) and value.args:
        return string_value(value.args[0].value) == "RANK"
    name = value.attr.value if isinstance(value, cst.Attribute) else value.value if isinstance(value, cst.Name) else ""
    return bool(GLOBAL_NAMES.match(name)) or _bound_to_global_rank(ctx, value, seen)


def _bound_to_global_rank(ctx, value: cst.BaseExpression, seen: frozenset[str]) -> bool:
    """A name every binding of which in its function is the global rank (`local_rank =
    int(os.environ["RANK"])`); not a parameter, whose value the caller decides."""
    if not isinstance(value, cst.Name) or value.value in seen:
        return False
    func = ctx.enclosing_func(value)
    if func is not None and value.value in ctx.index.param_names(func):
        return False
    bindings = [b for b in ctx.assignments if b.dotted == value.value and b.func is func]
    return bool(bindings) and all(_global_rank(ctx, b.value, seen | {value.value}) for b in bindings)
