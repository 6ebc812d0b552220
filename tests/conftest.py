"""Shared test options and helpers: golden updates, running scripts under python / torchrun, and
the replica check every multi-rank run gets (assert_replicas_identical).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ddpify.verify.invariants import step_differences
from ddpify.verify.launch import Launch as ProductLaunch
from ddpify.verify.launch import run_plan as launch_plan

from conftest_precision import pytest_terminal_summary  # noqa: F401  (the precision figure)

ROOT = Path(__file__).resolve().parent.parent

# Every conversion the tests make, in this process and in the ddpify commands they start, also
# converts its output again and fails if that would change it (ConvertOptions.self_check).
os.environ["DDPIFY_SELF_CHECK"] = "1"

# Every launched command gets a wall-clock limit; a hang fails the test instead of the suite.
PYTHON_TIMEOUT_S = 180
TORCHRUN_TIMEOUT_S = 300
NPROC = 2


def pytest_addoption(parser):
    parser.addoption(
        "--update-goldens",
        action="store_true",
        default=False,
        help="rewrite fixtures/convert/*.out.py and examples/*_ddp.py from the converter's output",
    )
    parser.addoption(
        "--fuzz-examples",
        type=int,
        default=None,
        metavar="N",
        help="tests/test_fuzz.py: N examples for each fuzz test (generated, spliced, mutated programs) instead of its default",
    )


# Tests that launch processes running torch (torchrun, python, mp.spawn): a whole module, or any
# test that reads the `runs` of a launch. `-m "not torchrun"` runs the rest (about 4 min).
TORCHRUN_MODULES = {
    "test_corpus", "test_examples", "test_integration", "test_multinode", "test_replicas", "test_verify",
    "test_verify_fixtures",
}  # fmt: skip
TORCHRUN_FIXTURES = {"runs"}
# Slow: every torchrun test, plus the modules that spend minutes without torch (fuzzing, real
# pre-commit runs, hostile inputs, libcst's full metadata on every bundled file). `-m "not slow"`
# is the quick loop (docs/development.md has its time).
SLOW_MODULES = {"test_fuzz", "test_precommit", "test_hostile_input", "test_check_index"}


def pytest_configure(config):
    config.addinivalue_line("markers", "torchrun: launches training processes (torchrun, python, mp.spawn) running torch")
    config.addinivalue_line("markers", "slow: a torchrun test, or fuzzing, pre-commit and hostile-input tests")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        if module in TORCHRUN_MODULES or TORCHRUN_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.torchrun)
        if module in SLOW_MODULES or item.get_closest_marker("torchrun"):
            item.add_marker(pytest.mark.slow)
    # The slow tests first (in their order): with two xdist workers (--dist loadscope: a module
    # is one unit of work, so its module-scoped fixture, a batched launch, runs once), the modules
    # with long launches start at once and the quick ones fill the gaps, instead of a long one
    # starting last.
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1)


def progress(message: str) -> None:
    """A line on the terminal past pytest's capture: a fixture that launches for minutes shows what it does."""
    sys.__stderr__.write(f"\n  [launch] {message}\n")
    sys.__stderr__.flush()


@pytest.fixture(scope="session", autouse=True)
def scratch_under_basetemp(tmp_path_factory):
    """Every temporary folder of the session, the tests' own and those of what they launch
    (torchrun's torchelastic_* log folders, a script's mkdtemp), lands under pytest's basetemp,
    which pytest prunes to its last three runs, instead of piling up in /tmp run after run.
    torch.compile's cache stays where it was, shared between runs."""
    import getpass
    import tempfile

    before = tempfile.gettempdir()
    scratch = tmp_path_factory.mktemp("scratch")
    with pytest.MonkeyPatch.context() as patch:
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            patch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.join(before, f"torchinductor_{getpass.getuser()}"))
        patch.setenv("TMPDIR", str(scratch))
        patch.setattr(tempfile, "tempdir", str(scratch))
        yield scratch


