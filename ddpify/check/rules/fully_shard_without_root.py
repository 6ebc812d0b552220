from typing import Optional

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.check.context import dotted_name, is_false
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._fsdp2 import optimizer_sources, prefixes, root_of, shards, unresolved

# nn modules without parameters: a network whose other attributes are only these has nothing
# outside its sharded blocks.
PARAMETERLESS = frozenset(
    {"Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "ReLU", "ReLU6", "LeakyReLU", "GELU", "SiLU",
     "Mish", "Tanh", "Sigmoid", "Softmax", "LogSoftmax", "Identity", "Flatten", "Unflatten", "MaxPool1d", "MaxPool2d",
     "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
     "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "Upsample", "ELU", "Softplus", "Hardtanh", "Hardswish"}
)  # fmt: skip


class FullyShardWithoutRoot(Rule):
    """`fully_shard` applied to a model's blocks but never to the model.

    ## What it does
    Flags the first `fully_shard` of a module inside a model (`for block in model.layers:
    fully_shard(block)`, `fully_shard(model.encoder)`) when the program never calls
    `fully_shard` on the model itself, and an optimizer trains the whole model
    (`AdamW(model.parameters())`).

    It stays silent when it cannot be sure the model has parameters of its own outside the
    sharded blocks (a class of the file with nothing else but parameter-free layers, or blocks
    taken from `model.modules()`/`model.children()`), when something is sharded that it cannot
    name, when the model is also wrapped another way (DDP, `replicate`, FSDP1), when the
    model is handed to a function it cannot see (which might shard it), or when the program
    freezes parameters (`requires_grad_(False)`: what stays unsharded may be the frozen part).

    ## Why is this bad?
    FSDP2 manages the parameters of the modules passed to `fully_shard`, and those of the
    root's other submodules once the root is passed too. Without `fully_shard(model)`, the
    embeddings, final norm and output head stay ordinary tensors on every rank: nothing
    reduces their gradients across ranks, so each rank trains its own copy on its own data and
    the copies drift apart silently (checked under torchrun: the ranks' weights differ after a
    few steps).

    ## Example
    ```python
    for block in model.layers:
        fully_shard(block)
    optimizer = torch.optim.AdamW(model.parameters())
    ```

    ## Use instead
    ```python
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)  # the rest of the parameters: embeddings, norm, head
    optimizer = torch.optim.AdamW(model.parameters())
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
    - https://github.com/Tencent-Hunyuan/UniRL/pull/7
    """

    CODE = "DDP136"
    NAME = "fully-shard-without-root"
    MESSAGE = (
        "`fully_shard` is applied to blocks of the model but never to the model: its other parameters (embeddings, "
        "head) stay unsharded and their gradients are not reduced across ranks; call `fully_shard(model)` after the blocks"
    )
    VALID = [
        "import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\n"
        "for layer in model.layers:\n    fully_shard(layer)\nfully_shard(model)\n"
        "opt = torch.optim.AdamW(model.parameters())\n",
        # a container of blocks only
        "import torch\nimport torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard\n"
        "class Stack(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.layers = nn.ModuleList([Block() for _ in range(4)])\n        self.drop = nn.Dropout(0.1)\n"
        "model = Stack()\nfor layer in model.layers:\n    fully_shard(layer)\nopt = torch.optim.AdamW(model.parameters())\n",
        # the embedding outside the blocks is frozen
        "import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\nmodel.embed.requires_grad_(False)\n"
        "for layer in model.layers:\n    fully_shard(layer)\nopt = torch.optim.AdamW(model.parameters())\n",
    ]
    INVALID = [
        Invalid(
            "import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\n"
            "for layer in model.layers:\n    fully_shard(layer)\nopt = torch.optim.AdamW(model.parameters())\n"
        ),
    ]

    def check(self, ctx):
        found = shards(ctx)
        if not found or unresolved(ctx):
            return
        reported = set()
        for shard in found:
            root = root_of(shard.path)
            if root == shard.path or root in reported:
                continue  # the model itself (or its whole contents: `model.modules()`)
            if shard.func is not None and root.split(".")[0] in ctx.index.param_names(shard.func):
                continue  # a helper's argument: judged where the helper is called
            if any(other.path == root for other in found):
                continue
            if not _trained_whole(ctx, root) or _wrapped_otherwise(ctx, root) or _handed_away(ctx, root, shard):
                continue
            if _freezes_something(ctx):
                continue  # frozen parameters left unsharded are fine (no gradient to reduce)
            inside = [other.path[len(root) + 1 :] for other in found if other.path.startswith(root + ".")]
            sharded_attrs = {path.split(".")[0] for path in inside}
            if _nothing_else(ctx, root, shard, sharded_attrs):
                continue
            reported.add(root)
            yield Report(shard.node, (
                f"`fully_shard` is applied to blocks of `{root}` but never to `{root}`: its other parameters (embeddings, "
                f"head) stay unsharded and their gradients are not reduced across ranks; call `fully_shard({root})` after "
                "the blocks"
            ))


def _trained_whole(ctx, root: str) -> bool:
    """An optimizer of this file is built from the whole model's parameters."""
    return any(
        root in optimizer_sources(ctx, ci) for ci in ctx.calls if ctx.index.root_of(ci.node) is ctx.module
    )


def _freezes_something(ctx) -> bool:
    """Does the program freeze parameters (`requires_grad_(False)`, `p.requires_grad = False`)?
    What stays outside the shards may then be the frozen part."""
    if any(ci.name == "requires_grad_" and ci.node.args and is_false(ci.node.args[0].value) for ci in ctx.calls):
        return True
    return any(b.dotted.endswith(".requires_grad") and is_false(b.value) for b in ctx.assignments)


def _wrapped_otherwise(ctx, root: str) -> bool:
    """The model is also wrapped by DDP, `replicate` or FSDP1: its other parameters are reduced there."""
    wrappers = N.DDP_CLASSES | N.REPLICATE | N.FSDP1_CLASSES
    for ci in ctx.calls:
        if ci.qnames & wrappers and ci.node.args and dotted_name(ci.node.args[0].value) in (root, *prefixes(root)):
            return True
    return False


def _handed_away(ctx, root: str, shard) -> bool:
    """The model is passed to a function this file cannot see (a library's `apply_fsdp(model)`
    might shard it); torch's own functions and the file's functions are known."""
    for ci in ctx.calls:
        if ci.func is not shard.func or ctx.local_callees(ci) or ci.qname_startswith(N.TORCH_PREFIX):
            continue
        if any(q.startswith("builtins.") for q in ci.qnames):
            continue
        if any(not a.star and dotted_name(a.value) == root for a in ci.node.args):
            return True
    return False


def _nothing_else(ctx, root: str, shard, sharded_attrs: set[str]) -> bool:
    """Is the model an instance of a class of the program whose `__init__` sets nothing with
    parameters besides the sharded blocks?"""
    cls = _class_of(ctx, root, shard)
    if cls is None:
        return False  # not known: a library's model has embeddings and a head
    init = next((s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__"), None)
    if init is None:
        return False
    for node in iter_nodes(init.body):
        if isinstance(node, (cst.Assign, cst.AnnAssign)):
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            for target in targets:
                name = dotted_name(target) or ""
                if not name.startswith("self.") or name.split(".")[1] in sharded_attrs:
                    continue
                if _has_parameters(node.value):
                    return False
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in (
            "register_parameter", "add_module", "register_module"
        ):
            return False
    return True


def _has_parameters(value: Optional[cst.BaseExpression]) -> bool:
    """A value that may hold parameters: a call of anything but a parameter-free nn layer."""
    if not isinstance(value, cst.Call):
        return False
    name = dotted_name(value.func) or ""
    return name.split(".")[-1] not in PARAMETERLESS


def _class_of(ctx, root: str, shard) -> Optional[cst.ClassDef]:
    """The class of the program the model was made from (`model = Transformer(cfg)`)."""
    if "." in root:
        return None
    for b in ctx.assignments:
        if b.dotted == root and b.func is shard.func and isinstance(b.value, cst.Call):
            name = dotted_name(b.value.func)
            for cls in ctx.index.classes:
                if name is not None and cls.name.value == name.split(".")[-1]:
                    return cls
            return None
    return None
