from ddpify.check.context import DATALOADER, is_true, kwarg
from ddpify.check.fix import remove_arg
from ddpify.check.rule import FIX_SAFE, Invalid, Report, Rule


class ShuffleWithSampler(Rule):
    """`shuffle=True` together with `sampler=`.

    ## What it does
    Flags `DataLoader(..., sampler=..., shuffle=True)`.

    ## Why is this bad?
    `DataLoader` raises `ValueError: sampler option is mutually exclusive with shuffle`.
    With a `DistributedSampler`, shuffling is the sampler's job (`DistributedSampler(shuffle=True)`,
    the default) together with `sampler.set_epoch(epoch)`.

    ## Example
    ```python
    loader = DataLoader(ds, batch_size=32, shuffle=True, sampler=DistributedSampler(ds))
    ```

    ## Use instead
    ```python
    loader = DataLoader(ds, batch_size=32, sampler=DistributedSampler(ds, shuffle=True))
    ```

    ## Fix safety
    Safe: the call raised before; removing `shuffle=True` keeps the sampler's own order.

    ## References
    - https://pytorch.org/docs/stable/data.html#torch.utils.data.DataLoader
    """

    CODE = "DDP111"
    NAME = "shuffle-with-sampler"
    MESSAGE = "`shuffle=True` with `sampler=` raises ValueError; remove `shuffle` and let the sampler shuffle"
    DISTRIBUTED_ONLY = False
    FIX = FIX_SAFE
    VALID = ["from torch.utils.data import DataLoader\nl = DataLoader(ds, sampler=s)\n",
             "from torch.utils.data import DataLoader\nl = DataLoader(ds, sampler=s, shuffle=False)\n"]
    INVALID = [
        Invalid(
            "from torch.utils.data import DataLoader\nl = DataLoader(ds, shuffle=True, sampler=s)\n",
            "from torch.utils.data import DataLoader\nl = DataLoader(ds, sampler=s)\n",
        ),
        Invalid(
            "from torch.utils.data import DataLoader\nl = DataLoader(ds, sampler=s, shuffle=True)\n",
            "from torch.utils.data import DataLoader\nl = DataLoader(ds, sampler=s)\n",
        ),
    ]

    def check(self, ctx):
        for ci in ctx.calls_to(*DATALOADER):
            shuffle = kwarg(ci.node, "shuffle")
            if shuffle is not None and is_true(shuffle.value) and kwarg(ci.node, "sampler"):
                yield Report(shuffle, fixes=[(ci.node, remove_arg(ci.node, shuffle))])
