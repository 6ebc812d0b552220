"""`ddpify verify` proves a conversion by what the ranks did, and names the invariant a broken one breaks.

tests/data/verify/train.py is a single-GPU script; ddp_train.py is our hand-written DDP version of
it, and BREAK=<name> in its environment breaks it in one of the ways DDP scripts go wrong. Each
broken version must make exactly its invariant FAIL (the ones that follow from it are N/A, naming
it), with a message that says what to do. Every run is real: torchrun with 2 CPU processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from batched import verify_all

from ddpify.verify.invariants import FAIL, NA, PASS
from ddpify.verify.session import VerifyError, VerifyOptions, verify

DATA = Path(__file__).resolve().parent / "data" / "verify"
TRAIN, DDP_TRAIN = DATA / "train.py", DATA / "ddp_train.py"


def statuses(result) -> dict[int, str]:
    return {r.number: r.status for r in result.results}


def failed(result) -> list[int]:
    return [r.number for r in result.results if r.status == FAIL]


@pytest.fixture(autouse=True)
def _probe_once(probe_once):
    """verify()'s GPU probe runs once per session (conftest.probe_once)."""


@pytest.fixture
def in_data(monkeypatch):
    monkeypatch.chdir(DATA)
    before = sorted(p.name for p in DATA.iterdir())
    yield
    assert sorted(p.name for p in DATA.iterdir()) == before, "verify wrote into the user's folder"


# (BREAK, the invariant that fails, words of its message the user acts on)
BROKEN = [
    ("group", 1, "world size 1, not 2"),
    ("late_wrap", 2, "ran a training forward at ddp_train.py:83 before it was wrapped in DDP"),
    ("sampler", 3, "every rank reads the whole training set (256 samples, sampler RandomSampler)"),
    ("set_epoch", 3, "call sampler.set_epoch(epoch) at the start of every epoch"),
    ("no_sync", 4, "optimizer steps ran inside model.no_sync()"),
    ("summed", 5, "the losses part at step 1"),
    ("save_all", 6, "model.pt is written by ranks 0, 1 (ddp_train.py:93): write it on rank 0 only"),
    ("prefix", 7, "its keys start with `module.`, so Sequential cannot load it; save model.module.state_dict()"),
    ("shard_eval", 8, "the metric covers one rank's shard"),
    ("env", 10, "KeyError: 'RANK'"),
]


@pytest.fixture(scope="module")
def verifications(tmp_path_factory, probe_once):
    """verify() of train.py converted in memory, of the hand-written ddp_train.py, and of each
    BREAK=<name> version of it, as `cd tests/data/verify && ddpify verify ...` runs them, their
    launches shared (tests/batched.verify_all: each verify() judges its own runs; BREAK reaches
    the runs through their environment). The user's folder is left as it was."""
    jobs = {"converted": (TRAIN, None, VerifyOptions(timeout=60), {}), "hand_written": (TRAIN, DDP_TRAIN, VerifyOptions(timeout=60), {})}
    for name, _, _ in BROKEN:
        jobs[name] = (TRAIN, DDP_TRAIN, VerifyOptions(timeout=60), {"BREAK": name})
    for name, (original, converted) in RESUMING.items():
        jobs[name] = (RESUME / original, converted and RESUME / converted, VerifyOptions(timeout=60), {})
    work = tmp_path_factory.mktemp("verify")
    before = sorted(p.name for p in DATA.iterdir())
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(DATA)
        results = verify_all(jobs, work / "launches")
    assert sorted(p.name for p in DATA.iterdir()) == before, "verify wrote into the user's folder"
    return results


def verified(verifications, name):
    result = verifications[name]
    if isinstance(result, BaseException):
        raise result
    return result


def test_the_conversion_of_train_py_passes_every_invariant(verifications):
    result = verified(verifications, "converted")
    assert result.converted == "converted in memory"
    assert statuses(result) == {**{n: PASS for n in range(1, 11)}, 11: NA}, [(r.number, r.summary) for r in result.results]
    assert result.results[10].summary.startswith("the script has no load code (no torch.load)")
    three = result.results[2]
    assert "epoch 2: ranks read 128/128 samples, disjoint, together all of them" in three.evidence
    assert result.exit_code == 0


def test_a_hand_written_ddp_script_passes_every_invariant(verifications):
    result = verified(verifications, "hand_written")
    assert statuses(result) == {**{n: PASS for n in range(1, 11)}, 11: NA}, [(r.number, r.summary) for r in result.results]
    assert "equal one process at 2x the batch" in result.results[4].summary


