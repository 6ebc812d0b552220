"""Which logging levels the program turns on, when its code says so plainly.

`logger.info(...)` reaches a console only if something set a handler and a level of INFO or
below: without `logging.basicConfig(level=logging.INFO)` (or `setLevel` and `addHandler`, a
`dictConfig`, Hydra's `@hydra.main`), Python drops it. The output rules ask this before they
claim that every rank writes a message (issue 32: a rule's premise proven, or no finding).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import libcst as cst

from ddpify.analysis.index import CallInfo, FileIndex, Func, last_name
from ddpify.analysis.literals import int_value, kwarg, string_value

LEVELS = {"CRITICAL": 50, "FATAL": 50, "ERROR": 40, "WARNING": 30, "WARN": 30, "INFO": 20, "DEBUG": 10, "NOTSET": 0}
INFO, DEBUG = LEVELS["INFO"], LEVELS["DEBUG"]
_CONFIG = {"logging.config.dictConfig", "logging.config.fileConfig"}  # their level is in data: not read here


def is_level_setting(ci: CallInfo) -> bool:
    """`logging.basicConfig(level=...)`, `x.setLevel(...)`, `logging.config.dictConfig(...)`."""
    return ci.name == "setLevel" or (ci.is_("logging.basicConfig") and kwarg(ci.node, "level") is not None) or ci.is_(*_CONFIG)


def is_handler_setting(ci: CallInfo) -> bool:
    """`logging.basicConfig(...)`, `x.addHandler(...)`, a `dictConfig`: a handler that writes records."""
    return ci.name == "addHandler" or ci.is_("logging.basicConfig", *_CONFIG)


def set_level(index: FileIndex, ci: CallInfo, options: Mapping[str, cst.BaseExpression]) -> Optional[int]:
    """The level this call sets, the same on every rank, or None when the code does not say it
    plainly (a parameter some caller fills from a config, a file's data). `options`: the
    defaults of the program's command-line options by name (`args.log_level` reads one)."""
    if ci.is_(*_CONFIG):
        return None
    arg = kwarg(ci.node, "level") if ci.name != "setLevel" else (ci.node.args[0] if ci.node.args else None)
    return None if arg is None else level_of(index, arg.value, ci.func, options)


def level_of(
    index: FileIndex, value: cst.BaseExpression, func: Optional[Func], options: Mapping[str, cst.BaseExpression], depth: int = 0
) -> Optional[int]:
    """The level an expression holds: `logging.INFO`, `"INFO"`, `20`, a name given one such
    value (every assignment the same), a parameter every caller fills with one, or a
    command-line option's default (`args.log_level` of `add_argument("--log-level", default="INFO")`)."""
    if (n := int_value(value)) is not None:
        return n
    if (s := string_value(value)) is not None:
        return LEVELS.get(s.upper())
    if isinstance(value, cst.Attribute) and last_name(value) in LEVELS and index.code(value.value).endswith("logging"):
        return LEVELS[last_name(value)]
    if isinstance(value, cst.Attribute) and value.attr.value in options and depth <= 3:
        return level_of(index, options[value.attr.value], None, {}, depth + 1)  # the same command line on every rank
    if not isinstance(value, cst.Name) or depth > 3:
        return None
    if value.value in LEVELS and "logging." + value.value in index.qnames(value):
        return LEVELS[value.value]  # `from logging import INFO`
    found = {
        level_of(index, b.value, b.func, options, depth + 1)
        for b in index.assignments
        if b.dotted == value.value and (b.func is func or b.func is None)
    }
    if func is not None and value.value in index.param_names(func):
        found |= {_passed_level(index, func, site, value.value, options, depth) for site in index.call_sites(func)} or {None}
    return found.pop() if len(found) == 1 else None


def _passed_level(
    index: FileIndex, func: Func, site: CallInfo, name: str, options: Mapping[str, cst.BaseExpression], depth: int
) -> Optional[int]:
    """The level a call site hands the parameter `name` (its default when it passes none)."""
    given = index.argument_for(func, site, name)
    return None if given is None else level_of(index, given[0], given[1], options, depth + 1)
