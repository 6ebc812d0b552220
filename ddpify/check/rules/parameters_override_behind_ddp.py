import libcst as cst

from ddpify.check.context import DDP_CLASSES, dotted_name, positional
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import assigned_name, before, class_of_call

MOVES = {"to", "cuda", "cpu", "float", "double", "half", "train"}


class ParametersOverrideBehindDDP(Rule):
    """`parameters()` of a DDP wrapper around a module that overrides `parameters()`.

    ## What it does
    Flags `ddp_model.parameters()` where the module in the wrapper is of a class of the
    program that defines its own `parameters()` (a meta-learner that hands out only its
    trainable weights, keeping frozen ones in another `ParameterList`).

    ## Why is this bad?
    The wrapper is another `nn.Module`: its `parameters()` walks every registered parameter of
    the module and never calls the override. Code that differentiated the model's own list now
    gets frozen tensors too (`torch.autograd.grad` raises "One of the differentiated Tensors
    does not require grad"), and an optimizer or fast-weight update pairs the wrong tensors.

    ## Example
    ```python
    net = DDP(Learner())  # Learner.parameters() returns self.vars only
    grads = torch.autograd.grad(loss, net.parameters())
    ```

    ## Use instead
    ```python
    net = DDP(Learner())
    grads = torch.autograd.grad(loss, net.module.parameters())
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html
    """

    CODE = "DDP153"
    NAME = "parameters-override-behind-ddp"
    DDP_ONLY = True
    MESSAGE = (
        "`{cls}` overrides `parameters()`, but the DDP wrapper's `parameters()` does not call it (it also yields "
        "the frozen parameters); use `{name}.module.parameters()`"
    )
    VALID = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\nclass Net(nn.Module):\n"
        "    def parameters(self, recurse=True):\n        return self.vars\nnet = DDP(Net())\n"
        "g = torch.autograd.grad(loss, net.module.parameters())\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nclass Net(nn.Module):\n"
        "    pass\nnet = DDP(Net())\ng = torch.autograd.grad(loss, net.parameters())\n",
    ]
    INVALID = [
        Invalid(
            "from torch.nn.parallel import DistributedDataParallel as DDP\nclass Net(nn.Module):\n"
            "    def parameters(self, recurse=True):\n        return self.vars\nnet = DDP(Net())\n"
            "g = torch.autograd.grad(loss, net.parameters())\n"
        ),
    ]

    def check(self, ctx):
        wrapped = {}  # the name holding the wrapper -> the overriding class's name
        for ci in ctx.ddp_calls:
            name, cls = assigned_name(ctx, ci.node), _overriding_class(ctx, ci)
            if name and cls:
                wrapped[name] = cls
        if not wrapped:
            return
        for ci in ctx.method_calls("parameters"):
            name = dotted_name(ci.receiver)
            if name in wrapped and ctx.is_ddp(ci.receiver):
                yield Report(ci.node, self.MESSAGE.format(cls=wrapped[name], name=name))


def _overriding_class(ctx, ddp_call) -> str | None:
    """The class of the module a DDP call wraps, when it defines `parameters()`."""
    args = positional(ddp_call.node)
    if not args:
        return None
    made = _made_by(ctx, _unmoved(args[0].value), ddp_call.node)
    if made is None:
        return None
    cls = class_of_call(ctx, made)
    if cls is None:
        return None
    defines = any(isinstance(s, cst.FunctionDef) and s.name.value == "parameters" for s in cls.body.body)
    return cls.name.value if defines else None


def _unmoved(expr):
    """`net` in `net.to(device)`, `net.cuda()`."""
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in MOVES:
        expr = expr.func.value
    return expr


def _made_by(ctx, expr, site):
    """The call that built the module: inline, or the one value its name is bound to before."""
    if isinstance(expr, cst.Call):
        return expr
    name = dotted_name(expr)
    bound = [b for b in ctx.assignments if b.dotted == name and b.func is ctx.enclosing_func(site) and before(ctx, b.value, site)]
    calls = [v for v in map(_unmoved, (b.value for b in bound)) if isinstance(v, cst.Call) and not ctx.info(v).qnames & DDP_CLASSES]
    return calls[-1] if calls else None
