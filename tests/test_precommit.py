"""The pre-commit hook for real: a throw-away repo uses this checkout's committed HEAD as hook repo."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

BAD = textwrap.dedent(
    """\
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP


    def main(net):
        dist.init_process_group("gloo")
        model = DDP(net)
        torch.save(model.state_dict(), f"model_rank{dist.get_rank()}.pt")
        dist.destroy_process_group()
    """
)


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def hook_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One pre-commit cache for the module: the hook's environment is built once."""
    return tmp_path_factory.mktemp("pre-commit-home")


def new_repo(tmp_path: Path, hooks: str) -> Path:
    """A throw-away git repo whose pre-commit config uses this checkout's HEAD as hook repo."""
    repo = tmp_path / "project"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "t")
    rev = git(ROOT, "rev-parse", "HEAD")
    (repo / ".pre-commit-config.yaml").write_text(f"repos:\n  - repo: {ROOT}\n    rev: {rev}\n    hooks:\n{hooks}")
    return repo


def run_hooks(repo: Path, home: Path) -> subprocess.CompletedProcess:
    git(repo, "add", ".")
    env = {**os.environ, "PRE_COMMIT_HOME": str(home), "PRE_COMMIT_COLOR": "never"}
    env.pop("VIRTUAL_ENV", None)
    cmd = [sys.executable, "-m", "pre_commit", "run", "--all-files"]
    return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)


def test_convert_check_hook_keeps_the_converted_script_up_to_date(tmp_path: Path, hook_home: Path) -> None:
    hooks = "      - id: ddpify-convert-check\n        args: [train.py, -o, train_ddp.py]\n"
    repo = new_repo(tmp_path, hooks)
    source = (ROOT / "examples" / "mnist_convnet.py").read_text()
    (repo / "train.py").write_text(source)
    missing = run_hooks(repo, hook_home)
    assert missing.returncode == 1 and "would write train_ddp.py" in missing.stdout + missing.stderr, missing.stdout
    assert not (repo / "train_ddp.py").exists()  # --check writes nothing

    converted = subprocess.run(
        [sys.executable, "-m", "ddpify", "convert", "train.py", "-o", "train_ddp.py"], cwd=repo, capture_output=True, text=True
    )
    assert converted.returncode == 0, converted.stderr
    fresh = run_hooks(repo, hook_home)
    assert fresh.returncode == 0 and "Passed" in fresh.stdout, fresh.stdout + fresh.stderr

    (repo / "train.py").write_text(source.replace("args.lr)", "0.5 * args.lr)"))  # the source moved on, the copy did not
    stale = run_hooks(repo, hook_home)
    out = stale.stdout + stale.stderr
    assert stale.returncode == 1 and "would rewrite train_ddp.py" in out, out
    assert "+++ train_ddp.py" in out and "0.5 * args.lr" in out


def test_precommit_hook_fails_then_passes(tmp_path):
    rev = git(ROOT, "rev-parse", "HEAD")
    repo = tmp_path / "project"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "t")
    (repo / ".pre-commit-config.yaml").write_text(
        f"repos:\n  - repo: {ROOT}\n    rev: {rev}\n    hooks:\n      - id: ddpify-check\n"
    )
    script = repo / "train.py"
    script.write_text(BAD)
    git(repo, "add", ".")
    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"), "PRE_COMMIT_COLOR": "never"}
    env.pop("VIRTUAL_ENV", None)
    cmd = [sys.executable, "-m", "pre_commit", "run", "--all-files"]

    failed = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    out = failed.stdout + failed.stderr
    assert failed.returncode == 1, out
    assert "train.py:9:16: DDP120" in out, out

    script.write_text(BAD.replace("model.state_dict()", "model.module.state_dict()"))
    git(repo, "add", ".")
    passed = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "ddpify check" in passed.stdout and "Passed" in passed.stdout
