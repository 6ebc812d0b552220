import libcst as cst

from ddpify.analysis import names as N

from ddpify.analysis.index import iter_nodes
from ddpify.analysis.names import DDP_OWN_API, NN_MODULE_API
from ddpify.check.fix import insert_module_attr
from ddpify.check.rule import FIX_SAFE, Invalid, Report, Rule
from ddpify.check.rules._common import single_process_branch

# What DistributedDataParallel answers itself: nn.Module's API and DDP's own. Anything else the
# script reads from the wrapper belongs to the network inside it (`model.module.<name>`).
WRAPPER_ATTRIBUTES = NN_MODULE_API | DDP_OWN_API


class AttributeOfDDPWrapper(Rule):
    """An attribute of the network read through the DDP wrapper.

    ## What it does
    Flags `ddp_model.<name>` where `ddp_model` holds the `DistributedDataParallel` wrapper and
    `<name>` is neither part of `nn.Module`'s API nor of DDP's (`model.config`,
    `model.generate(...)`, `model.backbone`): the wrapper does not forward attribute reads to the
    network it holds. Private names (`_x`), attributes the script sets on the wrapper itself, and
    reads under a test of what the name holds (`isinstance(model, DDP)`, `hasattr(model,
    "module")`) or in the `except` of a `try` that read `model.module` first are left alone, as
    is a method only another framework's engine has (`model.save_checkpoint(...)`,
    `model.backward(loss)`, `model.step()`: DeepSpeed's; the code expects that engine there, as
    MAE-style engines and `save_model` helpers do in their DeepSpeed branch).

    ## Why is this bad?
    It raises `AttributeError: 'DistributedDataParallel' object has no attribute ...` at run
    time, in code that worked on one GPU (often a sampling or logging helper reached late).

    ## Example
    ```python
    model = DDP(model, device_ids=[local_rank])
    blocks = model.config.n_layer
    ```

    ## Use instead
    ```python
    blocks = model.module.config.n_layer
    ```

    ## Fix safety
    Safe: the read fails today; `.module` reads what the single-GPU code read.

    ## References
    - https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html
    """

    CODE = "DDP124"
    NAME = "attribute-of-ddp-wrapper"
    DDP_ONLY = True
    MESSAGE = "the DDP wrapper has no such attribute (AttributeError): read it from the network, `model.module.<name>`"
    FIX = FIX_SAFE
    VALID = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\nn = model.module.config\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\nmodel.train()\nps = model.parameters()\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
        "n = model.module.config if isinstance(model, DDP) else model.config\n",
    ]
    INVALID = [
        Invalid(
            "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\nn = model.config\n",
            "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\nn = model.module.config\n",
        ),
    ]

    def check(self, ctx):
        if not ctx.ddp_bindings:
            return
        reads = [
            node for node in ctx.index.parents
            if isinstance(node, cst.Attribute) and isinstance(node.value, (cst.Name, cst.Attribute))
            and node.attr.value not in WRAPPER_ATTRIBUTES | N.ENGINE_METHODS and not node.attr.value.startswith("_")
            and ctx.is_ddp(node.value)
        ]  # fmt: skip
        own = {node.attr.value for node in reads if _assigned(ctx, node)}  # `model.tag = ...`: the wrapper's own
        for node in reads:
            if node.attr.value not in own and not _type_tested(ctx, node) and not _fallback(ctx, node) and not single_process_branch(ctx, node):
                held, name = ctx.code(node.value), node.attr.value
                message = f"the DDP wrapper has no attribute `{name}` (AttributeError): read `{held}.module.{name}`"
                yield Report(node, message, fixes=[(node, node.with_changes(value=insert_module_attr(node.value)))])


def _type_tested(ctx, node: cst.Attribute) -> bool:
    """`m.module.x if isinstance(m, DDP) else m.x`, `if hasattr(m, "module"): ...`: the code asks
    what it holds first. (The `else:` of `if self.is_distributed:` holds the plain model: see
    `single_process_branch`.)"""
    held = ctx.code(node.value)
    return any(
        isinstance(p, (cst.If, cst.IfExp)) and any(f"{test}({held}," in ctx.code(p.test) for test in ("isinstance", "hasattr"))
        for p in ctx.ancestors(node)
    )


def _fallback(ctx, node: cst.Attribute) -> bool:
    """`try: m.module.x() / except ...: m.x()`: the wrapper's attribute is read only when
    `m.module` failed, that is, when `m` holds no wrapper."""
    held = ctx.code(node.value)
    for handler in (a for a in ctx.ancestors(node) if isinstance(a, cst.ExceptHandler)):
        attempt = ctx.parent(handler)
        if isinstance(attempt, cst.Try) and any(
            isinstance(n, cst.Attribute) and n.attr.value == "module" and ctx.code(n.value) == held
            for n in iter_nodes(attempt.body)
        ):
            return True
    return False


def _assigned(ctx, node: cst.Attribute) -> bool:
    parent = ctx.parent(node)
    return isinstance(parent, (cst.AssignTarget, cst.AugAssign, cst.AnnAssign)) and getattr(parent, "target", None) is node
