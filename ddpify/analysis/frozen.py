"""Is a model frozen where it is built: no parameter left that requires a gradient?

DDP refuses such a module ("DistributedDataParallel is not needed when a module doesn't have any
parameter that requires a gradient"): a backbone a linear probe freezes but hands to the
optimizer with its head, an encoder frozen by a flag. Read in the model's own function, in
source order: `m.requires_grad_(False)` (also at the end of a chain, `Net().eval().requires_grad_(False)`),
`for p in m.parameters(): p.requires_grad = False`, or a function of the project that does
either to the model it gets, freeze it; unfreezing it or a part of it (`m.fc.requires_grad_()`),
a new layer (`m.fc = nn.Linear(...)`) or a new object under its name make it trainable. Under an
`if` (a loop, a `try`) either holds on some runs only: then the answer is None (not known
before the run). What the training loop does (`set_requires_grad(netD, False)` for the
generator's step) comes after the wrap, and does not count.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import dotted_name

GROWS = frozenset({"add_module", "register_module", "append", "extend", "insert"})


def frozen(script, model: str, scope, depth: int = 0) -> bool | None:
    """True: `model` is frozen on every path through `scope`; None: on some; False: on none."""
    events = []  # (node, True: frozen from here / False: trainable from here)
    for call in script.calls_in(scope):
        if (freezes := _call_freezes(script, call, model, depth)) is not None:
            events.append((call, freezes))
    for loop in script.nodes_in(scope, cst.For):
        owner, freezes = _parameter_loop(loop)
        if owner == model or _part_of(owner, model) and not freezes:
            events.append((loop, freezes))
    for assign in script.assigns.get(scope, []):
        target = dotted_name(assign.targets[0].target)
        if target == model and not _same_module(assign.value, model):
            events.append((assign, _frozen_chain(assign.value)))  # a new object under its name
        elif _part_of(target, model) and isinstance(assign.value, cst.Call):
            events.append((assign, False))  # `model.fc = nn.Linear(...)`: a layer that trains
    start, _ = script.index.source_order()
    events = [(node, freezes) for node, freezes in events if not script.in_training_loop(node, scope)]  # after the wrap
    state: bool | None = False
    for node, freezes in sorted(events, key=lambda event: start[event[0]]):
        if not _conditional(script, node, scope):
            state = freezes
        elif state is not freezes:
            state = None
    return state


def _call_freezes(script, call: cst.Call, model: str, depth: int) -> bool | None:
    """What a call does to `model`'s gradients: True freezes it all (`model.requires_grad_(False)`,
    `freeze(model)` of the project), False gives it a trainable part, None neither."""
    receiver = N.receiver(call)
    if receiver is not None:
        owner = dotted_name(N.module_itself(receiver))
        if N.call_name(call) == "requires_grad_" and (owner == model or _part_of(owner, model)):
            freezes = _freezes(call)
            return True if freezes and owner == model else None if freezes else False
        if N.call_name(call) in GROWS and owner == model:
            return False
    fn = script.local_function(call)
    if fn is not None and depth < 2 and fn is not script.scope_of(call):
        from ddpify.analysis.script import param_receiving

        param = param_receiving(fn, call, model)
        if param is not None and frozen(script, param, fn, depth + 1) is True:
            return True
    return None


def _parameter_loop(loop: cst.For) -> tuple[str | None, bool]:
    """`for p in m.parameters(): p.requires_grad = False` (`p.requires_grad_(False)`, `for name, p
    in m.named_parameters()`): (`m`, whether it freezes)."""
    it, target = loop.iter, loop.target
    if not (isinstance(it, cst.Call) and N.call_name(it) in ("parameters", "named_parameters") and N.receiver(it) is not None):
        return None, False
    if isinstance(target, cst.Tuple) and target.elements:
        target = target.elements[-1].value
    for stmt in loop.body.body:
        small = N.sole_statement(stmt)
        if isinstance(small, cst.Assign) and isinstance(attr := small.targets[0].target, cst.Attribute):
            if attr.value.deep_equals(target) and attr.attr.value == "requires_grad":
                return dotted_name(N.receiver(it)), N.is_name(small.value, "False")
        if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call) and N.call_name(small.value) == "requires_grad_":
            if N.receiver(small.value).deep_equals(target):
                return dotted_name(N.receiver(it)), _freezes(small.value)
    return None, False


def _freezes(call: cst.Call) -> bool:
    """`x.requires_grad_(False)` (`requires_grad=False`), not `x.requires_grad_()`."""
    return bool(call.args) and N.is_name(call.args[0].value, "False")


def _frozen_chain(value: cst.BaseExpression) -> bool:
    """`Net().eval().requires_grad_(False)`: a new object frozen as it is built."""
    while isinstance(value, cst.Call) and N.call_name(value) in N.SELF_RETURNING and N.receiver(value) is not None:
        if N.call_name(value) == "requires_grad_":
            return _freezes(value)
        value = N.receiver(value)
    return False


def _same_module(value: cst.BaseExpression, model: str) -> bool:
    return isinstance(value, cst.Call) and dotted_name(N.module_itself(value)) == model


def _part_of(ref: str | None, model: str) -> bool:
    return ref is not None and ref.startswith(model + ".")


def _conditional(script, node: cst.CSTNode, scope) -> bool:
    """Does `node` run on some paths only: under an `if` (not `if __name__ == "__main__":`), a
    loop, a `try` or an inline condition of `scope`?"""
    for anc in script.ancestors(node):
        if anc is scope:
            return False
        if isinstance(anc, cst.If) and not N.tests_module_name(anc.test):
            return True
        if isinstance(anc, (cst.Else, cst.For, cst.While, cst.Try, cst.ExceptHandler, cst.IfExp, cst.BooleanOperation)):
            return True
    return False
