"""A copy of the model made before the DDP wrap (a target network, an EMA) takes rank 0's weights.

    q_target.load_state_dict(q.state_dict())     # before the wrap: this rank's own weights
    q = DDP(q, ...)                               # DDP sends rank 0's weights to every rank
    q_target.load_state_dict(q.module.state_dict())  # inserted: the copy matches them again

Unless the script seeds every rank alike, each process initialises the model its own way. The
wrap makes the trained model rank 0's on every rank; a copy taken before it (`load_state_dict`
from the model's state, or `copy.deepcopy(model)`) would stay each rank's own, so the ranks
would compute different targets and train one model toward different goals.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.script import ref_of
from ddpify.convert.context import Context

COPY = "{copy}.load_state_dict({model}.state_dict())  # the copy takes the weights DDP sent from rank 0\n"
DEEPCOPY = frozenset({"copy.deepcopy"})


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    if ctx.fsdp2:
        return
    for model, wrapped in ctx.wrap_after.items():
        scope = script.models.get(model)
        if scope is None:
            continue
        copies = []
        for stmt in script.block_of(scope).body:
            if stmt is wrapped or not script.before(stmt, wrapped):
                break
            copies += [c for c in _copies_of(script, stmt, model) if c not in copies]
        later = _after(script, scope, wrapped)
        sent = model in script.run_with_weights  # never wrapped: rank 0's weights were sent to it
        if sent:
            later = [s for s in later if not script.loops_around(s, scope)]  # (a copy the loop makes comes later)
        for copy in copies:
            if any(_copies_of(script, stmt, model, copy, unwrapped=not sent) for stmt in later):
                continue  # re-copied after the wrap already (a converted script)
            edits.insert_after(wrapped, COPY.format(copy=copy, model=model if sent else f"{model}.module"))
            if sent:
                edits.change(wrapped, f"`{copy}`, copied from `{model}` before rank 0's weights were sent, takes them too")
            else:
                edits.change(wrapped, f"`{copy}`, copied from `{model}` before the wrap, takes the weights DDP sent from rank 0")


def _copies_of(script, stmt: cst.CSTNode, model: str, only: str | None = None, unwrapped: bool = False) -> list[str]:
    """The models `stmt` makes a copy of `model` into: `t.load_state_dict(model.state_dict())`,
    `t = copy.deepcopy(model)` (with `unwrapped`: from `model.module`)."""
    source = f"{model}.module" if unwrapped else model
    found = []
    for call in script.calls_in(stmt):
        receiver = N.receiver(call)
        if N.call_name(call) == "load_state_dict" and receiver is not None and call.args:
            inner = call.args[0].value
            if isinstance(inner, cst.Call) and N.call_name(inner) == "state_dict" and _named(N.receiver(inner)) == source:
                found.append(ref_of(receiver))
        elif script.is_call_to(call, DEEPCOPY) and call.args and _named(call.args[0].value) == source:
            assign = script.parent(call)
            if isinstance(assign, cst.Assign) and assign.value is call and len(assign.targets) == 1:
                found.append(ref_of(assign.targets[0].target))
    return [f for f in found if f and f != model and (only is None or f == only)]


def _named(node: cst.CSTNode | None) -> str | None:
    """`q`, `self.q`, and `q.module` / `self.q.module` as text."""
    if isinstance(node, cst.Attribute) and node.attr.value == "module":
        inner = ref_of(node.value)
        return f"{inner}.module" if inner else None
    return ref_of(node) if node is not None else None


def _after(script, scope, wrapped: cst.CSTNode) -> list[cst.CSTNode]:
    """The statements of `scope` that start after the wrap's statement, in any block."""
    return [s for s in script.nodes_in(scope, cst.SimpleStatementLine) if script.after(s, wrapped)]