# fixtures/run/resume_checkpoint: name -> (original, DDP version or None: converted in memory)
RESUME = Path(__file__).resolve().parent.parent / "fixtures" / "run" / "resume_checkpoint"
RESUMING = {
    "resume_option": ("train.py", None),
    "resume_exists": ("warm_start.py", None),
    "resume_rank0": ("train.py", "ddp_rank0_resume.py"),
}


def test_a_checkpoint_saved_in_training_loads_back_through_the_scripts_own_resume_option(verifications):
    """`--resume PATH` (and the restart line convert writes above it): a second torchrun run
    takes it with the file rank 0 saved, and every rank ends with the same parameters."""
    result = verified(verifications, "resume_option")
    eleven = result.results[10]
    assert eleven.status == PASS and not result.failures, [(r.number, r.status, r.summary) for r in result.results]
    assert "--resume <checkpoint>" in eleven.summary and "loads last.pt (train.py:" in eleven.summary, eleven.summary


def test_a_checkpoint_loaded_when_it_exists_loads_back_on_a_second_run(verifications):
    result = verified(verifications, "resume_exists")
    eleven = result.results[10]
    assert eleven.status == PASS and not result.failures, [(r.number, r.status, r.summary) for r in result.results]
    assert "the existence test at line" in eleven.summary and "loads weights.pt" in eleven.summary, eleven.summary


def test_a_resume_that_loads_on_rank_0_after_wrapping_fails(verifications):
    """Rank 0 alone takes the weights, after DDP broadcast its initial ones: the ranks part."""
    result = verified(verifications, "resume_rank0")
    assert failed(result) == [11], [(r.number, r.status, r.summary) for r in result.results]
    assert "the ranks' parameters differ: load the checkpoint on every rank" in result.results[10].summary


def test_the_resume_run_is_planned_from_the_scripts_load_code():
    """An option that holds the path gets the checkpoint; a flag, a literal or an existence test
    as written; an option that only loads weights (`--weights PRETRAINED`), a torch.load with no
    gate around it, or none at all, gets no second run."""
    from ddpify.verify.resume import resume_plan

    head = "import os, argparse, torch\np = argparse.ArgumentParser()\nopt = torch.optim.SGD([], lr=1)\n"
    cases = {
        "p.add_argument('--resume', default='')\na = p.parse_args()\nif a.resume:\n    opt.load_state_dict(torch.load(a.resume))\n": ["--resume", "{checkpoint}"],
        "p.add_argument('--weights', default='')\na = p.parse_args()\nif a.weights:\n    torch.load(a.weights)\n": None,
        "p.add_argument('--resume', action='store_true')\na = p.parse_args()\nif not a.resume:\n    pass\nelse:\n    opt.load_state_dict(torch.load('c.pt'))\n": ["--resume"],
        "p.add_argument('--init-from', default='scratch')\na = p.parse_args()\nif a.init_from == 'resume':\n    opt.load_state_dict(torch.load('c.pt'))\n": ["--init-from", "resume"],
        "if os.path.isfile('c.pt'):\n    torch.load('c.pt')\n": [],
        "torch.load('pretrained.pt')\n": None,
        "torch.save({}, 'c.pt')\n": None,
    }
    for body, args in cases.items():
        assert resume_plan(head + body, "t.py").args == args, body
    assert "no resume gate" in resume_plan(head + "torch.load('pretrained.pt')\n", "t.py").how


def test_the_resume_invariant_never_passes_without_every_ranks_word():
    """A rank with no trace, a run that loaded another file, or a rank that reported no
    parameters: never a PASS."""
    from ddpify.verify.invariants import Runs, resumes

    ddp = {"exit_code": 0, "saves": [{"keys": ["w"], "file": "/r/ddp/c.pt"}], "cwd": "/r/ddp"}
    def rank(loads, checksums):
        return {"exit_code": 0, "loads": [{"file": f} for f in loads], "final_checksums": checksums, "ddp_final": [],
                "optimizer_steps": [], "ddp_forwards": []}
    def runs(*resume):
        return Runs(nproc=2, ddp=[ddp, dict(ddp, saves=[])], ordered=[], original=None, reference=None, plain=None,
                    resume=list(resume), resume_how="--resume <checkpoint>")
    assert resumes(runs(rank(["/r/ddp/c.pt"], ["a"]), rank(["/r/ddp/c.pt"], ["a"]))).status == PASS
    assert resumes(runs(rank(["/r/ddp/c.pt"], ["a"]), None)).status == FAIL
    assert resumes(runs(rank(["/r/ddp/c.pt"], ["a"]), rank(["/r/ddp/c.pt"], []))).status == FAIL
    assert resumes(runs(rank(["/r/ddp/c.pt"], ["a"]), rank(["/r/ddp/c.pt"], ["b"]))).status == FAIL
    assert resumes(runs(rank(["/r/ddp/other.pt"], ["a"]), rank([], ["a"]))).status == NA
    assert resumes(Runs(nproc=2, ddp=[ddp, ddp], ordered=[], original=None, reference=None, plain=None, resume=None,
                        resume_how="no load code")).summary == "no load code"


