from ddpify.check.context import DATALOADER, kwarg
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import dataset_classes, is_iterable_dataset


class SamplerOnIterableDataset(Rule):
    """A `DistributedSampler` given to the loader of an iterable dataset.

    ## What it does
    Flags `DataLoader(data, sampler=DistributedSampler(data))` (the sampler inline or bound to
    a name) when `data` is made by a class of the program that derives from `IterableDataset`.

    ## Why is this bad?
    A DataLoader over an `IterableDataset` takes no sampler: it raises `ValueError:
    DataLoader with IterableDataset: expected unspecified sampler option` before the first
    batch. An iterable dataset is split by the dataset itself: its `__iter__` keeps the items
    of this rank (`itertools.islice(stream, rank, None, world_size)`), and of this worker.

    ## Example
    ```python
    class Shards(IterableDataset):
        def __iter__(self):
            yield from read_all()

    loader = DataLoader(Shards(), sampler=DistributedSampler(Shards()))
    ```

    ## Use instead
    ```python
    class Shards(IterableDataset):
        def __iter__(self):
            yield from itertools.islice(read_all(), dist.get_rank(), None, dist.get_world_size())

    loader = DataLoader(Shards(), batch_size=32)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://github.com/EarthNets/Dataset4EO/issues/5
    - https://pytorch.org/docs/stable/data.html#iterable-style-datasets
    """

    CODE = "DDP166"
    NAME = "sampler-on-iterable-dataset"
    DISTRIBUTED_ONLY = False
    MESSAGE = "a DistributedSampler given to the loader of an IterableDataset: the DataLoader raises; split the items by rank in the dataset's `__iter__`"
    VALID = [
        "from torch.utils.data import DataLoader, Dataset, DistributedSampler\nclass D(Dataset):\n    pass\n"
        "data = D()\nloader = DataLoader(data, sampler=DistributedSampler(data))\n",
    ]
    INVALID = [
        Invalid("from torch.utils.data import DataLoader, IterableDataset, DistributedSampler\nclass D(IterableDataset):\n"
                "    pass\ndata = D()\nloader = DataLoader(data, sampler=DistributedSampler(data))\n"),
    ]

    def check(self, ctx):
        for ci in ctx.calls_to(*DATALOADER):
            sampler = kwarg(ci.node, "sampler")
            if sampler is None or not ctx.is_distributed_sampler(sampler.value):
                continue
            data = kwarg(ci.node, "dataset") or next((a for a in ci.node.args if a.keyword is None), None)
            if data is not None and any(is_iterable_dataset(ctx, cls) for cls in dataset_classes(ctx, data.value, ci.func)):
                yield Report(sampler)

