"""Library calls that print as they work speak on rank 0 only, through their own switch.

`thop.profile(model, inputs=...)` prints a line for every layer it registers; torchinfo's
`summary` and ptflops' `get_model_complexity_info` print their tables. Every rank still makes the
call (its result may be used anywhere); the switch each library offers (`verbose=`,
`print_per_layer_stat=`) is on for rank 0 only, combined with one the call already passes.
"""

from __future__ import annotations

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.convert.context import Context
from ddpify.convert.edits import append_arg, keyword_arg


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    for call in script.calls:
        switch = next((k for q, k in N.PRINTING_CALLS.items() if script.is_call_to(call, frozenset({q}))), None)
        if switch is None or any(a.star == "**" for a in call.args):
            continue
        given = N.keyword(call, switch)
        if given is not None and D.reads_rank(script, given.value):
            continue
        rank0 = ctx.rank0_condition(script.statement_line(call) or call)
        if given is not None:
            edits.replace(given.value, edits.expression(f"({script.root_of(call).code_for_node(given.value)}) and {rank0}"))
        else:
            edits.rewrite(call, _appending(keyword_arg(switch, edits.expression(rank0))))
        edits.change(call, f"`{switch}=` on rank 0 only: the library prints once per job")


def _appending(arg):
    """A rewrite that adds `arg` last to the call it is given."""

    def rewrite(updated):
        return append_arg(updated, arg)

    return rewrite
