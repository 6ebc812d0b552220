"""Projects: an entry script and the modules of its own it imports, converted together.

Each project in fixtures/projects/<name>/ has its expected converted files (only those that
change) in fixtures/projects/<name>.out/ (regenerated with --update-goldens). The converted
copy of each project trains under torchrun with the invariants of PRODUCT.md: disjoint shards
in a new order each epoch, identical parameters on every rank, the parameters of one process
at twice the batch, one copy of each message and checkpoint, checkpoints that load into the
original model, and it still runs as one process under plain python.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_in_process import ddpify
from batched import run_cases
from conftest import NPROC, ROOT

from ddpify.projects import convert_project

PROJECTS = ROOT / "fixtures" / "projects"
B = 16  # per-process batch


@dataclass(frozen=True)
class Project:
    entry: str  # relative to the project's root
    changed: tuple[str, ...]  # the files a conversion changes
    samples: int  # the training set
    epochs: int
    lines: tuple[str, ...]  # printed once per job
    checkpoint: str  # saved by rank 0 (the last save's path)
    model: tuple[str, str, tuple]  # (module, class, args): the original model the checkpoint loads into
    batch: str = "--batch-size"  # the option that sets the batch size
    key: str | None = None  # the checkpoint keeps the model's state_dict under this key
    unequal: str | None = None  # why the parameters cannot equal one process's at twice the batch
    config: str | None = None  # a config file the entry reads (`-c FILE`), relative to the root

    def options(self, root: Path) -> list[str]:
        return ["-c", str(root / self.config)] if self.config else []


CASES = {
    # a Trainer class with callbacks in a package, driven by an entry script in a subfolder
    "library_trainer": Project(
        "projects/regress/regress.py", ("projects/regress/regress.py", "tinytrain/trainer.py"), 256, 2,
        ("running on device cpu", "iter 8: ", "saved regressor.pt after 16 iterations"), "regressor.pt",
        ("tinytrain.model", "Regressor", (8, 32)),
    ),
    # config.py / dataset.py / model.py / engine.py (train_fn, eval_fn) / train.py with the loop
    "kaggle_engine": Project(
        "train.py", ("engine.py", "train.py"), 192, 2, ("epoch 0: valid loss", "epoch 1: valid loss"), "model.bin",
        ("model", "Net", (8,)),
    ),
    # pytorch-cifar100's shape: loaders from utils.get_training_dataloader(), a warm-up
    # scheduler stepped per iteration, settings in a package, the model from models/
    "cifar_utils": Project(
        "train.py", ("train.py", "utils.py"), 192, 2, ("test set: epoch 1,", "test set: epoch 2,"), "checkpoint/best.pth",
        ("models.mlp", "MLP", ()), batch="-b",
    ),
    # pytorch-template's shape: a JSON config, a BaseDataLoader (a DataLoader subclass) that
    # splits off validation with SubsetRandomSampler, a BaseTrainer that saves and resumes, a
    # Trainer subclass with the steps, DataParallel chosen by prepare_device(n_gpu)
    "template_trainer": Project(
        "train.py", ("base/base_data_loader.py", "base/base_trainer.py", "train.py"), 192, 2,
        ("epoch 1: loss", "epoch 2: loss", "Saving checkpoint: saved/checkpoint-epoch2.pth"),
        "saved/checkpoint-epoch2.pth", ("model.model", "RegressionModel", ()), key="state_dict",
        unequal="SubsetRandomSampler draws its own random order (no shuffle option to turn off)", config="config.json",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_project_golden(name, update_goldens):
    case = CASES[name]
    source = PROJECTS / name
    result = convert_project(source / case.entry)
    expected = PROJECTS / f"{name}.out"
    changed = {path.relative_to(source.resolve()).as_posix(): r.code for path, (r, _, _) in result.changed.items()}
    if update_goldens:
        shutil.rmtree(expected, ignore_errors=True)
        for file, code in changed.items():
            (expected / file).parent.mkdir(parents=True, exist_ok=True)
            (expected / file).write_text(code)
    assert sorted(changed) == sorted(case.changed)
    for file, code in changed.items():
        assert code == (expected / file).read_text(), f"{file} differs from its golden (--update-goldens)"


def test_project_output_modes(tmp_path):
    """-o DIR/ writes a runnable copy (other files byte for byte, data left out); -o FILE.py
    refuses and names the other module; --diff covers every changed file; --in-place rewrites
    them; converting the written project again changes nothing."""
    case = CASES["library_trainer"]
    project = tmp_path / "proj"
    shutil.copytree(PROJECTS / "library_trainer", project)
    (project / "data").mkdir()
    (project / "data" / "big.bin").write_bytes(b"\0" * 16)

    single = ddpify("convert", case.entry, "-o", "out.py", cwd=project)
    assert single.returncode == 2 and "tinytrain/trainer.py" in single.stderr and "-o DIR/" in single.stderr
    assert len(single.stderr.strip().splitlines()) == 1

    diff = ddpify("convert", case.entry, "--diff", cwd=project)
    assert diff.returncode == 1
    assert all(f"+++ b/{file}" in diff.stdout for file in case.changed)

    out = tmp_path / "converted"
    copy = ddpify("convert", case.entry, "-o", f"{out}/", cwd=project)
    assert copy.returncode == 0, copy.stderr
    assert "tinytrain/trainer.py -> " in copy.stdout and "Not copied" in copy.stdout and "data" in copy.stdout
    assert not (out / "data").exists()
    for file in ("tinytrain/model.py", "tinytrain/utils.py", "tinytrain/__init__.py", "pyproject.toml"):
        assert filecmp.cmp(project / file, out / file, shallow=False), file
    golden = PROJECTS / "library_trainer.out"
    for file in case.changed:
        assert (out / file).read_text() == (golden / file).read_text()
    assert convert_project(out / case.entry).changed == {}  # the converted copy is a fixed point

    in_place = ddpify("convert", case.entry, "--in-place", cwd=project)
    assert in_place.returncode == 0, in_place.stderr
    for file in case.changed:
        assert (project / file).read_text() == (out / file).read_text()


def test_a_data_named_package_keeps_its_modules_in_the_copy(tmp_path):
    """`datasets/` holding modules the project imports: -o DIR/ copies its Python files (the
    converted one converted) and leaves its other files out, and says so."""
    out = tmp_path / "converted"
    case = ROOT / "fixtures" / "unseen" / "data_named_package"
    copy = ddpify("convert", str(case / "train.py"), "-o", f"{out}/", cwd=tmp_path)
    assert copy.returncode == 0, copy.stderr
    assert "Not copied into" in copy.stdout and "datasets (all but its Python modules)" in copy.stdout, copy.stdout
    assert (out / "datasets" / "__init__.py").is_file()
    assert "DistributedSampler" in (out / "datasets" / "toy.py").read_text()
    assert not (out / "datasets" / "NOTES.txt").exists()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each converted project under torchrun, shuffled and without shuffling, each original as one
    process at twice the batch: every project's shuffled run in one torchrun launch, every ordered
    run in another (a project never runs twice in the same processes: a library may keep state),
    the originals in one python launch (tests/batched.py; each case is read on its own). The
    shuffled launch also trains test_optimizer_built_by_name_from_config's project."""
    work = tmp_path_factory.mktemp("projects")
    launches = {}
    shuffled, ordered, reference = {}, {}, {}
    for name, case in CASES.items():
        out = work / name
        result = ddpify("convert", str(PROJECTS / name / case.entry), "-o", f"{out}/", cwd=work)
        assert result.returncode == 0, result.stderr
        script, env = str(out / case.entry), {"PYTHONPATH": str(out)}
        args = [case.batch, str(B), *case.options(out)]
        shuffled[name] = [{"label": "shuffled", "script": script, "args": args, "env": env}]
        ordered[name] = [{"label": "ordered", "script": script, "args": [*args, "--no-shuffle"], "env": env}]
        reference[name] = [
            {"label": "reference", "script": str(PROJECTS / name / case.entry), "env": {"PYTHONPATH": str(PROJECTS / name)},
             "args": [case.batch, str(B * NPROC), "--no-shuffle", *case.options(PROJECTS / name)]}
        ]  # fmt: skip
        launches[name, "out"] = out
    byname = optimizer_by_name_project(work / "byname")
    launches["byname", "convert"] = byname
    if byname[0].returncode == 0:
        out = byname[1]
        shuffled["byname"] = [
            {"label": "byname", "script": str(out / "train.py"), "args": ["-c", str(out / "config.json")], "env": {"PYTHONPATH": str(out)}}
        ]  # fmt: skip
    batches = {
        "shuffled": run_cases(shuffled, work / "shuffled", nproc=NPROC),
        "ordered": run_cases(ordered, work / "ordered", nproc=NPROC),
        "reference": run_cases(reference, work / "reference", nproc=None),
    }
    for kind, batch in batches.items():
        for name in batch.cases:
            launches[name, kind] = batch[name]
    launches["batches"] = batches
    return launches


