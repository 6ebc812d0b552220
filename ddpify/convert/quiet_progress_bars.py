"""Progress bars show on rank 0 only: `tqdm(...)` gets `disable=` for the other ranks.

The bar is kept (not removed), so code that calls `.set_postfix()` or `.update()` on
it still runs on every rank.

A `disable` the call already receives is combined with the rank's, never given twice: an
explicit `disable=x` becomes `disable=(x) or <not rank 0>`; one in a mapping passed as
`**kwargs` (`kwargs = dict(leave=False, disable=x)` bound just before) is combined where the
mapping spells it; a mapping whose keys cannot be seen gets the key merged in at the call
(`**{**kwargs, "disable": kwargs.get("disable") or <not rank 0>}`).
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.script import ref_of
from ddpify.convert.context import Context
from ddpify.convert.edits import append_arg, keyword_arg


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    for call in script.calls:
        if not script.is_call_to(call, N.TQDM):
            continue
        given = N.keyword(call, "disable") or _in_mapping(script, call)
        if given is not None and D.reads_rank(script, given.value):
            continue  # shows on one rank already
        if given is not None:
            others = _negate(ctx.rank0_condition(script.statement_line(given) or script.statement_line(call) or call))
            code = script.module.code_for_node(given.value)
            edits.replace(given.value, edits.expression(f"({code}) or {others}"))
            edits.change(call, "progress bar shows on rank 0 only")
            continue
        others = _negate(ctx.rank0_condition(script.statement_line(call) or call))
        mappings = [a for a in call.args if a.star == "**"]
        if not mappings:
            edits.rewrite(call, lambda updated, o=others: append_arg(updated, keyword_arg("disable", edits.expression(o))))
        elif isinstance(mappings[-1].value, (cst.Name, cst.Attribute)):
            m = script.module.code_for_node(mappings[-1].value)
            merged = f'{{**{m}, "disable": {m}.get("disable") or {others}}}'
            edits.replace(mappings[-1].value, edits.expression(merged))
        else:
            edits.note(call, f"progress bar: `disable=` may come in a `**` mapping here; add `or {others}` to it to show it on rank 0 only")
            continue
        edits.change(call, "progress bar shows on rank 0 only")


def _in_mapping(script, call: cst.Call) -> cst.Arg | cst.DictElement | None:
    """The `disable` a `**mapping` of `call` spells: `**{"disable": x}`, or `**kwargs` with
    `kwargs` last bound before the call, in its scope, to `dict(..., disable=x)` or `{"disable": x}`."""
    scope = script.scope_of(call)
    for arg in call.args:
        if arg.star != "**":
            continue
        value = arg.value
        if isinstance(value, cst.Name):
            bound = [a for a in script.assigns.get(scope, [])
                     if len(a.targets) == 1 and ref_of(a.targets[0].target) == value.value and script.ends_before(a, call)]  # fmt: skip
            value = bound[-1].value if bound else value
        if isinstance(value, cst.Call) and N.call_name(value) == "dict" and isinstance(value.func, cst.Name):
            found = N.keyword(value, "disable")
        elif isinstance(value, cst.Dict):
            found = next((e for e in value.elements if isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString)
                          and e.key.evaluated_value == "disable"), None)  # fmt: skip
        else:
            found = None
        if found is not None:
            return found
    return None


def _negate(condition: str) -> str:
    return condition.replace("== 0", "!= 0")
