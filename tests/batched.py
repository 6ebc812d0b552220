"""Many test cases in one launch: torchrun (or python) starts once, the cases run one after the other.

Each torchrun launch costs 10-15 s of process start-up on a 2-core machine (the agent and every
rank import torch), more than most cases take to train. run_cases() puts every case's runs in
one plan (ddpify/verify/tracer.py runs a plan's scripts one after the other in the same
processes, each with a rendezvous of its own, as `ddpify verify` does) and hands back, for each
case, a conftest.Launch of its own runs only, with the labels its tests know:

* its traces and parameter files (moved into the case's folder: ``launch.cwd``), each run's
  working folder ``launch.cwd / <label>`` (or the case's own ``cwd``);
* ``returncode``: 0 when every run of the case finished with status 0 on every rank, else the
  first non-zero status (or the launch's, when a rank left no trace);
* ``stdout``: what the case's runs printed, every rank, in plan order (from the traces; the
  batch checks that the traces hold every character the launch printed: ``unattributed``);
* the replica check of conftest.Launch on the first read of each multi-rank run.

One case cannot hide another's results: the plan runs with --keep-going and a timeout per run,
so a run that fails or hangs fails its own case; when a process dies (a crash, a hang stopped
at its timeout), the cases it had not finished run again in a new launch, without the case that
was running when it died. That case then gets a launch of its own (what an earlier case left in
the processes, such as a thread a forked DataLoader worker inherits, must not fail it); if it
dies there too, it is ``lost``: its tests report the missing traces and the launches' logs.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from conftest import Launch, run_plan

RUN_TIMEOUT_S = 150  # per run of a batched plan: a hang stops its process after this long
ROUNDS = 8  # launches at most: each one after a dead process drops the case that was running


def safe(key: str) -> str:
    """A case's name as a folder and label prefix (``examples/mnist`` -> ``examples_mnist``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", key)


@dataclass
class Batch:
    """The cases of a batched launch: ``batch[key]`` is the case's Launch."""

    cases: dict[str, Launch]
    launches: list[Launch]  # the launches made (more than one after a process died)
    lost: dict[str, str] = field(default_factory=dict)  # key -> why its runs are incomplete
    unattributed: list[str] = field(default_factory=list)  # per launch: what it printed that no trace holds

    labels: dict[str, str] = field(default_factory=dict)  # run label -> its case (labels unique across cases)

    def __getitem__(self, key: str) -> Launch:
        return self.cases[key]

    def log(self) -> str:
        return "\n".join(launch.log() for launch in self.launches)


@dataclass
class ByLabel:
    """A batch read as one launch, by run label (a plan whose labels are unique across its cases):
    trace/params/check_replicas go to the label's case; stdout and stderr are the launches' own."""

    batch: Batch
    cwd: Path  # where the runs' working folders are (they were given absolute cwds)

    def case(self, label: str) -> Launch:
        assert label in self.batch.labels, f"no run {label!r} in the batch"
        return self.batch[self.batch.labels[label]]

    def trace(self, label: str, rank: int) -> dict:
        return self.case(label).trace(label, rank)

    def params(self, label: str, rank: int):
        return self.case(label).params(label, rank)

    def check_replicas(self, label: str) -> None:
        self.case(label).check_replicas(label)

    @property
    def stdout(self) -> str:
        return "".join(launch.stdout for launch in self.batch.launches)

    @property
    def stderr(self) -> str:
        return "".join(launch.stderr for launch in self.batch.launches)

    def log(self) -> str:
        return self.batch.log()


