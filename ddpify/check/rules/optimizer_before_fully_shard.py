import libcst as cst

from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import may_precede
from ddpify.check.rules._fsdp2 import optimizer_sources, overlap, shards


class OptimizerBeforeFullyShard(Rule):
    """Optimizer built before `fully_shard` shards its model.

    ## What it does
    Flags an optimizer built from a module's parameters (`AdamW(model.parameters())`, parameter
    groups from `model.named_parameters()`, a local function or a model method that builds one,
    like `model.configure_optimizers(...)`) when, later in the same function, FSDP2's
    `fully_shard` shards that module or a module inside it (`for block in model.layers:
    fully_shard(block)`, `fully_shard(model)`). An optimizer built again after the sharding is
    not flagged, nor is one built after every child of the model was sharded and before only
    the model itself is (`for layer in model: fully_shard(layer)`, optimizer, `fully_shard(model)`).

    ## Why is this bad?
    `fully_shard` replaces each parameter of the module with a new `nn.Parameter` holding a
    DTensor shard. The optimizer still holds the original parameters, which no longer take part
    in the forward: they never get a gradient, so `optimizer.step()` changes nothing and the
    model does not train, without an error. Saving the optimizer with
    `get_optimizer_state_dict(model, optimizer)` then fails (checked under torchrun:
    `KeyError`), as its parameters are not the model's. Under DDP the order did not matter: the
    wrapper keeps the module's parameters.

    ## Example
    ```python
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    ```

    ## Use instead
    ```python
    model = Transformer(config)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ```

    ## Fix safety
    No automatic fix: moving the optimizer can move what it depends on (a learning-rate
    scheduler, a resumed state).

    ## References
    - https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
    - https://github.com/mosaicml/composer/pull/3822
    """

    CODE = "DDP131"
    NAME = "optimizer-before-fully-shard"
    MESSAGE = (
        "optimizer built before `fully_shard` shards its model: it keeps the original parameters, which sharding "
        "replaces, so its steps train nothing; build the optimizer after `fully_shard`"
    )
    VALID = [
        "import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\nfully_shard(model)\n"
        "opt = torch.optim.AdamW(model.parameters())\n",
        # the optimizer of another module
        "import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel, critic = Net(), Net()\n"
        "opt = torch.optim.SGD(critic.parameters(), lr=0.1)\nfully_shard(model)\n",
        # built again after sharding
        "import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfully_shard(model)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
        # every child sharded first: the root shard takes nothing the optimizer holds
        "import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel = make_blocks()\n"
        "for layer in model:\n    fully_shard(layer)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "fully_shard(model)\n",
    ]
    INVALID = [
        Invalid(
            "import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\n"
            "opt = torch.optim.AdamW(model.parameters())\nfor layer in model.layers:\n    fully_shard(layer)\n"
            "fully_shard(model)\n"
        ),
        Invalid(
            "import torch\nfrom torch.distributed.fsdp import fully_shard\n"
            "def build_optimizer(net):\n    return torch.optim.SGD(net.parameters(), lr=0.1)\n"
            "def main():\n    model = Net()\n    opt = build_optimizer(model)\n    fully_shard(model)\n"
        ),
    ]

    def check(self, ctx):
        found = shards(ctx)
        if not found:
            return
        builds = [(ci, optimizer_sources(ctx, ci)) for ci in ctx.calls if ctx.index.root_of(ci.node) is ctx.module]
        builds = [(ci, sources) for ci, sources in builds if sources]
        for ci, sources in builds:
            for shard in found:
                if shard.func is not ci.func or not may_precede(ctx, ci.node, shard.node):
                    continue
                if not any(overlap(source, shard.path) for source in sources):
                    continue
                if _rebuilt(ctx, shard, builds) or _repointed(ctx, ci, shard) or _only_leftovers(ctx, ci, shard, found):
                    continue
                yield Report(ci.node)
                break


def _only_leftovers(ctx, ci, shard, found) -> bool:
    """`for layer in model: fully_shard(layer)` (every child of `model`) before the optimizer,
    `fully_shard(model)` after it: the root shard takes only what the children left, which for
    a container of blocks is nothing."""
    return shard.exact and any(
        other.path == shard.path and not other.exact and other.func is ci.func and may_precede(ctx, other.node, ci.node)
        for other in found
    )


def _rebuilt(ctx, shard, builds) -> bool:
    """An optimizer of the same module is built again after the sharding."""
    return any(
        other.func is shard.func and may_precede(ctx, shard.node, other.node)
        and any(overlap(s, shard.path) for s in sources)
        for other, sources in builds
    )  # fmt: skip


def _repointed(ctx, ci, shard) -> bool:
    """`opt.add_param_group(...)`, `opt.param_groups[0]["params"] = ...` after the sharding: the
    script hands the sharded parameters over itself."""
    parent = ctx.parent(ci.node)
    if not isinstance(parent, cst.Assign) or len(parent.targets) != 1:
        return False
    name = ctx.code(parent.targets[0].target)
    for other in ctx.calls:
        if other.func is shard.func and other.name == "add_param_group" and other.receiver is not None:
            if ctx.code(other.receiver) == name and may_precede(ctx, shard.node, other.node):
                return True
    return any(
        isinstance(sub, cst.Subscript) and ctx.code(sub).startswith(f"{name}.param_groups")
        and isinstance(ctx.parent(sub), cst.AssignTarget) and may_precede(ctx, shard.node, sub)
        for sub in ctx.subscripts
    )  # fmt: skip
