"""`ddpify verify`'s report: text for people (the first line says what failed), JSON for tools."""

from __future__ import annotations

import json

from ddpify.verify.invariants import FAIL
from ddpify.verify.session import Verification


def headline(v: Verification) -> str:
    if v.failures:
        first = v.failures[0]
        more = f" (and {len(v.failures) - 1} more)" if len(v.failures) > 1 else ""
        return f"ddpify verify: FAIL {first.number} {first.title}{more}: {first.summary}"
    counts = {s: sum(1 for r in v.results if r.status == s) for s in ("PASS", "N/A")}
    return f"ddpify verify: PASS ({counts['PASS']} invariants hold, {counts['N/A']} not applicable)"


def text(v: Verification) -> str:
    o = v.options
    lines = [
        headline(v),
        f"{v.script} ({v.converted}): {_count(o.nproc, 'process', 'processes')}, {v.device}, "
        f"{_count(o.steps, 'step')} per epoch, {_count(o.epochs, 'epoch')}; "
        f"{v.seconds:.0f} s",
        "",
    ]
    for r in v.results:
        lines.append(f"{r.number:>3} {r.status:<4}  {r.title:<38} {r.summary}")
        lines += [f"{'':>11}{line}" for line in r.evidence]
    lines += [f"note: {n}" for n in v.notes]
    return "\n".join(lines)


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def as_json(v: Verification) -> str:
    o = v.options
    first = v.failures[0] if v.failures else None
    return json.dumps(
        dict(
            status=FAIL if v.failures else "PASS",
            exit_code=v.exit_code,
            first_failure=first.number if first else None,
            script=v.script,
            converted=v.converted,
            device=v.device,
            nproc=o.nproc,
            steps=o.steps,
            epochs=o.epochs,
            seconds=round(v.seconds, 1),
            invariants=[
                dict(number=r.number, title=r.title, status=r.status, summary=r.summary, evidence=r.evidence)
                for r in v.results
            ],
            notes=v.notes,
        ),
        indent=2,
    )
