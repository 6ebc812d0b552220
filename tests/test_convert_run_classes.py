"""`ddpify convert --run` on shapes whose static conversion comes out wrong, one per class of
silent error: the conversion never passes silently (exit 1, the failed invariant named in the
output's first line), and one it converts right passes. A module of its own, so that its runs
go on a test worker beside test_convert_run.py's.
"""

from __future__ import annotations

import pytest
from cli_in_process import ddpify
from conftest import ROOT

RUN = ROOT / "fixtures" / "run"

pytestmark = pytest.mark.torchrun


@pytest.fixture(autouse=True)
def _probe_once(probe_once):
    """verify()'s GPU probe runs once per session (conftest.probe_once)."""


# fixtures/run/wrong_<name>/train.py: shapes whose static conversion comes out wrong, one per class
# of silent error; name -> (the invariant in the output's first line, its words)
WRONG = {
    "module_keys": (7, "holds the DDP wrapper's state_dict: its keys start with `module.`"),  # named_parameters() of the DDP model
    "per_rank_files": (6, "history.csv is written by ranks 0, 1"),  # a write through a table of callables
    "replay": (3, "one run replayed 2 times"),  # batches drawn by a generator seeded alike on every rank
    "unsynced": (2, "trains 1 of its 3 parameters outside DDP"),  # a parameter beside the model: never averaged
}


@pytest.mark.parametrize("name", list(WRONG))
def test_a_wrong_conversion_exits_1_and_its_first_line_names_the_invariant(tmp_path, name):
    """With --run, a conversion that is not right never passes silently: exit 1, and the
    output's first line names the invariant that failed. (Data not split between ranks: the
    sequential_chunks test above.)"""
    number, words = WRONG[name]
    out = tmp_path / "out.py"
    done = ddpify("convert", "train.py", "-o", str(out), "--run", cwd=RUN / f"wrong_{name}")
    assert done.returncode == 1, done.stdout + done.stderr
    first = out.read_text().splitlines()[0]
    assert first.startswith(f"# ddpify: this conversion FAILED verification: {number} "), first
    assert words in first, first
    assert f"error: the conversion failed verification: {number} " in done.stderr
    assert TODO.get(name, "") in out.read_text()


# what the run tells the conversion to leave a TODO at (the static view sees nothing to flag)
TODO = {"module_keys": "# TODO(ddpify): the run saw this save store Linear's state_dict; save the network inside the DDP wrapper"}


def test_a_decision_on_validation_data_every_rank_reads_whole_passes(tmp_path):
    """ReduceLROnPlateau stepped on a validation loss: the conversion leaves the validation
    loader whole on every rank, so every rank takes the same decision, and --run proves it."""
    done = ddpify("convert", "train.py", "-o", str(tmp_path / "out.py"), "--run", cwd=RUN / "plateau_on_validation")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ddpify verify: PASS" in done.stdout
