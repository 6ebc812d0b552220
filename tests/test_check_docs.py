"""Docs that cannot drift: the rule table in docs/check.md and the rule count in README.md come
from the rules themselves."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from ddpify.check.cli import check
from ddpify.check.docs import PAGE, rule_table
from ddpify.check.rule import all_rules

ROOT = Path(__file__).resolve().parent.parent


def test_rule_table_is_the_rules() -> None:
    assert rule_table() in PAGE.read_text(encoding="utf-8"), "run `python -m ddpify.check.docs --write`"


def test_readme_counts_every_rule() -> None:
    counts = re.findall(r"A DDP linter with (\d+) rules", (ROOT / "README.md").read_text(encoding="utf-8"))
    assert counts == [str(len(all_rules()))]


def test_every_option_of_check_is_documented() -> None:
    page = PAGE.read_text(encoding="utf-8")
    for param in inspect.signature(check).parameters.values():
        info = param.default  # typer's OptionInfo / ArgumentInfo
        flags = [d.split("/")[0] for d in getattr(info, "param_decls", None) or () if d.startswith("--")]
        if flags and not info.hidden:
            assert any(f"`{f}" in page for f in flags), f"docs/check.md does not document {flags}"
