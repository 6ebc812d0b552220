from __future__ import annotations

from typing import Iterator, Optional

import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import is_true, kwarg, positional
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import assigned_name, exclusive, may_precede, trains

MOVES = frozenset({"to", "cuda", "cpu", "half", "float", "double", "bfloat16"})
ITERATORS = frozenset({"parameters", "named_parameters", "modules", "named_modules", "children", "named_children"})


def _chain(expr: cst.BaseExpression) -> Optional[str]:
    """`net.fc.weight` for `net.fc.weight`, `net[0].weight`, `net.fc.parameters()`; None for anything else."""
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        base = _chain(expr.value)
        return f"{base}.{expr.attr.value}" if base else None
    if isinstance(expr, cst.Subscript):
        base = _chain(expr.value)
        return f"{base}[]" if base else None
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in ITERATORS | MOVES:
        return _chain(expr.func.value)
    return None


def _under(chain: Optional[str], names: set[str]) -> bool:
    return chain is not None and any(chain == n or chain.startswith((n + ".", n + "[")) for n in names)


def _part(chain: Optional[str], names: set[str]) -> bool:
    """A part of the wrapped network (`net.backbone`, `net[0]`), not the whole of it."""
    return _under(chain, names) and chain not in names


def _new_parameter_or_module(ctx, value: cst.BaseExpression) -> bool:
    """`nn.Parameter(...)`, `nn.Linear(...)`: a constructor of torch.nn."""
    if not isinstance(value, cst.Call):
        return False
    return any(q.startswith(N.TORCH_NN) and q.rsplit(".", 1)[1][:1].isupper() for q in ctx.call_info[value].qnames)


class ParametersChangedAfterWrap(Rule):
    """Parameters frozen, unfrozen or replaced after the DDP wrap.

    ## What it does
    Flags, after `model = DDP(net)` and before a training step in the same function (a
    backward, or a call of a local function that trains):
    `requires_grad_(...)` on a part of the network (`net[0]`, `model.module.backbone`),
    `p.requires_grad = ...` on some of its parameters (`for p in net.encoder.parameters():`, or
    under an `if` in a loop over all of them), and the
    assignment of a new `nn.Parameter` or `nn.Module` to one of its attributes
    (`net.fc = nn.Linear(...)`, `net[2].weight = nn.Parameter(...)`). Freezing is left alone
    when DDP searches for unused parameters (`find_unused_parameters=True`) or covers the whole
    network (a frozen teacher wrapped only for SyncBatchNorm), and everything is when the
    network is wrapped again afterwards.

    ## Why is this bad?
    DDP registers a gradient hook on each parameter that requires a gradient when it is built,
    and waits for all of them in every backward. A parameter frozen later never reports, and
    the next iteration fails with `Expected to have finished reduction in the prior iteration`;
    one unfrozen later, or assigned in place of a hooked one, is never all-reduced: each rank
    trains its own copy.

    ## Example
    ```python
    model = DDP(net)
    net.backbone.requires_grad_(False)
    ```

    ## Use instead
    ```python
    net.backbone.requires_grad_(False)
    model = DDP(net)  # or wrap again after changing it
    ```

    ## Fix safety
    No automatic fix: the change has to move before the wrap, or the model be wrapped again.

    ## References
    - https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html
      ("the module's parameters [...] should not be changed after wrapping")
    - https://github.com/facebookresearch/ClassyVision/pull/398 (re-wrap after freezing)
    """

    CODE = "DDP141"
    NAME = "parameters-changed-after-wrap"
    DDP_ONLY = True
    MESSAGE = "parameters frozen or replaced after the DDP wrap: DDP keeps waiting for (or never reduces) them; change them before `DDP(...)`"
    VALID = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\nnet.backbone.requires_grad_(False)\n"
        "model = DDP(net)\nfor x in data:\n    model(x).sum().backward()\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net, find_unused_parameters=True)\n"
        "net.backbone.requires_grad_(False)\nfor x in data:\n    model(x).sum().backward()\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nteacher = DDP(teacher)\nstudent = DDP(student)\n"
        "for p in teacher.parameters():\n    p.requires_grad = False\nfor x in data:\n    student(x).sum().backward()\n",
    ]
    INVALID = [
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
                "for p in net.backbone.parameters():\n    p.requires_grad = False\nfor x in data:\n"
                "    model(x).sum().backward()\n"),
        Invalid("from torch import nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
                "model.module.fc = nn.Linear(8, 2)\nfor x in data:\n    model(x).sum().backward()\n"),
        Invalid("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
                "for name, p in model.named_parameters():\n    if 'trunk' in name:\n        p.requires_grad = False\n"
                "for x in data:\n    model(x).sum().backward()\n"),
    ]

    def check(self, ctx):
        steps = [c for c in ctx.calls if trains(ctx, c)]
        done: set = set()
        for wrap in ctx.ddp_calls:
            args = positional(wrap.node)
            if not args:
                continue
            names = {n for n in (_chain(args[0].value), assigned_name(ctx, wrap.node)) if n}
            names |= {f"{n}.module" for n in names}
            searches = (k := kwarg(wrap.node, "find_unused_parameters")) is not None and is_true(k.value)
            rewraps = [w.node for w in ctx.ddp_calls if w is not wrap and w.func is wrap.func and positional(w.node)
                       and _under(_chain(positional(w.node)[0].value), names)]
            for node, kind in _changes(ctx, wrap, names):
                if node in done or (kind == "freeze" and searches) or not may_precede(ctx, wrap.node, node):
                    continue
                if any(may_precede(ctx, node, w) for w in rewraps):
                    continue  # wrapped again after the change
                if not any(t.func is wrap.func and _may_follow(ctx, node, t.node) for t in steps):
                    continue
                done.add(node)
                what = ("toggles `requires_grad` of parameters DDP already registered: a frozen one never reports "
                        "its gradient (the next iteration fails: 'Expected to have finished reduction'), an "
                        "unfrozen one is never all-reduced") if kind == "freeze" else (
                        "puts a new parameter or module in place of one DDP hooked: its gradients are never "
                        "all-reduced, or DDP waits for the old one's")
                yield Report(node, f"`{ctx.code(node).strip()}` after `{ctx.code(wrap.node.func)}(...)` {what}; make "
                             "the change before the wrap, or wrap again after it")


