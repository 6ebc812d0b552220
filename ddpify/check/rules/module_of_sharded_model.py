import libcst as cst

from ddpify.check.rule import FIX_SAFE, Invalid, Report, Rule
from ddpify.check.rules._fsdp2 import is_sharded


class ModuleOfShardedModel(Rule):
    """`.module` read from a model sharded with `fully_shard`.

    ## What it does
    Flags `model.module` where `model` holds a model sharded with FSDP2's `fully_shard` (in
    place: `fully_shard(model)` returns the same object). Reads under a test of what the name
    holds (`isinstance(model, DDP)`, `hasattr(model, "module")`), names that may hold a DDP
    wrapper instead, and files whose own classes set a `module` attribute are left alone.

    ## Why is this bad?
    `fully_shard` wraps nothing: the model keeps its class (a subclass made by FSDP) and its
    attributes, and has no `module` attribute unless the network defines one. Code kept from a
    DDP script (`model.module.state_dict()`, `model.module.config`) raises
    `AttributeError: '...' object has no attribute 'module'`, often late, at the first
    checkpoint or evaluation.

    ## Example
    ```python
    fully_shard(model)
    n_layer = model.module.config.n_layer
    ```

    ## Use instead
    ```python
    fully_shard(model)
    n_layer = model.config.n_layer
    ```

    ## Fix safety
    Safe: the read fails today; the sharded model is the network itself, so dropping `.module`
    reads what the code meant.

    ## References
    - https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
    - https://github.com/pytorch/pytorch/issues/78607
    """

    CODE = "DDP134"
    NAME = "module-of-sharded-model"
    MESSAGE = (
        "a model sharded with `fully_shard` has no `.module` (AttributeError): it is the network itself; drop `.module`"
    )
    FIX = FIX_SAFE
    VALID = [
        "from torch.distributed.fsdp import fully_shard\nfully_shard(model)\nsd = model.state_dict()\n",
        "from torch.distributed.fsdp import fully_shard\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "if fsdp:\n    fully_shard(model)\nelse:\n    model = DDP(model)\n"
        "net = model.module if isinstance(model, DDP) else model\n",
    ]
    INVALID = [
        Invalid(
            "from torch.distributed.fsdp import fully_shard\nfully_shard(model)\nsd = model.module.state_dict()\n",
            "from torch.distributed.fsdp import fully_shard\nfully_shard(model)\nsd = model.state_dict()\n",
        ),
    ]

    def check(self, ctx):
        if not ctx.is_fsdp2 or any(b.dotted == "self.module" for b in ctx.assignments):
            return  # a network of the program's own has a `module` attribute
        for node in ctx.index.parents:
            if not (isinstance(node, cst.Attribute) and node.attr.value == "module"):
                continue
            if isinstance(node.value, (cst.Name, cst.Attribute)) and is_sharded(ctx, node.value):
                if not _assigned(ctx, node) and not _type_tested(ctx, node):
                    held = ctx.code(node.value)
                    message = (
                        f"`{held}` is sharded in place by `fully_shard` and has no `.module` (AttributeError): use `{held}`"
                    )
                    yield Report(node, message, fixes=[(node, node.value)])


def _type_tested(ctx, node: cst.Attribute) -> bool:
    """`m.module if isinstance(m, DDP) else m`, `if hasattr(m, "module"): ...`: the code asks
    what it holds first."""
    held = ctx.code(node.value)
    return any(
        isinstance(p, (cst.If, cst.IfExp))
        and any(f"{test}({held}," in ctx.code(p.test) for test in ("isinstance", "hasattr"))
        for p in ctx.ancestors(node)
    )


def _assigned(ctx, node: cst.Attribute) -> bool:
    parent = ctx.parent(node)
    return isinstance(parent, (cst.AssignTarget, cst.AugAssign, cst.AnnAssign)) and getattr(parent, "target", None) is node
