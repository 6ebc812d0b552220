from __future__ import annotations

from typing import Iterator

import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import dotted_name, positional
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import assigned_name, exclusive, may_precede, single_process_branch, strip_moves

# nn.Module methods that do not run the network (reading, moving, switching modes)
MODULE_API = frozenset({
    "state_dict", "load_state_dict", "parameters", "named_parameters", "buffers", "named_buffers", "modules",
    "named_modules", "children", "named_children", "train", "eval", "to", "cuda", "cpu", "half", "float", "double",
    "bfloat16", "zero_grad", "apply", "requires_grad_", "save_pretrained", "get_submodule", "get_parameter",
    "register_buffer", "register_parameter", "register_forward_hook", "register_forward_pre_hook",
    "register_full_backward_hook", "add_module", "extra_repr", "type",
})  # fmt: skip


def _module_of_wrapper(ctx, expr: cst.BaseExpression) -> bool:
    """`model.module` where `model` holds a DDP wrapper."""
    return isinstance(expr, cst.Attribute) and expr.attr.value == "module" and ctx.is_ddp(expr.value)


def _mentions_module_of_wrapper(ctx, expr: cst.BaseExpression) -> bool:
    """`model.module`, or `model.module if isinstance(model, DDP) else model`."""
    if isinstance(expr, cst.IfExp):
        return _mentions_module_of_wrapper(ctx, expr.body) or _mentions_module_of_wrapper(ctx, expr.orelse)
    return _module_of_wrapper(ctx, expr)


class ForwardBypassesWrapper(Rule):
    """The training forward runs the network under the DDP wrapper instead of the wrapper.

    ## What it does
    Flags, in a function that runs a backward, a call that runs the wrapped network without
    the wrapper: `model.module(x)`, `model.module.predict(x)` (any method but the
    `nn.Module` API: `state_dict`, `eval`, `parameters`, ...), a name bound to `model.module`
    (`raw = model.module if isinstance(model, DDP) else model`), and, after
    `ddp = DDP(net)` or `ddp = DDP(Combined(a, b))` in the same function, `net(x)`, `a(x)`.
    Calls under `torch.no_grad()`, and functions that call the wrapper too or all-reduce
    something themselves (gradients averaged by hand after the backward) are left alone.

    ## Why is this bad?
    DDP arms its gradient all-reduce in its own `forward` (the reducer's
    `prepare_for_backward`). A forward that goes around it builds a graph whose backward
    all-reduces nothing: no error, each rank steps on its own gradients and the replicas
    drift apart (2 CPU processes, 3 steps: parameter sums -2.159 and -1.995).

    ## Example
    ```python
    model = DDP(net)
    loss = criterion(model.module(x), y)
    loss.backward()
    ```

    ## Use instead
    ```python
    loss = criterion(model(x), y)  # a method other than forward: call it from forward
    loss.backward()
    ```

    ## Fix safety
    No automatic fix: a method other than `forward` has to be reached through `forward`.

    ## References
    - https://pytorch.org/docs/stable/notes/ddp.html (the reducer is prepared in forward)
    - https://github.com/pytorch/pytorch/pull/20282 (calling `ddp.module(input)` does not sync)
    """

    CODE = "DDP140"
    NAME = "forward-bypasses-wrapper"
    DDP_ONLY = True
    MESSAGE = "training forward runs the network without its DDP wrapper: backward all-reduces nothing and the ranks drift apart; call the wrapper"
    VALID = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\nfor x in data:\n"
        "    model(x).sum().backward()\n",
        "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\nfor x in data:\n"
        "    model(x).sum().backward()\nwith torch.no_grad():\n    model.module(x)\n",
    ]
    INVALID = [
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\nfor x in data:\n"
                "    model.module(x).sum().backward()\n"),
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\nfor x in data:\n"
                "    net(x).sum().backward()\n"),
    ]

    def check(self, ctx):
        if not ctx.ddp_calls:
            return
        backwards = [c for c in ctx.calls if ctx.is_backward(c)]
        calls_wrapper = {c.func for c in ctx.calls if ctx.is_ddp(c.node.func)}
        calls_wrapper |= {f for f in {c.func for c in ctx.calls} if _all_reduces(ctx, f)}
        done: set = set()
        for ci, why in self._bypasses(ctx):
            if ci.node in done or ci.in_no_grad or ci.func in calls_wrapper or single_process_branch(ctx, ci.node):
                continue  # (in a branch that runs without a group nothing is wrapped)
            if not any(_feeds(ctx, ci.node, b.node) for b in backwards if b.func is ci.func):
                continue
            if isinstance(ctx.parent(ci.node), cst.Expr):
                continue  # its result is dropped: it feeds no loss (`simulator.module.load(path)`)
            done.add(ci.node)
            yield Report(ci.node, f"`{ctx.code(ci.node.func)}(...)` {why}: DDP's all-reduce is armed in the "
                         "wrapper's forward, so this backward averages nothing and the ranks drift apart; call the "
                         "wrapper (put other methods inside `forward`)")

    def _bypasses(self, ctx) -> Iterator[tuple]:
        aliases = {(b.dotted, b.func) for b in ctx.assignments if _mentions_module_of_wrapper(ctx, b.value)}
        for ci in ctx.calls:
            f = ci.node.func
            if _module_of_wrapper(ctx, f):
                yield ci, "runs the network under the DDP wrapper"
            elif isinstance(f, cst.Attribute) and f.attr.value not in MODULE_API and _module_of_wrapper(ctx, f.value):
                yield ci, f"runs a method of the network under the DDP wrapper (`.{f.attr.value}`)"
            elif (dotted_name(f), ci.func) in aliases:
                yield ci, f"runs `{dotted_name(f)}`, bound to the network under the DDP wrapper"
        for wrap in ctx.ddp_calls:
            args = positional(wrap.node)
            if not args or assigned_name(ctx, wrap.node) is None:
                continue
            inner = strip_moves(args[0].value)
            names = {dotted_name(inner)} if dotted_name(inner) else set()
            if isinstance(inner, cst.Call):  # DDP(Combined(a, b)): its parts
                names = {dotted_name(a.value) for a in inner.args if dotted_name(a.value)}
            for ci in ctx.calls:
                if ci.func is wrap.func and ci.dotted in names and _after(ctx, wrap.node, ci.node):
                    yield ci, f"runs `{ci.dotted}`, which the DDP wrapper `{assigned_name(ctx, wrap.node)}` wraps"


def _all_reduces(ctx, func, depth: int = 0) -> bool:
    """Does the function all-reduce something itself, or through the functions it calls (the
    gradients averaged by hand after a forward that goes around DDP)?"""
    for c in ctx.calls:
        if c.func is not func:
            continue
        if c.name == "all_reduce" and c.qnames & N.COLLECTIVES:
            return True
        if depth < 2 and any(_all_reduces(ctx, f, depth + 1) for f in ctx.local_callees(c) if f is not func):
            return True
    return False


def _after(ctx, wrap: cst.Call, call: cst.Call) -> bool:
    return may_precede(ctx, wrap, call)


def _feeds(ctx, call: cst.Call, backward: cst.Call) -> bool:
    """Can the backward run after the call (later in the function, or the call is inside it)?"""
    if call is backward or any(p is backward for p in ctx.ancestors(call)):
        return True
    if may_precede(ctx, call, backward):
        return True
    loops = [p for p in ctx.ancestors(call) if isinstance(p, (cst.For, cst.While))]
    return any(any(q is loop for q in ctx.ancestors(backward)) for loop in loops) and not exclusive(ctx, call, backward)