def run_cases(
    cases: dict[str, list[dict]], workdir: Path, nproc: int | None, ranks: int | None = None, alone: tuple = ()
) -> Batch:
    """Run every case's plan entries (conftest.run_plan's form) in as few launches as it takes.

    cases: key -> that case's runs, in order; labels need only be unique within a case. A run's
    "cwd" is taken under the case's folder (default: its label; an absolute one is kept). Every
    run gets a "timeout" (RUN_TIMEOUT_S unless it has one). alone: keys of cases that get a
    launch of their own (say why where you name them: what an earlier case leaves in the
    processes breaks them).
    """
    ranks = ranks or nproc or 1
    batch = Batch({}, [])
    groups = [({key: cases[key]}, workdir / f"alone-{safe(key)}") for key in alone]
    groups.append(({key: runs for key, runs in cases.items() if key not in alone}, workdir))
    retry: list[str] = []
    for group, work in groups:
        if group:
            _rounds(group, work, nproc, ranks, batch, retry)
    for key in retry:  # died in the batch: a launch of its own, as the script would run for real
        why = batch.lost.pop(key)
        _rounds({key: cases[key]}, workdir / f"alone-{safe(key)}", nproc, ranks, batch, [])
        if key in batch.lost:
            _lost(batch, key, "it died in the batch too")
        else:  # shown in pytest's warnings summary: a case that needs alone=, or an intermittent crash
            warnings.warn(f"tests/batched.py: case {key!r} died in a batched launch ({why}) and passed in a launch of its own")
    batch.cases = {key: batch.cases[key] for key in cases}  # the caller's order
    labels = {run["label"]: key for key, runs in cases.items() for run in runs}
    if len(labels) == sum(len(runs) for runs in cases.values()):  # else: a label in several cases, read by case
        batch.labels = labels
    return batch


def _rounds(cases: dict[str, list[dict]], workdir: Path, nproc: int | None, ranks: int, batch: Batch, retry: list) -> None:
    """Launch the cases, again without the case a dead process was running (added to retry when
    it was not alone), until every case has run (or ROUNDS launches); add what happened to batch."""
    pending = list(cases)
    for round_ in range(ROUNDS):
        work = workdir if round_ == 0 else workdir / f"again{round_}"
        plan = []
        for key in pending:
            plan += [_entry(run, safe(key)) for run in cases[key]]
        limit = 120 + sum(run["timeout"] for run in plan)
        done = threading.Event()
        reaper = threading.Thread(target=_reap_orphans, args=(work, done), daemon=True)
        reaper.start()
        try:
            launch = run_plan(plan, work, nproc, ranks=ranks, keep_going=True, limit_s=limit)
        finally:
            done.set()
            reaper.join()
        batch.launches.append(launch)
        printed = "".join(t["stdout"] for t in launch.traces.values())
        printed = printed.replace("\r\n", "\n").replace("\r", "\n")  # as the launch's text-mode pipe reads it
        missing = Counter(launch.stdout) - Counter(printed)
        batch.unattributed.append("".join(sorted(missing.elements())))
        incomplete = []
        for key in pending:
            batch.cases[key] = _case(launch, key, cases[key], work, ranks)
            if not _complete(batch.cases[key], cases[key], ranks):
                incomplete.append(key)
        if not incomplete:
            return
        culprit, *pending = incomplete
        _lost(batch, culprit, f"a process of the launch died while running it (exit {launch.returncode}"
              f"{', TIMED OUT' if launch.timed_out else ''})")  # fmt: skip
        if len(plan) > len(cases[culprit]):
            retry.append(culprit)
        if not pending:
            return
    for key in pending:  # rounds exhausted: what is left keeps its incomplete traces
        _lost(batch, key, "not run to the end: too many processes died in this batch")


def _lost(batch: Batch, key: str, why: str) -> None:
    batch.lost[key] = why
    batch.cases[key].stderr = f"[batch] case {key!r}: {why}\n{batch.cases[key].stderr}"


