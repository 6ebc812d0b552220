"""The pre-commit hook for real: a throw-away repo uses this checkout's committed HEAD as hook repo."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
