from ddpify.analysis import names as N
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._fsdp2 import first_arg, full_state_dict, is_sharded


class FullStateDictOnRankZero(Rule):
    """Full state dict of a sharded model gathered on rank 0 only.

    ## What it does
    Flags, inside a rank-0-only branch (or a function only called from one),
    `get_model_state_dict`, `get_optimizer_state_dict` or `get_state_dict` of a model sharded
    with FSDP2's `fully_shard` when the options ask for the full state dict
    (`options=StateDictOptions(full_state_dict=True, ...)`, also through a name bound to one),
    and `.full_tensor()` of a DTensor in an FSDP2 script.

    A sharded state dict (no `full_state_dict=True`) and `model.state_dict()` gather nothing
    and are not flagged here (saving one on rank 0 only is DDP135).

    ## Why is this bad?
    A full state dict is made by all-gathering every shard: a collective every rank must join.
    Called on rank 0 alone, rank 0 waits for ranks that never come; the other ranks wait at
    their next collective; the job hangs until the timeout (checked under torchrun: with gloo
    the run fails when the other ranks leave). `cpu_offload=True` keeps the result on rank 0
    only, but every rank must still make the call.

    ## Example
    ```python
    if rank == 0:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        torch.save(get_model_state_dict(model, options=options), "model.pt")
    ```

    ## Use instead
    ```python
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)  # every rank
    if rank == 0:
        torch.save(state, "model.pt")
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://docs.pytorch.org/docs/stable/distributed.checkpoint.html#torch.distributed.checkpoint.state_dict.get_model_state_dict
    - https://github.com/pytorch/pytorch/issues/148756
    """

    CODE = "DDP132"
    NAME = "full-state-dict-on-rank-zero"
    MESSAGE = (
        "full state dict of a sharded model gathered on rank 0 only: the all-gather waits for the other ranks (hang); "
        "gather it on every rank, then save on rank 0"
    )
    VALID = [
        "import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
        "from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict\n"
        "fully_shard(model)\nsd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))\n"
        "if dist.get_rank() == 0:\n    save(sd)\n",
        # a sharded state dict gathers nothing
        "import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
        "from torch.distributed.checkpoint.state_dict import get_model_state_dict\n"
        "fully_shard(model)\nif dist.get_rank() == 0:\n    sd = get_model_state_dict(model)\n",
    ]
    INVALID = [
        Invalid(
            "import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
            "from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict\n"
            "fully_shard(model)\nif dist.get_rank() == 0:\n"
            "    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))\n"
        ),
        Invalid(
            "import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
            "from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict\n"
            "full = StateDictOptions(full_state_dict=True, cpu_offload=True)\n"
            "def save(m, opt):\n    return get_optimizer_state_dict(m, opt, options=full)\n"
            "fully_shard(model)\nif dist.get_rank() == 0:\n    save(model, opt)\n"
        ),
        Invalid(
            "import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\nfully_shard(model)\n"
            "if dist.get_rank() == 0:\n    full = {k: v.full_tensor() for k, v in model.state_dict().items()}\n"
        ),
    ]

    def check(self, ctx):
        if not ctx.is_fsdp2:
            return
        for ci in ctx.calls_to(*N.STATE_DICT_GETTERS):
            model = first_arg(ci.node, "model")
            if model is not None and is_sharded(ctx, model) and ctx.in_rank0(ci.node) and full_state_dict(ctx, ci):
                yield Report(ci.node)
        for ci in ctx.method_calls("full_tensor"):
            if not ci.node.args and ctx.in_rank0(ci.node):
                yield Report(ci.node, (
                    "`full_tensor()` on rank 0 only: it all-gathers the DTensor's shards from every rank (hang); "
                    "call it on every rank, then use the result on rank 0"
                ))
