from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import single_process_branch


class LoadIntoDDPModel(Rule):
    """`load_state_dict` on the DDP wrapper.

    ## What it does
    Flags `ddp_model.load_state_dict(...)` where `ddp_model` holds the `DistributedDataParallel` wrapper.
    A program that also saves the wrapper's own `state_dict()` (a resume of its own checkpoints,
    a best-model copy) loads `module.` keys into the wrapper: that round trip is consistent and
    is not flagged (nor is its save, DDP120).

    ## Why is this bad?
    The wrapper expects keys prefixed with `module.`; a checkpoint from the single-GPU model
    (or from `model.module.state_dict()`) fails with missing/unexpected keys.

    ## Example
    ```python
    model = DDP(model, device_ids=[local_rank])
    model.load_state_dict(torch.load(path, map_location="cpu"))
    ```

    ## Use instead
    ```python
    model.load_state_dict(torch.load(path, map_location="cpu"))  # before wrapping
    model = DDP(model, device_ids=[local_rank])
    ```

    ## Fix safety
    No automatic fix: it depends on how the checkpoint was saved.

    ## References
    - https://pytorch.org/tutorials/intermediate/ddp_tutorial.html#save-and-load-checkpoints
    """

    CODE = "DDP121"
    NAME = "load-into-ddp-model"
    DDP_ONLY = True
    MESSAGE = "`load_state_dict` on the DDP wrapper expects `module.` keys; load before wrapping or into `model.module`"
    VALID = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\nnet.load_state_dict(sd)\nmodel = DDP(net)\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\nmodel.module.load_state_dict(sd)\n",
    ]
    INVALID = [
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\nmodel.load_state_dict(sd)\n"),
    ]

    def check(self, ctx):
        if ctx.ddp_state_round_trip:
            return  # the wrapper's own state_dict, loaded back into it: consistent
        for ci in ctx.method_calls("load_state_dict"):
            if ctx.is_ddp(ci.receiver) and not single_process_branch(ctx, ci.node):
                yield Report(ci.node)  # (the `else:` of `if dist.is_initialized():` holds the plain model)
