"""A list made from a set is sorted, so every rank builds it in the same order.

    words = list(set(text.split()))          # was: each process's own order
    words = sorted(set(text.split()))        # now: the same on every rank

A set of strings iterates in an order its process's hash seed decides, and every process that
torchrun starts draws its own (PYTHONHASHSEED). A vocabulary built as `list(set(words))` then
gives the same word a different id on each rank: the ranks train one model on data that means
different things, and `ddpify verify` sees full-batch training whose ranks' inputs differ.
`list(set(x))` and `tuple(set(x))` become sorted; as one process the order was arbitrary anyway.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.convert.context import Context

MESSAGE = "`{call}(set(...))` follows each process's hash seed: sorted, so every rank builds the same order"


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    for call in script.calls:
        if not (N.is_call_of(call, "list") or N.is_call_of(call, "tuple")) or len(call.args) != 1 or call.args[0].keyword:
            continue
        inner = call.args[0].value
        if not (isinstance(inner, cst.Call) and N.is_call_of(inner, "set")):
            continue
        sort = cst.Call(func=cst.Name("sorted"), args=[cst.Arg(inner)])
        name = call.func.value
        edits.replace(call, sort if name == "list" else call.with_changes(args=[cst.Arg(sort)]))
        edits.change(call, MESSAGE.format(call=name))
