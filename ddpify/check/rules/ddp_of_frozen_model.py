import libcst as cst

from ddpify.check.context import DDP_CLASSES, dotted_name, is_false, iter_nodes, positional
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import strip_moves


class DdpOfFrozenModel(Rule):
    """A model whose parameters were all frozen, wrapped in DDP.

    ## What it does
    Flags `DDP(teacher)` (also through a helper of the file that wraps its argument) when the
    function froze every parameter of `teacher` before (`teacher.requires_grad_(False)`, or
    `for p in teacher.parameters(): p.requires_grad = False`) and turned none back on.

    ## Why is this bad?
    DDP synchronizes gradients; a module with no parameter that requires one has nothing to
    synchronize, and the constructor raises `RuntimeError: DistributedDataParallel is not needed
    when a module doesn't have any parameter that requires a gradient`. A frozen network (a
    distillation teacher, a perceptual-loss network) runs the same on every rank unwrapped.

    ## Example
    ```python
    teacher.requires_grad_(False)
    teacher = DDP(teacher.to(device), device_ids=[local_rank])
    ```

    ## Use instead
    ```python
    teacher.requires_grad_(False)
    teacher = teacher.to(device).eval()  # no wrapper: nothing of it is trained
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://github.com/yoshitomo-matsubara/torchdistill/issues/122
    """

    CODE = "DDP167"
    NAME = "ddp-of-frozen-model"
    MESSAGE = "every parameter of this model was frozen before it is wrapped: DDP raises (no parameter requires a gradient); use the frozen model unwrapped"
    VALID = [
        "import torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "for p in model.parameters():\n    p.requires_grad = False\nfor p in model.head.parameters():\n"
        "    p.requires_grad = True\nmodel = DDP(model)\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
                "teacher.requires_grad_(False)\nteacher = DDP(teacher)\n"),
    ]

    def check(self, ctx):
        for ci in ctx.calls_to(*DDP_CLASSES):
            args = positional(ci.node)
            name = dotted_name(strip_moves(args[0].value, frozenset({"eval", "train"}))) if args else None
            if name is None or _tests_requires_grad(ctx, ci):
                continue  # (`if not any(p.requires_grad for p in m.parameters()): return m` first)
            if _frozen_before(ctx, name, ci.func, ctx.line(ci.node)):
                yield Report(ci.node)
            elif ci.func is not None and name in ctx.index.param_names(ci.func):
                for site in ctx.call_sites(ci.func):  # `teacher = wrap_model(teacher, device)`
                    given = ctx.index.argument_for(ci.func, site, name)
                    passed = dotted_name(given[0]) if given and given[0] is not None else None
                    if passed and _frozen_before(ctx, passed, site.func, ctx.line(site.node)):
                        yield Report(site.node)


def _tests_requires_grad(ctx, ci) -> bool:
    """Does the code that wraps read `requires_grad` before the wrap (in its function, or in the
    tests of the `if`s around it): it tells a frozen model from a trained one itself."""
    scope = ci.func.body if ci.func is not None else ctx.module
    line = ctx.line(ci.node)
    return any(
        isinstance(n, (cst.If, cst.IfExp)) and ctx.line(n) <= line and "requires_grad" in ctx.code(n.test)
        for n in iter_nodes(scope)
    )


_ADDS = {"add_module", "register_module", "append", "extend", "insert"}
def _frozen_before(ctx, name: str, func, line: int) -> bool:
    """Did the function (module level for None) freeze every parameter of `name` before `line`,
    and turn none back on?"""
    scope = func.body if func is not None else ctx.module
    frozen = False
    for node in iter_nodes(scope):
        if ctx.line(node) >= line:
            continue
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "requires_grad_":
            off = bool(node.args) and is_false(node.args[0].value)
            if not off:
                return False  # `requires_grad_()` / `(True)`: something trains
            frozen |= dotted_name(node.func.value) == name
        elif isinstance(node, cst.Assign) and any(
            isinstance(t.target, cst.Attribute) and t.target.attr.value == "requires_grad" for t in node.targets
        ):
            if not is_false(node.value):
                return False
        elif isinstance(node, cst.Assign) and frozen and any(
            isinstance(t.target, (cst.Attribute, cst.Subscript)) and dotted_name(t.target.value) == name for t in node.targets
        ):
            return False  # `net.out = nn.Linear(8, 3)`, `net[2] = ...` after the freeze: a new part, trained
        elif frozen and isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in _ADDS:
            if dotted_name(node.func.value) == name:
                return False  # `net.add_module("head", ...)`
        elif isinstance(node, cst.For) and _loops_over_parameters_of(node, name) and _sets_requires_grad_off(node):
            frozen = True
    return frozen


def _loops_over_parameters_of(loop: cst.For, name: str) -> bool:
    """`for p in teacher.parameters():` (or `named_parameters()` with the name unpacked)."""
    it = loop.iter
    return (
        isinstance(it, cst.Call) and isinstance(it.func, cst.Attribute)
        and it.func.attr.value in ("parameters", "named_parameters") and dotted_name(it.func.value) == name
        and not it.args
    )  # fmt: skip


def _sets_requires_grad_off(loop: cst.For) -> bool:
    """The loop's body sets `.requires_grad = False` (or calls `.requires_grad_(False)`), with no test."""
    for stmt in loop.body.body:
        for small in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
            if isinstance(small, cst.Assign) and is_false(small.value) and any(
                isinstance(t.target, cst.Attribute) and t.target.attr.value == "requires_grad" for t in small.targets
            ):
                return True
            if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
                call = small.value
                if isinstance(call.func, cst.Attribute) and call.func.attr.value == "requires_grad_" and call.args and is_false(call.args[0].value):
                    return True
    return False
