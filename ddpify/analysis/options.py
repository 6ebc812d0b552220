"""Command-line options a conversion left without effect: an argparse option the script read
before and no longer reads (a `--gpu` index that LOCAL_RANK now decides, a `--gpus` list that
fed the DataParallel the conversion removed)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import libcst as cst

from ddpify.analysis.index import iter_nodes

_GPU_WORDS = ("gpu", "cuda", "device", "rank")


def dead_options(before: cst.Module, after: cst.Module, line: Callable[[cst.CSTNode], int]) -> list[tuple[int, str]]:
    """(line of its `add_argument`, note) for each option read in `before` and not in `after`;
    `line` gives a node of `before` its line. A script that hands its options on wholesale
    (`f(**vars(args))`, `getattr(args, name)`) is left out: its reads cannot be counted."""
    nodes = list(iter_nodes(before))  # one walk of the script serves every question below
    calls = [n for n in nodes if isinstance(n, cst.Call)]
    if _reads_wholesale(calls):
        return []
    declared = _declared(calls, line)
    if not declared:
        return []
    was, now = _reads(nodes), _reads(iter_nodes(after))
    notes = []
    for dest, (where, flag) in declared.items():
        if was[dest] and not now[dest]:
            why = "LOCAL_RANK now picks each process's GPU" if any(w in dest.lower() for w in _GPU_WORDS) else "the conversion removed its last use"
            notes.append((where, f"`{flag}` no longer has any effect: {why} (kept, so existing command lines still parse)"))
    return notes


def _declared(calls: list[cst.Call], line: Callable[[cst.CSTNode], int]) -> dict[str, tuple[int, str]]:
    """dest -> (line, the option's long flag) of each `parser.add_argument("--flag", ...)`."""
    out: dict[str, tuple[int, str]] = {}
    for call in calls:
        found = _option(call)
        if found is not None:
            out[found[0]] = (line(call), found[1])
    return out


def option_defaults(calls: Iterable[cst.Call]) -> dict[str, cst.BaseExpression]:
    """dest -> the default of each `parser.add_argument("--log-level", default="INFO")`: what
    every process reads when the command line does not set it (the same on every rank)."""
    out: dict[str, cst.BaseExpression] = {}
    for call in calls:
        found = _option(call)
        default = next((a.value for a in call.args if a.keyword and a.keyword.value == "default"), None)
        if found is not None and default is not None:
            out[found[0]] = default
    return out


def option_dests(calls: Iterable[cst.Call]) -> set[str]:
    """The dest of each `parser.add_argument("--flag", ...)` among `calls`."""
    return {found[0] for found in map(_option, calls) if found is not None}


def _option(call: cst.Call) -> tuple[str, str] | None:
    """(dest, long flag) of a `parser.add_argument("--flag", ...)` call, else None."""
    if not (isinstance(call.func, cst.Attribute) and call.func.attr.value == "add_argument"):
        return None
    flags = [a.value.evaluated_value for a in call.args if a.keyword is None and isinstance(a.value, cst.SimpleString)]
    flags = [f for f in flags if isinstance(f, str) and f.startswith("-")]
    if not flags:
        return None
    long = next((f for f in flags if f.startswith("--")), flags[0])
    dest = next(
        (a.value.evaluated_value for a in call.args if a.keyword and a.keyword.value == "dest" and isinstance(a.value, cst.SimpleString)),
        long.lstrip("-").replace("-", "_"),
    )
    return dest, long


def _reads(nodes: Iterable[cst.CSTNode]) -> Counter:
    """How often each name is read as an attribute of a plain name (`args.gpu`, `opt.gpu`), not of `self`."""
    return Counter(
        node.attr.value
        for node in nodes
        if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value != "self"
    )


def _reads_wholesale(calls: list[cst.Call]) -> bool:
    """`f(**vars(args))`, or `getattr(args, name)` with a name that is not a literal."""
    for call in calls:
        name = call.func.value if isinstance(call.func, cst.Name) else None
        if name == "getattr" and len(call.args) > 1 and not isinstance(call.args[1].value, cst.SimpleString):
            return True
        if any(a.star == "**" and _calls_vars(a.value) for a in call.args):
            return True
    return False


def _calls_vars(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "vars"
