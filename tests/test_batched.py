"""tests/batched.py: many cases in one launch, and one case cannot hide another's results.

Real launches of tiny scripts through ddpify/verify/tracer.py: a case that fails, exits the
process, hangs or prints past its trace is reported as such, and every other case still has all
of its own traces (the cases after a dead process run again in a new launch).
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from batched import run_cases
from conftest import NPROC

OK = """
import torch
import torch.distributed as dist
torch.manual_seed(0)
if "RANK" in __import__("os").environ:
    dist.init_process_group("gloo")
model = torch.nn.Linear(2, 1)
if dist.is_initialized():
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    opt.zero_grad()
    model(torch.ones(4, 2)).sum().backward()
    opt.step()
print("ok from", __import__("os").environ.get("RANK", "alone"))
if dist.is_initialized():
    dist.destroy_process_group()
"""

FAILS = "import sys\nprint('failing')\nsys.exit(2)\n"
DIES = "import os\nif os.environ.get('RANK', '1') == '1':\n    os._exit(3)\nimport time\ntime.sleep(600)\n"
# hangs, and leaves a child behind that holds the launch's stdout (a DataLoader worker stuck on a lock)
HANGS = "import os, time\nprint('hanging')\nos.fork()\ntime.sleep(600)\n"
STRAY = "import os\nos.write(1, b'stray\\n')\nprint('said')\n"


def write(tmp_path, name, code):
    path = tmp_path / f"{name}.py"
    path.write_text(code)
    return str(path)


def check_survivors(batch, survivors, ranks):
    for key in survivors:
        case = batch[key]
        assert key not in batch.lost, batch.lost
        assert case.returncode == 0, case.log()
        assert sorted(case.traces) == [("a", r) for r in range(ranks)] + [("b", r) for r in range(ranks)]
        assert all(t["exit_code"] == 0 for t in case.traces.values())
        assert case.stdout.count("ok from") == 2 * ranks, case.stdout
        for rank in range(ranks):
            case.params("a", rank)  # the files moved under the plain labels; replicas checked
        assert (case.cwd / "a").is_dir() and (case.cwd / "b").is_dir()


@pytest.mark.torchrun
def test_python_batch_reports_each_case_on_its_own(tmp_path):
    ok = write(tmp_path, "ok", OK)
    cases = {
        "first": [{"label": "a", "script": ok}, {"label": "b", "script": ok}],
        "fails": [{"label": "a", "script": write(tmp_path, "fails", FAILS)}],
        "second": [{"label": "a", "script": ok}, {"label": "b", "script": ok}],
        "dies": [{"label": "a", "script": write(tmp_path, "dies", DIES)}, {"label": "b", "script": ok}],
        "third": [{"label": "a", "script": ok}, {"label": "b", "script": ok}],
        "hangs": [{"label": "a", "script": write(tmp_path, "hangs", HANGS), "timeout": 5}],
        "stray": [{"label": "a", "script": write(tmp_path, "stray", STRAY)}],
        "fourth": [{"label": "a", "script": ok}, {"label": "b", "script": ok}],
    }
    start = time.monotonic()
    batch = run_cases(cases, tmp_path / "runs", nproc=None)
    assert time.monotonic() - start < 120, "the hung case's child kept the launch open"
    # one launch, one after each dead process, and one of its own for each case that died
    assert len(batch.launches) == 5, batch.log()
    check_survivors(batch, ["first", "second", "third", "fourth"], ranks=1)
    assert batch["fails"].returncode == 2 and batch["fails"].stdout == "failing\n"
    assert "fails" not in batch.lost
    assert sorted(batch.lost) == ["dies", "hangs"], batch.lost
    assert batch["dies"].traces == {} and batch["dies"].returncode != 0
    assert "[batch] case 'dies': a process of the launch died while running it" in batch["dies"].log()
    assert "it died in the batch too" in batch["dies"].log()
    assert batch["hangs"].stacks[("a", 0)].startswith("Timeout ("), batch["hangs"].stacks
    assert batch["stray"].returncode == 0 and batch["stray"].stdout == "said\n"
    # what a process printed before it died, and what bypassed sys.stdout, no trace holds
    assert [Counter(extra) for extra in batch.unattributed] == [
        Counter(), Counter("hanging\n"), Counter("stray\n"), Counter(), Counter("hanging\n")
    ]


@pytest.mark.torchrun
def test_torchrun_batch_survives_a_rank_that_dies(tmp_path):
    """Rank 1 leaves mid-plan: torchrun stops rank 0 too; the cases after it run again."""
    ok = write(tmp_path, "ok", OK)
    cases = {
        "first": [{"label": "a", "script": ok}, {"label": "b", "script": ok}],
        "dies": [{"label": "a", "script": write(tmp_path, "dies", DIES)}, {"label": "b", "script": ok}],
        "second": [{"label": "a", "script": ok}, {"label": "b", "script": ok}],
    }
    batch = run_cases(cases, tmp_path / "runs", nproc=NPROC)
    assert len(batch.launches) == 3, batch.log()  # the batch, the cases after "dies", "dies" alone
    check_survivors(batch, ["first", "second"], ranks=NPROC)
    assert list(batch.lost) == ["dies"] and batch["dies"].returncode != 0
    assert ("a", 1) not in batch["dies"].traces
    assert not any(batch.unattributed), batch.unattributed


# Fails as a rank does whose forked DataLoader worker crashed on what an earlier case left in its
# process, the first time only (a marker file): in a launch of its own it then runs clean.
WORKER_CRASH = """
import os
marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crashed-once")
if not os.path.exists(marker):
    open(marker, "w").close()
    raise RuntimeError("DataLoader worker (pid(s) 4154) exited unexpectedly")
print("ran clean")
"""


def test_a_case_whose_dataloader_worker_crashed_runs_again_on_its_own(tmp_path):
    ok = write(tmp_path, "ok", OK)
    cases = {
        "first": [{"label": "a", "script": ok}, {"label": "b", "script": ok}],
        "crash": [{"label": "a", "script": write(tmp_path, "crash", WORKER_CRASH)}],
        "second": [{"label": "a", "script": ok}, {"label": "b", "script": ok}],
    }
    with pytest.warns(UserWarning, match="case 'crash' died in a batched launch"):
        batch = run_cases(cases, tmp_path / "runs", nproc=None)
    check_survivors(batch, ["first", "second"], ranks=1)
    assert "crash" not in batch.lost, batch.lost
    assert batch["crash"].returncode == 0 and batch["crash"].stdout == "ran clean\n", batch["crash"].log()
