"""`ddpify convert` from the command line: outputs, summaries and every error path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_in_process import ddpify

ROOT = Path(__file__).resolve().parents[1]
FLAT = ROOT / "fixtures" / "convert" / "flat_script.in.py"
NOOP_DDP = ROOT / "fixtures" / "noop" / "multigpu_torchrun.py"


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(FLAT.read_text())
    return path


def test_stdout_is_the_converted_script_and_summary_goes_to_stderr(script: Path) -> None:
    before = script.read_bytes()
    result = ddpify("convert", str(script))
    assert result.returncode == 0, result.stderr
    compile(result.stdout, "out.py", "exec")
    assert "dist.init_process_group" in result.stdout and "ddpify" not in result.stdout.replace("TODO(ddpify)", "")
    assert "Launch: torchrun --nproc-per-node=N" in result.stderr
    assert script.read_bytes() == before  # never touched without --in-place


def test_output_file_and_summary_with_lines_and_launch_command(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "train_ddp.py"
    result = ddpify("convert", str(script), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_text().startswith(script.read_text().splitlines()[0])
    assert f"{script}:" in result.stdout and "DistributedDataParallel" in result.stdout
    assert f"torchrun --nproc-per-node=N {out}" in result.stdout
    assert "global batch" in result.stdout and "learning rate" in result.stdout
    assert result.stdout.count("\n") >= 5


def test_output_with_a_trailing_slash_is_a_folder_also_for_one_module(script: Path, tmp_path: Path) -> None:
    """`-o out/` names a folder even when the project is one module: out/train.py, never a
    file named `out`."""
    out = tmp_path / "out"
    result = ddpify("convert", str(script), "-o", f"{out}/", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert out.is_dir() and "dist.init_process_group" in (out / "train.py").read_text()
    assert f"-> {out / 'train.py'}:" in result.stdout
    up_to_date = ddpify("convert", str(script), "-o", f"{out}/", "--check", cwd=tmp_path)
    assert up_to_date.returncode == 0, up_to_date.stdout + up_to_date.stderr


def test_output_equal_to_input_is_refused(script: Path) -> None:
    before = script.read_bytes()
    result = ddpify("convert", str(script), "-o", str(script))
    assert result.returncode == 2
    assert "refusing to overwrite" in result.stderr and "--in-place" in result.stderr
    assert script.read_bytes() == before


def test_in_place_rewrites_and_second_run_changes_nothing(script: Path) -> None:
    assert ddpify("convert", str(script), "--in-place").returncode == 0
    converted = script.read_bytes()
    again = ddpify("convert", str(script), "--in-place")
    assert again.returncode == 0
    assert "already distributed" in again.stderr
    assert script.read_bytes() == converted


def test_diff_prints_a_unified_diff_and_exits_1(script: Path) -> None:
    before = script.read_bytes()
    result = ddpify("convert", str(script), "--diff")
    assert result.returncode == 1
    assert result.stdout.startswith(f"--- a/{script}")
    assert "+    dist.destroy_process_group()" in result.stdout or "+dist.destroy_process_group()" in result.stdout
    assert script.read_bytes() == before


def test_already_distributed_script_is_passed_through_unchanged(tmp_path: Path) -> None:
    """As black does for a file it leaves alone: -o gets an identical copy, stdout the input,
    so `ddpify convert x.py > y.py` in a pipeline still gives a script."""
    out = tmp_path / "out.py"
    result = ddpify("convert", str(NOOP_DDP), "-o", str(out))
    assert result.returncode == 0
    assert "already distributed" in result.stderr and f"{NOOP_DDP}:" in result.stderr
    assert out.read_bytes() == NOOP_DDP.read_bytes()
    piped = subprocess.run([sys.executable, "-m", "ddpify", "convert", str(NOOP_DDP)], capture_output=True, timeout=120)
    assert piped.returncode == 0 and piped.stdout == NOOP_DDP.read_bytes()


def test_a_hard_link_to_the_input_is_the_input(script: Path, tmp_path: Path) -> None:
    link = tmp_path / "out.py"
    link.hardlink_to(script)
    before = script.read_bytes()
    result = ddpify("convert", str(script), "-o", str(link))
    assert result.returncode == 2 and "refusing to overwrite the input" in result.stderr, result.stderr
    assert script.read_bytes() == before


@pytest.mark.parametrize("where", ["missing/out.py", "folder", "a_file/out.py"])
def test_output_that_cannot_be_written_is_one_line(script: Path, tmp_path: Path, where: str) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "a_file").write_text("")  # a file where a folder should be: unwritable even for root
    result = ddpify("convert", str(script), "-o", str(tmp_path / where))
    _one_line_error(result, str(tmp_path / where))
    assert "Traceback" not in result.stderr


def test_writes_are_atomic_and_keep_permissions(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.py"
    out.write_text("old\n")
    out.chmod(0o640)
    assert ddpify("convert", str(script), "-o", str(out)).returncode == 0
    assert out.stat().st_mode & 0o777 == 0o640 and "init_process_group" in out.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.py", "train.py"]  # no temporary left behind
    fresh = tmp_path / "fresh.py"
    assert ddpify("convert", str(script), "-o", str(fresh)).returncode == 0
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~_umask()


def test_a_write_killed_midway_leaves_the_old_file_whole(tmp_path: Path) -> None:
    """A process killed while it writes (SIGKILL, between the temporary file and the rename)."""
    target = tmp_path / "train.py"
    target.write_text("the old script\n")
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "import ddpify.files as files\n"
        "real = os.replace\n"
        "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"files.write_atomic(Path({str(target)!r}), b'x' * 10_000_000)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert done.returncode == -9
    assert target.read_text() == "the old script\n"


def test_an_output_that_is_no_regular_file_is_written_to_never_replaced(tmp_path: Path) -> None:
    """`-o` naming a FIFO (as `-o /dev/null` names a device): the converted script goes through it
    and the FIFO stays a FIFO; the atomic rename would have put a regular file in its place."""
    import stat
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    done = ddpify("convert", str(FLAT), "-o", str(fifo))
    reader.join(timeout=60)
    assert done.returncode == 0, done.stderr
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert received and b"DistributedDataParallel" in received[0]


def test_an_output_that_is_a_link_writes_the_file_it_names(tmp_path: Path) -> None:
    """`-o` naming a symbolic link: the file the link names gets the script, the link stays."""
    real = tmp_path / "kept" / "train_ddp.py"
    real.parent.mkdir()
    real.write_text("old\n")
    link = tmp_path / "train_ddp.py"
    link.symlink_to(real)
    done = ddpify("convert", str(FLAT), "-o", str(link))
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and "DistributedDataParallel" in real.read_text()


def test_stdout_keeps_the_source_encoding(tmp_path: Path) -> None:
    latin = tmp_path / "latin.py"
    latin.write_bytes(("# -*- coding: latin-1 -*-\n# caf\u00e9\n" + FLAT.read_text()).encode("latin-1"))
    result = subprocess.run([sys.executable, "-m", "ddpify", "convert", str(latin)], capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert b"# caf\xe9\n" in result.stdout  # latin-1 bytes under the latin-1 cookie
    compile(result.stdout, "out.py", "exec")


def test_version_and_short_help() -> None:
    version = ddpify("--version")
    assert version.returncode == 0 and version.stdout.startswith("ddpify ")
    assert ddpify("-h").returncode == 0 and ddpify("convert", "-h").stdout == ddpify("convert", "--help").stdout


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _one_line_error(result: subprocess.CompletedProcess, where: str) -> None:
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {where}"), lines[0]
    assert result.stdout == ""


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n\ndef main(:\n    pass\n")
    out = tmp_path / "out.py"
    result = ddpify("convert", str(bad), "-o", str(out))
    _one_line_error(result, f"{bad}:3: syntax error")
    assert not out.exists()


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.py"
    _one_line_error(ddpify("convert", str(missing)), f"{missing}: no such file")


def test_non_python_file(tmp_path: Path) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("# Training notes\n\nRun `python train.py` with lr=0.1.\n")
    result = ddpify("convert", str(notes))
    _one_line_error(result, f"{notes}:3: syntax error")


def test_binary_file_is_not_python(tmp_path: Path) -> None:
    blob = tmp_path / "weights.py"
    blob.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01")
    result = ddpify("convert", str(blob))
    assert result.returncode == 1 and f"error: {blob}:" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unknown_encoding(tmp_path: Path) -> None:
    odd = tmp_path / "odd.py"
    odd.write_bytes(b"# -*- coding: klingon -*-\nimport torch\n")
    _one_line_error(ddpify("convert", str(odd)), f"{odd}:1: unknown encoding")


def test_full_batch_training_gets_no_per_process_batch_advice(tmp_path: Path) -> None:
    """Every process trains on all of the data (full-batch, replicated): the summary says so and
    does not claim a global batch of batch_size x processes."""
    src = tmp_path / "graph.py"
    src.write_text(
        "import torch\nfeatures = torch.randn(20, 4)\nlabels = torch.randint(0, 2, (20,))\n"
        "model = torch.nn.Linear(4, 2)\nopt = torch.optim.Adam(model.parameters(), lr=0.01)\n"
        "for epoch in range(3):\n    opt.zero_grad()\n"
        "    torch.nn.functional.cross_entropy(model(features), labels).backward()\n    opt.step()\n"
    )
    result = ddpify("convert", str(src), "-o", str(tmp_path / "graph_ddp.py"))
    assert result.returncode == 0, result.stderr
    assert "full-batch training" in result.stdout, result.stdout
    assert "global batch" not in result.stdout and "learning rate" not in result.stdout, result.stdout


def test_latin1_script_keeps_its_encoding(tmp_path: Path) -> None:
    src = tmp_path / "latin.py"
    text = "# -*- coding: latin-1 -*-\n# Modèle à entraîner\n" + FLAT.read_text()
    src.write_bytes(text.encode("latin-1"))
    out = tmp_path / "out.py"
    assert ddpify("convert", str(src), "-o", str(out)).returncode == 0
    assert "# Modèle à entraîner" in out.read_bytes().decode("latin-1")


def test_script_without_model_or_loader(tmp_path: Path) -> None:
    util = tmp_path / "util.py"
    util.write_text("import torch\n\nx = torch.ones(3)\nprint(x.sum())\n")
    _one_line_error(ddpify("convert", str(util)), f"{util}:1: no model to convert")


def test_a_trainer_picked_by_name_at_run_time_is_named_in_the_error(tmp_path: Path) -> None:
    """`globals()[config.agent](config).run()`: what trains is known only at run time, and the
    error says where, instead of only that no optimizer was found."""
    src = tmp_path / "main.py"
    src.write_text(
        "import argparse\nfrom agents import *\n\n"
        "def main():\n    args = argparse.ArgumentParser().parse_args()\n"
        "    agent = globals()[args.agent](args)\n    agent.run()\n\nmain()\n"
    )
    result = ddpify("convert", str(src))
    _one_line_error(result, f"{src}:6: no model to convert: what trains is picked at run time (`globals()[args.agent]`)")


def test_hand_made_batches_convert_with_a_todo_at_the_loop(tmp_path: Path) -> None:
    src = tmp_path / "nodata.py"
    src.write_text(
        "import torch\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for x in [torch.ones(1, 2), torch.zeros(1, 2)]:\n    opt.zero_grad()\n    model(x).sum().backward()\n    opt.step()\n"
    )
    out = tmp_path / "out.py"
    result = ddpify("convert", str(src), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert f"{src}:4: TODO(ddpify): the data is not read through a DataLoader" in result.stdout
    lines = out.read_text().splitlines()
    todo = next(i for i, line in enumerate(lines) if "# TODO(ddpify): the data is not read through a DataLoader" in line)
    assert lines[todo + 1].startswith("for ")
    assert ddpify("convert", str(src), "-o", str(out), "--strict").returncode == 1


CUSTOM_SAMPLER = """\
import torch
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

