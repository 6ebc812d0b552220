from __future__ import annotations

from typing import Optional

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.check.context import DDP_CLASSES, dotted_name, has_star_kwargs, is_false, is_true, kwarg, last_name
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import class_of_call, may_precede

# torch.nn modules without parameters: skipping them leaves no gradient missing.
PARAMETER_FREE = frozenset(
    {"ReLU", "ReLU6", "LeakyReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish", "Sigmoid", "Tanh", "Hardtanh",
     "Hardswish", "Hardsigmoid", "Softplus", "Softsign", "Softmax", "Softmax2d", "LogSoftmax", "Softmin", "Identity",
     "Flatten", "Unflatten", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "MaxPool1d", "MaxPool2d",
     "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
     "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "Upsample", "UpsamplingNearest2d",
     "UpsamplingBilinear2d", "PixelShuffle", "PixelUnshuffle", "ZeroPad2d", "ConstantPad1d", "ConstantPad2d",
     "ReflectionPad1d", "ReflectionPad2d", "ReplicationPad2d", "CosineSimilarity", "PairwiseDistance", "Threshold",
     "Tanhshrink", "Softshrink", "Hardshrink", "LogSigmoid", "GLU", "ChannelShuffle", "Fold", "Unfold",
     "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LocalResponseNorm"}
)  # fmt: skip
# Tests of a tensor's layout, not its values: the same every step of a run.
LAYOUT = frozenset({"size", "dim", "ndim", "shape", "dtype", "device", "is_cuda", "is_floating_point", "numel", "ndimension"})
RANDOM_TESTS = N.RANDOM_VALUES | N.RANDOM_TENSORS

Uses = tuple[frozenset, frozenset, bool]  # (used on every path, used on some path, the path ends)
_NONE: Uses = (frozenset(), frozenset(), False)


