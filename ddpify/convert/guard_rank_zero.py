"""Print, log, save and evaluate once: on global rank 0.

Statements are guarded whole (adjacent ones share one `if`); an `if` whose body only
prints or saves gets `and dist.get_rank() == 0` added to its test instead. Nothing
that runs a collective or a DDP forward is put behind the guard: evaluation helpers
run on rank 0 through the unwrapped `model.module`, and checkpoints save
`model.module.state_dict()`, which loads into the single-GPU model.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from ddpify.analysis import names as N
from ddpify.convert.context import Context

ONCE = N.PRINT | N.TORCH_SAVE | N.LOGGING_CALLS


def run(ctx: Context) -> None:
    script = ctx.script
    eval_helpers = {c.func.value for c in script.eval_calls}
    targets: dict[cst.SimpleStatementLine, str] = {}
    for call in script.calls:
        line = script.statement_line(call)
        if line is None or len(line.body) != 1 or getattr(line.body[0], "value", None) is not call:
            continue
        scope = script.scope_of(call)
        if isinstance(scope, cst.FunctionDef) and scope.name.value in eval_helpers:
            continue  # runs on rank 0 only already
        if script.is_call_to(call, ONCE):
            targets[line] = ctx.rank0_condition(line)
        if script.is_call_to(call, N.TORCH_SAVE):
            _save_unwrapped(ctx, call)
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


def _save_unwrapped(ctx: Context, save: cst.Call) -> None:
    """`torch.save(model.state_dict(), ...)` of the DDP model saves `model.module.state_dict()`."""
    script = ctx.script
    ddp = script.ddp_names.get(script.scope_of(save), set())
    for call in script.calls_in(save):
        owner = N.receiver(call)
        if N.call_name(call) == "state_dict" and isinstance(owner, cst.Name) and owner.value in ddp:
            if _after_wrap(ctx, call):
                ctx.edits.replace(owner, ctx.edits.expression(f"{owner.value}.module"))
                ctx.edits.change(script.line(call), f"saves `{owner.value}.module.state_dict()` (no `module.` prefix)")


def _pass_unwrapped(ctx: Context, call: cst.Call) -> None:
    model = ctx.script.model_name
    if not _after_wrap(ctx, call):
        return
    for arg in call.args:
        if m.matches(arg.value, m.Name(model)):
            ctx.edits.replace(arg.value, ctx.edits.expression(f"{model}.module"))
    ctx.edits.change(ctx.script.line(call), f"evaluates `{model}.module` on rank 0")


def _after_wrap(ctx: Context, node: cst.CSTNode) -> bool:
    script = ctx.script
    scope = script.scope_of(node)
    if scope is not script.model_scope or ctx.wrap_after is None:
        return True
    body = list(script.body_of(scope).body)
    return body.index(script.top_statement(node, scope)) > body.index(ctx.wrap_after)
