from ddpify.check.context import DATALOADER, has_star_kwargs, int_value, kwarg
from ddpify.check.rule import Invalid, Report, Rule


class DataLoaderWithoutWorkers(Rule):
    """DataLoader loading in the training process.

    ## What it does
    Flags a `DataLoader` without `num_workers` (or with `num_workers=0`) in a distributed script.
    Off by default: small in-memory datasets do not need workers.

    ## Why is this bad?
    With several GPUs per machine, loading and augmenting in the main process often starves
    the GPUs; worker processes overlap loading with compute.

    ## Example
    ```python
    loader = DataLoader(ds, batch_size=64, sampler=sampler)
    ```

    ## Use instead
    ```python
    loader = DataLoader(ds, batch_size=64, sampler=sampler, num_workers=4, pin_memory=True)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/data.html#single-and-multi-process-data-loading
    """

    CODE = "DDP902"
    NAME = "dataloader-without-workers"
    MESSAGE = "DataLoader loads data in the training process; set `num_workers` (and `pin_memory=True`)"
    DEFAULT = False
    SEVERITY = "warning"
    VALID = ["import torch.distributed as dist\nfrom torch.utils.data import DataLoader\nl = DataLoader(ds, num_workers=4)\n"]
    INVALID = [Invalid("import torch.distributed as dist\nfrom torch.utils.data import DataLoader\nl = DataLoader(ds)\n")]

    def check(self, ctx):
        for ci in ctx.calls_to(*DATALOADER):
            workers = kwarg(ci.node, "num_workers")
            if has_star_kwargs(ci.node) or len(ci.node.args) > 5 and ci.node.args[5].keyword is None:
                continue
            if workers is None or int_value(workers.value) == 0:
                yield Report(ci.node)
