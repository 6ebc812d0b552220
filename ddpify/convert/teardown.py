"""Destroy the process group when the script's setup scope finishes (after a last barrier)."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.convert.context import Context

# The barrier lets every rank finish (rank 0 may still be saving) before any of them tears the
# group down: without it, gloo can abort a process at exit (seen in ~1 run in 10 on CPU).
TEARDOWN = "dist.barrier()  # every rank is done\ndist.destroy_process_group()\n"


def run(ctx: Context) -> None:
    script = ctx.script
    if any(script.is_call_to(c, D.DESTROY_PROCESS_GROUP) for c in script.calls):
        return  # the script tears its process group down already
    cls = script.class_of(ctx.setup_scope)
    if cls is not None:
        _after_driver(ctx, cls)
        return
    body = list(script.block_of(ctx.setup_scope).body)
    last = body[-1]
    if _is_main_guard(last):
        last = last.body.body[-1]  # the script ends with its `__main__` block
    _teardown_at(ctx, last)


def _teardown_at(ctx: Context, last: cst.CSTNode) -> None:
    """Barrier and destroy after `last` (before it when it returns); a barrier already
    there is not doubled."""
    script, edits = ctx.script, ctx.edits
    code = TEARDOWN
    before = D.sibling(script, last, -1) if _is_return(last) else last
    if before is not None and isinstance(before, cst.SimpleStatementLine) and D.barrier_in(script, before):
        code = TEARDOWN.split("\n", 1)[1]
    if _is_return(last):
        edits.insert_before(last, code)
    else:
        edits.insert_after(last, code)
    edits.change(last, "`dist.destroy_process_group()` at the end")


def _is_return(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Return)


def _is_main_guard(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.If) and "__name__" in cst.Module([]).code_for_node(stmt.test)


def _after_driver(ctx: Context, cls: cst.ClassDef) -> None:
    """Setup runs in a method: tear down at the end of the function (or script) that builds the
    object, never inside the branch that builds it (`if args.model == "GAN": model = GAN(args)`,
    trained further down)."""
    script, edits = ctx.script, ctx.edits
    for call in script.calls:
        if script.class_called(call) is cls or isinstance(call.func, cst.Name) and call.func.value == cls.name.value:
            scope = script.scope_of(call)
            body = script.body_of(scope).body
            last = body[-1]
            if _is_main_guard(last):
                last = last.body.body[-1]
            _teardown_at(ctx, last)
            return
    edits.todo(cls, cls, "call `dist.destroy_process_group()` when training ends")
