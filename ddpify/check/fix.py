"""Applying rules' fixes: replace nodes, re-parse, repeat until nothing changes."""

from __future__ import annotations

import libcst as cst


class _Replace(cst.CSTTransformer):
    def __init__(self, replacements: dict[int, cst.CSTNode]) -> None:
        self.replacements = replacements

    def on_leave(self, original_node, updated_node):  # type: ignore[override]
        new = self.replacements.get(id(original_node))
        return new if new is not None else updated_node


def apply_replacements(module: cst.Module, fixes: list[tuple[cst.CSTNode, cst.CSTNode]]) -> str:
    """Code of ``module`` with each original node swapped for its replacement (first one wins)."""
    replacements: dict[int, cst.CSTNode] = {}
    for original, new in fixes:
        replacements.setdefault(id(original), new)
    return module.visit(_Replace(replacements)).code


def remove_arg(call: cst.Call, arg: cst.Arg) -> cst.Call:
    """``call`` without ``arg``, keeping the comma style and layout of what remains."""
    args = [a for a in call.args if a is not arg]
    if args and call.args and call.args[-1] is arg:
        # the new last argument takes the removed one's ending: its trailing comma (or lack of
        # one) and the space before `)` (a newline in a call laid out over lines)
        args[-1] = args[-1].with_changes(comma=arg.comma, whitespace_after_arg=arg.whitespace_after_arg)
    return call.with_changes(args=args)


def add_kwarg(call: cst.Call, name: str, value: cst.BaseExpression) -> cst.Call:
    args = list(call.args)
    new = cst.Arg(
        keyword=cst.Name(name),
        value=value,
        equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
    )
    if args:
        last = args[-1]
        if isinstance(last.comma, cst.Comma):
            # keep the user's trailing comma (and the line break before ")") after the new argument
            new = new.with_changes(comma=last.comma)
        args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    args.append(new)
    return call.with_changes(args=args)


def insert_module_attr(expr: cst.BaseExpression) -> cst.Attribute:
    """``ddp_model`` -> ``ddp_model.module``."""
    return cst.Attribute(value=expr, attr=cst.Name("module"))
