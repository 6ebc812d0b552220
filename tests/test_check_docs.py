"""Docs that cannot drift: the rule pages and their index in docs/rules/ and the rule count in
README.md come from the rules themselves."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from ddpify.check.cli import check
from ddpify.check.docs import INDEX, PAGE, RULES_DIR, pages, rule_page, rule_table, stale, write
from ddpify.check.output import RULES_PAGE, help_uri
from ddpify.check.rule import all_rules

ROOT = Path(__file__).resolve().parent.parent


def test_rule_table_is_the_rules() -> None:
    assert rule_table() in (RULES_DIR / INDEX).read_text(encoding="utf-8"), (
        "docs/rules/index.md's rule table is not the rules': regenerate it with `python -m ddpify.check.docs --write`"
    )


def test_every_rule_page_is_the_rules_docstring() -> None:
    """docs/rules/ holds exactly the generated pages: one per rule, each equal to what its class
    says now, and no page of a rule that is gone."""
    assert stale() == [], "stale rule pages: regenerate them with `python -m ddpify.check.docs --write`"
    assert sorted(p.name for p in RULES_DIR.glob("*.md")) == sorted(pages())
    for r in all_rules():
        page = (RULES_DIR / f"{r.CODE}.md").read_text(encoding="utf-8")
        for section in ("## What it does", "## Why is this bad?", "## Example", "## Use instead", "## Fix safety"):
            assert section in page, f"docs/rules/{r.CODE}.md has no {section!r}: write it in the rule's docstring"
        assert r.MESSAGE in page and r.NAME in page
        assert f"[{r.CODE}]({r.CODE}.md)" in rule_table()


def test_stale_names_a_changed_a_missing_and_an_orphan_page_and_write_repairs_them(tmp_path: Path) -> None:
    write(tmp_path)
    assert stale(tmp_path) == []
    first = all_rules()[0].CODE
    last = all_rules()[-1].CODE
    (tmp_path / f"{first}.md").write_text(rule_page(all_rules()[0]).replace("## Example", "## Exemple"), encoding="utf-8")
    (tmp_path / f"{last}.md").unlink()
    (tmp_path / "DDP999.md").write_text("# gone\n", encoding="utf-8")
    assert stale(tmp_path) == sorted([f"{first}.md", f"{last}.md", "DDP999.md"])
    assert sorted(write(tmp_path)) == sorted([f"{first}.md", f"{last}.md", "DDP999.md"])
    assert stale(tmp_path) == [] and not (tmp_path / "DDP999.md").exists()


def test_every_sarif_help_uri_points_at_the_rules_page() -> None:
    for r in all_rules():
        uri = help_uri(r.CODE, "https://example.org/ddpify")
        assert uri == f"https://example.org/ddpify/{RULES_PAGE}/{r.CODE}.md"
        assert (ROOT / "docs" / Path(RULES_PAGE).relative_to("blob/main/docs") / f"{r.CODE}.md").is_file(), uri


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