@pytest.mark.parametrize("kind", ["shuffled", "ordered", "reference"])
def test_batched_launches_lost_nothing(runs, kind):
    """Every project ran to the end in its batched launch, and the traces hold all that the launch
    printed (each project's stdout is read from its traces)."""
    batch = runs["batches"][kind]
    assert not batch.lost, f"{batch.lost}\n{batch.log()}"
    for launch, extra in zip(batch.launches, batch.unattributed):
        assert not extra, f"printed by no run of the plan: {extra!r}\n{launch.log()}"


def _ran(launch, label: str, ranks: int = NPROC) -> list[dict]:
    traces = [launch.trace(label, r) for r in range(ranks)]  # checks every rank's parameters agree
    for rank, t in enumerate(traces):
        assert t["exit_code"] == 0, f"rank {rank}: {t['error']}\n{launch.log()}"
    return traces


@pytest.mark.parametrize("name", CASES)
def test_project_under_torchrun(runs, name):
    case = CASES[name]
    launch = runs[name, "shuffled"]
    traces = _ran(launch, "shuffled")
    for rank, t in enumerate(traces):
        assert t["ddp_wrapped"] == 1 and t["init_process_group"], f"rank {rank}: no process group or no DDP model"
    # disjoint shards that cover what one process trains on (the first loader: the training one), in
    # a new order each epoch
    reference = _ran(runs[name, "reference"], "reference", ranks=1)[0]
    whole = next(set(p["indices"]) for p in reference["passes"] if p["loader"] == 0 and p["complete"])
    assert len(whole) == case.samples
    passes = [[p["indices"] for p in t["passes"] if p["loader"] == 0 and p["complete"]] for t in traces]
    assert all(len(p) == case.epochs for p in passes), passes
    for epoch in range(case.epochs):
        a, b = set(passes[0][epoch]), set(passes[1][epoch])
        assert not a & b and a | b == whole, f"epoch {epoch}: shards overlap or miss samples"
    assert passes[0][0] != passes[0][1], "the same order every epoch: set_epoch missing"
    # one voice: each line printed once over all ranks; checkpoints by rank 0 only, loadable
    printed = [line for t in traces for line in t["stdout"].splitlines()]
    for line in case.lines:
        assert sum(line in p for p in printed) == 1, f"{line!r} printed {sum(line in p for p in printed)} times"
    assert traces[1]["saves"] == [] and traces[0]["saves"]
    assert all(s["keys"] and not s["module_prefix"] for s in traces[0]["saves"])
    module, cls, args = case.model
    sys.path.insert(0, str(PROJECTS / name))
    try:
        import importlib

        import torch

        model = getattr(importlib.import_module(module), cls)(*args)
        saved = torch.load(launch.cwd / "shuffled" / case.checkpoint)
        model.load_state_dict(saved[case.key] if case.key else saved)
    finally:
        sys.path.remove(str(PROJECTS / name))
        top = module.split(".")[0]
        for loaded in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            sys.modules.pop(loaded, None)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if not case.unequal])
