"""The examples as a user runs them: `python examples/<name>.py` and `python examples/<name>_ddp.py`, no harness.

Their torchrun behaviour is covered by test_integration.py (cases "examples/mnist" and
"examples/mnist_convnet"); their conversions by test_golden.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import PYTHON_TIMEOUT_S, ROOT

EXAMPLES = {
    # name: (small-run arguments, once-per-run message, checkpoint, arguments that ask for real MNIST)
    "mnist": (
        ["--epochs", "1", "--train-size", "128", "--test-size", "64", "--save-model"],
        "Final test accuracy:",
        "digit_net.pt",
        ["--data-dir", "{empty}"],
    ),
    "mnist_convnet": (
        ["--epochs", "1", "--train-size", "128", "-b", "32"],
        "trained in ",
        "convnet.ckpt",
        ["--real-data", "--data-dir", "{empty}"],
    ),
}


def python(script, args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=PYTHON_TIMEOUT_S
    )


@pytest.mark.parametrize("name", sorted(EXAMPLES))
@pytest.mark.parametrize("variant", ["", "_ddp"])
def test_example_runs_offline_with_python(name, variant, tmp_path):
    args, once, checkpoint, _ = EXAMPLES[name]
    script = ROOT / "examples" / f"{name}{variant}.py"
    assert script.exists(), f"{script} missing (converted examples come from pytest --update-goldens)"
    proc = python(script, args, tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.count(once) == 1, proc.stdout
    import torch  # here, not at the top: collecting this module (also for -m "not slow") then costs no torch import

    state = torch.load(tmp_path / checkpoint, map_location="cpu", weights_only=True)
    assert state and not any(k.startswith("module.") for k in state)
    assert not (tmp_path / "data").exists(), "synthetic runs must not create or download a dataset"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_real_data_is_never_downloaded(name, tmp_path):
    *_, real = EXAMPLES[name]
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = python(ROOT / "examples" / f"{name}.py", [a.format(empty=empty) for a in real], tmp_path)
    assert proc.returncode != 0
    assert "MNIST" in proc.stderr and str(empty) in proc.stderr, proc.stderr  # a clear message naming the folder
    assert "Traceback" not in proc.stderr
    assert not any(p.is_file() for p in empty.rglob("*")), "nothing may be downloaded"
