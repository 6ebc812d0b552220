"""`ddpify verify`: convert (or take) a DDP script, run it and the original briefly, judge the invariants.

Runs, each in its own copy of the working folder (launch.py, workspace.py):
* one process (plain python): the original as written (``original``), the original seeded and
  unshuffled with the training batch times N (``reference``), and the converted script
  (``plain``; ``plain-reference`` stands in for the reference when the original cannot run here);
* torchrun with N processes: the converted script as written (``ddp``), and seeded and
  unshuffled (``ordered``, compared with ``reference``), and, when the converted script has
  resume code (resume.py), once more in the ``ddp`` run's folder, taking that code (``resume``).
Every run stops itself after K optimizer steps per epoch and two epochs (tracer.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from ddpify.analysis.run_facts import RunFacts
from ddpify.verify.invariants import FAIL, Result, Runs, check_all, stack_summary
from ddpify.verify.launch import Launch, run_plan
from ddpify.verify.resume import ResumePlan, resume_plan
from ddpify.verify.workspace import link_parent, stage

PROBE = "import json, torch; print(json.dumps({'torch': torch.__version__, 'gpus': torch.cuda.device_count()}))"
LABELS = ("original", "reference", "plain", "plain-reference", "ddp", "ordered")
STARTUP_S = 120  # torchrun's start and the interpreters' imports, on top of the runs' own limits


class VerifyError(Exception):
    """Verification cannot run (usage, environment, or an original that fails on its own): exit 2;
    `refused`: the conversion itself refused the script (exit 1, as `convert` does)."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


@dataclass
class VerifyOptions:
    nproc: int = 2
    steps: int = 4
    epochs: int = 2
    timeout: float = 120.0  # seconds per run
    device: str = "auto"  # "cpu": never the GPUs
    python: str = sys.executable
    args: list[str] = field(default_factory=list)
    convert_options: object = None  # ddpify.results.ConvertOptions for the in-memory conversion
    keep: Path | None = None  # keep the runs' folders and traces here


@dataclass
class Verification:
    script: str
    converted: str  # what was verified: "converted in memory", a path, or "as written"
    device: str
    options: VerifyOptions
    results: list[Result]
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if r.status == FAIL]

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0


@dataclass
class Observation:
    """The original's runs as one process (as written, and the seeded reference at N x the batch),
    made before converting: `convert --run` reads facts from them, and `verify` reuses them."""

    source: Path
    root: Path
    gpus: int
    env: dict
    work: Path
    launch: Launch
    seconds: float

    @property
    def trace(self) -> dict:
        return self.launch.traces[("original", 0)]

    def facts(self) -> RunFacts:
        cwd = Path(self.launch.traces[("original", 0)]["cwd"]).relative_to(self.work / "original")
        return RunFacts.from_trace(self.trace, str(self.source.relative_to(self.root)), str(cwd))

    def discard(self, options: VerifyOptions) -> None:
        if options.keep is None:
            shutil.rmtree(self.work, ignore_errors=True)


def observe(original: Path, options: VerifyOptions | None = None) -> Observation:
    """Run the original briefly as one process, in a copy of its folder; VerifyError (with its
    traceback, or where it stood at the timeout) when it fails on its own."""
    options = options or VerifyOptions()
    start = time.monotonic()
    if not original.is_file():
        raise VerifyError(f"{original}: no such file")
    gpus = _probe(options.python)
    source = original.resolve()
    root = run_root(source)
    on_gpus = options.device != "cpu" and gpus >= options.nproc
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if not on_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    work = Path(tempfile.mkdtemp(prefix="ddpify-verify-")) if options.keep is None else options.keep
    work.mkdir(parents=True, exist_ok=True)
    folders = {label: work / label for label in LABELS}
    for label in ("original", "reference"):
        shutil.rmtree(folders[label], ignore_errors=True)
        stage(root, folders[label], {}, None, work.resolve())
    link_parent(root, work, {*LABELS, "traces"})
    scaled = {"seed": 0, "batch_scale": options.nproc}
    launch = run_plan(
        [
            _entry(options, root, folders, "original", source),
            _entry(options, root, folders, "reference", source, reference={**scaled, "train_loader_from": "original"},
                   only_if_ok="original"),
        ],
        work / "traces", None, python=options.python, limit_s=2 * options.timeout + STARTUP_S, env=env, keep_going=True,
    )  # fmt: skip
    observation = Observation(source, root, gpus, env, work, launch, time.monotonic() - start)
    trace = launch.traces.get(("original", 0))
    if trace is None or trace["exit_code"] != 0:
        observation.discard(options)
        raise VerifyError(_why_failed(source, trace, launch, options))
    return observation


