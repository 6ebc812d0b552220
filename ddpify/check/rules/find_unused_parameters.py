from ddpify.check.context import DDP_CLASSES, is_true, kwarg
from ddpify.check.rule import Invalid, Report, Rule


class FindUnusedParameters(Rule):
    """`find_unused_parameters=True` costs a graph traversal every step.

    ## What it does
    Flags `DistributedDataParallel(..., find_unused_parameters=True)`. Off by default: it is
    required when some parameters really get no gradient.

    ## Why is this bad?
    DDP walks the autograd graph after every forward to find parameters without gradients,
    and cannot start reducing early: slower steps for models that use every parameter.

    ## Example
    ```python
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    ```

    ## Use instead
    ```python
    model = DDP(model, device_ids=[local_rank])  # or static_graph=True
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html
    """

    CODE = "DDP905"
    NAME = "find-unused-parameters"
    DDP_ONLY = True
    MESSAGE = "`find_unused_parameters=True` traverses the graph every step; drop it if every parameter gets a gradient"
    DEFAULT = False
    SEVERITY = "warning"
    VALID = ["from torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(net)\n"]
    INVALID = [Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(net, find_unused_parameters=True)\n")]

    def check(self, ctx):
        for ci in ctx.calls_to(*DDP_CLASSES):
            k = kwarg(ci.node, "find_unused_parameters")
            if k is not None and is_true(k.value):
                yield Report(k)