class UnusedParametersWithoutSearch(Rule):
    """DDP wraps a model whose `forward` skips a submodule on some steps.

    ## What it does
    Flags `DistributedDataParallel(model, ...)` without `find_unused_parameters=True` (nor
    `static_graph=True`) when `model`'s class is defined in the file (or a project module it
    imports) and its `forward` calls a submodule with parameters (`self.head = nn.Linear(...)`
    in `__init__`) only under a condition that can change from step to step: a test of the
    input's values (`if x.sum() > 0:`, `if mask.any():`), a random draw (`if random.random() <
    p:`), a flag argument of `forward` that the training code passes a changing value
    (`model(x, with_aux=step % 2 == 0)`), or an early `return` taken on such a test. It also
    flags submodules used only when `self.training` is false (never in a training step). The
    report names the submodules.

    Conditions that are the same every step are left alone: a flag set in `__init__`
    (`if self.use_aux:`, the submodule is usually built under the same flag), `self.training` in
    training, `is None` tests of an argument, the input's shape or dtype; so are submodules
    used on every branch, parameter-free modules (activations, dropout, pooling, losses), uses
    in loops, and helper methods of the class, which are followed.

    ## Why is this bad?
    Without the search, DDP's reducer waits for a gradient of every parameter before it
    finishes a step's all-reduce. After a step that skipped the submodule, the next forward
    raises (torch 2.15, 2 processes, gloo): `RuntimeError: Expected to have finished reduction
    in the prior iteration before starting a new one. This error indicates that your module
    has parameters that were not used in producing loss.` A single-GPU run never shows it, and
    the failing step depends on the data.

    ## Example
    ```python
    class Net(nn.Module):
        def forward(self, x):
            h = self.body(x)
            if h.norm() > 10:
                h = self.rescale(h)
            return self.head(h)

    model = DDP(Net().to(device), device_ids=[local_rank])
    ```

    ## Use instead
    ```python
    model = DDP(Net().to(device), device_ids=[local_rank], find_unused_parameters=True)
    ```

    ## Fix safety
    No automatic fix: the search costs a graph traversal per step; reworking `forward` so
    every parameter takes part (multiplying a skipped branch's output by 0) may be preferred.

    ## References
    - https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html
      (`find_unused_parameters`)
    - https://pytorch.org/docs/stable/notes/ddp.html#internal-design
    """

    CODE = "DDP130"
    NAME = "unused-parameters-without-search"
    DDP_ONLY = True
    MESSAGE = "the model's forward skips a submodule on some steps: its parameters get no gradient and DDP fails on the next step; pass `find_unused_parameters=True`"
    VALID = [
        "import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(2, 2)\n"
        "        self.b = nn.Linear(2, 2)\n    def forward(self, x):\n        x = self.a(x)\n"
        "        if x.sum() > 0:\n            x = self.b(x)\n        return x\n"
        "model = DDP(Net(), find_unused_parameters=True)\n",
        "import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "class Net(nn.Module):\n    def __init__(self, extra):\n        super().__init__()\n        self.a = nn.Linear(2, 2)\n"
        "        self.extra = extra\n        self.b = nn.Linear(2, 2)\n    def forward(self, x):\n        x = self.a(x)\n"
        "        if self.extra:\n            x = self.b(x)\n        return x\nmodel = DDP(Net(True))\n",
    ]
    INVALID = [
        Invalid("import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
                "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(2, 2)\n"
                "        self.b = nn.Linear(2, 2)\n    def forward(self, x):\n        x = self.a(x)\n"
                "        if x.sum() > 0:\n            x = self.b(x)\n        return x\nmodel = DDP(Net())\n"),
        Invalid("import torch.nn as nn\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
                "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(2, 2)\n"
                "        self.b = nn.Linear(2, 2)\n    def forward(self, x, extra=False):\n        x = self.a(x)\n"
                "        if extra:\n            x = self.b(x)\n        return x\nmodel = DDP(Net())\n"
                "for step in range(4):\n    model(batch, extra=step % 2 == 0).sum().backward()\n"),
    ]

    def check(self, ctx):
        for wrap in ctx.ddp_calls:
            call = wrap.node
            if not call.args or call.args[0].keyword is not None or has_star_kwargs(call):
                continue
            search = kwarg(call, "find_unused_parameters")
            if search is not None and not is_false(search.value):
                continue
            static = kwarg(call, "static_graph")
            if static is not None and is_true(static.value):
                continue
            cls = _wrapped_class(ctx, wrap)
            if cls is None:
                continue
            skipped = _skipped_submodules(ctx, cls, _varied_arguments(ctx, cls))
            if skipped:
                listed = ", ".join(f"`self.{name}` (decided by `{test}`)" for name, test in skipped)
                yield Report(call, (
                    f"`{cls.name.value}.forward` skips {listed} on some steps: their parameters get no gradient and "
                    "DDP fails on the next step (\"Expected to have finished reduction in the prior iteration\"); "
                    "pass `find_unused_parameters=True`"
                ))


def _strip(expr: cst.BaseExpression) -> cst.BaseExpression:
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in (
        "to", "cuda", "cpu", "half", "float", "double", "bfloat16", "train"
    ):  # fmt: skip
        expr = expr.func.value
    return expr


def _wrapped_class(ctx, wrap) -> Optional[cst.ClassDef]:
    """The class of the model DDP wraps: `DDP(Net(...))`, or `model = Net(...)` (moves chained
    or not) before `DDP(model)` in the same function."""
    expr = _strip(wrap.node.args[0].value)
    if isinstance(expr, cst.Call):
        return class_of_call(ctx, expr)
    name = dotted_name(expr)
    if name is None:
        return None
    found = None
    for b in ctx.assignments:
        if b.dotted == name and b.func is wrap.func and b._node is not None and may_precede(ctx, b._node, wrap.node):
            value = _strip(b.value)
            if isinstance(value, cst.Call) and value.func is not None:
                cls = class_of_call(ctx, value)
                if cls is not None:
                    found = cls
                elif b.value is not wrap.node:
                    found = None  # rebound to something we cannot see into
    return found


def _methods(cls: cst.ClassDef) -> dict[str, cst.FunctionDef]:
    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ()
    return {s.name.value: s for s in body if isinstance(s, cst.FunctionDef)}


