"""Every rule: unique code, full docs, and its own VALID/INVALID examples as test cases."""

from __future__ import annotations

import re

import libcst as cst
import pytest

from ddpify.check.rule import CODE_RE, FIX_SAFE, FIX_UNSAFE, all_rules
from ddpify.check.runner import check_source

RULES = all_rules()
SECTIONS = ("## What it does", "## Why is this bad?", "## Example", "## Use instead", "## Fix safety", "## References")


def test_enough_rules_and_unique_codes():
    codes = [r.CODE for r in RULES]
    assert len(codes) == len(set(codes))
    assert len([c for c in codes if c != "DDP000"]) >= 25
    names = [r.NAME for r in RULES]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.CODE)
def test_rule_metadata(rule):
    assert CODE_RE.match(rule.CODE)
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", rule.NAME)
    assert rule.MESSAGE and "\n" not in rule.MESSAGE
    doc = rule.doc()
    for section in SECTIONS:
        assert section in doc, f"{rule.CODE} docstring lacks {section}"
    assert rule.VALID and rule.INVALID
    # opinionated rules are exactly the DDP9xx ones
    assert rule.DEFAULT == (not rule.CODE.startswith("DDP9"))
    assert (rule.FIX is not None) == any(i.fixed is not None for i in rule.INVALID)
    assert rule.FIX in (None, FIX_SAFE, FIX_UNSAFE)
    if rule.FIX is not None:  # its page says why the fix is safe or not
        assert "## Fix safety" in doc and rule.FIX.capitalize() in doc.split("## Fix safety", 1)[1]


CASES = [(r, i, ex) for r in RULES for i, ex in enumerate(r.VALID)]
BAD = [(r, i, ex) for r in RULES for i, ex in enumerate(r.INVALID)]


@pytest.mark.parametrize("rule,index,source", CASES, ids=[f"{r.CODE}-valid{i}" for r, i, _ in CASES])
def test_valid_example_is_silent(rule, index, source):
    found = check_source(source, "example.py", [rule.CODE]).findings
    assert found == [], found


@pytest.mark.parametrize("rule,index,example", BAD, ids=[f"{r.CODE}-invalid{i}" for r, i, _ in BAD])
def test_invalid_example_fires(rule, index, example):
    source = example.code
    found = check_source(source, "example.py", [rule.CODE]).findings
    assert found and all(f.code == rule.CODE for f in found), found
    if example.fixed is not None:
        if rule.FIX == FIX_UNSAFE:  # --fix alone leaves it
            assert check_source(source, "example.py", [rule.CODE], fix=True).fixed_source is None
        result = check_source(source, "example.py", [rule.CODE], fix=True, unsafe_fixes=True)
        assert result.fixed_source == example.fixed
        cst.parse_module(result.fixed_source)
        assert result.findings == []
        # a second run changes nothing
        assert check_source(example.fixed, "example.py", [rule.CODE], fix=True, unsafe_fixes=True).fixed_source is None
