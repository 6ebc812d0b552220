"""`ddpify check` agrees with `ddpify convert`: its default rules find nothing in a converted
golden, except what the conversion itself left as a TODO at that line (convert no longer turns
check findings into TODOs after the fact: a pass says it, or the rule was wrong)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddpify.check.rule import all_rules
from ddpify.check.runner import check_source

ROOT = Path(__file__).resolve().parent.parent
GOLDENS = sorted(
    [*(ROOT / "fixtures" / "convert").glob("*.out.py"), *(ROOT / "fixtures" / "patterns").glob("*.out.py"), *(ROOT / "examples").glob("*_ddp.py")]
)
DEFAULT = [r.CODE for r in all_rules() if r.DEFAULT]
TODO = re.compile(r"#\s*TODO\(ddpify\):\s*(DDP\d+)?")


@pytest.mark.parametrize("golden", GOLDENS, ids=lambda p: str(p.relative_to(ROOT)))
def test_check_finds_nothing_convert_did_not_report(golden):
    code = golden.read_text()
    lines = code.splitlines()
    unexplained = []
    for f in check_source(code, str(golden), codes=DEFAULT).findings:
        above = lines[max(f.line - 4, 0) : f.line]  # a TODO comment above the statement
        if any(TODO.search(line) and (f.code in line or "DDP" not in line.split("TODO(ddpify):", 1)[1][:8]) for line in above):
            continue
        unexplained.append(f"{f.line}: {f.code} {f.message}")
    assert not unexplained, f"{golden.name}: check disagrees with convert:\n" + "\n".join(unexplained)