def _submodules(ctx, init: cst.FunctionDef) -> set[str]:
    """`self.x = nn.Linear(...)` (a torch.nn module with parameters, a class of the project, a
    torchvision or timm model) in `__init__`."""
    found = set()
    for node in iter_nodes(init.body):
        if not isinstance(node, cst.Assign) or not isinstance(node.value, cst.Call):
            continue
        for t in node.targets:
            name = dotted_name(t.target)
            if not name or not name.startswith("self.") or name.count(".") != 1:
                continue
            call = node.value
            qnames = ctx.info(call).qnames if call in ctx.call_info else frozenset()
            short = last_name(call.func) or ""
            if any(q.startswith(N.NN_PREFIX) for q in qnames):
                if short not in PARAMETER_FREE and not short.endswith("Loss") and short not in ("ModuleList", "ModuleDict", "ParameterList"):
                    found.add(name[5:])
            elif any(q.startswith(("torchvision.models.", "timm.")) for q in qnames) or class_of_call(ctx, call) is not None:
                found.add(name[5:])
    return found


def _varied_arguments(ctx, cls: cst.ClassDef) -> set[str]:
    """`forward`'s parameters that a call of the DDP model passes a value that may change from
    step to step (`model(x, with_aux=step % 2 == 0)`; a literal does not change)."""
    forward = _methods(cls).get("forward")
    if forward is None:
        return set()
    names = [p.name.value for p in forward.params.params][1:]  # without self
    varied = set()
    for ci in ctx.calls:
        if not ctx.is_ddp(ci.node.func):
            continue
        for i, arg in enumerate(ci.node.args):
            if isinstance(arg.value, (cst.Integer, cst.Float, cst.SimpleString)) or (
                isinstance(arg.value, cst.Name) and arg.value.value in ("True", "False", "None")
            ):
                continue
            if arg.keyword is not None:
                varied.add(arg.keyword.value)
            elif arg.star == "" and i < len(names):
                varied.add(names[i])
    return varied


def _skipped_submodules(ctx, cls: cst.ClassDef, varied: set[str] = frozenset()) -> list[tuple[str, str]]:
    methods = _methods(cls)
    forward, init = methods.get("forward"), methods.get("__init__")
    if forward is None or init is None:
        return []
    subs = _submodules(ctx, init)
    if not subs:
        return []
    params = ctx.index.param_names(forward) - {"self"}
    walker = _Walker(ctx, subs, methods, params, varied)
    must, may, _ = walker.block(list(forward.body.body) if isinstance(forward.body, cst.IndentedBlock) else [])
    return [(name, walker.tests.get(name, "...")) for name in sorted(may - must, key=lambda n: walker.order.get(n, 0))]


