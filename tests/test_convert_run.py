"""`ddpify convert --run`: facts from a brief run of the original, and a conversion that proves itself.

fixtures/run/<case>/ are small projects of ours. Every run is real: the original as one process
under the tracer, then verify's runs (torchrun with 2 CPU processes) of what convert wrote.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_in_process import ddpify
from conftest import ROOT

from ddpify.analysis.run_facts import RunFacts

RUN = ROOT / "fixtures" / "run"

pytestmark = pytest.mark.torchrun


@pytest.fixture(autouse=True)
def _probe_once(probe_once):
    """verify()'s GPU probe runs once per session (conftest.probe_once)."""


def test_run_shards_drawn_batches_and_proves_it(tmp_path):
    """Episodes and a replay store in another module, seeded alike: the run sees a new batch each
    step, so every seed is offset by the rank, and verify's runs prove the ranks no longer replay
    one run (a conversion that leaves them replaying fails: the next tests)."""
    out = tmp_path / "out"
    done = ddpify("convert", "train.py", "-o", f"{out}/", "--run", "--", "--episodes", "2",
                  cwd=RUN / "replayed_episodes")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Facts from the run:" in done.stdout
    assert "a different batch each step" in done.stdout
    assert "ddpify verify: PASS" in done.stdout
    train = (out / "train.py").read_text()
    assert "walk.seed(args.seed + " in train and "np.random.seed(args.seed + " in train
    assert "torch.manual_seed(torch.initial_seed() + dist.get_rank())" in train
    assert "random.seed(seed + " in (out / "buffer.py").read_text()
    assert "self.rng.seed(value)" in (out / "buffer.py").read_text()  # its caller's seed is offset, not twice
    assert not train.startswith("# ddpify:")


def test_static_conversion_of_drawn_batches_seeds_by_rank_too():
    """Without the run, the store's `draw` (every class defining it draws with random.sample) tells
    the same: the seeds are offset by the rank."""
    done = ddpify("convert", "train.py", "--diff", cwd=RUN / "replayed_episodes")
    assert "+walk.seed(args.seed + " in done.stdout and "+torch.manual_seed(torch.initial_seed() + dist.get_rank())" in done.stdout


def test_a_file_read_back_after_rank0_wrote_it_waits_for_it(tmp_path):
    """The weights saved every epoch under its number and reloaded by the best epoch's: the paths
    are spelled apart, so only the run tells that the load reads what the save wrote; every rank
    then reads it after a barrier (without one, rank 1 may read a half-written file)."""
    out = tmp_path / "out.py"
    done = ddpify("convert", "train.py", "-o", str(out), "--run", cwd=RUN / "best_epoch_reload")
    assert done.returncode == 0, done.stdout + done.stderr
    code = out.read_text()
    assert 'dist.barrier()  # rank 0 has written this file\nmodel.module.load_state_dict(' in code or (
        'dist.barrier()  # rank 0 has written this file\nmodel.load_state_dict(' in code
    ), code
    static = ddpify("convert", "train.py", cwd=RUN / "best_epoch_reload")
    assert "rank 0 has written this file" not in static.stdout  # the static view cannot pair them


def test_a_loader_handed_back_by_a_factory_is_sharded_where_it_is_made(tmp_path):
    """`return DataLoader(..., shuffle=shuffle, **options)` passed straight into the training
    function, the same factory making the evaluation loader (no shuffle): the static view leaves a
    TODO; the run saw it train, so the loaders it makes that shuffle get their sampler in the call,
    the evaluation one reads everything, and verify's runs prove the shards."""
    out = tmp_path / "out"
    done = ddpify("convert", "train.py", "-o", f"{out}/", "--run", cwd=RUN / "returned_loader")
    assert done.returncode == 0, done.stdout + done.stderr
    data = (out / "data.py").read_text()
    assert "train_dataset = TensorDataset(x, x * x)" in data
    assert "sampler=DistributedSampler(train_dataset, shuffle=True, num_replicas=" in data
    assert ") if shuffle else None" in data
    assert "TODO(ddpify)" not in data and "ddpify verify: PASS" in done.stdout
    static = ddpify("convert", "train.py", "-o", f"{tmp_path / 'static'}/", cwd=RUN / "returned_loader")
    assert "TODO(ddpify)" in (tmp_path / "static" / "data.py").read_text()


