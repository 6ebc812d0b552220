"""Code that several passes write into a converted script: module-level helper functions."""

from __future__ import annotations

import libcst as cst

from ddpify.convert.context import Context


# Average the gradients by hand, for a backward DDP's reducer does not see (a model run through
# its own methods, a gradient penalty's forward): the passes that insert `average_gradients(...)`.
AVERAGE_GRADIENTS = '''

def average_gradients(model):
    """Average the gradients over all processes, as DDP's backward does after its own forward."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads or dist.get_world_size() == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, synced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(synced.view_as(g))
'''


def define_function(ctx: Context, name: str, code: str, where: cst.CSTNode | None = None) -> None:
    """Define the helper `name` once, after the imports of the module that uses it at `where`
    (the script's, by default), unless that module defines it already."""
    module = ctx.script.module if where is None else ctx.script.root_of(where)
    own = ctx.script.functions if module is ctx.script.module else {
        s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef)
    }
    if (module, name) in ctx.helpers or name in own:
        return
    ctx.helpers.add((module, name))
    anchor = next((s for s in module.body if not _is_import(s) and not _is_docstring(s)), module.body[-1])
    ctx.edits.insert_before(anchor, code)
    blank = 0
    for line in anchor.leading_lines:
        if line.comment is not None:
            break
        blank += 1
    if blank < 2 and not {h for h in ctx.helpers if h[0] is module} - {(module, name)}:  # two blank lines after it (once)
        pad = [cst.EmptyLine()] * (2 - blank)
        ctx.edits.rewrite(anchor, lambda updated: updated.with_changes(leading_lines=[*pad, *updated.leading_lines]))


def _is_import(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], (cst.Import, cst.ImportFrom))


def _is_docstring(stmt: cst.CSTNode) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, cst.SimpleString)
    )
