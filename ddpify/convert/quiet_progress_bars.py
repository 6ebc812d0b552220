"""Progress bars show on rank 0 only: `tqdm(...)` gets `disable=` for the other ranks.

The bar is kept (not removed), so code that calls `.set_postfix()` or `.update()` on
it still runs on every rank.
"""

from __future__ import annotations


from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.convert.context import Context
from ddpify.convert.edits import append_arg, keyword_arg


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    for call in script.calls:
        if not script.is_call_to(call, N.TQDM):
            continue
        others = _negate(ctx.rank0_condition(script.statement_line(call) or call))
        existing = N.keyword(call, "disable")
        if existing is not None and D.reads_rank(script, existing.value):
            continue  # shows on one rank already
        if existing is not None:
            code = script.module.code_for_node(existing.value)
            edits.replace(existing.value, edits.expression(f"({code}) or {others}"))
        else:
            edits.rewrite(call, lambda updated, o=others: append_arg(updated, keyword_arg("disable", edits.expression(o))))
        edits.change(call, "progress bar shows on rank 0 only")


def _negate(condition: str) -> str:
    return condition.replace("== 0", "!= 0")
