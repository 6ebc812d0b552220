"""Is a model run with weights handed to it, so that DDP cannot wrap it?

    grads = torch.autograd.grad(loss, net.parameters(), create_graph=True)
    fast = [p - lr * g for p, g in zip(net.parameters(), grads)]
    out = net(x, fast)                       # the forward reads the weights it is given

A meta-learner (MAML and its kin) differentiates the model's parameters with
`torch.autograd.grad` and runs the model with weights computed from them (or through
`torch.func.functional_call`). DDP averages gradients only as they are accumulated into `.grad`
in the backward of its own forward: it does not work with `torch.autograd.grad`, and it cannot
see a forward that reads weights passed in. Wrapped, `autograd.grad` over the wrapper's
parameters fails ("One of the differentiated Tensors does not require grad": DDP's
`parameters()` is nn.Module's, not the model's own override) even on one process. Such a model
is not wrapped: every rank starts from rank 0's weights and averages its gradients by hand
after each backward (convert/wrap_model.py, convert/average_gradients.py).

What counts, in the training code only (a function that trains, or a loop around backward),
where the model is in sight under any of its names (its own scope, a trainer's `self.` attribute,
a training function's parameter), and in what that code calls with it (a helper handed the model,
a method of the same object, `self.adapt(x, y)`):
`torch.autograd.grad(..., inputs)` whose inputs are the model's parameters or weights computed
from them; a call of the model (or of a method of its own) with such weights as an argument;
`functional_call(model, ...)`
(higher's `innerloop_ctx(model, opt)` too).
Weights computed from the parameters are collections: `model.parameters()` /
`model.named_parameters()` (in `list`, `dict`, `zip`, `map`, `.items()`), a comprehension over
them, or a name bound to any of these (`fast = list(map(f, zip(grads, fast)))` stays one); a single
tensor taken from them (`next(model.parameters()).dtype`) is not.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import dotted_name

PARAMETER_METHODS = frozenset({"parameters", "named_parameters"})
COLLECTIONS = frozenset({"list", "tuple", "dict", "zip", "map", "OrderedDict", "ParameterList", "ParameterDict"})
VIEWS = frozenset({"items", "values"})


def run_with_weights(script, holders: list[tuple[object, str]]) -> cst.Call | None:
    """The call that shows a model is run with weights handed to it (preferred) or has its
    parameters differentiated with autograd.grad, in the training code of `holders` ((scope, the
    model's name there) pairs); None when nothing does."""
    found: list[cst.Call] = []
    seen: set = set()
    for scope, name in holders:
        found += _in_scope(script, scope, name, trains=scope in script.training_functions, depth=0, seen=seen)
    # what the summary shows: a forward with weights passed in over autograd.grad, one with gradients over one without
    return min(found, key=lambda c: (differentiates(script, c), _without_grad(script, c)), default=None)


def _without_grad(script, call: cst.Call) -> bool:
    return any(
        isinstance(a, cst.With) and any(isinstance(i.item, cst.Call) and script.is_call_to(i.item, N.NO_GRAD) for i in a.items)
        for a in script.ancestors(call)
    )


def differentiates(script, call: cst.Call) -> bool:
    """Is this evidence `torch.autograd.grad` (not a forward with weights passed in)?"""
    return script.is_call_to(call, N.AUTOGRAD_GRAD)


def _in_scope(script, scope, name: str, trains: bool, depth: int, seen: set) -> list[cst.Call]:
    if (scope, name, trains) in seen:
        return []  # (looked at already: a method that is a holder and called by another)
    seen.add((scope, name, trains))
    derived: set[str] | None = None
    found = []
    for call in script.calls_in(scope):
        if not (trains or script.in_training_loop(call, scope)):
            continue
        if derived is None:
            derived = weight_names(script, scope, name)
        if _shows(script, call, name, derived):
            found.append(call)
        fn = script.local_function(call)
        if fn is None or fn is scope or depth >= 2:
            continue
        from ddpify.analysis.script import param_receiving

        if name.startswith("self.") and N.is_name(N.receiver(call), "self"):
            param = name  # `self.adapt(x, y)`: a method of the same object sees `self.model` too
        else:
            param = param_receiving(fn, call, name)  # a helper handed the model
        if param is not None and param != "self":
            found += _in_scope(script, fn, param, trains=True, depth=depth + 1, seen=seen)
    return found


def _shows(script, call: cst.Call, name: str, derived: set[str]) -> bool:
    if script.is_call_to(call, N.AUTOGRAD_GRAD):
        inputs = N.keyword(call, "inputs") or next(iter(N.positional(call)[1:2]), None)
        return inputs is not None and is_weights(inputs.value, name, derived)
    if script.is_call_to(call, N.FUNCTIONAL_CALL):
        module = N.keyword(call, "module") or next(iter(N.positional(call)), None)
        return module is not None and dotted_name(module.value) == name
    runs = dotted_name(call.func) == name or (  # `net(x, fast)`, `net.forward(x, fast)`, `net.functional(x, fast)`
        isinstance(call.func, cst.Attribute)
        and dotted_name(call.func.value) == name
        and (call.func.attr.value == "forward" or call.func.attr.value not in N.NN_MODULE_API)
    )
    return runs and any(is_weights(arg.value, name, derived) for arg in call.args)


def weight_names(script, scope, name: str, depth: int = 0) -> set[str]:
    """The names `scope` binds to weights computed from `name`'s parameters (also what a method
    of the same object or a helper handed the model returns: `fast = self.adapt(x, y)`)."""
    derived: set[str] = set()
    assigns = [a for a in script.assigns.get(scope, []) if len(a.targets) == 1]
    for a in assigns:
        target = dotted_name(a.targets[0].target)
        if target is not None and isinstance(a.value, cst.Call) and _returns_weights(script, a.value, scope, name, depth):
            derived.add(target)
    while True:
        more = {
            target
            for a in assigns
            if (target := dotted_name(a.targets[0].target)) is not None
            and target not in derived
            and is_weights(a.value, name, derived)
        }
        if not more:
            return derived
        derived |= more


def _returns_weights(script, call: cst.Call, scope, name: str, depth: int) -> bool:
    """Does `call` (the project's function) return weights computed from `name`'s parameters?"""
    from ddpify.analysis.script import param_receiving, returns

    fn = script.local_function(call)
    if fn is None or fn is scope or depth >= 2:
        return False
    if name.startswith("self.") and N.is_name(N.receiver(call), "self"):
        inner = name
    else:
        inner = param_receiving(fn, call, name)
    if inner is None or inner == "self":
        return False
    derived = weight_names(script, fn, inner, depth + 1)
    return any(r.value is not None and is_weights(r.value, inner, derived) for r in returns(fn))


def is_weights(node: cst.CSTNode, name: str, derived: set[str]) -> bool:
    """Is `node` the parameters of `name` as a collection, or weights computed from them?"""
    if isinstance(node, (cst.Name, cst.Attribute)) and dotted_name(node) in derived:
        return True
    if isinstance(node, cst.Call):
        if N.call_name(node) in PARAMETER_METHODS and N.receiver(node) is not None:
            return dotted_name(N.receiver(node)) == name
        if N.call_name(node) in VIEWS and N.receiver(node) is not None:
            return is_weights(N.receiver(node), name, derived)
        if N.call_name(node) in COLLECTIONS:
            return any(is_weights(arg.value, name, derived) for arg in node.args)
        return False
    if isinstance(node, (cst.ListComp, cst.GeneratorExp, cst.SetComp, cst.DictComp)):
        clause = node.for_in
        while clause is not None:
            if is_weights(clause.iter, name, derived):
                return True
            clause = clause.inner_for_in
    return False