def run_root(source: Path) -> Path:
    """The folder the runs copy: the one the user runs from (the script's, when it lies outside
    it), widened to hold the folders the script puts on sys.path itself (`sys.path.append(ROOT)`
    of an entry in `src/` that imports `utils/`)."""
    from ddpify.analysis.project import project_root
    from ddpify.analysis.sys_path import added_folders, python_path_roots
    from ddpify.engine import parse
    from ddpify.files import read_source

    root = Path.cwd().resolve()
    if root not in source.parents:
        root = source.parent
    try:
        folders = added_folders(parse(read_source(source)[0], str(source)), source)
    except Exception:  # noqa: BLE001 - a script that does not parse fails in its own run, with its own message
        folders = []
    folders += python_path_roots(source, project_root(source))  # `cd pkg && PYTHONPATH=.. python train.py`
    for folder in folders:
        if root not in (folder, *folder.parents):
            root = Path(os.path.commonpath([root, folder]))
    return root


def _python_path(folder: Path, root: Path) -> list[str]:
    """The user's PYTHONPATH for a run in `folder`, a copy of root: entries inside root point into
    the copy (its modules are the converted ones), the others stay."""
    found = []
    for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        path = Path(entry).resolve()
        found.append(str(folder / path.relative_to(root)) if path == root or root in path.parents else entry)
    return found


def _run_folder(folder: Path, root: Path, source: Path) -> Path:
    """Where a run works in its copy `folder` of root: the user's folder, or the script's."""
    cwd = Path.cwd().resolve()
    return folder / (cwd if root in (cwd, *cwd.parents) else source.parent).relative_to(root)


def _why_failed(source: Path, trace: dict | None, launch: Launch, options: VerifyOptions) -> str:
    """The original's own failure: its traceback, or where it stood when it ran past the timeout."""
    stacks = launch.stacks.get(("original", 0), "")
    if stacks.startswith("Timeout (") or launch.timed_out:
        where = stack_summary(stacks) if stacks else "no stack was written"
        return f"{source.name} ran past --timeout {options.timeout:g}s as one process; where it stood: {where}"
    error = _own_failure(trace, launch.stderr)
    return f"{source.name} fails on its own as one process, before verification can start:\n{error.rstrip()}"


def _own_failure(trace: dict | None, stderr: str) -> str:
    """The original's error: its traceback; for an exit of its own (`SystemExit(2)` from argparse)
    what it printed before, its usage error."""
    error = (trace or {}).get("error") or stderr[-4000:]
    printed = "\n".join(line for line in stderr.strip().splitlines() if not line.startswith(("W1", "I1", "E1")))
    if error.strip().startswith("SystemExit") and printed:
        error = f"{printed[-2000:]}\n{error}"
    return error