def _reap_orphans(work: Path, done: threading.Event) -> None:
    """While the launch runs: SIGKILL what a dead rank left behind (a DataLoader worker stuck in a
    lock it inherited keeps the launch's stdout open, so the launch would wait for its limit).

    A rank's leftovers are the processes of its session (torchrun starts each rank in a session
    of its own, the launcher starts plain python in one) that run this launch's plan."""
    plan = str(work / "plan.json")
    while not done.wait(2):
        ranks = set()
        for path in work.glob("pid-*"):
            try:
                ranks.add(int(path.read_text()))
            except (OSError, ValueError):
                continue
        dead = {pid for pid in ranks if _state(pid) in (None, "Z")}
        if not dead:
            continue
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            pid = int(stat.parent.name)
            if int(fields[3]) in dead and pid not in ranks and plan in cmdline:  # fields[3]: the session
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


def _state(pid: int) -> str | None:
    """A process's state letter (Z: exited, not reaped yet), None when there is none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _entry(run: dict, prefix: str) -> dict:
    """A case's run as an entry of the batch's plan: its label, and the labels it names
    (only_if_ok, only_if_failed, reference.train_loader_from, resume.after), prefixed by the case's name."""
    entry = dict(
        run,
        label=f"{prefix}.{run['label']}",
        cwd=str(Path(prefix) / run.get("cwd", run["label"])),  # an absolute cwd stays
        timeout=run.get("timeout", RUN_TIMEOUT_S),
    )
    for name in ("only_if_ok", "only_if_failed"):
        if run.get(name):
            entry[name] = f"{prefix}.{run[name]}"
    if run.get("resume"):
        entry["resume"] = dict(run["resume"], after=f"{prefix}.{run['resume']['after']}")
    if (run.get("reference") or {}).get("train_loader_from"):
        entry["reference"] = dict(run["reference"], train_loader_from=f"{prefix}.{run['reference']['train_loader_from']}")
    return entry


# A DataLoader worker forked from a process that ran earlier cases can crash on what they left
# in it (a thread of torch.compile's): the rank then raises this, which its own script never did.
INHERITED_CRASH = re.compile(r"DataLoader worker \(pid\(?s?\)? [\d, ]+\) (is killed by signal|exited unexpectedly)")


def _complete(case: Launch, runs: list[dict], ranks: int) -> bool:
    """Every run of the case that was to run left its traces (only_if_ok / only_if_failed: a run
    that waits on an earlier one is to run when that one's trace says so), and none of them
    failed by a crash of a forked DataLoader worker (INHERITED_CRASH)."""
    if any(INHERITED_CRASH.search(t.get("error") or "") for t in case.traces.values()):
        return False
    for run in runs:
        for rank in range(ranks):
            after = case.traces.get((run.get("only_if_ok") or run.get("only_if_failed"), rank))
            if run.get("only_if_ok") and not (after and after["exit_code"] == 0):
                continue
            if run.get("only_if_failed") and not (after and after["exit_code"] != 0):
                continue
            if (run["label"], rank) not in case.traces:
                return False
    return True


def _case(launch: Launch, key: str, runs: list[dict], work: Path, ranks: int) -> Launch:
    """The case's own Launch: its files moved into work/<key>/ under their plain labels."""
    folder = work / safe(key)
    folder.mkdir(parents=True, exist_ok=True)
    traces, stacks = {}, {}
    codes = []
    for run in runs:
        label, prefixed = run["label"], f"{safe(key)}.{run['label']}"
        for rank in [*range(ranks), "launcher"]:
            for kind in ("trace", "params", "stacks", "pid"):
                suffix = {"trace": "json", "params": "pt", "stacks": "txt", "pid": ""}[kind]
                name = f"{kind}-{{}}-{rank}{'.' + suffix if suffix else ''}"
                source = work / name.format(prefixed)
                if source.exists():
                    source.replace(folder / name.format(label))
        for rank in range(ranks):
            if (prefixed, rank) in launch.traces:
                traces[(label, rank)] = launch.traces[(prefixed, rank)]
                codes.append(traces[(label, rank)]["exit_code"])
            else:
                codes.append(launch.returncode or 1)
            if (prefixed, rank) in launch.stacks:
                stacks[(label, rank)] = launch.stacks[(prefixed, rank)]
    stdout = "".join(traces[(run["label"], r)]["stdout"] for run in runs for r in range(ranks) if (run["label"], r) in traces)
    returncode = next((code for code in codes if code), 0)
    case = Launch(
        launch.cmd, folder, returncode, stdout, launch.stderr, launch.seconds,
        launch.timed_out and returncode != 0, traces=traces, stacks=stacks, ranks=ranks,
    )  # fmt: skip
    case.may_diverge = {run["label"]: run["diverges"] for run in runs if run.get("diverges")}
    return case