@pytest.fixture(scope="session")
def update_goldens(request) -> bool:
    return request.config.getoption("--update-goldens")


@pytest.fixture(scope="session")
def probe_once():
    """`ddpify verify` first asks a fresh `python -c "import torch"` how many GPUs it sees (one
    torch import, 2-3 s of CPU), on every call. Within a session the answer cannot change: the
    first call of each interpreter asks for real, later calls get its answer (a probe that fails
    is asked again). For the modules that call verify() dozens of times."""
    from ddpify.verify import session

    real, answers = session._probe, {}

    def probe(python: str) -> int:
        if python not in answers:
            answers[python] = real(python)
        return answers[python]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(session, "_probe", probe)
        yield


@pytest.fixture(scope="session")
def fuzz_examples(request) -> int | None:
    """--fuzz-examples N, or None for each fuzz test's own default."""
    return request.config.getoption("--fuzz-examples")


@dataclass
class Launch(ProductLaunch):
    """The product's launch (ddpify.verify.launch) plus the replica check every multi-rank run gets."""

    may_diverge: dict = field(default_factory=dict)  # label -> why its ranks may end apart (plan "diverges")
    replicas: dict = field(default_factory=dict)  # label -> None (checked, identical) or the failure message

    def params(self, label: str, rank: int):
        """One rank's optimizers' parameters at the end of run `label` (replicas checked as by trace())."""
        import torch

        if label not in self.may_diverge:
            self.check_replicas(label)
        return torch.load(self.cwd / f"params-{label}-{rank}.pt")

    def trace(self, label: str, rank: int) -> dict:
        """One rank's trace of run `label`; the first read of a multi-rank run checks its replicas."""
        assert (label, rank) in self.traces, f"no trace for run {label!r} rank {rank}\n{self.log()}"
        if label not in self.may_diverge:
            self.check_replicas(label)
        return self.traces[(label, rank)]

    def check_replicas(self, label: str) -> None:
        """assert_replicas_identical for run `label` (once; the verdict is kept), if it has 2+ ranks.

        Skipped while a rank's trace is missing or records a failure: the caller's exit checks
        report that, and a rank that stopped early has its parameters apart for that reason.
        """
        if self.ranks < 2:
            return
        traces = [self.traces.get((label, r)) for r in range(self.ranks)]
        if any(t is None or t["exit_code"] != 0 for t in traces):
            return
        if label not in self.replicas:
            try:
                assert_replicas_identical(self.cwd, label, traces)
                self.replicas[label] = None
            except AssertionError as exc:
                self.replicas[label] = str(exc)
        if self.replicas[label] is not None:
            raise AssertionError(self.replicas[label])


def run_plan(
    plan: list[dict], workdir: Path, nproc: int | None, ranks: int | None = None, keep_going: bool = False,
    limit_s: float | None = None,
) -> Launch:  # fmt: skip
    """Run ddpify/verify/tracer.py over a plan, under torchrun with nproc processes or plain python (None),
    with the product's launcher (ddpify.verify.launch, as `ddpify verify` runs it).

    Each plan entry is {"label", "script", "args", "env", "cwd"}; a relative cwd is taken under workdir.
    An entry may add "diverges": "<why>" for a run whose ranks may legitimately end with different
    parameters (a deliberately broken script); every other run with 2+ ranks has its replicas
    checked (assert_replicas_identical) by the first Launch.trace() of it. ranks: the processes
    each run has (default nproc, or 1 under python; NPROC for a script that calls mp.spawn).
    Traces land in workdir. Never raises on failure: the caller asserts on the Launch. keep_going:
    the runs after a failing one still run (give each a "timeout" so a rank left waiting ends).
    limit_s: the whole launch's limit (default PYTHON_TIMEOUT_S or TORCHRUN_TIMEOUT_S). Many
    cases in one launch: tests/batched.py.
    """
    plan = [dict(run, cwd=str(workdir / run.get("cwd", run["label"]))) for run in plan]
    ranks = ranks or nproc or 1
    how = f"torchrun --nproc-per-node={nproc}" if nproc else "python"
    progress(f"{how}: {len(plan)} run(s) in {workdir.name}/ ({', '.join(run['label'] for run in plan[:4])}{', ...' if len(plan) > 4 else ''})")
    done = launch_plan(
        plan, workdir, nproc, python=sys.executable, ranks=ranks,
        limit_s=limit_s or (PYTHON_TIMEOUT_S if nproc is None else TORCHRUN_TIMEOUT_S),
        env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}, keep_going=keep_going,
    )  # fmt: skip
    launch = Launch(**vars(done))
    launch.may_diverge = {run["label"]: run["diverges"] for run in plan if run.get("diverges")}
    return launch


