"""Print, log, save and evaluate once: on global rank 0.

Statements are guarded whole (adjacent ones share one `if`); an `if` whose body only
prints or saves gets `and dist.get_rank() == 0` added to its test instead. Nothing
that runs a collective or a DDP forward is put behind the guard: evaluation helpers
run on rank 0 through the unwrapped `model.module`.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from ddpify.analysis import names as N
from ddpify.analysis.script import ref_of
from ddpify.convert.context import Context

ONCE = N.PRINT | N.TORCH_SAVE | N.LOGGING_CALLS


def run(ctx: Context) -> None:
    script = ctx.script
    eval_helpers = {script.local_function(c) for c in script.eval_calls}
    targets: dict[cst.SimpleStatementLine, str] = {}
    for call in script.calls:
        line = script.statement_line(call)
        if line is None or len(line.body) != 1 or getattr(line.body[0], "value", None) is not call:
            continue
        scope = script.scope_of(call)
        if scope in eval_helpers:
            continue  # runs on rank 0 only already
        if script.is_call_to(call, ONCE):
            targets[line] = ctx.rank0_condition(line)
    for call in script.eval_calls:
        line = script.statement_line(call)
        targets[line] = ctx.rank0_condition(line)
        _pass_unwrapped(ctx, call)
    _guard(ctx, targets)


def _guard(ctx: Context, targets: dict[cst.SimpleStatementLine, str]) -> None:
    script, edits = ctx.script, ctx.edits
    merged: set[cst.If] = set()
    for line, condition in targets.items():
        block = script.parent(line)
        owner = script.parent(block)
        if (
            isinstance(owner, cst.If)
            and owner not in merged
            and owner.orelse is None
            and not isinstance(script.parent(owner), cst.If)
            and all(targets.get(s) == condition for s in block.body)
        ):
            merged.add(owner)
            edits.rewrite(owner, lambda updated, c=condition: updated.with_changes(test=_and(ctx, updated.test, c)))
            edits.change(script.line(owner), "runs on rank 0 only")
        elif not any(script.inside(line, o) for o in merged):
            edits.guard(line, condition)
            edits.change(script.line(line), "runs on rank 0 only")


def _and(ctx: Context, test: cst.BaseExpression, condition: str) -> cst.BaseExpression:
    if isinstance(test, (cst.BooleanOperation, cst.IfExp, cst.Lambda, cst.NamedExpr)) and not test.lpar:
        test = test.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return cst.BooleanOperation(left=test, operator=cst.And(), right=ctx.edits.expression(condition))


def _pass_unwrapped(ctx: Context, call: cst.Call) -> None:
    model = ctx.script.model_name
    if not ctx.after_wrap(call):
        return
    for arg in call.args:
        if ref_of(arg.value) == model:
            ctx.edits.replace(arg.value, ctx.edits.expression(f"{model}.module"))
    ctx.edits.change(ctx.script.line(call), f"evaluates `{model}.module` on rank 0")
