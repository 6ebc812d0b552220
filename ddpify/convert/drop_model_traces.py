"""`--to fsdp2`: a tool that traces or profiles the whole sharded model is dropped, with a note.

    writer.add_graph(net, images)                 # single-GPU script
    summary(net, input_size=(1, 3, 32, 32))

    # ddpify: dropped `writer.add_graph(net, images)`: it traces `net`, whose parameters FSDP2
    # shards (run it on the model before fully_shard)

Such a tool runs the model's forward with hooks of its own (a graph tracer, a FLOP counter). On
a sharded model every forward gathers parameters from every rank, so the call cannot run on
rank 0 alone, and run on every rank the tracer sees DTensors: TensorBoard's tracer fails inside
and the group breaks ("Connection closed by peer"). Only a call that is a statement of its own
is dropped (nothing reads what it returns); one whose result is used gets a TODO.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.script import ref_of
from ddpify.convert.context import Context

TRACING_METHODS = frozenset({"add_graph"})  # SummaryWriter.add_graph(model, input)


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    sharded = set(script.models) - set(script.run_with_weights) - ctx.replicated.keys()
    for call in script.calls:
        traced = _traced_model(ctx, call, sharded)
        if traced is None:
            continue
        shown = script.module.code_for_node(call)
        line = script.statement_line(call)
        small = line.body[0] if line is not None and len(line.body) == 1 else None
        if not (isinstance(small, cst.Expr) and small.value is call):
            edits.todo(line or call, call, f"`{shown}` traces `{traced}`, which FSDP2 shards: run it on the model before fully_shard")
            continue
        ctx.every_rank.add(call)  # (never guarded: it is gone)
        _drop(ctx, line, f"# ddpify: dropped `{_short(shown)}`: it traces `{traced}`, whose parameters FSDP2 shards (run it on the model before fully_shard)")
        edits.change(call, f"`{_short(shown)}` is dropped: tracing a sharded model on one rank hangs the group (run it before fully_shard)")


def _traced_model(ctx: Context, call: cst.Call, sharded: set[str]) -> str | None:
    """The sharded model a tracer or profiler gets as its first argument, after the shard."""
    script = ctx.script
    method = isinstance(call.func, cst.Attribute) and call.func.attr.value in TRACING_METHODS
    if not method and not set(script.names(call.func)) & N.MODEL_PROFILERS:
        return None
    args = N.positional(call) or [a for a in call.args if a.keyword is not None and a.keyword.value == "model"]
    owner = ref_of(args[0].value) if args else None
    return owner if owner in sharded and ctx.after_wrap(call, owner) else None


def _drop(ctx: Context, line: cst.SimpleStatementLine, comment: str) -> None:
    """Remove `line`, leaving `comment` in its place (on the next statement of its block, or on a
    `pass` when it was the last)."""
    script, edits = ctx.script, ctx.edits
    block = list(script.parent(line).body)
    at = block.index(line)
    edits.remove(line)
    if at + 1 < len(block):
        lines = [cst.EmptyLine(comment=cst.Comment(comment))]
        edits.rewrite(block[at + 1], lambda updated: updated.with_changes(leading_lines=[*lines, *updated.leading_lines]))
    else:
        edits.insert_before(line, f"pass  {comment}\n")


def _short(code: str) -> str:
    return code if len(code) <= 60 else code[:57] + "..."