def test_parameters_outside_ddp_pass_only_where_their_gradients_are_averaged_by_hand():
    """A model run with weights passed in is never wrapped: invariant 2 passes where every step of
    its optimizer all-reduced its gradients after the backward (the tracer's `hand_averaged`),
    and fails where a step did not (an all_reduce of a loss is too little)."""
    from ddpify.verify.invariants import Runs, wrapped

    def runs(averaged):
        trace = {"exit_code": 0, "ddp_models": [], "optimizers": 1, "hand_averaged": [averaged],
                 "uncovered": [{"optimizer": 0, "missing": 4, "of": 4}], "optimizer_info": [{"type": "Adam", "where": "t.py:9"}],
                 "unwrapped_forwards": [{"module": "Meta", "where": "t.py:20", "optimizers": [0]}]}
        return Runs(nproc=2, ddp=[trace, trace], ordered=[], original=None, reference=None, plain=None)

    assert wrapped(runs(True)).status == PASS, wrapped(runs(True)).summary
    for averaged in (False, None):
        result = wrapped(runs(averaged))
        assert result.status == FAIL and "outside DDP" in result.summary, result.summary


@pytest.mark.parametrize("name,number,message", BROKEN, ids=[b[0] for b in BROKEN])
def test_each_broken_ddp_script_fails_exactly_its_invariant(verifications, name, number, message):
    result = verified(verifications, name)
    assert failed(result) == [number], [(r.number, r.status, r.summary) for r in result.results]
    summary = next(r.summary for r in result.results if r.number == number)
    assert message in summary, summary
    assert result.exit_code == 1
    for r in result.results:  # what follows from the failure names it
        if r.summary.startswith("follows from"):
            assert r.status == NA and r.summary.startswith(f"follows from {number} ")


def test_a_hang_is_stopped_at_the_timeout_and_shows_where_each_rank_was(in_data, monkeypatch):
    monkeypatch.setenv("BREAK", "hang")
    start = time.monotonic()
    result = verify(TRAIN, DDP_TRAIN, VerifyOptions(timeout=20))
    assert time.monotonic() - start < 150
    assert failed(result) == [9], [(r.number, r.status, r.summary) for r in result.results]
    nine = result.results[8]
    assert "hung and was stopped at the timeout" in nine.summary
    assert "rank 0: ddp_train.py:90 in main" in nine.summary and "in barrier" in nine.summary, nine.summary
    assert any(line.startswith("rank 1: ") for line in nine.evidence), nine.evidence


# --- the command line ------------------------------------------------------------------------------


def ddpify(*args, cwd=DATA, env=None):
    return subprocess.run(
        [sys.executable, "-m", "ddpify", *args], cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )  # fmt: skip


