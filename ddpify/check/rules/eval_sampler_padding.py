from ddpify.check.context import DISTRIBUTED_SAMPLER, is_false, is_true, kwarg
from ddpify.check.rule import Invalid, Report, Rule


class EvalSamplerPadding(Rule):
    """Evaluation `DistributedSampler` pads the dataset with duplicates.

    ## What it does
    Flags `DistributedSampler(..., shuffle=False)` (the evaluation sampler) without `drop_last=True`.
    Off by default: correct when the dataset size is a multiple of the world size or the
    metric is only approximate.

    ## Why is this bad?
    To give every rank the same number of samples the sampler repeats up to N-1 samples;
    metrics reduced over ranks count them twice.

    ## Example
    ```python
    val_sampler = DistributedSampler(val_set, shuffle=False)
    ```

    ## Use instead
    ```python
    # evaluate the remainder separately, or count only the first len(val_set) samples
    val_sampler = DistributedSampler(val_set, shuffle=False)
    n_seen = torch.tensor(len(val_set))  # divide summed metrics by the true size
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://github.com/pytorch/examples/blob/main/imagenet/main.py (aux_val_loader)
    """

    CODE = "DDP901"
    NAME = "eval-sampler-padding"
    MESSAGE = "evaluation DistributedSampler pads with duplicate samples that skew metrics; divide by the true dataset size"
    DEFAULT = False
    SEVERITY = "warning"
    VALID = ["from torch.utils.data import DistributedSampler\ns = DistributedSampler(ds)\n"]
    INVALID = [Invalid("from torch.utils.data import DistributedSampler\ns = DistributedSampler(ds, shuffle=False)\n")]

    def check(self, ctx):
        for ci in ctx.calls_to(*DISTRIBUTED_SAMPLER):
            shuffle, drop = kwarg(ci.node, "shuffle"), kwarg(ci.node, "drop_last")
            if shuffle is not None and is_false(shuffle.value) and not (drop and is_true(drop.value)):
                yield Report(ci.node)
