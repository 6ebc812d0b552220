"""TorchFix-style fixtures: ``fixtures/check/<group>/<case>.py`` with the expected ``<case>.txt``,
and the no-false-positive corpus (hand-written clean DDP scripts + every converted output)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpify.check.rule import all_rules, select_rules
from ddpify.check.runner import check_source

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "fixtures" / "check"
CASES = sorted(p for p in CHECK.rglob("*.py") if p.parent.name != "clean")
CLEAN = sorted((CHECK / "clean").glob("*.py")) + sorted((ROOT / "fixtures" / "convert").glob("*.out.py"))


def codes_for(case: Path) -> set[str]:
    """Opinionated rules are off by default: their fixtures run with every rule."""
    return select_rules(["ALL"]) if case.parent.name == "opinionated" else select_rules(None)


def found(case: Path) -> list[str]:
    result = check_source(case.read_text(encoding="utf-8"), str(case), codes_for(case))
    return [f"{f.line}:{f.column} {f.code}" for f in result.findings]


@pytest.mark.parametrize("case", CASES, ids=[str(p.relative_to(CHECK)) for p in CASES])
def test_fixture(case):
    expected = case.with_suffix(".txt").read_text(encoding="utf-8").split()
    expected = [" ".join(expected[i : i + 2]) for i in range(0, len(expected), 2)]
    assert found(case) == expected


def test_every_rule_fires_in_a_fixture_and_silent_cases_exist():
    fired = {line.split()[1] for case in CASES for line in case.with_suffix(".txt").read_text().splitlines() if line}
    assert {r.CODE for r in all_rules()} <= fired
    silent = [c for c in CASES if not c.with_suffix(".txt").read_text().strip()]
    groups = {c.parent.name for c in CASES} - {"parse", "opinionated"}
    assert groups <= {c.parent.name for c in silent}, "every group needs a case where it must stay silent"


@pytest.mark.parametrize("script", CLEAN, ids=[p.name for p in CLEAN])
def test_clean_corpus_has_no_findings(script):
    result = check_source(script.read_text(encoding="utf-8"), str(script), select_rules(None))
    assert result.findings == []


def test_clean_corpus_is_distributed():
    """The corpus must exercise the distributed rules, not slip past them as single-GPU code."""
    from ddpify.check.context import FileContext

    for script in sorted((CHECK / "clean").glob("*.py")):
        assert FileContext(str(script), script.read_text()).is_distributed, script
