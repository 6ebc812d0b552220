"""The replica check (conftest.assert_replicas_identical) catches ranks that train apart.

Every multi-rank run the suite makes is checked by the first Launch.trace() of it: DDP keeps the
ranks' parameters bitwise identical after each optimizer step, so a conversion that trains
without gradient sync fails even when everything else (shards, one voice, saves) is right.
tests/data/unsynced_training.py joins a process group but trains an unwrapped model; its first
two batches are the same on both ranks, later ones depend on the rank, so the ranks part after
optimizer step 3. With --ddp it is the same rank-dependent data with gradient sync: identical.
With --ddp --manual the parameters are updated by hand (no torch optimizer: the DDP models'
checksums before each training forward are compared), and --rank0-update-from 3 parts the ranks
before forward 4.
"""

from __future__ import annotations

import pytest

from conftest import NPROC, ROOT, run_plan

SCRIPT = ROOT / "tests" / "data" / "unsynced_training.py"


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    plan = [
        {"label": "unsynced", "script": str(SCRIPT), "args": [], "diverges": "no DDP: the point of this test"},
        {"label": "ddp", "script": str(SCRIPT), "args": ["--ddp"]},
        {"label": "manual", "script": str(SCRIPT), "args": ["--ddp", "--manual"]},
        {"label": "manual_rank0", "script": str(SCRIPT), "args": ["--ddp", "--manual", "--rank0-update-from", "3"],
         "diverges": "a rank guard around the hand-written update: the point of this test"},
    ]  # fmt: skip
    return run_plan(plan, tmp_path_factory.mktemp("replicas"), NPROC)


def test_the_runs_finished(launch):
    assert launch.returncode == 0, launch.log()
    for label in ("unsynced", "ddp", "manual", "manual_rank0"):
        for rank in range(NPROC):
            t = launch.trace(label, rank)
            assert t["exit_code"] == 0, t["error"]
            if label.startswith("manual"):
                assert t["optimizer_steps"] == [] and [len(f) for f in t["ddp_forwards"]] == [6], t["ddp_forwards"]
            else:
                assert [len(s) for s in t["optimizer_steps"]] == [6], t["optimizer_steps"]
                assert [len(f) for f in t["ddp_forwards"]] == ([6] if label == "ddp" else [])


@pytest.mark.parametrize("label", ["ddp", "manual"])
def test_rank_dependent_data_with_ddp_stays_replicated(launch, label):
    launch.check_replicas(label)  # also done by launch.trace(label, ...)
    traces = [launch.trace(label, r) for r in range(NPROC)]
    assert traces[0]["optimizer_steps"] == traces[1]["optimizer_steps"]
    assert traces[0]["ddp_forwards"] == traces[1]["ddp_forwards"] and traces[0]["ddp_final"] == traces[1]["ddp_final"]


def test_training_without_gradient_sync_fails_naming_the_first_step(launch):
    with pytest.raises(AssertionError) as failure:
        launch.check_replicas("unsynced")
    message = str(failure.value)
    print(message)
    assert "run 'unsynced'" in message
    assert "rank 0 vs rank 1: optimizer 0: ranks first differ after step 3 (of 6 / 6)" in message
    # the final parameters: all four of the two Linear layers differ, each named with its max difference
    for j, shape in enumerate(([8, 4], [8], [1, 8], [1])):
        assert f"optimizer 0 parameter {j} (shape {shape}): max |difference| = " in message
    assert "max |difference| = 0" not in message.replace("max |difference| = 0.", "")


def test_hand_written_update_on_rank_0_only_fails_naming_the_first_forward(launch):
    with pytest.raises(AssertionError) as failure:
        launch.check_replicas("manual_rank0")
    message = str(failure.value)
    print(message)
    assert "rank 0 vs rank 1: DDP model 0: ranks first differ before training forward 4 (of 6 / 6)" in message
    assert "rank 0 vs rank 1: DDP model 0: parameters differ at the end of the run" in message
    assert "optimizer 0" not in message  # there is none


def test_reading_an_unmarked_diverging_run_fails(launch):
    """Without "diverges" in its plan entry, the first trace() of the run raises: no test can forget the check."""
    launch.may_diverge.pop("unsynced", None)
    launch.replicas.pop("unsynced", None)
    try:
        for _ in range(2):  # and again on every later read
            with pytest.raises(AssertionError, match=r"optimizer 0: ranks first differ after step 3 "):
                launch.trace("unsynced", 1)
    finally:
        launch.may_diverge["unsynced"] = "no DDP: the point of this test"
