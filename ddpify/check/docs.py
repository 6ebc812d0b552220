"""The rule table of docs/check.md, made from the rules themselves (a test keeps the page equal).

    python -m ddpify.check.docs            # print the table
    python -m ddpify.check.docs --write    # rewrite it in docs/check.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from ddpify.check.output import rule_anchor
from ddpify.check.rule import all_rules

HEADER = "| Code | Name | Default | Fix | Message |\n| --- | --- | --- | --- | --- |\n"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "check.md"


def rule_table() -> str:
    """One row per rule: code, name, on by default, fix safety, message."""
    return HEADER + "".join(_row(r) for r in all_rules())


def _row(r) -> str:
    anchor = f'<a id="{rule_anchor(r.CODE)}"></a>'  # what SARIF's helpUri points at
    default = "yes" if r.DEFAULT else "no (opt-in)"
    return f"| {anchor}{r.CODE} | {r.NAME} | {default} | {r.FIX or ''} | {r.MESSAGE} |\n"


def rewrite(page: str) -> str:
    """`page` with the table that follows HEADER replaced by today's."""
    start = page.index(HEADER)
    end = page.find("\n\n", start)
    return page[:start] + rule_table() + page[end + 1 if end != -1 else len(page) :]


def main() -> None:
    if sys.argv[1:] == ["--write"]:
        PAGE.write_text(rewrite(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        sys.stdout.write(rule_table())


if __name__ == "__main__":
    main()
