"""A DDP model called twice before one backward, while DDP searches for unused parameters,
gets a TODO at the second call.

    netD = DDP(netD, find_unused_parameters=True)
    lossD = bce(netD(real), ones) + bce(netD(fake.detach()), zeros)   # two forwards of netD
    lossD.backward()

With `find_unused_parameters=True` DDP prepares its search at every forward: forwards that use
different parameters fail at run time ("Expected to mark a variable ready only once") unless
the model is wrapped with `static_graph=True` or the inputs go through one forward. ddpify
cannot merge the forwards safely, so it says where (the finding of `ddpify check`'s DDP119).
The wrap ddpify itself adds does not search: two forwards and one backward then reduce fine
(each parameter's gradient is ready once), and nothing is said. Forwards under
`torch.no_grad()` do not count.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.script import ref_of
from ddpify.check.rules.forward_twice_before_backward import ForwardTwiceBeforeBackward as Rule
from ddpify.convert.context import Context

NO_GRAD = N.NO_GRAD
TODO = f"{Rule.CODE} {Rule.MESSAGE}"


def run(ctx: Context) -> None:
    script = ctx.script
    wraps = [c for c in script.calls if script.is_call_to(c, D.DDP)]
    if any(_static_graph(c) for c in wraps) or not any(_searches_unused(c) for c in wraps):
        return  # the wrap ddpify adds searches for nothing: two forwards and one backward reduce fine
    steps: dict[tuple, dict] = {}
    models = set().union(*script.ddp_names.values()) if script.ddp_names else set()
    for call in script.calls:
        backward = N.call_name(call) == "backward" and N.receiver(call) is not None
        if not backward and ref_of(call.func) not in models:
            continue  # neither a backward nor a forward of a DDP model
        scope = script.scope_of(call)
        step = steps.setdefault((scope, next(iter(script.loops_around(call, scope)), None)), {"forwards": {}, "backward": None})
        if backward:
            if step["backward"] is None or script.before(call, step["backward"]):
                step["backward"] = call
            continue
        model = ref_of(call.func)
        if model in script.ddp_names.get(scope, ()) and ctx.after_wrap(call, model) and not _without_grad(script, call):
            step["forwards"].setdefault(model, []).append(call)
    for step in steps.values():
        if step["backward"] is None:
            continue
        for calls in step["forwards"].values():
            before = [c for c in calls if script.before(c, step["backward"])]
            flagged = set()
            for call in before[1:]:
                stmt = script.statement_line(call) or call
                if stmt not in flagged:
                    flagged.add(stmt)
                    ctx.edits.todo(stmt, call, TODO)


def _without_grad(script, node: cst.CSTNode) -> bool:
    return any(
        isinstance(anc, cst.With) and any(isinstance(i.item, cst.Call) and script.is_call_to(i.item, NO_GRAD) for i in anc.items)
        for anc in script.ancestors(node)
    )


def _searches_unused(call: cst.Call) -> bool:
    """`DDP(model, find_unused_parameters=True)` (or a value set at run time)."""
    arg = N.keyword(call, "find_unused_parameters")
    return arg is not None and not (isinstance(arg.value, cst.Name) and arg.value.value == "False")


def _static_graph(call: cst.Call) -> bool:
    arg = N.keyword(call, "static_graph")
    return arg is not None and isinstance(arg.value, cst.Name) and arg.value.value == "True"