data = TensorDataset(torch.randn(32, 2), torch.randn(32, 1))
weights = torch.ones(32)
loader = DataLoader(data, batch_size=4, sampler=WeightedRandomSampler(weights, 32))
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
"""


def test_custom_sampler_leaves_a_todo_and_strict_fails(tmp_path: Path) -> None:
    src = tmp_path / "weighted.py"
    src.write_text(CUSTOM_SAMPLER)
    out = tmp_path / "out.py"
    relaxed = ddpify("convert", str(src), "-o", str(out))
    assert relaxed.returncode == 0
    assert f"{src}:6: TODO(ddpify): `loader` has a custom sampler" in relaxed.stdout
    lines = out.read_text().splitlines()
    todo = next(i for i, line in enumerate(lines) if line.startswith("# TODO(ddpify): `loader` has a custom sampler"))
    assert lines[todo + 1].startswith("loader = DataLoader(")
    strict = ddpify("convert", str(src), "-o", str(out), "--strict")
    assert strict.returncode == 1


GPU_OPTIONS = '''\
import argparse
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--gpu", type=int, default=0, help="GPU to train on")
parser.add_argument("-g", "--gpus", dest="device_ids", type=str, default="0,1")
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()
print(vars(args))

model = nn.DataParallel(nn.Linear(4, 1).cuda(args.gpu), device_ids=[int(g) for g in args.device_ids.split(",")])
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=True)
for epoch in range(2):
    for x, y in loader:
        x, y = x.cuda(args.gpu), y.cuda(args.gpu)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
'''


def test_summary_names_the_options_the_conversion_left_without_effect(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(GPU_OPTIONS)
    result = ddpify("convert", str(script), "-o", str(tmp_path / "out.py"))
    assert result.returncode == 0, result.stderr
    notes = [line.strip() for line in result.stdout.splitlines() if ": note: " in line]
    assert notes == [
        f"{script}:7: note: `--gpu` no longer has any effect: LOCAL_RANK now picks each process's GPU"
        " (kept, so existing command lines still parse)",
        f"{script}:8: note: `--gpus` no longer has any effect: LOCAL_RANK now picks each process's GPU"
        " (kept, so existing command lines still parse)",
    ]
    converted = (tmp_path / "out.py").read_text()
    assert "args.gpu" not in converted and "args.device_ids" not in converted and "args.lr" in converted
    # options handed on wholesale cannot be counted: no note rather than a wrong one
    script.write_text(GPU_OPTIONS.replace("print(vars(args))", "print(**vars(args))"))
    assert ": note: " not in ddpify("convert", str(script), "-o", str(tmp_path / "out.py")).stdout


def test_summary_says_a_device_parameter_no_longer_counts(tmp_path: Path) -> None:
    """`def train(epochs=2, device="cuda:1")`: the per-process device takes the parameter's name at
    the top of the function, so a caller's `device=` is ignored; the summary says so, once."""
    script = tmp_path / "train.py"
    script.write_text((ROOT / "fixtures" / "unseen" / "device_default_param" / "train.py").read_text())
    result = ddpify("convert", str(script), "-o", str(tmp_path / "out.py"))
    assert result.returncode == 0, result.stderr
    notes = [line.strip() for line in result.stdout.splitlines() if "parameter of" in line]
    assert notes == [
        f"{script}:7: note: the `device` parameter of `train()` no longer has any effect: each process uses its own"
        " device (`cuda:<local_rank>` or the CPU)"
    ]