def load_traces(workdir: Path, label: str | None, ranks: int) -> dict:
    """{(label, rank): trace} of the trace files that exist (label None: tracer.py without a plan)."""
    traces = {}
    for rank in range(ranks):
        path = workdir / f"trace-{_tag(label, rank)}.json"
        if path.exists():
            traces[(label, rank)] = json.loads(path.read_text())
    return traces


def _tag(label: str | None, rank: int) -> str:
    return f"{label}-{rank}" if label else str(rank)


# --- DDP's invariant: every rank holds the same parameters after every optimizer step -------------


def assert_replicas_identical(workdir: Path, label: str | None, traces: list[dict]) -> None:
    """Every rank of run `label` ended with bitwise identical parameters, and had them after every step.

    DDP averages the gradients before each optimizer step, so the replicas never part: a
    conversion that trains without gradient sync passes every other check and fails this one.
    Compares params-<label>-<rank>.pt (each optimizer's parameters at the end, tracer.py)
    exactly, and the checksums in the traces: after every optimizer step (``optimizer_steps``),
    and of every DDP model before each training forward and at the end (``ddp_forwards``,
    ``ddp_final``: scripts that update parameters by hand have no optimizer). The AssertionError
    names, for every rank that differs from rank 0, each optimizer's first step after which
    they differ (each DDP model's first forward), and each differing final parameter (optimizer
    index, parameter index, shape, max |difference|).
    """
    import torch

    name = f"run {label!r}" if label else "the run"
    params = [torch.load(workdir / f"params-{_tag(label, r)}.pt") for r in range(len(traces))]
    problems = []
    for r in range(1, len(traces)):
        steps, final = step_differences(traces[0], traces[r]), _param_differences(params[0], params[r])
        if final and not steps and any(traces[0].get("optimizer_steps") or []):
            steps = ["identical after every optimizer step: they parted after the last one (a load or edit on some ranks)"]
        problems += [f"rank 0 vs rank {r}: {p}" for p in steps + final]
    if problems:
        shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
        raise AssertionError(
            f"{name}: the ranks' parameters are not identical (DDP keeps every rank's copy the same after "
            "each optimizer step; training without gradient sync, or an edit on some ranks only, parts them):\n  "
            + "\n  ".join(shown)
        )


def _param_differences(a: list, b: list) -> list[str]:
    """Each final parameter that is not bitwise equal on the two ranks, with its max |difference|."""
    import torch

    if len(a) != len(b):
        return [f"{len(a)} vs {len(b)} optimizers at the end"]
    found = []
    for i, (opt_a, opt_b) in enumerate(zip(a, b)):
        if len(opt_a) != len(opt_b):
            found.append(f"optimizer {i}: {len(opt_a)} vs {len(opt_b)} parameters")
            continue
        for j, (x, y) in enumerate(zip(opt_a, opt_b)):
            if x.shape != y.shape or x.dtype != y.dtype:
                found.append(f"optimizer {i} parameter {j}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
            elif not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                diff = (x.double() - y.double()).abs().nan_to_num(nan=float("inf")).max().item() if x.numel() else 0.0
                found.append(f"optimizer {i} parameter {j} (shape {list(x.shape)}): max |difference| = {diff:.3g}")
    return found
