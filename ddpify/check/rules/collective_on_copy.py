from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import int_value, kwarg, positional
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._inplace import asynchronous, in_place_collectives, tensor_arg

# methods that return a new tensor (a copy), always or whenever they convert or move it
COPYING = frozenset({"clone", "float", "double", "half", "bfloat16", "long", "int", "to", "cuda", "cpu"})


def _copy(ctx, expr: cst.BaseExpression) -> str | None:
    """The call that makes `expr` a new tensor (`x.float()`, `torch.tensor(...)`), or None."""
    if not isinstance(expr, cst.Call):
        return None
    f = expr.func
    if isinstance(f, cst.Attribute) and f.attr.value in COPYING:
        return f.attr.value
    if ctx.call_info[expr].qnames & N.TENSOR_FACTORIES:
        return ctx.code(f)
    return None


class CollectiveOnCopy(Rule):
    """An in-place collective called on a temporary copy whose result is thrown away.

    ## What it does
    Flags a statement `dist.all_reduce(x.float())`, `dist.all_reduce(x.cuda())`,
    `dist.broadcast(torch.tensor(v), 0)`: the tensor handed to an in-place collective
    (`all_reduce`, `reduce`, `broadcast`) is made by the call itself (`.clone()`, a dtype
    conversion, `.to(...)`, `.cuda()`, `.cpu()`, `torch.tensor(...)`), so no name holds it
    afterwards. `.to(...)`, `.cuda()` and `.cpu()` copy only when they move or convert; the
    message says so. A broadcast from rank 0 in rank 0's own branch sends, and keeps nothing.

    ## Why is this bad?
    The collective writes the reduced values into the tensor it is given. A temporary copy
    is reduced and dropped, and the original keeps this rank's own value: each rank goes on to
    report or use its local number as if it were the global one (2 CPU processes: accuracies
    0.375 and 0.219 instead of the same 0.297 on both).

    ## Example
    ```python
    dist.all_reduce(counts.float())
    ```

    ## Use instead
    ```python
    counts = counts.float()
    dist.all_reduce(counts)
    ```

    ## Fix safety
    No automatic fix: the copy has to be named, and the code after it read that name.

    ## References
    - https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce
    """

    CODE = "DDP139"
    NAME = "collective-on-copy"
    MESSAGE = "in-place collective on a temporary copy: the reduced copy is thrown away and the original keeps this rank's value"
    VALID = [
        "import torch.distributed as dist\ncounts = counts.float()\ndist.all_reduce(counts)\n",
        "import torch.distributed as dist\ndist.all_reduce(stats.detach())\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\ndist.all_reduce(counts.float())\n"),
        Invalid("import torch, torch.distributed as dist\ndist.broadcast(torch.tensor(flag), 0)\n"),
    ]

    def check(self, ctx):
        for ci in in_place_collectives(ctx):
            if asynchronous(ci) or not isinstance(ctx.parent(ci.node), cst.Expr):
                continue
            arg = tensor_arg(ci)
            made_by = _copy(ctx, arg) if arg is not None else None
            if made_by is None or _sends(ctx, ci):
                continue
            maybe = " (when it moves or converts the tensor)" if made_by in ("to", "cuda", "cpu") else ""
            yield Report(ci.node, f"`{ctx.code(ci.node.func)}` reduces `{ctx.code(arg)}`, a new tensor{maybe}, and "
                         "nothing keeps it: the reduced values are lost and the original keeps this rank's value; "
                         "bind the tensor to a name, reduce it, and read that name")


def _sends(ctx, ci) -> bool:
    """`dist.broadcast(t.to(device), src=0)` under a rank-0 test: this rank is the source, it
    receives nothing to keep."""
    if ci.name != "broadcast":
        return False
    src = kwarg(ci.node, "src") or next(iter(positional(ci.node)[1:2]), None)
    return src is not None and int_value(src.value) == 0 and ctx.in_rank0(ci.node)