def test_a_conversion_that_fails_verification_says_so(tmp_path):
    """Batches handed out in order by an iterator class: the conversion cannot shard them (a TODO);
    verify's runs see every rank train on the same batches, so convert exits 1 and the output's
    first line says why."""
    out = tmp_path / "out.py"
    done = ddpify("convert", "train.py", "-o", str(out), "--run", cwd=RUN / "sequential_chunks")
    assert done.returncode == 1, done.stdout + done.stderr
    first = out.read_text().splitlines()[0]
    assert first.startswith("# ddpify: this conversion FAILED verification: 3 ")
    assert "error: the conversion failed verification: 3 disjoint shards" in done.stderr
    compile(out.read_text(), str(out), "exec")


def test_an_original_that_fails_on_its_own_writes_nothing(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import torch\nmodel = torch.nn.Linear(2, 1)\nraise ValueError('no data here')\n")
    out = tmp_path / "out.py"
    done = ddpify("convert", str(script), "-o", str(out), "--run", cwd=tmp_path)
    assert done.returncode == 2
    assert "fails on its own as one process" in done.stderr and "ValueError: no data here" in done.stderr
    assert "Traceback" in done.stderr
    assert not out.exists()


def test_an_original_that_exits_on_its_own_shows_what_it_printed(tmp_path):
    """An argparse usage error (SystemExit(2)): the script's own message, not only the exit."""
    script = tmp_path / "needs_args.py"
    script.write_text("import argparse\nimport torch\np = argparse.ArgumentParser()\np.add_argument('--logdir', required=True)\np.parse_args()\n")
    done = ddpify("convert", str(script), "-o", str(tmp_path / "out.py"), "--run", cwd=tmp_path)
    assert done.returncode == 2
    assert "the following arguments are required: --logdir" in done.stderr, done.stderr


def test_a_run_past_the_timeout_says_where_it_stood(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text("import time\n\n\ndef wait_for_data():\n    while True:\n        time.sleep(0.1)\n\n\nwait_for_data()\n")
    out = tmp_path / "out.py"
    done = ddpify("convert", str(script), "-o", str(out), "--run", "--timeout", "5", cwd=tmp_path)
    assert done.returncode == 2
    assert "ran past --timeout 5s" in done.stderr and "wait_for_data" in done.stderr, done.stderr
    assert not out.exists()


def test_run_facts_from_a_trace():
    """Sites by module and line; the loader that fed the steps; what is no project code is left out."""
    trace = {
        "cwd": "/w/original",
        "loaders": [{"id": 0, "where": "train.py:10"}, {"id": 1, "where": "data/feeds.py:7"}],
        "passes": [{"loader": 1, "steps": 3}, {"loader": 0, "steps": 0}],
        "optimizer_steps": [["a", "b", "c"]],
        "optimizer_info": [{"type": "SGD", "where": "train.py:12"}],
        "unwrapped_forwards": [{"module": "Net", "where": "train.py:20"}],
        "env_set": [{"name": "CUDA_VISIBLE_DEVICES", "where": "train.py:3"}, {"name": "X", "where": "../elsewhere.py:1"}],
        "seeds": [{"kind": "torch", "where": "train.py:4"}, {"kind": "numpy", "where": "data/feeds.py:2"}],
        "files": [{"path": "/w/original/out/model.pt", "mode": "wb", "where": "train.py:30"},
                  {"path": "/w/original/in.csv", "mode": "r", "where": "data/feeds.py:5"}],
        "forward_inputs": ["x", "y"],
    }  # fmt: skip
    facts = RunFacts.from_trace(json.loads(json.dumps(trace)), "train.py")
    assert str(facts.train_loader) == "data/feeds.py:7" and facts.train_loader.module == "data.feeds"
    assert facts.lines("train_loader", "data.feeds") == {7} and facts.lines("loader", "") == {10}
    assert facts.lines("env:CUDA_VISIBLE_DEVICES", "") == {3} and not facts.lines("env:X", "")
    assert facts.lines("seed", "data.feeds") == {2}
    assert [(p, str(s)) for p, s in facts.written] == [(str(Path("out/model.pt")), "train.py:30")]
    assert facts.steps == 3 and not facts.loaderless and facts.drawn
    assert any("data/feeds.py:7" in line for line in facts.summary())


def test_a_checkpoint_the_static_view_misses_loads_into_the_original_model(tmp_path):
    """The state dicts of a table of parts saved in a comprehension, and a save function handed
    in as a parameter (`write=torch.save`): the static view sees no model in the first and no
    save in the second. The run saw both store Net's state_dict, so the first saves the network
    inside the wrapper and the second runs on rank 0 only (every rank reads its file back after a
    barrier); the output's checkpoints, written by `python out.py` (DDP in a group of one), have no
    `module.` keys and load into Net."""
    case = RUN / "hidden_checkpoint"
    out = tmp_path / "train.py"
    done = ddpify("convert", "train.py", "-o", str(out), "--run", cwd=case)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the checkpoint saved at train.py:12 stores Net's state_dict under 'model'" in done.stdout, done.stdout
    assert "and an optimizer's state under 'optimizer'" in done.stdout
    assert "the checkpoint saved at train.py:16 stores Net's state_dict" in done.stdout
    assert "Net trained on cpu, its batches on cpu" in done.stdout
    assert "ddpify verify: PASS" in done.stdout
    code = out.read_text()
    assert 'getattr(part, "module", part).state_dict() for name, part in parts.items()' in code
    assert "    if dist.get_rank() == 0:\n        write(net.state_dict(), path)" in code
    assert 'dist.barrier()  # rank 0 has written this file\nmodel.module.load_state_dict(torch.load("weights.ckpt"' in code
    static = ddpify("convert", "train.py", cwd=case).stdout
    assert 'getattr(part, "module", part)' not in static and "        write(net.state_dict(), path)" not in static
    assert "rank 0 has written this file" not in static
    (tmp_path / "model.py").write_text((case / "model.py").read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ran = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    spec = importlib.util.spec_from_file_location("hidden_checkpoint_model", case / "model.py")
    spec.loader.exec_module(model := importlib.util.module_from_spec(spec))
    parts = torch.load(tmp_path / "parts.ckpt")
    weights = torch.load(tmp_path / "weights.ckpt")
    for state in (parts["model"], weights):
        assert not any(k.startswith("module.") for k in state), list(state)
        model.Net().load_state_dict(state)


def test_run_facts_say_what_each_save_stored_and_where_models_trained():
    """Saves by site (the first save at a site tells), what each stored, under which key; the
    device of each trained model and of its first batch; a model on the CPU beside a GPU."""
    trace = {
        "cwd": "/w",
        "unwrapped_forwards": [{"module": "Net", "where": "train.py:20", "device": "cpu", "batch_device": "cpu"},
                               {"module": "Critic", "where": "train.py:21", "device": "cuda:0", "batch_device": "cuda:0"}],
        "cuda_available": True,
        "saves": [
            {"where": "train.py:30", "stores": [{"kind": "state_dict", "key": "model", "model": "Net", "prefixed": False},
                                                {"kind": "optimizer", "key": "optimizer"}]},
            {"where": "train.py:30", "stores": []},
            {"where": "utils/io.py:5", "stores": [{"kind": "module", "key": None, "module": "Net", "trained": True}]},
            {"where": "train.py:40", "stores": [{"kind": "optimizer", "key": None}]},
            {"where": "train.py:41", "stores": [{"kind": "state_dict", "key": None, "model": "Net", "prefixed": True}]},
            {"where": "train.py:42", "stores": []},
            {"where": "../site.py:1", "stores": [{"kind": "optimizer", "key": None}]},
        ],
    }  # fmt: skip
    facts = RunFacts.from_trace(json.loads(json.dumps(trace)), "train.py")
    assert facts.lines("save", "") == {30, 40, 41, 42} and facts.lines("model_save", "") == {30, 41}
    assert facts.lines("model_save", "utils.io") == {5} and facts.lines("model_save", "io") == {5}
    assert [str(s.site) for s in facts.saved_at("", 29, 31)] == ["train.py:30"]
    assert facts.devices == {"Net": "cpu", "Critic": "cuda:0"} and facts.batch_devices["Critic"] == "cuda:0"
    assert facts.on_cpu_beside_a_gpu() == ["Net"]
    summary = facts.summary()
    assert "the checkpoint saved at train.py:30 stores Net's state_dict under 'model' and an optimizer's state under 'optimizer'" in summary
    assert "the checkpoint saved at utils/io.py:5 stores the whole Net" in summary
    assert "the checkpoint saved at train.py:40 stores an optimizer's state" in summary
    assert "the checkpoint saved at train.py:41 stores Net's state_dict (keys with `module.`)" in summary
    assert not any("train.py:42" in line or "site.py" in line for line in summary)
    assert "Critic trained on cuda:0, its batches on cuda:0" in summary
    assert any(line.startswith("Net trained on cpu, its batches on cpu (a GPU was there") for line in summary)
    assert not RunFacts.from_trace({**trace, "cuda_available": False}, "train.py").on_cpu_beside_a_gpu()
    assert RunFacts.from_trace({}, "train.py").saves == []  # an older trace: no saves, no devices


def test_the_tracer_says_what_a_save_stores():
    """A trained model's state_dict (plain, or with `module.` keys) under a key of the dict saved,
    the whole model, an optimizer's state; a state dict of no trained model is left out."""
    from ddpify.verify import tracer

    model, other = torch.nn.Linear(3, 2), torch.nn.Linear(5, 5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer._TRAINED_MODELS[:] = [model]
    try:
        assert tracer._stores(model.state_dict()) == [dict(kind="state_dict", key=None, model="Linear", prefixed=False)]
        prefixed = {f"module.{k}": v for k, v in model.state_dict().items()}
        assert tracer._stores({"net": prefixed, "opt": optimizer.state_dict(), "epoch": 3}) == [
            dict(kind="state_dict", key="net", model="Linear", prefixed=True), dict(kind="optimizer", key="opt")]
        assert tracer._stores(model) == [dict(kind="module", key=None, module="Linear", trained=True)]
        assert tracer._stores({"m": other}) == [dict(kind="module", key="m", module="Linear", trained=False)]
        assert tracer._stores(other.state_dict()) == [] and tracer._stores(torch.zeros(2)) == []
    finally:
        tracer._TRAINED_MODELS.clear()
    assert tracer._device_of(tracer._tensors((torch.zeros(1), [torch.ones(1)], {"m": torch.zeros(2)}, 3))) == "cpu"
    assert tracer._device_of(tracer._tensors((3, "x"))) is None


def _runs(ddp_inputs, original_inputs):
    from ddpify.verify.invariants import Runs

    ddp = [{"forward_inputs": i, "passes": [], "loaders": [], "exit_code": 0} for i in ddp_inputs]
    return Runs(nproc=len(ddp), ddp=ddp, ordered=ddp, original={"forward_inputs": original_inputs}, reference=None, plain=None)


def test_verify_judges_the_ranks_inputs_without_a_loader():
    """Invariant 3 with no DataLoader: ranks fed the same inputs while the original's changed step
    to step replay one run; full-batch training (the same inputs every step) whose ranks' inputs
    differ built its data apart; a rank that noted no input gives no verdict, never a PASS."""
    from ddpify.verify.invariants import FAIL, NA, sharded

    assert sharded(_runs([["a", "b"], ["a", "b"]], ["x", "y", "z"])).status == FAIL
    assert "replayed" in sharded(_runs([["a", "b"], ["a", "b"]], ["x", "y"])).summary
    assert sharded(_runs([["a", "b"], ["c", "d"]], ["x", "y"])).status != FAIL  # drawn, and drawn apart
    assert sharded(_runs([["a", "a"], ["a", "a"]], ["x", "x"])).status != FAIL  # full batch, the same data
    differs = sharded(_runs([["a", "a"], ["b", "b"]], ["x", "x"]))
    assert differs.status == FAIL and "full batch" in differs.summary
    assert sharded(_runs([["a", "a"], []], ["x", "x"])).status == NA  # rank 1 noted nothing: no verdict, never a PASS


def test_verify_fails_disjoint_indices_that_feed_every_rank_the_same_items():
    """A dataset whose items are drawn at random from a seed the ranks share: the sampler splits
    the indices, yet every rank feeds the same batches. Constant data (the original's
    inputs never change) and a rank that noted nothing give no verdict."""
    from ddpify.verify.invariants import _same_items

    assert "same batches" in _same_items(_runs([["a", "b"], ["a", "b"]], ["x", "y"]))
    assert _same_items(_runs([["a", "b"], ["c", "d"]], ["x", "y"])) is None
    assert _same_items(_runs([["a", "b"], ["a", "c"]], ["x", "y"])) is None  # a GAN's noise alike, its real batches apart
    assert _same_items(_runs([["a"], ["a"]], ["x", "x"])) is None
    assert _same_items(_runs([["a"], []], ["x", "y"])) is None


def test_verify_runs_a_package_entry_with_the_users_pythonpath_pointing_into_its_copy(tmp_path, monkeypatch):
    """`cd pkg && PYTHONPATH=.. python train.py`: the entry imports `pkg.helpers` through the
    user's PYTHONPATH. The runs copy that folder (above the one the user runs from), and the
    PYTHONPATH entry points into the copy, so the converted helper runs (its message once), not
    the user's own file; a data file beside the project (`../points.csv`) is found from the copy."""
    pkg = tmp_path / "proj" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text(
        "import torch\n\n\ndef load_points(path):\n    print('reading the points')\n"
        "    rows = [[float(v) for v in line.split(',')] for line in open(path)]\n    return torch.tensor(rows)\n"
    )
    (pkg / "train.py").write_text(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\nfrom pkg.helpers import load_points\n\n"
        "points = load_points('../../points.csv')\nmodel = torch.nn.Linear(1, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "loader = DataLoader(TensorDataset(points[:, :1], points[:, 1:]), batch_size=4, shuffle=True)\n"
        "for epoch in range(2):\n    for x, y in loader:\n        loss = ((model(x) - y) ** 2).mean()\n"
        "        opt.zero_grad()\n        loss.backward()\n        opt.step()\n"
    )
    (tmp_path / "points.csv").write_text("".join(f"{i / 10},{i / 5 + 1}\n" for i in range(16)))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "proj"))
    done = ddpify("verify", "train.py", cwd=pkg)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 PASS  one voice" in done.stdout


def test_the_tracer_notes_files_not_folders(tmp_path, monkeypatch):
    """A library probing a folder (a cache opening /tmp) writes no file: only the file counts."""
    from ddpify.verify import tracer

    monkeypatch.setattr(tracer, "_trace", {"files": [], "collectives": 0})
    monkeypatch.setattr(tracer, "_state", {"active": True})
    tracer._note_file(str(tmp_path), "w")
    tracer._note_file(str(tmp_path / "out.txt"), "w")
    assert [f["path"] for f in tracer._trace["files"]] == [str(tmp_path / "out.txt")]