@pytest.mark.slow  # nine fresh interpreters, one per hash seed and fixture
@pytest.mark.parametrize("name", ["hand_updates", "transfer_tempdir", "gan_two_models"])
def test_summary_order_does_not_depend_on_hash_seeds(tmp_path: Path, name: str) -> None:
    """Notes on one line come in the order the passes run, whatever the set and dict order."""
    case = ROOT / "fixtures" / "patterns" / f"{name}.in.py"
    summaries = set()
    for seed in ("0", "1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-m", "ddpify", "convert", str(case), "-o", str(tmp_path / f"{seed}.py")],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        summaries.add(result.stdout.replace(seed + ".py", "OUT.py"))
        assert (tmp_path / f"{seed}.py").read_text() == (tmp_path / "0.py").read_text()
    assert len(summaries) == 1, summaries


def test_a_model_wrapped_where_a_trainer_keeps_it_counts_as_wrapped(tmp_path: Path) -> None:
    """`self.net = DDP(model.to(self.gpu), ...)` in a trainer's constructor wraps the `model`
    handed to it: the script is distributed already, and nothing is said to be left to wrap."""
    script = tmp_path / "trainer_ddp.py"
    script.write_text(
        "import os\nimport torch\nimport torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from torch.utils.data.distributed import DistributedSampler\n\n\n"
        "class Trainer:\n"
        "    def __init__(self, model, loader, opt):\n"
        "        self.gpu = int(os.environ['LOCAL_RANK'])\n"
        "        self.net = DDP(model.to(self.gpu), device_ids=[self.gpu])\n"
        "        self.loader, self.opt = loader, opt\n\n"
        "    def run(self, epochs):\n"
        "        for epoch in range(epochs):\n"
        "            self.loader.sampler.set_epoch(epoch)\n"
        "            for x, y in self.loader:\n"
        "                self.opt.zero_grad()\n"
        "                self.net(x).sub(y).pow(2).mean().backward()\n"
        "                self.opt.step()\n\n\n"
        "def main():\n"
        "    dist.init_process_group('nccl')\n"
        "    torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
        "    model = torch.nn.Linear(4, 1)\n"
        "    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))\n"
        "    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))\n"
        "    Trainer(model, loader, torch.optim.SGD(model.parameters(), lr=0.1)).run(2)\n"
        "    dist.destroy_process_group()\n\n\n"
        "main()\n"
    )
    result = ddpify("convert", str(script), "-o", str(tmp_path / "out.py"))
    assert result.returncode == 0 and "already distributed" in result.stderr
    assert "not converted" not in result.stderr, result.stderr