def verify(
    original: Path, converted: Path | None = None, options: VerifyOptions | None = None,
    observation: Observation | None = None,
) -> Verification:  # fmt: skip
    """Run the verification and judge the eleven invariants; raise VerifyError when it cannot run.
    `observation`: the original's runs, made already (`convert --run`); then the conversion is
    the one `options.convert_options` gives, with the facts of that run."""
    options = options or VerifyOptions()
    start = time.monotonic()
    for path in (original, converted):
        if path is not None and not path.is_file():
            raise VerifyError(f"{path}: no such file")
    if observation is None:
        gpus = _probe(options.python)
        source = original.resolve()
        root = run_root(source)
    else:
        gpus, source, root = observation.gpus, observation.source, observation.root
    texts, what, notes = _converted_files(source, converted, root, options)
    for path in texts:  # a module of the project above the folder the user runs from (`PYTHONPATH=..`)
        if root not in path.parents:
            root = Path(os.path.commonpath([root, path.parent]))
    runs_at = source if converted is None else _placed(converted.resolve(), source, root)
    on_gpus = options.device != "cpu" and gpus >= options.nproc
    device = f"nccl on {options.nproc} GPU{'s' if options.nproc > 1 else ''}" if on_gpus else "gloo on CPU"
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if not on_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if observation is not None:
        work = observation.work
    else:
        work = Path(tempfile.mkdtemp(prefix="ddpify-verify-")) if options.keep is None else options.keep
    work.mkdir(parents=True, exist_ok=True)
    traces = work / "traces"
    linked: list[Path] = []
    try:
        folders = {label: work / label for label in LABELS}
        for label in LABELS:
            if observation is not None and label in ("original", "reference"):
                continue
            shutil.rmtree(folders[label], ignore_errors=True)
            replaced = {} if label in ("original", "reference") else texts
            stage(root, folders[label], replaced, linked if label == "ddp" else None, work.resolve())
        link_parent(root, work, {*LABELS, "traces"})
        runs = _run(options, root, folders, traces, source, runs_at, env, observation, texts)
    finally:
        if options.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    if linked:
        notes.append("linked into the runs' folders, not copied (the runs read them from your folder): "
                     + ", ".join(str(p.relative_to(root)) for p in linked[:5]))  # fmt: skip
    if runs.stand_in:
        notes.append("the original fails on this machine, so the converted script as one process is the reference: "
                     + _last_error(runs.original_error))  # fmt: skip
    return Verification(str(original), what, device, options, check_all(runs), time.monotonic() - start, notes)