def _changes(ctx, wrap, names: set[str]) -> Iterator[tuple[cst.CSTNode, str]]:
    """Freezes (`requires_grad_`, `.requires_grad = `) and replacements in the wrap's function."""
    root = wrap.func if wrap.func is not None else ctx.module
    found: list[tuple[cst.CSTNode, str]] = []
    loop_vars: dict[str, cst.For] = {}  # `p` of `for p in net.encoder.parameters():`
    whole_loops: set[cst.For] = set()  # loops over all the network's parameters

    class Visit(cst.CSTVisitor):
        def visit_FunctionDef(self, node):
            return node is root

        def visit_ClassDef(self, node):
            return False

        def visit_For(self, node):
            if _under(_chain(node.iter), names):
                if _chain(node.iter) in names:
                    whole_loops.add(node)
                targets = node.target.elements if isinstance(node.target, cst.Tuple) else [node.target]
                for t in targets:
                    value = t.value if isinstance(t, cst.Element) else t
                    if isinstance(value, cst.Name):
                        loop_vars[value.value] = node

        def visit_Call(self, node):
            f = node.func
            if isinstance(f, cst.Attribute) and f.attr.value == "requires_grad_":
                if _part(_chain(f.value), names) or _some(_chain(f.value), node):
                    found.append((node, "freeze"))

        def visit_Assign(self, node):
            for t in node.targets:
                target = t.target
                if isinstance(target, cst.Attribute) and target.attr.value == "requires_grad":
                    base = _chain(target.value)
                    if _part(base, names) or _some(base, node):
                        found.append((node, "freeze"))
                elif isinstance(target, (cst.Attribute, cst.Subscript)) and _chain(target) not in names and _under(
                    _chain(target), names
                ) and _new_parameter_or_module(ctx, node.value):
                    found.append((node, "replace"))

    def _some(var: Optional[str], node: cst.CSTNode) -> bool:
        """A loop variable over some of the parameters: of a part, or picked by an `if` in a loop over all."""
        loop = loop_vars.get(var or "")
        if loop is None or not any(p is loop for p in ctx.ancestors(node)):
            return False  # (a later loop's own `v`: `for k, v in teacher.state_dict().items():`)
        if loop not in whole_loops:
            return True
        between = []
        for p in ctx.ancestors(node):
            if p is loop:
                break
            between.append(p)
        return any(isinstance(p, cst.If) for p in between)

    root.visit(Visit())
    return iter(found)


def _may_follow(ctx, node: cst.CSTNode, step: cst.Call) -> bool:
    """Can the training call run after `node` (later in the function, or again in a loop around both)?"""
    if may_precede(ctx, node, step):
        return True
    loops = [p for p in ctx.ancestors(node) if isinstance(p, (cst.For, cst.While))]
    return any(any(q is loop for q in ctx.ancestors(step)) for loop in loops) and not exclusive(ctx, node, step)
