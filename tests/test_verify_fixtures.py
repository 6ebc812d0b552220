"""`ddpify verify` over every golden conversion, pattern, example and corpus fixture: each invariant
holds or does not apply, with its reason. The product feature is what proves the product.

The goldens (fixtures/convert/*.out.py, fixtures/patterns/*.out.py, examples/*_ddp.py) are
verified as CONVERTED against their originals; the corpus fixtures, which have no goldens, are
converted in memory. Each runs with the arguments its own integration test uses. The
verifications share their launches (tests/batched.verify_all): verify() itself runs unchanged,
once per case, and judges its own runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from batched import verify_all
from test_corpus import SPECS as CORPUS
from test_integration import CASES as INTEGRATION
from test_patterns import CASES as PATTERNS

from ddpify.verify.invariants import FAIL, NA, PASS
from ddpify.verify.session import VerifyError, VerifyOptions

ROOT = Path(__file__).resolve().parent.parent
B = 16
ALWAYS = (1, 4, 9, 10)  # process group, replicas in sync, no hang, one process: apply to every script
# Goldens that need GPUs (test_patterns runs none of them here either): verify says why, precisely.
NEEDS_GPUS = {
    "patterns/model_parallel": "Found no NVIDIA driver",  # cuda:0 and cuda:1 in every process, the original too
    "patterns/sync_batchnorm": "SyncBatchNorm layers only work with GPU modules",
}


def cases():
    for name, case in INTEGRATION.items():
        argv, env = case.knobs(B, True)
        yield pytest.param(ROOT / case.original, ROOT / case.converted, argv, env, id=name)
    for name, case in PATTERNS.items():
        source = ROOT / "fixtures" / "patterns" / f"{name}.in.py"
        yield pytest.param(source, source.with_name(f"{name}.out.py"), case.args, {}, id=f"patterns/{name}")
    for name, spec in CORPUS.items():
        yield pytest.param(ROOT / "fixtures" / "corpus" / f"{name}.py", None, spec.runs[0], {}, id=f"corpus/{name}")


CASES = {p.id: p.values for p in cases()}


@pytest.fixture(scope="module")
def verifications(tmp_path_factory, probe_once):
    """verify() of every case, as the product runs it, its launches shared: one python launch for
    every case's single-process runs and one torchrun launch for every case's DDP runs
    (tests/batched.verify_all; each verify() judges its own runs). Run from a folder that holds
    none of the scripts, so each verifies with its own folder as the working folder, as `cd
    <its folder> && ddpify verify` does."""
    work = tmp_path_factory.mktemp("verify")
    jobs = {
        name: (original, converted, VerifyOptions(timeout=150, args=list(argv)), env)
        for name, (original, converted, argv, env) in CASES.items()
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(work)
        return verify_all(jobs, work / "launches")


@pytest.mark.parametrize("name", list(CASES))
def test_every_conversion_verifies(verifications, name):
    result = verifications[name]
    if name in NEEDS_GPUS:
        if isinstance(result, VerifyError):
            assert NEEDS_GPUS[name] in str(result)
            return
        assert not isinstance(result, BaseException), result
        nine = result.results[8]
        assert nine.status == FAIL and NEEDS_GPUS[name] in nine.summary, nine.summary
        return
    if isinstance(result, BaseException):
        raise result
    shown = "\n".join(f"{r.number} {r.status} {r.summary} {r.evidence[:3]}" for r in result.results)
    assert all(r.status in (PASS, NA) for r in result.results), shown
    assert all(r.summary for r in result.results if r.status == NA), shown
    assert all(result.results[n - 1].status == PASS for n in ALWAYS), shown
