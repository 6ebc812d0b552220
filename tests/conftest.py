"""Shared test options and helpers: golden updates, and running scripts under python / torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACE_RUN = ROOT / "tests" / "harness" / "trace_run.py"

# Every launched command gets a wall-clock limit; a hang fails the test instead of the suite.
PYTHON_TIMEOUT_S = 180
TORCHRUN_TIMEOUT_S = 300
NPROC = 2


def pytest_addoption(parser):
    parser.addoption(
        "--update-goldens",
        action="store_true",
        default=False,
        help="rewrite fixtures/convert/*.out.py and examples/*_ddp.py from the converter's output",
    )


@pytest.fixture(scope="session")
def update_goldens(request) -> bool:
    return request.config.getoption("--update-goldens")


@dataclass
class Launch:
    """One finished command: what ran, its status and output, and where its traces are."""

    cmd: list[str]
    cwd: Path
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    traces: dict = field(default_factory=dict)  # label -> {rank: trace dict}

    def log(self) -> str:
        """The whole story, for failure messages."""
        return (
            f"$ (cd {self.cwd} && {' '.join(self.cmd)})\n"
            f"exit {self.returncode}{' (TIMED OUT)' if self.timed_out else ''} after {self.seconds:.1f}s\n"
            f"----- stdout -----\n{self.stdout}\n----- stderr -----\n{self.stderr[-12000:]}"
        )

    def params(self, label: str, rank: int):
        import torch

        return torch.load(self.cwd / f"params-{label}-{rank}.pt")

    def trace(self, label: str, rank: int) -> dict:
        assert (label, rank) in self.traces, f"no trace for run {label!r} rank {rank}\n{self.log()}"
        return self.traces[(label, rank)]


def _descendants(pid: int) -> list[int]:
    """Every process below pid (from /proc), deepest first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        found.append(child)
        stack.extend(children.get(child, []))
    return found[::-1]


def run_plan(plan: list[dict], workdir: Path, nproc: int | None) -> Launch:
    """Run tests/harness/trace_run.py over a plan, under torchrun with nproc processes or plain python (None).

    Each plan entry is {"label", "script", "args", "env", "cwd"}; a relative cwd is taken under workdir.
    Traces land in workdir. Never raises on failure: the caller asserts on the Launch.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    plan = [dict(run, cwd=str(workdir / run.get("cwd", run["label"]))) for run in plan]
    plan_file = workdir / "plan.json"
    plan_file.write_text(json.dumps(plan, indent=1))
    if nproc is None:
        cmd = [sys.executable, str(TRACE_RUN), "--plan", str(plan_file)]
        limit = PYTHON_TIMEOUT_S
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--standalone", f"--nproc-per-node={nproc}",
            str(TRACE_RUN), "--plan", str(plan_file),
        ]  # fmt: skip
        limit = TORCHRUN_TIMEOUT_S
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DDPIFY_TRACE_DIR=str(workdir), CUDA_VISIBLE_DEVICES="")
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        # torchrun starts its workers in sessions of their own: find them before killing the agent
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stdout, stderr = proc.communicate()
    launch = Launch(cmd, workdir, proc.returncode, stdout, stderr, time.monotonic() - start, timed_out)
    for run in plan:
        for rank in range(nproc or 1):
            path = workdir / f"trace-{run['label']}-{rank}.json"
            if path.exists():
                launch.traces[(run["label"], rank)] = json.loads(path.read_text())
    return launch
