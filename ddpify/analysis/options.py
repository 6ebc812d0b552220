"""Command-line options a conversion left without effect: an argparse option the script read
before and no longer reads (a `--gpu` index that LOCAL_RANK now decides, a `--gpus` list that
fed the DataParallel the conversion removed)."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import libcst as cst
import libcst.matchers as m

_ADD_ARGUMENT = m.Call(func=m.Attribute(attr=m.Name("add_argument")))
_GPU_WORDS = ("gpu", "cuda", "device", "rank")


def dead_options(before: cst.Module, after: cst.Module, line: Callable[[cst.CSTNode], int]) -> list[tuple[int, str]]:
    """(line of its `add_argument`, note) for each option read in `before` and not in `after`;
    `line` gives a node of `before` its line. A script that hands its options on wholesale
    (`f(**vars(args))`, `getattr(args, name)`) is left out: its reads cannot be counted."""
    if _reads_wholesale(before):
        return []
    declared = _declared(before, line)
    if not declared:
        return []
    was, now = _reads(before), _reads(after)
    notes = []
    for dest, (line, flag) in declared.items():
        if was[dest] and not now[dest]:
            why = "LOCAL_RANK now picks each process's GPU" if any(w in dest.lower() for w in _GPU_WORDS) else "the conversion removed its last use"
            notes.append((line, f"`{flag}` no longer has any effect: {why} (kept, so existing command lines still parse)"))
    return notes


def _declared(module: cst.Module, line: Callable[[cst.CSTNode], int]) -> dict[str, tuple[int, str]]:
    """dest -> (line, the option's long flag) of each `parser.add_argument("--flag", ...)`."""
    out: dict[str, tuple[int, str]] = {}
    for call in m.findall(module, _ADD_ARGUMENT):
        flags = [a.value.evaluated_value for a in call.args if a.keyword is None and isinstance(a.value, cst.SimpleString)]
        flags = [f for f in flags if isinstance(f, str) and f.startswith("-")]
        if not flags:
            continue
        long = next((f for f in flags if f.startswith("--")), flags[0])
        dest = next(
            (a.value.evaluated_value for a in call.args if a.keyword and a.keyword.value == "dest" and isinstance(a.value, cst.SimpleString)),
            long.lstrip("-").replace("-", "_"),
        )
        out[dest] = (line(call), long)
    return out


def _reads(module: cst.Module) -> Counter:
    """How often each name is read as an attribute of a plain name (`args.gpu`, `opt.gpu`), not of `self`."""
    return Counter(
        node.attr.value
        for node in m.findall(module, m.Attribute(value=m.Name(), attr=m.Name()))
        if node.value.value != "self"
    )


def _reads_wholesale(module: cst.Module) -> bool:
    handed_on = m.Arg(value=m.Call(func=m.Name("vars")), star="**")
    if m.findall(module, handed_on):
        return True
    lookups = m.findall(module, m.Call(func=m.Name("getattr")))
    return any(len(c.args) > 1 and not isinstance(c.args[1].value, cst.SimpleString) for c in lookups)
