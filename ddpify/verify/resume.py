"""How verify's resume run takes the script's own load code (invariant 11), read from the converted code.

A script resumes through a gate around its `torch.load`: a test of the checkpoint's existence
(`if os.path.exists(CKPT):`, taken by a second run in the same folder), an option
(`if args.resume: torch.load(args.resume)`, `--resume CHECKPOINT`; a flag `--resume`;
`if args.init_from == "resume":`, `--init-from resume`) whose branch restores training (loads an
optimizer's state or sets what a later loop counts from: `--weights PRETRAINED` is no resume),
or the restart line `convert` writes above such a gate (taken with TORCHELASTIC_RESTART_COUNT=1,
as after a torchrun restart).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import libcst as cst
from libcst.metadata import MetadataWrapper

from ddpify.analysis import names as N
from ddpify.analysis.script import analyze
from ddpify.convert.resume_after_restart import _restores_training

CHECKPOINT = "{checkpoint}"  # the tracer puts the file rank 0 saved in its place


@dataclass
class ResumePlan:
    """The resume run's extra arguments and environment, and how it takes the load (for the report);
    `args` None: there is no resume run, `how` says why."""

    args: list[str] | None
    how: str
    env: tuple = (("TORCHELASTIC_RESTART_COUNT", "1"),)


def resume_plan(code: str, path: str) -> ResumePlan:
    """The resume run for the converted script `code`, or why there is none."""
    try:
        script = analyze(MetadataWrapper(cst.parse_module(code), unsafe_skip_copy=True), need_model=False)
    except Exception:  # noqa: BLE001 - a script verify cannot read statically has no resume run
        return ResumePlan(None, "the converted script could not be read for its load code")
    loads = [c for c in script.calls if script.is_call_to(c, N.TORCH_LOAD) and N.positional(c)]
    if not loads:
        return ResumePlan(None, "the script has no load code (no torch.load): nothing resumes from a checkpoint")
    flags = _flags(script)
    found: list[tuple[list[str], str]] = []
    for load in loads:
        for test, in_body, branch in _gates(script, load):
            taken = _taken_by(script, test, in_body, N.positional(load)[0].value, flags, script.line(load))
            found += [(args, how) for args, how in taken if not args or _restores_training(SimpleNamespace(script=script), branch)]
    if "TORCHELASTIC_RESTART_COUNT" in code:  # the restart line `convert` writes above a resume gate
        found.append(([], "TORCHELASTIC_RESTART_COUNT=1, as after a restart"))
    if not found:
        where = ", ".join(f"{path}:{script.line(c)}" for c in loads[:3])
        return ResumePlan(None, f"no resume gate (an option that restores training, or a test that the file exists) around torch.load at {where}")
    args = next((a for a, _ in found if a), [])
    return ResumePlan(args, "; ".join(dict.fromkeys(how for _, how in found)))


def _gates(script, load: cst.Call):
    """(test, whether the load is in its body, the branch holding it) of each `if` around `load`, inside its function."""
    for node in script.ancestors(load):
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            return
        if isinstance(node, cst.If) and not script.inside(load, node.test):
            yield node.test, script.inside(load, node.body), node.body if script.inside(load, node.body) else node.orelse


def _taken_by(script, test, in_body: bool, path, flags: dict, line: int) -> list[tuple[list[str], str]]:
    """How a resume run takes the gate `test`: ([], how) when the run needs no argument, ([flag, ...], how)."""
    if any(N.call_name(c) in N.EXISTENCE_TESTS for c in script.calls_in(test)):
        return [([], f"the existence test at line {line}")]
    subject, negated = test, False
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        subject, negated = test.expression, True
    elif isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        compared = test.comparisons[0]
        if N.is_name(compared.comparator, "None") and isinstance(compared.operator, (cst.Is, cst.IsNot)):
            subject, negated = test.left, isinstance(compared.operator, cst.Is)
        elif isinstance(compared.operator, cst.Equal) and isinstance(compared.comparator, cst.SimpleString) and in_body:
            option = flags.get(_dest(test.left))
            value = compared.comparator.evaluated_value
            return [([option[0], value], f"{option[0]} {value}")] if option and isinstance(value, str) else []
    if negated == in_body:
        return []
    option = flags.get(_dest(subject))
    if option is None:
        return []
    flag, takes_value = option
    if subject.deep_equals(path):
        return [([flag, CHECKPOINT], f"{flag} <checkpoint>")]
    return [([flag], flag)] if not takes_value else []


def _dest(node) -> str | None:
    """`args.resume` -> "resume" (an option's destination), else None."""
    return node.attr.value if isinstance(node, cst.Attribute) and isinstance(node.attr, cst.Name) else None


def _flags(script) -> dict[str, tuple[str, bool]]:
    """dest -> (its long flag, whether it takes a value) of each `parser.add_argument("--flag", ...)`."""
    out = {}
    for call in script.calls:
        if N.call_name(call) != "add_argument":
            continue
        flags = [a.value.evaluated_value for a in call.args if a.keyword is None and isinstance(a.value, cst.SimpleString)]
        flags = [f for f in flags if isinstance(f, str) and f.startswith("-")]
        if not flags:
            continue
        keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        flag = next((f for f in flags if f.startswith("--")), flags[0])
        dest = keywords.get("dest")
        dest = dest.evaluated_value if isinstance(dest, cst.SimpleString) else flag.lstrip("-").replace("-", "_")
        action = keywords.get("action")
        stores = isinstance(action, cst.SimpleString) and action.evaluated_value in ("store_true", "store_const", "count")
        out[dest] = (flag, not stores)
    return out