def test_project_equals_one_process_at_twice_the_batch(runs, name):
    """(Not for a case whose `unequal` says why: its own sampler draws a random order.)"""
    _ran(runs[name, "reference"], "reference", ranks=1)
    _ran(runs[name, "ordered"], "ordered")
    ours, theirs = runs[name, "ordered"].params("ordered", 0), runs[name, "reference"].params("reference", 0)
    assert len(ours) == len(theirs) == 1
    for a, b in zip(ours[0], theirs[0]):
        assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", CASES)
def test_project_runs_as_one_process(runs, name):
    case, out = CASES[name], runs[name, "out"]
    run = subprocess.run(
        [sys.executable, str(out / case.entry), "--no-shuffle", case.batch, str(B * NPROC)],
        cwd=out, env=dict(os.environ, PYTHONPATH=str(out), OMP_NUM_THREADS="1"), capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert all(line in run.stdout for line in case.lines[-1:])


def test_kaggle_evaluation_adds_up(runs):
    """eval_fn's loss, summed over the ranks' slices of the validation set, is the original's on
    the same parameters: the converted ordered run prints what the reference prints."""
    ours = _ran(runs["kaggle_engine", "ordered"], "ordered")[0]["stdout"]
    theirs = _ran(runs["kaggle_engine", "reference"], "reference", ranks=1)[0]["stdout"]
    mine = [float(line.rsplit(" ", 1)[1]) for line in ours.splitlines() if "valid loss" in line]
    ref = [float(line.rsplit(" ", 1)[1]) for line in theirs.splitlines() if "valid loss" in line]
    assert len(mine) == len(ref) == 2
    assert all(abs(a - b) < 1e-4 for a, b in zip(mine, ref)), (mine, ref)


def test_shared_module_is_converted_once(tmp_path):
    """Two entry scripts share utils.py: converting the second in place leaves the helper as the
    first conversion left it (its loader has its sampler already) and converts only the script."""
    project = tmp_path / "proj"
    shutil.copytree(PROJECTS / "cifar_utils", project)
    shutil.copy(project / "train.py", project / "train_again.py")
    first = ddpify("convert", "train.py", "--in-place", cwd=project)
    assert first.returncode == 0, first.stderr
    helper = (project / "utils.py").read_text()
    assert "DistributedSampler(training" in helper
    second = ddpify("convert", "train_again.py", "--in-place", cwd=project)
    assert second.returncode == 0, second.stderr
    assert (project / "utils.py").read_text() == helper
    assert (project / "train_again.py").read_text() == (project / "train.py").read_text()
    assert "utils.py" not in second.stdout


def test_only_the_entry_changes_one_file_output_works(tmp_path):
    """A project whose helper module is converted already: -o FILE.py and stdout still work."""
    project = tmp_path / "proj"
    shutil.copytree(PROJECTS / "cifar_utils", project)
    shutil.copy(project / "train.py", project / "train_again.py")
    assert ddpify("convert", "train.py", "--in-place", cwd=project).returncode == 0
    to_file = ddpify("convert", "train_again.py", "-o", "train_again_ddp.py", cwd=project)
    assert to_file.returncode == 0, to_file.stderr
    assert (project / "train_again_ddp.py").read_text() == (project / "train.py").read_text()
    to_stdout = ddpify("convert", "train_again.py", cwd=project)
    assert to_stdout.returncode == 0 and to_stdout.stdout == (project / "train.py").read_text()


def test_copy_names_the_data_the_code_reads(tmp_path):
    """data/ is not copied; the summary says which line reads it, relative to where it runs."""
    project = tmp_path / "proj"
    shutil.copytree(PROJECTS / "cifar_utils", project)
    (project / "data").mkdir()
    (project / "data" / "train.csv").write_text("x\n")
    train = project / "train.py"
    train.write_text(train.read_text().replace(
        '    parser.add_argument("-net", type=str, default="mlp")\n',
        '    parser.add_argument("-net", type=str, default="mlp")\n    parser.add_argument("--data", default="./data/train.csv")\n',
    ))  # fmt: skip
    line = next(i for i, text in enumerate(train.read_text().splitlines(), 1) if "./data/train.csv" in text)
    out = tmp_path / "out"
    copy = ddpify("convert", "train.py", "-o", f"{out}/", cwd=project)
    assert copy.returncode == 0, copy.stderr
    assert not (out / "data").exists()
    assert f"train.py:{line} reads data/ relative to where it runs" in copy.stdout


def test_converted_helpers_serve_other_callers(runs):
    """A converted helper module still works for a caller with no process group (a test script,
    a notebook): the sampler reads its place from torchrun's environment, defaulting to one process."""
    out = runs["cifar_utils", "out"]
    code = "import utils; batches = list(utils.get_training_dataloader(batch_size=16)); print(len(batches))"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=out, env=dict(os.environ, PYTHONPATH=str(out), OMP_NUM_THREADS="1"),
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "12"  # all 192 samples: one process reads the whole set
    # engine.eval_fn, whose sums are all-reduced now, evaluated by a caller with no process group
    out = runs["kaggle_engine", "out"]
    code = (
        "import numpy as np, torch, dataset, engine, model\n"
        "x = np.ones((8, 8), dtype='float32'); data = dataset.RegressionDataset(x, x[:, :1])\n"
        "loader = torch.utils.data.DataLoader(data, batch_size=4)\n"
        "print(engine.eval_fn(loader, model.Net(8), 'cpu') >= 0)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=out, env=dict(os.environ, PYTHONPATH=str(out), OMP_NUM_THREADS="1"),
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "True"


def test_check_follows_the_project(tmp_path):
    """`check` sees the project as convert does: a rank-0 guard in train.py around a helper whose
    collective is in utils.py hangs the other ranks; the finding is at the guarded call in
    train.py and names the line in utils.py. utils.py alone is fine."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "utils.py").write_text(
        "import torch.distributed as dist\n\n\ndef report(t):\n    dist.all_reduce(t)\n    return t\n"
    )
    (tmp_path / "train.py").write_text(
        "import torch\nimport torch.distributed as dist\n\nimport utils\n\n"
        "dist.init_process_group('gloo')\nt = torch.ones(1)\nif dist.get_rank() == 0:\n    utils.report(t)\n"
        "dist.destroy_process_group()\n"
    )
    both = ddpify("check", "train.py", "utils.py", "--select", "DDP116", cwd=tmp_path)
    assert both.returncode == 1, both.stdout + both.stderr
    findings = [line for line in both.stdout.splitlines() if "DDP116" in line]
    assert findings == [
        "train.py:9:5: DDP116 collective inside a branch only some ranks take (rank 0 only, or a test of the rank) hangs the other ranks; call it on every rank,"
        " outside the branch (the call leads to `dist.all_reduce(t)` in utils.py:5)"
    ]
    alone = ddpify("check", "utils.py", "--select", "DDP116", cwd=tmp_path)
    assert alone.returncode == 0, alone.stdout


def optimizer_by_name_project(tmp_path):
    """template_trainer with its optimizer built by name from the config, converted with the CLI:
    (the conversion's result, its output folder). The runs fixture trains it under torchrun."""
    project = tmp_path / "proj"
    shutil.copytree(PROJECTS / "template_trainer", project)
    train = project / "train.py"
    train.write_text(
        train.read_text()
        .replace('torch.optim.SGD(trainable_params, lr=config["optimizer"]["lr"])', 'init_obj(config, "optimizer", torch.optim, trainable_params)')
        .replace("from utils import prepare_device, read_json", "from utils import init_obj, prepare_device, read_json")
    )  # fmt: skip
    (project / "utils" / "util.py").write_text(
        (project / "utils" / "util.py").read_text()
        + "\n\ndef init_obj(config, name, module, *args, **kwargs):\n"
        + '    return getattr(module, config[name]["type"])(*args, **dict(config[name]["args"], **kwargs))\n'
    )
    config = project / "config.json"
    config.write_text(config.read_text().replace('"optimizer": {"lr": 0.05}', '"optimizer": {"type": "SGD", "args": {"lr": 0.05}}'))
    out = tmp_path / "out"
    return ddpify("convert", "train.py", "-o", f"{out}/", cwd=project), out


def test_optimizer_built_by_name_from_config(runs):
    """pytorch-template builds its optimizer by name, `config.init_obj('optimizer', torch.optim,
    params)`: a call handed the torch.optim module and the model's parameters builds the
    optimizer, so the model is found and wrapped before the Trainer keeps it; trained under
    torchrun, every rank ends with the same parameters and a shard of its own."""
    result, out = runs["byname", "convert"]
    assert result.returncode == 0, result.stderr
    assert "model = DDP(model" in (out / "train.py").read_text()
    traces = _ran(runs["byname", "shuffled"], "byname")  # checks every rank's parameters agree
    passes = [[set(p["indices"]) for p in t["passes"] if p["loader"] == 0 and p["complete"]] for t in traces]
    assert passes[0] and all(not a & b for a, b in zip(passes[0], passes[1])), "ranks share training samples"


def test_a_training_step_of_another_module_inside_a_print_runs_on_every_rank(tmp_path):
    """`print(epoch, trainer.step(x, y))` where `Trainer` lives in another module: the print goes
    to rank 0, the step stays on every rank (bound to a name first), or rank 1 never trains and
    rank 0 waits in the first gradient all-reduce."""
    (tmp_path / "steps.py").write_text(
        "import torch.nn as nn\nimport torch\n\n\nclass Stepper:\n    def __init__(self, model):\n        self.model = model\n"
        "        self.opt = torch.optim.SGD(model.parameters(), lr=0.1)\n\n    def step(self, x, y):\n"
        "        loss = nn.functional.mse_loss(self.model(x), y)\n        self.opt.zero_grad()\n        loss.backward()\n"
        "        self.opt.step()\n        return loss.item()\n"
    )
    (tmp_path / "main.py").write_text(
        "import torch\nimport torch.nn as nn\nfrom steps import Stepper\n\nmodel = nn.Linear(4, 1)\nstepper = Stepper(model)\n"
        "for epoch in range(3):\n    x, y = torch.randn(8, 4), torch.randn(8, 1)\n    print(epoch, stepper.step(x, y))\n"
    )
    result = convert_project(tmp_path / "main.py")
    code = next(outcome.code for path, (outcome, _, _) in result.changed.items() if path.name == "main.py")
    assert "    step_result = stepper.step(x, y)\n    if dist.get_rank() == 0:\n        print(epoch, step_result)" in code, code