def test_cli_passes_script_arguments_after_the_double_dash_and_prints_json():
    done = ddpify("verify", "train.py", "--format", "json", "--", "--epochs", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["status"] == "PASS" and report["first_failure"] is None
    three = report["invariants"][2]
    assert "one epoch ran" in three["summary"], three  # --epochs 1 reached the script


def test_cli_first_line_names_the_failure_and_exit_1():
    done = ddpify("verify", "train.py", "ddp_train.py", env={"BREAK": "set_epoch"})
    assert done.returncode == 1, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("ddpify verify: FAIL 3 disjoint shards, new order each epoch: rank 0 reads its shard in the same order")


def test_cli_exit_2_without_torch_or_with_a_script_that_fails_on_its_own(tmp_path):
    done = ddpify("verify", "train.py", "--python", "/bin/false")
    assert done.returncode == 2 and done.stderr.startswith("error: no torch in /bin/false"), done.stderr
    assert "Traceback" not in done.stderr
    done = ddpify("verify", "missing.py")
    assert done.returncode == 2 and done.stderr.strip() == "error: missing.py: no such file"
    broken = tmp_path / "broken.py"
    broken.write_text((TRAIN.read_text()).replace("    args = parser.parse_args()\n", "    args = parser.parse_args()\n    open('no/such/file.csv')\n"))
    done = ddpify("verify", "broken.py", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "fails on its own as one process" in done.stderr and "FileNotFoundError" in done.stderr, done.stderr


def test_verify_error_for_a_conversion_that_cannot_be_done(tmp_path, monkeypatch):
    script = tmp_path / "empty.py"
    script.write_text("print('no training here')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(VerifyError, match="empty.py"):
        verify(script, None, VerifyOptions(timeout=30))


def test_a_keep_folder_inside_the_working_folder_is_not_copied_into_the_runs(tmp_path):
    """`ddpify verify train.py --keep runs/` from the script's folder: each run's copy of the
    folder leaves verify's own folder out (copying it into itself never ends)."""
    from ddpify.verify.workspace import stage

    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.txt").write_text("1\n")
    keep = tmp_path / "runs" / "verify"
    for label in ("original", "ddp"):
        stage(tmp_path, keep / label, {tmp_path / "train.py": b"print('ddp')\n"}, None, keep.resolve())
    assert (keep / "ddp" / "train.py").read_text() == "print('ddp')\n"
    assert (keep / "ddp" / "data" / "x.txt").read_text() == "1\n"
    assert (keep / "ddp" / "runs").is_dir() and not (keep / "ddp" / "runs" / "verify").exists()


def test_evaluation_compares_the_evaluation_parts_of_a_line():
    """Verify's 8th check reads the metrics a line reports about evaluation; the last training
    step's loss printed beside them is rank 0's batch, as in any DDP script."""
    from ddpify.verify.invariants import evaluated_part

    assert evaluated_part("Epoch: 0 | train loss: 2.3233 | test accuracy: 0.09") == "test accuracy: 0.09"
    assert evaluated_part("Ep 1 (Step 000000): Train loss 0.639, Val loss 0.664") == "Val loss 0.664"
    assert evaluated_part("Test set: Average loss: 0.2000, Accuracy: 9/10 (90%)") == (
        "Test set: Average loss: 0.2000 | Accuracy: 9/10 (90%)"
    )
    assert evaluated_part("epoch 2 loss 0.5 acc 0.75") == "epoch 2 loss 0.5 acc 0.75"
    stamped = "2026-11-25 23:26:51,976 INFO epoch 0: loss=0.6980 acc=0.559"  # logging's time: one part
    assert evaluated_part(stamped) == "<time> INFO epoch 0: loss=0.6980 acc=0.559"


def test_a_loss_over_masked_targets_is_noted_as_differing_by_construction(monkeypatch):
    """`cross_entropy(..., ignore_index=-1)` over targets with masked positions averages over
    what each rank keeps: verify notes it (the math check is then not applicable) only when a
    target is masked, and computes the same loss."""
    import torch
    import torch.nn.functional as F

    from ddpify.verify import tracer

    monkeypatch.setattr(tracer, "_trace", {"randomness": []})
    loss = tracer._masked_mean(F.cross_entropy)
    logits = torch.randn(4, 3, requires_grad=True)
    assert torch.equal(loss(logits, torch.tensor([0, 1, 2, 1]), ignore_index=-1), F.cross_entropy(logits, torch.tensor([0, 1, 2, 1])))
    assert tracer._trace["randomness"] == []
    masked = torch.tensor([0, -1, 2, -1])
    assert torch.equal(loss(logits, masked, ignore_index=-1), F.cross_entropy(logits, masked, ignore_index=-1))
    assert tracer._trace["randomness"] and "ignore_index" in tracer._trace["randomness"][0]


LEAVES_A_PROCESS = """\
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # inherits stdout and stderr
open("child.pid", "w").write(str(child.pid))
print("done")
"""


def _alive(pid: int) -> bool:
    """Is pid a process that has not ended (a zombie has ended)?"""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_process_left_behind_holding_the_output_does_not_hold_the_launch(tmp_path):
    """A script ends and leaves a process that still holds its stdout (a DataLoader worker whose
    rank died does): the launch ends with the script, not at its limit, and takes the process with it."""
    from ddpify.verify.launch import run_plan

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "leave.py").write_text(LEAVES_A_PROCESS)
    plan = [{"label": "leave", "script": str(tmp_path / "run" / "leave.py"), "cwd": str(tmp_path / "run")}]
    start = time.monotonic()
    launch = run_plan(plan, tmp_path / "work", None, python=sys.executable, limit_s=90, env={"OMP_NUM_THREADS": "1"})
    assert not launch.timed_out and time.monotonic() - start < 60, launch.log()
    assert launch.returncode == 0 and "done" in launch.stdout, launch.log()
    pid = int((tmp_path / "run" / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), "the process the script left behind outlived the launch"