class _Walker:
    """Which submodules `forward` uses on every path through it, and which on some."""

    def __init__(self, ctx, subs: set[str], methods: dict, params: set[str], varied: set[str] = frozenset()) -> None:
        self.ctx, self.subs, self.methods, self.params, self.varied = ctx, subs, methods, params, varied
        self.tests: dict[str, str] = {}  # submodule -> the condition it is used under
        self.order: dict[str, int] = {}
        self.depth = 0
        self.done: dict[tuple, Uses] = {}  # the uses of each statement sequence walked

    # statements ----------------------------------------------------------------------------------
    def block(self, stmts: list) -> Uses:
        """The uses of a statement sequence. An `if` walks the rest after each branch, so the same
        rest comes back once per path into it: each sequence is walked once (k `if`s in a row
        would otherwise cost 2**k)."""
        if not stmts:
            return _NONE
        key = tuple(map(id, stmts))
        if key not in self.done:
            self.done[key] = self._block(stmts)
        return self.done[key]

    def _block(self, stmts: list) -> Uses:
        s, rest = stmts[0], stmts[1:]
        if isinstance(s, cst.If):
            test = self.expr(s.test)
            orelse = [s.orelse] if isinstance(s.orelse, cst.If) else list(s.orelse.body.body) if s.orelse else []
            yes = self.block(list(s.body.body) + rest)
            no = self.block(orelse + rest)
            kind = self.kind(s.test)
            return self.join(test, yes, no, kind, s.test)
        if isinstance(s, (cst.For, cst.While)):
            head = self.expr(s.iter if isinstance(s, cst.For) else s.test)
            body = self.block(list(s.body.body))
            after = self.block(rest)
            return head[0] | body[0] | after[0], head[1] | body[1] | after[1], after[2]
        if isinstance(s, (cst.With, cst.Try)):
            heads = [self.expr(item) for item in s.items] if isinstance(s, cst.With) else []
            head = (frozenset().union(*(h[0] for h in heads)), frozenset().union(*(h[1] for h in heads)), False)
            inner = self.block(list(s.body.body) + rest)
            return head[0] | inner[0], head[1] | inner[1], inner[2]
        if isinstance(s, (cst.FunctionDef, cst.ClassDef)):
            return self.block(rest)
        if isinstance(s, cst.SimpleStatementLine):
            here = self.expr(s)
            if any(isinstance(x, (cst.Return, cst.Raise)) for x in s.body):
                return here[0], here[1], True
            after = self.block(rest)
            return here[0] | after[0], here[1] | after[1], after[2]
        here = self.expr(s)
        after = self.block(rest)
        return here[0] | after[0], here[1] | after[1], after[2]

    def join(self, test: Uses, yes: Uses, no: Uses, kind: str, node) -> Uses:
        may = test[1] | yes[1] | no[1]
        if kind == "dynamic":
            must = test[0] | (yes[0] & no[0])
        elif kind == "training":
            must = test[0] | yes[0]
        elif kind == "not-training":
            must = test[0] | no[0]
        else:
            must = test[0] | yes[0] | no[0]
        for name in may - must:
            self.tests.setdefault(name, self.ctx.code(node))
        return must, may, yes[2] and no[2]

    def kind(self, test: cst.BaseExpression) -> str:
        code = self.ctx.code(test).strip()
        if code == "self.training":
            return "training"
        if code in ("not self.training", "not (self.training)"):
            return "not-training"
        return "dynamic" if self.dynamic(test) else "static"

    def dynamic(self, test: cst.BaseExpression) -> bool:
        """Can the test's value change from step to step: a random draw, a look at the values
        (not the shape) of the input or of what forward computed from it, or a flag of forward's
        that the training code passes a changing value?"""
        for node in iter_nodes(test):
            if isinstance(node, cst.Name) and node.value in self.varied:
                return True  # `if with_aux:`, called as `model(x, with_aux=step % 2 == 0)`
            if isinstance(node, cst.Call) and node in self.ctx.call_info:
                info = self.ctx.info(node)
                if info.qnames & RANDOM_TESTS:
                    return True
                f = node.func
                if isinstance(f, cst.Attribute) and f.attr.value not in LAYOUT and self.local(f.value):
                    return True  # `x.sum()`, `mask.any()`
                if info.qname_startswith(N.TORCH_PREFIX) and any(self.local(a.value) for a in node.args):
                    return True  # `torch.any(mask)`
        return False

    def local(self, expr: cst.CSTNode) -> bool:
        """A name of forward's own (an argument or a value it computed), not `self`."""
        while isinstance(expr, (cst.Attribute, cst.Subscript)):
            if isinstance(expr, cst.Attribute) and expr.attr.value in LAYOUT:
                return False
            expr = expr.value
        return isinstance(expr, cst.Name) and expr.value not in ("self", "cls") and expr.value not in ("torch", "np", "F", "nn")

    # expressions ---------------------------------------------------------------------------------
    def expr(self, node: cst.CSTNode) -> Uses:
        must: set = set()
        may: set = set()

        def visit(n: cst.CSTNode) -> bool:  # True: do not go below
            if isinstance(n, cst.IfExp):
                test = self.expr(n.test)
                yes, no = self.expr(n.body), self.expr(n.orelse)
                m, y, _ = self.join(test, yes, no, self.kind(n.test), n.test)
                must.update(m)
                may.update(y)
                return True
            if isinstance(n, (cst.Lambda, cst.FunctionDef, cst.ClassDef)):
                return True
            if isinstance(n, cst.Attribute) and isinstance(n.value, cst.Name) and n.value.value == "self":
                name = n.attr.value
                if name in self.subs:
                    must.add(name)
                    may.add(name)
                    self.order.setdefault(name, len(self.order))
                elif name in self.methods and self.depth < 3 and name not in ("forward", "__init__"):
                    parent = self.ctx.parent(n)
                    if isinstance(parent, cst.Call) and parent.func is n:
                        self.depth += 1
                        inner = self.block(list(self.methods[name].body.body)) if isinstance(
                            self.methods[name].body, cst.IndentedBlock) else _NONE
                        self.depth -= 1
                        must.update(inner[0])
                        may.update(inner[1])
                return True
            return False

        if not visit(node):
            for _ in iter_nodes(node, prune=visit):  # `visit` records what it meets
                pass
        return frozenset(must), frozenset(may), False
