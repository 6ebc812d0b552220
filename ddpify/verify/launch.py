"""Start the tracer over a plan of runs, under torchrun or as one process, and stop it if it hangs.

Used by `ddpify verify` and by the test suite. Nothing here imports torch: the runs are
subprocesses of the Python that has it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

TRACER = Path(__file__).resolve().parent / "tracer.py"
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


@dataclass
class Launch:
    """One finished launch: what ran, its status and output, its traces and the stacks of a hang."""

    cmd: list[str]
    cwd: Path
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    traces: dict = field(default_factory=dict)  # (label, rank) -> trace dict
    stacks: dict = field(default_factory=dict)  # (label, rank) -> the stacks faulthandler wrote
    ranks: int = 1

    def log(self) -> str:
        """The whole story, for failure messages."""
        return (
            f"$ (cd {self.cwd} && {' '.join(self.cmd)})\n"
            f"exit {self.returncode}{' (TIMED OUT)' if self.timed_out else ''} after {self.seconds:.1f}s\n"
            f"----- stdout -----\n{self.stdout}\n----- stderr -----\n{self.stderr[-12000:]}"
        )


def run_plan(
    plan: list[dict], workdir: Path, nproc: int | None, *, python: str, limit_s: float, ranks: int | None = None,
    env: dict | None = None, keep_going: bool = False,
) -> Launch:  # fmt: skip
    """Run the tracer over `plan` (written to workdir/plan.json), under torchrun with nproc processes
    or as one process (None); traces land in workdir. Past limit_s every process of the launch gets
    SIGTERM (the tracer writes its stacks), then SIGKILL. Never raises on the script's failure."""
    workdir.mkdir(parents=True, exist_ok=True)
    plan_file = workdir / "plan.json"
    plan_file.write_text(json.dumps(plan, indent=1))
    cmd = [python, str(TRACER), "--plan", str(plan_file), *(["--keep-going"] if keep_going else [])]
    if nproc is not None:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    run_env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    run_env.update(PYTHONUNBUFFERED="1", DDPIFY_TRACE_DIR=str(workdir), **(env or {}))
    start = time.monotonic()
    timed_out = False
    out_file, err_file = workdir / "launch-stdout.txt", workdir / "launch-stderr.txt"
    # files, not pipes: a process the launch leaves behind (a DataLoader worker of a rank that
    # died) would hold a pipe open, and reading it to its end would wait for that process
    with open(out_file, "w") as out, open(err_file, "w") as err:
        proc = subprocess.Popen(cmd, cwd=workdir, env=run_env, stdout=out, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop(proc, workdir)
            proc.wait()
    _signal_group(proc.pid, signal.SIGKILL)  # what is left of the launch once torchrun is gone
    stdout, stderr = out_file.read_text(errors="replace"), err_file.read_text(errors="replace")
    ranks = ranks or nproc or 1
    launch = Launch(cmd, workdir, proc.returncode, stdout, stderr, time.monotonic() - start, timed_out, ranks=ranks)
    for run in plan:
        for rank in range(ranks):
            tag = f"{run['label']}-{rank}"
            trace, stacks = workdir / f"trace-{tag}.json", workdir / f"stacks-{tag}.txt"
            if trace.exists():
                launch.traces[(run["label"], rank)] = json.loads(trace.read_text())
            if stacks.exists() and stacks.stat().st_size:
                launch.stacks[(run["label"], rank)] = stacks.read_text(errors="replace")
    return launch


def stop(proc: subprocess.Popen, workdir: Path) -> None:
    """SIGTERM every process of the launch (the tracer dumps its stacks on it), then SIGKILL."""
    pids = [*_traced_pids(workdir), *descendants(proc.pid), proc.pid]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        _signal_group(proc.pid, sig)  # processes whose parent died first are no one's descendants
        if sig == signal.SIGTERM:
            time.sleep(2)


def _signal_group(leader: int, sig: int) -> None:
    """Send sig to every process of the launch's process group (`start_new_session`), if any is left."""
    try:
        os.killpg(leader, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _traced_pids(workdir: Path) -> list[int]:
    pids = []
    for path in workdir.glob("pid-*"):
        try:
            pids.append(int(path.read_text()))
        except (OSError, ValueError):
            continue
    return pids


def descendants(pid: int) -> list[int]:
    """Every process below pid (from /proc where there is one), deepest first."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for entry in proc.iterdir():
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
