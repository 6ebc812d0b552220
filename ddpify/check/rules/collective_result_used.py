from __future__ import annotations

import libcst as cst

from ddpify.check.context import dotted_name
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._inplace import asynchronous, in_place_collectives


def _use(ctx, call: cst.Call) -> str | None:
    """How the call's return value is used: "assigned" to a name, "read" (`.item()`, an argument,
    arithmetic), or None (a statement of its own, a `return`, `_ = ...`)."""
    parent = ctx.parent(call)
    if isinstance(parent, cst.Assign) and parent.value is call:
        names = [dotted_name(t.target) for t in parent.targets]
        return None if names == ["_"] else "assigned"
    if isinstance(parent, cst.AnnAssign) and parent.value is call:
        return "assigned"
    if isinstance(parent, cst.Attribute) and parent.value is call:
        return "read"
    if isinstance(parent, (cst.Arg, cst.BinaryOperation, cst.Subscript)):
        return "read"
    return None


class CollectiveResultUsed(Rule):
    """The return value of an in-place collective used as its result.

    ## What it does
    Flags `reduced = dist.all_reduce(t)` (and `dist.reduce`, `dist.broadcast`), and reads of the
    call's value (`dist.all_reduce(t).item()`, `f(dist.all_reduce(t))`), without `async_op=True`.
    `return dist.all_reduce(t)` in a wrapper and `_ = ...` are left alone.

    ## Why is this bad?
    These collectives write the result into `t` and return None (a work handle only with
    `async_op=True`). The name bound to the return value holds None, and the next `.item()` or
    arithmetic on it raises `AttributeError: 'NoneType' object has no attribute ...`; when it is
    only logged, the log shows `None` while `t` holds the reduced value.

    ## Example
    ```python
    reduced = dist.all_reduce(loss.detach().clone())
    print(reduced.item())
    ```

    ## Use instead
    ```python
    reduced = loss.detach().clone()
    dist.all_reduce(reduced)
    print(reduced.item())
    ```

    ## Fix safety
    No automatic fix: the tensor has to be named before the call.

    ## References
    - https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce
      ("Returns: Async work handle, if async_op is set to True. None, if not async_op")
    """

    CODE = "DDP138"
    NAME = "collective-result-used"
    MESSAGE = "in-place collective's return value used: it returns None; read the tensor it reduced"
    VALID = [
        "import torch.distributed as dist\nt = loss.detach().clone()\ndist.all_reduce(t)\nprint(t.item())\n",
        "import torch.distributed as dist\nwork = dist.all_reduce(t, async_op=True)\nwork.wait()\n",
        "import torch.distributed as dist\ndef reduce(t):\n    return dist.all_reduce(t)\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nreduced = dist.all_reduce(loss.clone())\nprint(reduced.item())\n"),
        Invalid("import torch.distributed as dist\nprint(dist.all_reduce(t).item())\n"),
    ]

    def check(self, ctx):
        for ci in in_place_collectives(ctx):
            if asynchronous(ci):
                continue
            use = _use(ctx, ci.node)
            if use is not None:
                yield Report(ci.node, f"`{ctx.code(ci.node.func)}` reduces its tensor in place and returns None: "
                             f"the value {use} here is None; keep the tensor in a name and read it after the call")
