"""Every fix, safe and unsafe, applied to every check fixture and every converted golden: the
result compiles, a second round changes nothing, and no fix reads `.module` from something
that is not the DDP model (the shape of an AttributeError an unsafe fix once wrote)."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from ddpify.check.context import FileContext
from ddpify.check.rule import select_rules
from ddpify.check.runner import check_source

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted(p for p in (ROOT / "fixtures" / "check").rglob("*.py") if p.parent.name != "parse")
FILES += sorted((ROOT / "fixtures" / "convert").glob("*.out.py")) + sorted((ROOT / "fixtures" / "patterns").glob("*.out.py"))


def _module_reads_off_ddp(path: str, source: str) -> int:
    """How many `X.module` reads there are whose `X` does not hold the DDP model."""
    ctx = FileContext(path, source)
    return sum(
        1 for node in ctx.index.parents
        if isinstance(node, cst.Attribute) and node.attr.value == "module"
        and isinstance(node.value, (cst.Name, cst.Attribute)) and not ctx.is_ddp(node.value)
    )  # fmt: skip


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_every_fix_keeps_the_code_correct(path):
    source = path.read_text(encoding="utf-8")
    codes = select_rules(["ALL"])
    result = check_source(source, str(path), codes, fix=True, unsafe_fixes=True)
    fixed = result.fixed_source
    if fixed is None:
        return  # nothing to fix here
    compile(fixed, str(path), "exec")
    again = check_source(fixed, str(path), codes, fix=True, unsafe_fixes=True)
    assert again.fixed_source is None, "a second round of fixes changed the file again"
    assert _module_reads_off_ddp(str(path), fixed) <= _module_reads_off_ddp(str(path), source), (
        "a fix reads `.module` from something that is not the DDP model"
    )


def test_the_files_include_fixes_to_apply():
    """The test above must exercise fixes: some files change under --fix --unsafe-fixes."""
    changed = [
        p for p in FILES
        if check_source(p.read_text(encoding="utf-8"), str(p), select_rules(["ALL"]), fix=True, unsafe_fixes=True).fixed_source
    ]  # fmt: skip
    assert len(changed) >= 4, changed
