"""Golden conversions: every input has a reviewed expected output, and conversion is stable.

fixtures/convert/<case>.in.py -> fixtures/convert/<case>.out.py
examples/<name>.py            -> examples/<name>_ddp.py
fixtures/noop/*.py            -> unchanged (already distributed) or ConvertError (not a training script)

`pytest tests/test_golden.py --update-goldens` rewrites the expected outputs from the converter;
review them in the diff.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddpify.engine import ConvertError, convert_source

ROOT = Path(__file__).resolve().parent.parent
CONVERT = ROOT / "fixtures" / "convert"
NOOP = ROOT / "fixtures" / "noop"
EXAMPLES = ROOT / "examples"


def golden_pairs() -> list[tuple[Path, Path]]:
    pairs = [(src, src.with_name(src.name[: -len(".in.py")] + ".out.py")) for src in sorted(CONVERT.glob("*.in.py"))]
    pairs += [
        (src, src.with_name(src.stem + "_ddp.py"))
        for src in sorted(EXAMPLES.glob("*.py"))
        if not src.stem.endswith("_ddp")
    ]
    return pairs


def pair_id(pair) -> str:
    return str(pair[0].relative_to(ROOT))


# What each no-op input must do. A new file in fixtures/noop must be added here (see the last test).
NOOP_EXPECTED = {
    # hand-written torchrun DDP script: returned byte-identical, flagged as already distributed
    "multigpu_torchrun.py": "unchanged",
    # uses torch but has no model, optimizer or DataLoader: nothing to convert
    "inspect_checkpoint.py": "ConvertError",
}


@pytest.fixture(scope="module", params=golden_pairs(), ids=pair_id)
def converted(request, update_goldens):
    src, golden = request.param
    result = convert_source(src.read_text(), str(src))
    if update_goldens and (not golden.exists() or golden.read_text() != result.code):
        golden.write_text(result.code)
    return src, golden, result


def test_inputs_exist():
    assert len(list(CONVERT.glob("*.in.py"))) >= 10
    assert {p.name for p in EXAMPLES.glob("*.py")} >= {"mnist.py", "mnist_convnet.py"}


def test_output_matches_golden(converted):
    src, golden, result = converted
    assert golden.exists(), f"{golden.relative_to(ROOT)} missing: run pytest --update-goldens and review it"
    assert result.code == golden.read_text(), (
        f"conversion of {src.relative_to(ROOT)} differs from {golden.relative_to(ROOT)}; "
        "if the change is intended, run pytest --update-goldens and review the diff"
    )


def test_output_is_a_conversion(converted):
    src, _, result = converted
    assert not result.already_distributed, f"{src.name} is a single-GPU script"
    assert result.code != src.read_text()
    assert result.changes, "a conversion must say what it changed"
    for needle in ("DistributedDataParallel", "DistributedSampler", "init_process_group", "destroy_process_group"):
        assert needle in result.code, f"{needle} missing from the conversion of {src.name}"
    assert "ddpify" not in result.code.replace("TODO(ddpify)", ""), "output must not import or mention ddpify"


def test_output_compiles(converted):
    src, _, result = converted
    compile(result.code, f"{src.name} (converted)", "exec")


def test_second_conversion_is_a_noop(converted):
    src, _, result = converted
    again = convert_source(result.code, f"{src.name} (converted)")
    assert again.already_distributed
    assert again.code == result.code
    assert again.pending == [], f"passes would still change the output: {again.pending}"


def test_nothing_left_to_do(converted):
    """Every input here is an idiom the converter must handle fully: no TODO left for the user."""
    src, _, result = converted
    assert result.todos == [], f"{src.name}: {result.todos}"
    assert "TODO(ddpify)" not in result.code


HARD_CODED_GPU = re.compile(r"""["']cuda:(?!\{local_rank\})|\.cuda\((?!\)|local_rank\b)|device_ids=\[(?!local_rank\])""")


def test_no_hard_coded_gpu_index(converted):
    """Invariant 2: every device that meant "the GPU" is this process's GPU (cuda:<local_rank>).

    A "cuda:0", f"cuda:{gpu}", .cuda(gpu) or device_ids=[0] left in the output puts every rank on
    one GPU (and disagrees with DDP's device_ids). CPU runs cannot see this, so it is checked here.
    """
    src, _, result = converted
    hits = [
        f"line {n}: {line.strip()}"
        for n, line in enumerate(result.code.splitlines(), 1)
        if HARD_CODED_GPU.search(line) and not line.lstrip().startswith("#")
    ]
    assert not hits, f"{src.name}: device not tied to LOCAL_RANK:\n" + "\n".join(hits)


def test_comments_are_preserved(converted):
    src, _, result = converted
    comments = [line.strip() for line in src.read_text().splitlines() if line.strip().startswith("#")]
    for comment in comments:
        assert comment in result.code, f"comment {comment!r} of {src.name} lost"


@pytest.mark.parametrize("name", sorted(NOOP_EXPECTED))
def test_noop_input(name):
    path = NOOP / name
    source = path.read_text()
    if NOOP_EXPECTED[name] == "unchanged":
        result = convert_source(source, str(path))
        assert result.already_distributed
        assert result.code == source
    else:
        with pytest.raises(ConvertError) as info:
            convert_source(source, str(path))
        assert info.value.path == str(path)
        assert info.value.message


def test_every_noop_fixture_has_an_expectation():
    assert {p.name for p in NOOP.glob("*.py")} == set(NOOP_EXPECTED)