def test_several_scripts_convert_in_one_call_into_a_folder_and_check_against_it(tmp_path: Path) -> None:
    """`ddpify convert a.py b.py -o out/`: each script into the folder, one process; `--check`
    then passes, and fails (exit 1) once one output is stale; a missing script fails alone."""
    sources = []
    for name in ("a.py", "b.py"):
        path = tmp_path / name
        path.write_text(FLAT.read_text())
        sources.append(str(path))
    out = tmp_path / "out"
    result = ddpify("convert", *sources, "-o", f"{out}/")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["a.py", "b.py"]
    assert all("init_process_group" in (out / n).read_text() for n in ("a.py", "b.py"))
    assert ddpify("convert", *sources, "-o", f"{out}/", "--check").returncode == 0
    (out / "b.py").write_text((out / "b.py").read_text() + "# edited\n")
    stale = ddpify("convert", *sources, "-o", f"{out}/", "--check")
    assert stale.returncode == 1 and "b.py" in stale.stdout + stale.stderr
    missing = ddpify("convert", sources[0], str(tmp_path / "gone.py"), "-o", f"{tmp_path / 'out2'}/")
    assert missing.returncode == 1 and "gone.py" in missing.stderr
    assert (tmp_path / "out2" / "a.py").exists()  # the other script still converted


@pytest.mark.parametrize(
    "args, message",
    [
        (["-o", "one.py"], "several scripts go to a folder"),
        ([], "several scripts: pass -o DIR/, --in-place or --diff"),
        (["--run"], "--run converts one script at a time"),
    ],
)
def test_several_scripts_need_a_folder_in_place_or_diff(tmp_path: Path, args: list[str], message: str) -> None:
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text(FLAT.read_text())
    result = ddpify("convert", str(tmp_path / "a.py"), str(tmp_path / "b.py"), *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
