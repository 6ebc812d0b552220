"""Converting a converted script changes nothing because every pass recognises its own work,
not because the script mentions DDP: take each golden output, undo ONE piece of what convert
did (a hunk of the input -> output diff: the DistributedSampler line, the `sampler=` argument,
set_epoch, the DDP wrap, the process-group setup, a rank-0 guard, `.module`, the all-reduce of
metrics, the barrier and destroy_process_group, ...), convert the damaged script again, and
require that convert puts the piece back (the golden again, or the piece's lines again) or
reports it at that place (an edit it plans there, a TODO, or, for a script it leaves alone as
already distributed, a "not converted" note).

Pure conversion (no torch, no verification): each damaged script is converted once.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from pathlib import Path

import libcst as cst
import pytest

from ddpify.analysis.script import AnalysisError
from ddpify.convert import convert_module
from ddpify.engine import ConvertOptions

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_patterns import options_for  # noqa: E402


def goldens() -> list[tuple[str, Path, Path, ConvertOptions]]:
    found = []
    for src in sorted((ROOT / "fixtures" / "convert").glob("*.in.py")):
        found.append((f"convert/{src.name[:-6]}", src, src.with_name(src.name[:-6] + ".out.py"), ConvertOptions()))
    for src in sorted((ROOT / "fixtures" / "patterns").glob("*.in.py")):
        name = src.name[:-6]
        found.append((f"patterns/{name}", src, src.with_name(name + ".out.py"), options_for(name)))
    for src in sorted((ROOT / "examples").glob("*.py")):
        if not src.stem.endswith("_ddp"):
            found.append((f"examples/{src.stem}", src, src.with_name(src.stem + "_ddp.py"), ConvertOptions()))
    return [g for g in found if g[2].exists()]


def _code_lines(lines: list[str]) -> list[str]:
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def hunks(source: str, golden: str) -> list[tuple[int, int, int, int]]:
    """The places where convert changed code: (i1, i2, j1, j2) of input and output lines. Added
    imports are not pieces (passes recognise their work by qualified name, which needs them)."""
    a, b = source.splitlines(keepends=True), golden.splitlines(keepends=True)
    found = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "insert":  # the imports at the head of an insertion are not part of the piece
            while j1 < j2 and b[j1].startswith(("import ", "from ")) or (j1 < j2 and not b[j1].strip()):
                j1 += 1
        if tag == "equal" or _code_lines(b[j1:j2]) == _code_lines(a[i1:i2]):
            continue  # blank lines, comments
        if all(line.startswith(("import ", "from ")) for line in _code_lines(b[j1:j2])):
            continue
        found.append((i1, i2, j1, j2))
    return found


def damaged_versions(source: str, golden: str, every: bool):
    """The golden with hunks undone (back to the input's lines): each one alone (`every`), or
    every other one at a time (two scripts per golden, no two neighbouring hunks together); only
    versions that still parse. Yields (damaged script, [(piece's golden lines, its region in the
    damaged script)])."""
    a, b = source.splitlines(keepends=True), golden.splitlines(keepends=True)
    found = hunks(source, golden)
    groups = [[h] for h in found] if every else [found[0::2], found[1::2]]
    for group in groups:
        if not group:
            continue
        lines, pieces, done = [], [], 0
        for i1, i2, j1, j2 in group:
            lines += b[done:j1]
            start = len(lines) + 1
            lines += a[i1:i2]
            pieces.append((b[j1:j2], (start, max(len(lines), start))))
            done = j2
        damaged = "".join(lines + b[done:])
        try:
            compile(damaged, "<damaged>", "exec", dont_inherit=True)
            cst.parse_module(damaged)
        except (SyntaxError, cst.ParserSyntaxError):
            continue
        yield damaged, pieces


def noticed(result, golden: str, piece: list[str], region: tuple[int, int]) -> bool:
    if result.code == golden:
        return True
    lines = {line.strip() for line in result.code.splitlines()}
    if not result.already_distributed and all(line in lines for line in _code_lines(piece)):
        return True  # the piece is back (perhaps with other code around it)
    start, end = region[0] - 2, region[1] + 2
    marks = [line for _, line, _ in result.planned + result.pending] + [t.line for t in result.todos]
    return any(start <= line <= end for line in marks)


@pytest.mark.parametrize("case", goldens(), ids=lambda g: g[0])
def test_every_piece_is_restored_or_reported(case):
    """Two damaged scripts per golden (half the pieces undone in each); DDPIFY_EVERY_PIECE=1
    undoes one piece at a time instead (slower: one conversion per piece)."""
    name, src, golden_path, options = case
    source, golden = src.read_text(), golden_path.read_text()
    missed, tried = [], 0
    for damaged, pieces in damaged_versions(source, golden, every=os.environ.get("DDPIFY_EVERY_PIECE") == "1"):
        tried += len(pieces)
        try:
            # Every pass runs (the shortcut off): what it would add to a script it otherwise leaves
            # alone as already distributed is what convert reports there (the "not converted"
            # notes; see the last test), so one conversion tells both.
            result = convert_module(cst.parse_module(damaged), options, shortcut=False)
        except AnalysisError:
            continue  # refused with a line and a reason: reported
        for piece, region in pieces:
            if not noticed(result, golden, piece, region):
                missed.append(f"lines {region[0]}-{region[1]} of the damaged script, undone and not noticed:\n" + "".join(piece))
    assert tried, f"{name}: no piece could be undone"
    assert not missed, f"{name}: {len(missed)} of {tried} undone pieces went unnoticed:\n" + "\n".join(missed)


def test_the_test_would_catch_the_old_shortcut():
    """Undoing set_epoch keeps init_process_group, DDP and the sampler in the script: a check
    that stopped at those markers (the old `already distributed` shortcut) would say nothing."""
    golden = (ROOT / "examples" / "mnist_ddp.py").read_text()
    damaged = re.sub(r"(?m)^ *train_sampler\.set_epoch\(epoch\)\n", "", golden, count=1)
    assert damaged != golden
    result = convert_module(cst.parse_module(damaged))
    assert result.already_distributed and result.code == damaged
    assert any("set_epoch" in what for _, _, what in result.pending), result.pending


PARTIAL = {
    # what is taken out of the converted example -> what convert must put back
    "no DDP wrap": (
        '    model = DDP(model, device_ids=[local_rank] if next(model.parameters()).is_cuda else None)\n',
        '    model = DDP(model, device_ids=[local_rank] if next(model.parameters()).is_cuda else None)\n',
    ),
    "no sampler": (
        "    train_sampler = DistributedSampler(train_set, shuffle=fit_opts.get(\"shuffle\", False))\n"
        "    train_loader = DataLoader(train_set, sampler=train_sampler, **{**fit_opts, \"shuffle\": False})\n",
        "DistributedSampler(train_set",
    ),
}


@pytest.mark.parametrize("what", list(PARTIAL))
def test_partly_converted_script_gets_what_it_lacks(what):
    """A script with a process group but no DDP wrap, or a wrap but no sampler, is not "already
    distributed": it gets the missing part (and the result verifies as a fixed point)."""
    from ddpify.engine import convert_source

    golden = (ROOT / "examples" / "mnist_ddp.py").read_text()
    removed, needle = PARTIAL[what]
    if what == "no sampler":
        damaged = golden.replace(removed, "    train_loader = DataLoader(train_set, **fit_opts)\n")
    else:
        damaged = golden.replace(removed, "")
    assert damaged != golden
    result = convert_source(damaged, "partial.py")
    assert not result.already_distributed
    assert needle in result.code
    assert "already distributed" not in " ".join(n.message for n in result.changes)


def test_verification_names_a_pass_that_redoes_its_work(monkeypatch):
    """A pass that does not recognise its own work makes convert stop with an internal error
    that names the pass and the line, instead of writing a script that drifts on every run."""
    from ddpify.convert import teardown
    from ddpify.engine import ConvertError, convert_source

    def always(ctx):  # teardown that never sees the teardown it wrote
        body = list(ctx.script.block_of(ctx.setup_scope).body)
        ctx.edits.insert_after(body[-1], "dist.destroy_process_group()\n")

    monkeypatch.setattr(teardown, "run", always)
    src = ROOT / "fixtures" / "convert" / "flat_script.in.py"
    with pytest.raises(ConvertError) as info:
        convert_source(src.read_text(), str(src))
    assert "internal error" in info.value.message and "teardown" in info.value.message
    assert info.value.line > 1


SELF_CHECKED = """\
import torch
from torch.utils.data import DataLoader

model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(torch.randn(8, 4), batch_size=2, shuffle=True)
for x in loader:
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()
"""


def test_self_check_converts_the_output_again_and_names_the_pass_that_would_change_it(monkeypatch):
    """ConvertOptions.self_check (on in this suite, in `ddpify verify`, and under
    DDPIFY_SELF_CHECK=1): a pass that would edit the converted script again is an internal error
    naming the pass and the line; without it the output is not converted a second time."""
    import ddpify.convert
    from ddpify.engine import ConvertError, convert_source

    assert ConvertOptions().self_check, "the suite sets DDPIFY_SELF_CHECK=1 (conftest.py)"
    monkeypatch.setattr(ddpify.convert, "replan", lambda *args, **kwargs: [("wrap_model", 5, "wrap `model` again")])
    with pytest.raises(ConvertError, match=r"converting the output again would change it \(pass wrap_model: wrap `model` again, line 5"):
        convert_source(SELF_CHECKED, "train.py", ConvertOptions(self_check=True))
    assert "DistributedSampler" in convert_source(SELF_CHECKED, "train.py", ConvertOptions(self_check=False)).code
