import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._fsdp2 import first_arg, full_state_dict, is_sharded, last_value


class SaveShardedStateDictOnRankZero(Rule):
    """State dict of a sharded model saved by rank 0 alone.

    ## What it does
    Flags `torch.save` on rank 0 only (a rank-0 branch, or a function only called from one) of
    the state dict of a model sharded with FSDP2's `fully_shard`: `model.state_dict()`, or
    `get_model_state_dict(model)` / `get_state_dict(model, optimizer)` without
    `full_state_dict=True`, in the saved object or in a name assigned from them just before.

    ## Why is this bad?
    A sharded model's state dict holds DTensors: each rank's own shard of every parameter
    (checked under torchrun: half of each weight's rows with two ranks). Saved by rank 0 alone,
    the file has rank 0's shards only; the rest of the model is lost, and the file does not load
    into the network it came from: `load_state_dict` raises `got mixed torch.Tensor and DTensor`.
    Under DDP every rank held the whole model, so saving on rank 0 was enough.

    ## Example
    ```python
    if rank == 0:
        torch.save(model.state_dict(), "model.pt")
    ```

    ## Use instead
    ```python
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)  # every rank: gathers the shards
    if rank == 0:
        torch.save(state, "model.pt")
    ```
    or save the shards of every rank with `torch.distributed.checkpoint.save`.

    ## Fix safety
    No automatic fix: gathering must move out of the rank-0 branch.

    ## References
    - https://docs.pytorch.org/docs/stable/distributed.checkpoint.html
    - https://github.com/ibrahimethemhamamci/CT-CLIP/issues/16
    """

    CODE = "DDP135"
    NAME = "save-sharded-state-dict-on-rank-zero"
    MESSAGE = (
        "rank 0 saves the state dict of a sharded model: it holds rank 0's shards only (DTensors) and does not load "
        "into the network; gather it with `get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, "
        "cpu_offload=True))` on every rank, then save on rank 0"
    )
    VALID = [
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
        "from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict\nfully_shard(model)\n"
        "sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
        "if dist.get_rank() == 0:\n    torch.save(sd, 'm.pt')\n",
        # every rank saves its own shards
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\nfully_shard(model)\n"
        "torch.save(model.state_dict(), f'shard{dist.get_rank()}.pt')\n",
    ]
    INVALID = [
        Invalid(
            "import torch\nimport torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\nfully_shard(model)\n"
            "if dist.get_rank() == 0:\n    torch.save({'model': model.state_dict()}, 'm.pt')\n"
        ),
        Invalid(
            "import torch\nimport torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
            "from torch.distributed.checkpoint.state_dict import get_model_state_dict\nfully_shard(model)\n"
            "sd = get_model_state_dict(model)\nif dist.get_rank() == 0:\n    torch.save(sd, 'm.pt')\n"
        ),
    ]

    def check(self, ctx):
        if not ctx.is_fsdp2:
            return
        for save in ctx.calls_to(*N.TORCH_SAVE):
            saved = first_arg(save.node, "obj")
            if saved is None or not ctx.in_rank0(save.node):
                continue
            for node in _sharded_state(ctx, saved, save):
                yield Report(node)


def _sharded_state(ctx, saved: cst.CSTNode, save) -> list[cst.CSTNode]:
    """The parts of the saved object that are a sharded state dict (the name that holds one, for
    a state dict taken before the save)."""
    if _gathers(saved):
        return []  # `{k: v.full_tensor() for k, v in model.state_dict().items()}`: gathered (DDP132 if on rank 0 only)
    found = []
    for node in iter_nodes(saved):
        if isinstance(node, cst.Call) and _shard_getter(ctx, node):
            found.append(node)
        elif isinstance(node, cst.Name) and not _attribute_name(ctx, node):
            value = last_value(ctx, node.value, save.func, save.node)
            if isinstance(value, (cst.Call, cst.Dict)) and not _gathers(value) and any(
                isinstance(n, cst.Call) and _shard_getter(ctx, n) for n in iter_nodes(value)
            ):
                found.append(node)
    return found


def _gathers(node: cst.CSTNode) -> bool:
    """Does the expression gather shards itself (`.full_tensor()`)?"""
    return any(
        isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value == "full_tensor"
        for n in iter_nodes(node)
    )


def _shard_getter(ctx, call: cst.Call) -> bool:
    """`model.state_dict()` or a sharded `get_model_state_dict(model)` of a sharded model."""
    ci = ctx.info(call)
    if ci.name == "state_dict" and ci.receiver is not None and not call.args:
        return is_sharded(ctx, ci.receiver)
    if ci.qnames & (N.GET_MODEL_STATE_DICT | N.GET_STATE_DICT):
        model = first_arg(call, "model")
        return model is not None and is_sharded(ctx, model) and full_state_dict(ctx, ci) is False
    return False


def _attribute_name(ctx, name: cst.Name) -> bool:
    parent = ctx.parent(name)
    if isinstance(parent, cst.Attribute):
        return parent.attr is name
    return isinstance(parent, cst.Arg) and parent.keyword is name
