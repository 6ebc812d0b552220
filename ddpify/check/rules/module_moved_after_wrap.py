from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.names import is_cuda_string
from ddpify.check.context import DDP_CLASSES, dotted_name, kwarg, positional, string_value
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import before, dominates, exclusive, may_precede, trains

# `module.half()`: the methods that move or convert a module's parameters in place.
DTYPE_METHODS = frozenset({"half", "double", "bfloat16"})
MOVE_METHODS = DTYPE_METHODS | {"float", "cuda", "cpu", "to"}
DTYPES = re.compile(r"^torch\.(float16|half|bfloat16|float64|double|float32|float)$")

# What a move does: ("dtype", text) another dtype; ("float32", text) back to float32 (a no-op unless
# the module was converted before); ("cuda" | "cpu" | "device", text): a device, known or not.
Move = tuple[str, str]


def _move(ctx, call: cst.Call) -> Optional[Move]:
    name = call.func.attr.value if isinstance(call.func, cst.Attribute) else ""
    text = ctx.code(call.func.attr) + ctx.code(call)[len(ctx.code(call.func)) :]  # `to(device)`
    if name in DTYPE_METHODS:
        return "dtype", text
    if name == "float":
        return "float32", text
    if name in ("cuda", "cpu"):
        return name, text
    if name != "to":
        return None
    dtype = kwarg(call, "dtype")
    args = [a.value for a in positional(call)]
    dtypes = [a for a in ([dtype.value] if dtype else []) + args if DTYPES.match(ctx.code(a))]
    if dtypes:
        return ("float32" if ctx.code(dtypes[0]).endswith(("float32", "float")) else "dtype"), text
    device = kwarg(call, "device")
    target = device.value if device is not None else (args[0] if args else None)
    if target is None:
        return None  # `to(memory_format=...)`, `to(**kw)`: not a move we can judge
    if string_value(target) == "cpu":
        return "cpu", text
    if is_cuda_string(target) or (
        isinstance(target, cst.Call) and ctx.qnames(target.func) & N.TORCH_DEVICE and target.args
        and (string_value(target.args[0].value) or "").startswith("cuda")
    ):
        return "cuda", text
    return "device", text


def _strip_moves(ctx, expr: cst.BaseExpression) -> tuple[cst.BaseExpression, list[Move]]:
    """`Net().to(device).half()` -> (`Net()`, its moves, first to last)."""
    moves: list[Move] = []
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in MOVE_METHODS:
        move = _move(ctx, expr)
        if move is None:
            break
        moves.insert(0, move)
        expr = expr.func.value
    return expr, moves


class ModuleMovedAfterWrap(Rule):
    """A module moved to another device or dtype after the DDP wrap.

    ## What it does
    Flags `model.to(...)`, `.cuda()`, `.cpu()`, `.half()`, `.double()`, `.bfloat16()` (and
    `.float()` back from one of those) on a module that a `DistributedDataParallel` already wraps,
    or on the wrapper itself, when training may follow: `model = DDP(model); model.half()`, or
    `ddp = DDP(net); net.cuda()` (the inner module moved under the wrapper).

    The order is read in the function that wraps: the wrap must be able to run before the move
    (a move in the `else:` of `if distributed: model = DDP(model)` is fine), and the name must not
    be rebound in between (`model = Net(); model.load_state_dict(...); model.to(device)` after
    training is another module). A move after the function's last training step (a `.cpu()`
    before saving) is left alone, as is a move back to where the module already was: the same
    call before the wrap, `.to(device)` after `DDP(model, device_ids=[rank])` or after another
    move to an unknown device. In other methods of the class that wraps `self.model` in
    `__init__`, only dtype changes are flagged. A helper that receives the model (`evaluate(model.module)`)
    is not followed.

    ## Why is this bad?
    DDP registers its gradient hooks on the parameters and sizes its buckets when it is built.
    Converting them afterwards replaces their storage: autograd drops the gradient accumulators
    DDP hooked, so backward still runs but nothing is all-reduced. On torch 2.15 (2 CPU
    processes, gloo) `model = DDP(net); model.double()` trains without any error while each rank
    keeps its own gradient (grads 2.0 and 4.0 on the two ranks instead of the averaged 3.0), and
    the replicas drift apart step after step. A move to another device goes through the same
    path, with DDP's buckets left on the old device.

    ## Example
    ```python
    model = DDP(Net())
    model.to(device)
    ```

    ## Use instead
    ```python
    model = DDP(Net().to(device), device_ids=[local_rank])
    ```

    ## Fix safety
    No automatic fix: the move has to go before the wrap, which may be in another statement.

    ## References
    - https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html
      ("the module's parameters [...] should not be changed after wrapping")
    - https://pytorch.org/tutorials/intermediate/ddp_tutorial.html
    """

    CODE = "DDP127"
    NAME = "module-moved-after-wrap"
    DDP_ONLY = True
    MESSAGE = "the module is moved or converted after the DDP wrap: DDP's gradient hooks and buckets stay on the old parameters; move it before `DDP(...)`"
    VALID = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = Net().to(device)\nmodel = DDP(model)\n"
        "for x in data:\n    model(x).sum().backward()\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = Net()\nif distributed:\n    model = DDP(model)\n"
        "else:\n    model.to(device)\nfor x in data:\n    model(x).sum().backward()\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(Net())\nfor x in data:\n"
        "    x = x.to(device)\n    model(x).sum().backward()\n",
    ]
    INVALID = [
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(Net())\nmodel.to(device)\n"
                "for x in data:\n    model(x).sum().backward()\n"),
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nnet = Net().cuda()\nddp = DDP(net)\nnet.half()\n"),
    ]

    def check(self, ctx):
        moves = [ci for ci in ctx.calls if ci.receiver is not None and ci.name in MOVE_METHODS]
        if not moves:
            return
        done: set[cst.Call] = set()
        for wrap in ctx.ddp_calls:
            if not wrap.node.args or wrap.node.args[0].keyword is not None:
                continue
            for ci, message in _moved_after(ctx, wrap, moves):
                if ci.node not in done:
                    done.add(ci.node)
                    yield Report(ci.node, message)


