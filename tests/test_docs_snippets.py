"""Before/after snippets in README.md and docs/ are pieces of real fixtures, goldens and examples.

A snippet is a ```diff block under a marker naming its two files:

    <!-- snippet before=fixtures/patterns/x.in.py after=fixtures/patterns/x.out.py -->

`-` lines must be lines of the `before` file, `+` lines lines of the `after` file, unmarked
lines lines of both, each in the order shown (compared without their indentation, which a
snippet may shorten). A line that is only `...` stands for lines left out. `after=convert:PATH`
means what `ddpify convert PATH` gives today (for a fixture without a golden).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!-- snippet before=(\S+) after=(\S+) -->\n```diff\n(.*?)\n```", re.S)
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def snippets() -> list[tuple[str, str, str, str]]:
    """(document, before, after, diff body) for every marked snippet."""
    found = []
    for doc in DOCUMENTS:
        text = doc.read_text(encoding="utf-8")
        for m in MARKER.finditer(text):
            found.append((str(doc.relative_to(ROOT)), m.group(1), m.group(2), m.group(3)))
    return found


@lru_cache(maxsize=None)
def source(spec: str) -> tuple[str, ...]:
    """The stripped lines of a file, or of its conversion (`convert:PATH`)."""
    if spec.startswith("convert:"):
        from ddpify.engine import convert_source

        path = ROOT / spec.removeprefix("convert:")
        text = convert_source(path.read_text(encoding="utf-8"), path.name).code
    else:
        text = (ROOT / spec).read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines())


def sides(body: str) -> tuple[list[str], list[str]]:
    """The lines a snippet says are in the before file, and those it says are in the after file."""
    before, after = [], []
    for line in body.splitlines():
        mark, content = line[:1], line[1:].strip()
        if not content or content == "..." or line.startswith("@@"):
            continue
        assert mark in "-+ ", f"a diff line starts with '-', '+' or ' ': {line!r}"
        if mark in "- ":
            before.append(content)
        if mark in "+ ":
            after.append(content)
    return before, after


def missing_in_order(wanted: list[str], lines: tuple[str, ...]) -> str | None:
    """The first wanted line that is not found after the previous one's place, or None."""
    at = 0
    for line in wanted:
        try:
            at = lines.index(line, at) + 1
        except ValueError:
            return line
    return None


ALL = snippets()


@pytest.mark.parametrize("doc, before, after, body", ALL, ids=[f"{d}:{b}" for d, b, _, _ in ALL])
def test_snippet_lines_are_in_the_named_files(doc: str, before: str, after: str, body: str) -> None:
    old, new = sides(body)
    assert new, f"{doc}: a snippet of {after} shows no line of it"
    for spec, wanted in ((before, old), (after, new)):
        lost = missing_in_order(wanted, source(spec))
        assert lost is None, f"{doc}: {lost!r} is not in {spec} (or not in this order): update the snippet"


def test_the_checker_sees_a_line_that_drifted() -> None:
    lines = ("a = 1", "b = 2", "c = 3")
    assert missing_in_order(["a = 1", "c = 3"], lines) is None
    assert missing_in_order(["c = 3", "a = 1"], lines) == "a = 1"  # order matters
    assert missing_in_order(["b = 3"], lines) == "b = 3"
    assert sides("-x = 1\n+x = 2\n y\n ...\n") == (["x = 1", "y"], ["x = 2", "y"])


def test_readme_shows_the_example_converted() -> None:
    readme = [s for s in ALL if s[0] == "README.md"]
    assert [(b, a) for _, b, a, _ in readme] == [("examples/mnist_convnet.py", "examples/mnist_convnet_ddp.py")]
    assert 10 <= len(readme[0][3].splitlines()) <= 30


CAPABILITIES = (
    "Process group",
    "Devices",
    "Data",
    "Model",
    "Evaluation",
    "One voice",
    "Checkpoints",
    "Accumulation",
    "Start-up",
    "Elastic restarts",
    "Several nodes",
)


def test_every_capability_has_a_section_with_a_snippet() -> None:
    page = (ROOT / "docs" / "what-convert-does.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", page, flags=re.M)[1:]
    by_title = {s.split("\n", 1)[0].strip(): s for s in sections}
    for title in CAPABILITIES:
        assert title in by_title, f"docs/what-convert-does.md has no section {title!r}"
        assert MARKER.search(by_title[title]), f"section {title!r} has no before/after snippet"
