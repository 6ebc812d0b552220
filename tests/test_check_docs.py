"""Docs that cannot drift: the rule table in docs/check.md and the rule count in README.md come
from the rules themselves."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from ddpify.check.cli import check
from ddpify.check.docs import PAGE, rewrite, rule_table
from ddpify.check.output import RULES_PAGE, help_uri
from ddpify.check.rule import all_rules

ROOT = Path(__file__).resolve().parent.parent


def test_rule_table_is_the_rules() -> None:
    assert rule_table() in PAGE.read_text(encoding="utf-8"), (
        "docs/check.md's rule table is not the rules': regenerate it with `python -m ddpify.check.docs --write`"
    )


def test_every_sarif_help_uri_points_at_an_anchor_of_the_page() -> None:
    page = PAGE.read_text(encoding="utf-8")
    for r in all_rules():
        uri = help_uri(r.CODE, "https://example.org/ddpify")
        assert uri.startswith(f"https://example.org/ddpify/{RULES_PAGE}#")
        assert f'<a id="{uri.split("#", 1)[1]}"></a>{r.CODE} |' in page, f"no anchor for {uri} in docs/check.md"


def test_readme_counts_every_rule() -> None:
    counts = re.findall(r"(\d+) rules", (ROOT / "README.md").read_text(encoding="utf-8"))
    assert counts and set(counts) == {str(len(all_rules()))}, f"README.md says {counts} rules; there are {len(all_rules())}"


def test_every_option_of_check_is_documented() -> None:
    page = PAGE.read_text(encoding="utf-8")
    for param in inspect.signature(check).parameters.values():
        info = param.default  # typer's OptionInfo / ArgumentInfo
        flags = [d.split("/")[0] for d in getattr(info, "param_decls", None) or () if d.startswith("--")]
        if flags and not info.hidden:
            assert any(f"`{f}" in page for f in flags), f"docs/check.md does not document {flags}"


def test_rewrite_replaces_only_the_table() -> None:
    page = PAGE.read_text(encoding="utf-8")
    stale = page.replace("| save-ddp-state-dict |", "| save-state-dict |").replace(" | unsafe | ", " | safe | ", 1)
    assert stale != page and rewrite(stale) == page
