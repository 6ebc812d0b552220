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
was running when it died (that one's tests report the missing traces and the launch's log).
"""

from __future__ import annotations

import re
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

    def __getitem__(self, key: str) -> Launch:
        return self.cases[key]

    def log(self) -> str:
        return "\n".join(launch.log() for launch in self.launches)


def run_cases(cases: dict[str, list[dict]], workdir: Path, nproc: int | None, ranks: int | None = None) -> Batch:
    """Run every case's plan entries (conftest.run_plan's form) in as few launches as it takes.

    cases: key -> that case's runs, in order; labels need only be unique within a case. A run's
    "cwd" is taken under the case's folder (default: its label). Every run gets a "timeout"
    (RUN_TIMEOUT_S unless it has one).
    """
    ranks = ranks or nproc or 1
    pending = list(cases)
    found: dict[str, Launch] = {}
    lost: dict[str, str] = {}
    launches: list[Launch] = []
    unattributed: list[str] = []
    for round_ in range(ROUNDS):
        if not pending:
            break
        work = workdir if round_ == 0 else workdir / f"again{round_}"
        plan = []
        for key in pending:
            for run in cases[key]:
                plan.append(
                    dict(
                        run,
                        label=f"{safe(key)}.{run['label']}",
                        cwd=f"{safe(key)}/{run.get('cwd', run['label'])}",
                        timeout=run.get("timeout", RUN_TIMEOUT_S),
                    )
                )
        limit = 120 + sum(run["timeout"] for run in plan)
        launch = run_plan(plan, work, nproc, ranks=ranks, keep_going=True, limit_s=limit)
        launches.append(launch)
        printed = "".join(t["stdout"] for t in launch.traces.values())
        printed = printed.replace("\r\n", "\n").replace("\r", "\n")  # as the launch's text-mode pipe reads it
        missing = Counter(launch.stdout) - Counter(printed)
        unattributed.append("".join(sorted(missing.elements())))
        incomplete = []
        for key in pending:
            found[key] = _case(launch, key, cases[key], work, ranks)
            if not _complete(found[key], cases[key], ranks):
                incomplete.append(key)
        if not incomplete:
            pending = []
            break
        culprit, *pending = incomplete
        lost[culprit] = (
            f"a process of the launch died while running it (exit {launch.returncode}"
            f"{', TIMED OUT' if launch.timed_out else ''}): the cases after it ran again in a new launch"
        )
    for key in pending:  # rounds exhausted: what is left keeps its incomplete traces
        lost.setdefault(key, "not run to the end: too many processes died in this batch")
    for key, why in lost.items():
        found[key].stderr = f"[batch] case {key!r}: {why}\n{found[key].stderr}"
    return Batch(found, launches, lost, unattributed)


def _complete(case: Launch, runs: list[dict], ranks: int) -> bool:
    return all((run["label"], rank) in case.traces for run in runs for rank in range(ranks))


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