# --- `ddpify verify` over many scripts, its launches shared ---------------------------------------


def verify_all(jobs: dict[str, tuple], workdir: Path) -> dict[str, object]:
    """Run ``ddpify.verify.session.verify(original, converted, options)`` for every job, as the
    product runs it, with the launches of all jobs shared: key -> (original, converted, options,
    env) gives key -> its Verification, or the exception verify raised.

    Each verify() runs in a thread of its own, one at a time (one lock: only one thread runs
    Python code, the others wait), unchanged but for its launcher: its calls of
    ddpify.verify.session.run_plan wait until every unfinished verify() has made the same call,
    and then one run_cases() launch runs all their plans (each job a case). Each verify() gets back a Launch of its own runs, its traces and parameter files in the
    folder it asked for, and judges them itself. env: the job's environment, given to each of its
    runs (the plan entries' env) instead of the process's.
    """
    from ddpify.verify import session
    from ddpify.verify.launch import Launch as ProductLaunch

    lock = threading.Condition()
    local = threading.local()
    state = {"alive": len(jobs), "waiting": {}, "answers": {}, "launches": 0}
    results: dict[str, object] = {}

    def shared_run_plan(plan, traces, nproc, *, python, limit_s, ranks=None, env=None, keep_going=False):
        key = local.key
        assert python == sys.executable and keep_going, "verify_all runs what verify runs: sys.executable, --keep-going"
        state["waiting"][key] = (plan, Path(traces), nproc)
        launch_if_all_wait()
        while key not in state["answers"]:
            lock.wait()
        answer = state["answers"].pop(key)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def launch_if_all_wait():
        waiting = state["waiting"]
        if not waiting or len(waiting) < state["alive"]:
            return
        state["waiting"] = {}
        for nproc in {nproc for _, _, nproc in waiting.values()}:
            group = {key: w for key, w in waiting.items() if w[2] == nproc}
            state["launches"] += 1
            kind = "torchrun" if nproc else "python"
            cases = {key: [dict(run, env={**jobs[key][3], **run.get("env", {})}) for run in plan]
                     for key, (plan, _, _) in group.items()}  # fmt: skip
            try:
                batch = run_cases(cases, workdir / f"{state['launches']}-{kind}", nproc)
            except BaseException as exc:  # noqa: BLE001 - every verify() waiting on it raises it
                state["answers"].update((key, exc) for key in group)
                continue
            for key, (plan, traces, _) in group.items():
                case = batch[key]
                traces.mkdir(parents=True, exist_ok=True)
                for path in case.cwd.iterdir():
                    if path.is_file():
                        path.replace(traces / path.name)
                state["answers"][key] = ProductLaunch(
                    case.cmd, traces, case.returncode, case.stdout, case.stderr, case.seconds, case.timed_out,
                    traces=case.traces, stacks=case.stacks, ranks=case.ranks,
                )  # fmt: skip
        lock.notify_all()

    def job(key):
        local.key = key
        original, converted, options, _ = jobs[key]
        with lock:
            try:
                results[key] = session.verify(original, converted, options)
            except BaseException as exc:  # noqa: BLE001 - the test of this job reports it
                results[key] = exc
            finally:
                state["alive"] -= 1
                launch_if_all_wait()

    real = session.run_plan
    session.run_plan = shared_run_plan
    try:
        threads = [threading.Thread(target=job, args=(key,), name=f"verify {key}") for key in jobs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        session.run_plan = real
    return results
