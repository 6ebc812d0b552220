from __future__ import annotations


import libcst as cst

from ddpify.check.context import dotted_name
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._inplace import in_place_collectives, tensor_arg

# calls that give a Python number, not a tensor
NUMBER_METHODS = frozenset({"item"})
NUMBER_BUILTINS = frozenset({"float", "int", "len", "round"})


def _number(expr: cst.BaseExpression) -> bool:
    """Is this expression surely a Python number (a literal, `.item()`, `float(...)`, arithmetic on those)?"""
    if isinstance(expr, (cst.Integer, cst.Float)):
        return True
    if isinstance(expr, cst.UnaryOperation):
        return _number(expr.expression)
    if isinstance(expr, cst.BinaryOperation):
        return _number(expr.left) and _number(expr.right)
    if isinstance(expr, cst.Call):
        f = expr.func
        if isinstance(f, cst.Attribute) and f.attr.value in NUMBER_METHODS:
            return True
        return isinstance(f, cst.Name) and f.value in NUMBER_BUILTINS
    return False


def _bindings(ctx, name: str, call: cst.Call) -> list[cst.BaseExpression]:
    """The values bound to `name` (`=`, `+=`, ...) in the call's function before the call (or in a loop around it)."""
    func = ctx.enclosing_func(call)
    root = func if func is not None else ctx.module
    values: list[cst.BaseExpression] = []

    class Visit(cst.CSTVisitor):
        def visit_FunctionDef(self, node):
            return node is root

        def visit_ClassDef(self, node):
            return False

        def visit_Assign(self, node):
            if any(dotted_name(t.target) == name for t in node.targets):
                values.append(node.value)
            for t in node.targets:  # `a, total = (x, torch.tensor(0))`: its item, else the whole value
                if isinstance(t.target, (cst.Tuple, cst.List)):
                    names = [dotted_name(e.value) for e in t.target.elements]
                    if name in names:
                        items = node.value.elements if isinstance(node.value, (cst.Tuple, cst.List)) else ()
                        values.append(items[names.index(name)].value if len(items) == len(names) else node.value)

        def visit_AnnAssign(self, node):
            if node.value is not None and dotted_name(node.target) == name:
                values.append(node.value)

        def visit_AugAssign(self, node):
            if dotted_name(node.target) == name:
                values.append(node.value)

        def visit_For(self, node):
            if dotted_name(node.target) == name:
                values.append(node.iter)  # bound to the items of something: not known to be numbers

    root.visit(Visit())
    return values


class CollectiveOnPythonNumber(Rule):
    """An in-place collective called on a Python number.

    ## What it does
    Flags `dist.all_reduce(x)`, `dist.reduce(x, ...)` and `dist.broadcast(x, ...)` where `x`
    is a Python number: `loss.item()`, `float(...)`, or a name that the function binds only
    to such values (`total = 0.0`, then `total += loss.item()`). A name bound to anything else
    on some path (`total = torch.zeros(1)`) is left alone.

    ## Why is this bad?
    The collectives reduce a tensor in place; a Python float has no storage to write into.
    torch raises `TypeError: Invalid function argument. Expected parameter tensor of type
    torch.Tensor` on every rank, at the end of the epoch that computed the number.

    ## Example
    ```python
    total_loss += loss.item()
    dist.all_reduce(total_loss)
    ```

    ## Use instead
    ```python
    total_loss += loss.detach()  # a tensor (or torch.tensor(total_loss, device=device))
    dist.all_reduce(total_loss)
    ```

    ## Fix safety
    No automatic fix: the sum has to become a tensor where it starts.

    ## References
    - https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce
    """

    CODE = "DDP137"
    NAME = "collective-on-python-number"
    MESSAGE = "collective on a Python number (TypeError): `dist.all_reduce` and friends reduce a tensor in place; keep the value in a tensor"
    VALID = [
        "import torch, torch.distributed as dist\ntotal = torch.zeros(())\nfor loss in losses:\n    total += loss.detach()\n"
        "dist.all_reduce(total)\n",
        "import torch, torch.distributed as dist\ntotal = 0.0\nfor loss in losses:\n    total += loss.item()\n"
        "total = torch.tensor(total)\ndist.all_reduce(total)\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\ntotal = 0.0\nfor loss in losses:\n    total += loss.item()\n"
                "dist.all_reduce(total)\n"),
        Invalid("import torch.distributed as dist\ndist.all_reduce(loss.item())\n"),
    ]

    def check(self, ctx):
        for ci in in_place_collectives(ctx):
            arg = tensor_arg(ci)
            if arg is None:
                continue
            if _number(arg):
                yield Report(ci.node, f"`{ctx.code(ci.node)}` reduces a Python number, not a tensor (TypeError); "
                             "reduce a tensor and call `.item()` afterwards")
                continue
            name = dotted_name(arg)
            if name is None:
                continue
            values = _bindings(ctx, name, ci.node)
            if values and all(_number(v) for v in values):
                yield Report(ci.node, f"`{name}` holds a Python number (bound only to numbers and `.item()` "
                             f"results here), and `{ctx.code(ci.node.func)}` reduces tensors in place (TypeError); "
                             "accumulate it in a tensor")
