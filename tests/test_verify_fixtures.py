"""`ddpify verify` over every golden conversion, pattern, example and corpus fixture: each invariant
holds or does not apply, with its reason. The product feature is what proves the product.

The goldens (fixtures/convert/*.out.py, fixtures/patterns/*.out.py, examples/*_ddp.py) are
verified as CONVERTED against their originals; the corpus fixtures, which have no goldens, are
converted in memory. Each runs with the arguments its own integration test uses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_corpus import SPECS as CORPUS
from test_integration import CASES as INTEGRATION
from test_patterns import CASES as PATTERNS

from ddpify.verify.invariants import FAIL, NA, PASS
from ddpify.verify.session import VerifyError, VerifyOptions, verify

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


@pytest.mark.parametrize("original,converted,argv,env", list(cases()))
def test_every_conversion_verifies(request, monkeypatch, original, converted, argv, env):
    monkeypatch.chdir(original.parent)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    options = VerifyOptions(timeout=150, args=list(argv))
    name = request.node.callspec.id
    if name in NEEDS_GPUS:
        try:
            result = verify(original, converted, options)
        except VerifyError as exc:
            assert NEEDS_GPUS[name] in str(exc)
            return
        nine = result.results[8]
        assert nine.status == FAIL and NEEDS_GPUS[name] in nine.summary, nine.summary
        return
    result = verify(original, converted, options)
    shown = "\n".join(f"{r.number} {r.status} {r.summary} {r.evidence[:3]}" for r in result.results)
    assert all(r.status in (PASS, NA) for r in result.results), shown
    assert all(r.summary for r in result.results if r.status == NA), shown
    assert all(result.results[n - 1].status == PASS for n in ALWAYS), shown
