"""Drop `nn.DataParallel`: DDP takes its place.

`model = nn.DataParallel(model)` and `model.encoder = nn.DataParallel(model.encoder)` (also
under `if torch.cuda.device_count() > 1:`) go away; `nn.DataParallel(net).to(device)` keeps `net.to(device)`; `isinstance(m,
nn.DataParallel)` asks about DDP, so `.module` code keeps working. A state dict the script
loaded into its DataParallel model has `module.` keys (the checkpoints of its earlier runs):
it is loaded with that prefix stripped, since the model now loads unwrapped (`model` before the
DDP wrap, `model.module` after it); checkpoints without the prefix load as they are.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import dotted_name
from ddpify.analysis.script import data_parallel_loads
from ddpify.convert.context import Context


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    for alias in script.data_parallel_imports:
        edits.drop_import_if_unused(*alias)
    for node in script.data_parallel:
        parent = script.parent(node)
        if isinstance(parent, cst.Call) and parent.func is node:
            _unwrap(ctx, parent)
        elif _chooses_wrapped(script, node):
            # `a if isinstance(m, nn.DataParallel) else b`: the model is always wrapped now.
            choice = script.parent(script.parent(script.parent(node)))
            edits.rewrite(choice, lambda updated: updated.body)
            edits.change(node, "the model is always wrapped now: keeps the wrapped branch")
        else:
            edits.replace(node, cst.Name("DDP"))
            edits.change(node, "`DataParallel` check now asks about `DDP`")
    for call in data_parallel_loads(script):
        _strip_prefix(ctx, call)


def _strip_prefix(ctx: Context, call: cst.Call) -> None:
    """`model.load_state_dict(state)` -> `model.load_state_dict({k.removeprefix("module."): v
    for k, v in state.items()})` (what other passes do inside `state` stays)."""
    arg = (N.positional(call) or [N.keyword(call, "state_dict")])[0]
    template = ctx.edits.expression('{k.removeprefix("module."): v for k, v in state.items()}')

    def strip(updated: cst.BaseExpression) -> cst.DictComp:
        if isinstance(updated, (cst.BinaryOperation, cst.BooleanOperation, cst.IfExp, cst.Lambda, cst.Await)) and not updated.lpar:
            updated = updated.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        items = template.for_in.iter
        iterate = items.with_changes(func=items.func.with_changes(value=updated))
        return template.with_changes(for_in=template.for_in.with_changes(iter=iterate))

    ctx.edits.rewrite(arg.value, strip)
    ctx.edits.change(call, "the nn.DataParallel model's state dict has `module.` keys: loaded with the prefix stripped")


def _unwrap(ctx: Context, call: cst.Call) -> None:
    script, edits = ctx.script, ctx.edits
    line = script.statement_line(call)
    if line is not None and _wraps_itself(script, line):
        # `model = DataParallel(model)`, `model.encoder = DataParallel(model.encoder)`: nothing is
        # left to do (DDP wraps the whole model); drop a bare `if` that holds only such lines too.
        block = script.parent(line)
        owner = script.parent(block)
        if isinstance(owner, cst.If) and owner.orelse is None and all(_wraps_itself(script, s) for s in block.body):
            edits.remove(owner)
        elif isinstance(owner, cst.Else) and all(_wraps_itself(script, s) for s in block.body):
            # `else: model = nn.DataParallel(model)`: the `else` goes, not left as `else: pass`
            edits.rewrite(script.parent(owner), lambda updated: updated.with_changes(orelse=None))
        else:
            edits.remove(line)
    else:
        edits.rewrite(call, lambda updated: N.positional(updated)[0].value if N.positional(updated) else N.keyword(updated, "module").value)
    edits.change(call, "`nn.DataParallel` removed: DistributedDataParallel replaces it")


def _wraps_itself(script, stmt: cst.CSTNode) -> bool:
    """Is `stmt` a line `x = nn.DataParallel(x, ...)` (x a name or `a.b` attribute chain)?"""
    assign = N.sole_assign(stmt)
    if assign is None or not isinstance(assign.value, cst.Call) or assign.value.func not in script.data_parallel:
        return False
    args = N.positional(assign.value) or [N.keyword(assign.value, "module")]
    inner = args[0].value if args[0] is not None else None
    return inner is not None and dotted_name(inner) is not None and dotted_name(assign.targets[0].target) == dotted_name(inner)


def _chooses_wrapped(script, node: cst.CSTNode) -> bool:
    """Is `node` the class in `isinstance(x, DataParallel)`, the test of an `a if ... else b`?"""
    arg = script.parent(node)
    call = script.parent(arg)
    choice = script.parent(call)
    return (
        isinstance(arg, cst.Arg)
        and isinstance(call, cst.Call)
        and N.call_name(call) == "isinstance"
        and isinstance(choice, cst.IfExp)
        and choice.test is call
    )
