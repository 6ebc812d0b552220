"""Code the analysis cannot follow gets a TODO where it enters the program, never a guess.

    import legacy_utils                         # a module of the project that does not parse
    trainer = importlib.import_module(name)     # a module chosen at run time (a name, not a literal)

What such code does with the model, the data or the files (a training loop, a DataLoader, a
checkpoint) is unknown to the conversion, so the line says so and the summary lists it
(`--strict` exits 1). So is a second trainer class whose models share the first one's names
(`self.G` of `DCGAN` and of `GAN`, picked by a command-line branch): only the first is converted.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import dotted_name
from ddpify.convert.context import Context

DYNAMIC_IMPORTS = frozenset({"importlib.import_module", "builtins.__import__", "__import__"})


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    unreadable = dict(script.facts.unreadable)
    if unreadable:
        for node in script.nodes_of(cst.Import) + script.nodes_of(cst.ImportFrom):
            for name in _imported(node):
                if name in unreadable:
                    why = unreadable[name]
                    edits.todo(_statement(script, node), node, f"`{name}` cannot be read ({why}): what it does with the model, data or files is not converted")
                    break
    for call, model, cls in script.unconverted_models:
        first = script.class_of(script.models[model])
        edits.todo(
            _statement(script, call), call,
            f"`{model}` of `{cls.name.value if cls else '?'}` is not converted (one trainer class per program is: "
            f"`{first.name.value if first else '?'}`): wrap it in DDP and shard its data by hand, or convert each trainer on its own",
        )  # fmt: skip
    for call in script.calls:
        literal = call.args and isinstance(call.args[0].value, cst.SimpleString)
        if N.call_name(call) in ("import_module", "__import__") and script.is_call_to(call, DYNAMIC_IMPORTS) and not literal:
            edits.todo(
                _statement(script, call), call,
                "a module imported at run time is not followed: convert what it does with the model, data or files by hand",
            )  # fmt: skip


def _imported(node: cst.Import | cst.ImportFrom) -> list[str]:
    """The dotted names an import may load (`from a import b`: `a.b`, then `a`)."""
    if isinstance(node, cst.Import):
        return [dotted_name(alias.name) or "" for alias in node.names]
    base = dotted_name(node.module) if node.module is not None else ""
    names = [] if isinstance(node.names, cst.ImportStar) else [f"{base}.{dotted_name(a.name)}" for a in node.names]
    return [*names, base]


def _statement(script, node: cst.CSTNode) -> cst.CSTNode:
    """The statement that holds `node` (where the TODO goes)."""
    for anc in [node, *script.ancestors(node)]:
        if isinstance(anc, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            return anc
    return node