def _moved_after(ctx, wrap, moves):
    call = wrap.node
    inner_expr, placed = _strip_moves(ctx, call.args[0].value)
    inner = dotted_name(inner_expr)
    parent = ctx.parent(call)
    wrapper = None
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
        wrapper = dotted_name(parent.targets[0].target)
    elif isinstance(parent, cst.AnnAssign):
        wrapper = dotted_name(parent.target)
    names = {n for n in (wrapper, f"{wrapper}.module" if wrapper else None, inner) if n}
    if not names:
        return
    func = wrap.func
    # where the module was before the wrap: the moves chained into the wrap's argument, into
    # the inner name's binding, and the inner name's moves that may run before the wrap
    placement: Optional[str] = None  # None: built here, on the CPU; "?": not seen
    if inner is not None:
        placement = "?"
        for b in ctx.assignments:
            if b.dotted == inner and b.func is func and b._node is not None and may_precede(ctx, b._node, call):
                value, chained = _strip_moves(ctx, b.value)
                if isinstance(value, cst.Call) and not chained and not placed:
                    placement = None
                placed = chained + placed
        for ci in moves:
            if dotted_name(ci.receiver) == inner and ci.func is func and may_precede(ctx, ci.node, call):
                move = _move(ctx, ci.node)
                if move is not None:
                    placed = [*placed, move]
    elif isinstance(inner_expr, cst.Call):
        placement = None  # `DDP(Net())`
    texts = {text for _, text in placed}
    devices = [kind for kind, _ in placed if kind not in ("dtype", "float32")]
    if devices:
        placement = devices[-1]
    if (k := kwarg(call, "device_ids")) is not None and ctx.code(k.value) != "None":
        placement = "cuda"
    converted = any(kind == "dtype" for kind, _ in placed)
    training = [ci for ci in ctx.index.calls_under(func if func is not None else ctx.module) if ci.func is func and trains(ctx, ci)]
    for ci in moves:
        held = dotted_name(_strip_modes(_strip_moves(ctx, ci.receiver)[0]))  # `net.cuda().half()`, `net.eval().cpu()`: `net`
        if held not in names or ci.node is call or any(p is call for p in ctx.ancestors(ci.node)):
            continue
        move = _move(ctx, ci.node)
        if move is None or move[1] in texts:
            continue
        kind = move[0]
        if ci.func is not func:  # another method of the class that wrapped `self.model` in `__init__`
            if not (held.startswith("self.") and func is not None and func.name.value == "__init__"
                    and _same_class(ctx, func, ci.func) and kind == "dtype"):  # fmt: skip
                continue
        else:
            if not may_precede(ctx, call, ci.node) or _rebound(ctx, held, call, ci.node):
                continue
            if training and not any(_may_follow(ctx, ci.node, t.node) for t in training):
                continue  # after the last training step: saving, exporting
        if kind == "float32" and not converted:
            continue
        if kind == "cpu" and placement not in ("cuda", "device"):
            continue  # already on the CPU, or not known to be elsewhere
        if kind in ("cuda", "device") and placement not in (None, "cpu"):
            continue  # already on a device: most likely the same one
        what = "wrapper" if held == wrapper else "module under the wrapper"
        yield ci, (
            f"`{ctx.code(ci.node)}` after `{ctx.code(call.func)}(...)` moves the {what}: DDP's gradient hooks and "
            "buckets stay on the old parameters (gradients are no longer averaged); move it before the wrap"
        )


def _strip_modes(expr: cst.BaseExpression) -> cst.BaseExpression:
    """`net` in `net.eval()`, `net.train()` (they return the module itself)."""
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in ("eval", "train"):
        expr = expr.func.value
    return expr


def _rebound(ctx, name: str, wrap: cst.Call, move: cst.Call) -> bool:
    """Is `name` bound to something else on every path between the wrap and the move?"""
    for b in ctx.assignments:
        node = b._node
        if b.dotted != name or node is None or any(p is wrap for p in ctx.ancestors(b.value)) or b.value is wrap:
            continue
        if any(p is b.value for p in ctx.ancestors(move)) or not before(ctx, wrap, node):
            continue  # `model = model.to(device)`: the move itself
        if dominates(ctx, node, move):
            return True
    return False


def _may_follow(ctx, move: cst.Call, step: cst.Call) -> bool:
    """Can the training call `step` run after `move` (later in the function, or again in a loop
    around both)?"""
    if may_precede(ctx, move, step):
        return True
    loops = [p for p in ctx.ancestors(move) if isinstance(p, (cst.For, cst.While))]
    return any(any(q is loop for q in ctx.ancestors(step)) for loop in loops) and not exclusive(ctx, move, step)


def _same_class(ctx, a, b) -> bool:
    if b is None:
        return False
    cls_a = next((p for p in ctx.ancestors(a) if isinstance(p, cst.ClassDef)), None)
    return cls_a is not None and any(p is cls_a for p in ctx.ancestors(b))