def _probe(python: str) -> int:
    """The number of GPUs torch sees in `python`; VerifyError when it has no torch."""
    try:
        done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VerifyError(f"cannot run {python}: {exc}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise VerifyError(f"no torch in {python} ({last}): install torch there, or pass --python PYTHON") from None
    return int(json.loads(done.stdout.strip().splitlines()[-1])["gpus"])


def _converted_files(source: Path, converted: Path | None, root: Path, options: VerifyOptions):
    """{path under root: converted bytes}, how the converted script came about, and notes."""
    if converted is not None:
        return {_placed(converted.resolve(), source, root): converted.read_bytes()}, str(converted), []
    from ddpify.engine import ConvertError, ConvertOptions, convert_file
    from ddpify.projects import convert_project, is_project

    convert_options = replace(options.convert_options or ConvertOptions(), self_check=True)  # proves a fixed point too
    try:
        if is_project(source):
            changed = convert_project(source, convert_options).changed
            return {p: r.code.encode(enc) for p, (r, _, enc) in changed.items()}, "converted in memory (project)", []
        result, encoding = convert_file(source, convert_options)
    except ConvertError as exc:
        where = f"{exc.path}:{exc.line}" if exc.line else exc.path
        raise VerifyError(f"{where}: {exc.message}", refused=True) from None
    if result.already_distributed:
        return {}, "as written (already distributed)", ["the script is already distributed: it is verified as written"]
    lines = f"line numbers in {source.name} are those of the converted script (`ddpify convert {source.name}` prints it)"
    return {source: result.code.encode(encoding)}, "converted in memory", [lines]


def _placed(converted: Path, source: Path, root: Path) -> Path:
    """Where the converted script runs: where it is if under root, else beside the original."""
    return converted if root in converted.parents else source.parent / converted.name


def _entry(options: VerifyOptions, root: Path, folders: dict, label: str, script: Path, **extra) -> dict:
    """One run of a plan: `script` (a path under root) in the copy `folders[label]`."""
    folder = folders[label]
    return dict(label=label, script=str(folder / script.relative_to(root)), args=list(options.args),
                cwd=str(_run_folder(folder, root, script)),
                env={"PYTHONPATH": os.pathsep.join([str(folder), *_python_path(folder, root)])},
                limit={"steps": options.steps, "epochs": options.epochs}, timeout=options.timeout, root=str(folder),
                **extra)  # fmt: skip


def _run(options: VerifyOptions, root: Path, folders: dict, traces: Path, source: Path, runs_at: Path, env: dict,
         observation: Observation | None = None, texts: dict | None = None) -> Runs:  # fmt: skip
    def entry(label: str, script: Path, **extra) -> dict:
        return _entry(options, root, folders, label, script, **extra)

    resume = resume_plan(_read_text(runs_at, texts or {}), runs_at.name)
    scaled = {"seed": 0, "batch_scale": options.nproc}
    plan = [
        entry("original", source),
        entry("reference", source, reference={**scaled, "train_loader_from": "original"}, only_if_ok="original"),
        entry("plain", runs_at),
        entry("plain-reference", runs_at, reference={**scaled, "train_loader_from": "plain"}, only_if_failed="original"),
    ]
    def launch_multi(reference_label: str):
        """The torchrun launch: as written, and seeded and unshuffled against the reference."""
        ordered = {"seed": 0, "batch_scale": 1}
        compare = str(traces / f"params-{reference_label}-0.pt")
        multi_plan = [entry("ddp", runs_at), entry("ordered", runs_at, reference=ordered, compare_params=compare)]
        if resume.args is not None:
            multi_plan.append(_resume_entry(entry("ddp", runs_at), resume, options))
        return run_plan(
            multi_plan, traces, options.nproc, python=options.python,
            limit_s=len(multi_plan) * options.timeout + STARTUP_S, env=env, keep_going=True,
        )  # fmt: skip

    if observation is not None:  # the original ran already, and ran: the plain run goes beside the torchrun launch
        with ThreadPoolExecutor(max_workers=1) as pool:
            plain_launch = pool.submit(
                run_plan, [plan[2]], traces / "plain-launch", None, python=options.python,
                limit_s=2 * options.timeout + STARTUP_S, env=env, keep_going=True,
            )  # fmt: skip
            multi = launch_multi("reference")
            single = plain_launch.result()
        single.traces.update(observation.launch.traces)
        original, plain = single.traces.get(("original", 0)), single.traces.get(("plain", 0))
        reference_label, original_ok = "reference", True
    else:
        single = run_plan(
            plan,
            traces, None, python=options.python, limit_s=4 * options.timeout + STARTUP_S, env=env, keep_going=True,
        )  # fmt: skip
        original, plain = single.traces.get(("original", 0)), single.traces.get(("plain", 0))
        original_ok = original is not None and original["exit_code"] == 0
        if not original_ok and not (plain and plain["exit_code"] == 0):
            error = _own_failure(original, single.stderr)
            raise VerifyError(f"{source.name} fails on its own as one process, before verification can start:\n{error.rstrip()}")
        reference_label = "reference" if original_ok else "plain-reference"
        multi = launch_multi(reference_label)
    hung = {label for (label, _), text in multi.stacks.items() if text.startswith("Timeout (")} | {
        label for label in ("ddp", "ordered") if multi.timed_out and not all((label, r) in multi.traces for r in range(options.nproc))
    }
    runs = Runs(
        nproc=options.nproc,
        ddp=[multi.traces.get(("ddp", r)) for r in range(options.nproc)],
        ordered=[multi.traces.get(("ordered", r)) for r in range(options.nproc)],
        original=original if original_ok else plain,
        reference=single.traces.get((reference_label, 0)),
        plain=plain,
        stand_in=not original_ok,
        stacks=multi.stacks,
        hung=hung,
        stderr=multi.stderr,
        original_error=(original or {}).get("error"),
        resume=[multi.traces.get(("resume", r)) for r in range(options.nproc)] if resume.args is not None else None,
        resume_how=resume.how,
    )
    return runs


def _resume_entry(ddp: dict, resume: ResumePlan, options: VerifyOptions) -> dict:
    """The resume run (invariant 11): the converted script again, in the ddp run's folder, after it,
    taking its own load code (resume.py); brief: one epoch of at most 2 steps."""
    return dict(ddp, label="resume", resume={"after": "ddp", "args": resume.args}, env={**ddp["env"], **dict(resume.env)},
                limit={"steps": min(2, options.steps), "epochs": 1})  # fmt: skip


def _read_text(script: Path, texts: dict) -> str:
    """The converted script's code: converted in memory, or as it is on disk."""
    data = texts.get(script)
    return (data if data is not None else script.read_bytes()).decode("utf-8", errors="replace")


def _last_error(error: str | None) -> str:
    lines = [line for line in (error or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no trace"
