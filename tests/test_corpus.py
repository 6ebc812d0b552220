"""Convert every script in fixtures/corpus/ and run the result under real torchrun (issue 4).

The corpus is single-GPU training scripts written in the style of widely used public ones
(pytorch/examples, tutorials, popular repos), each training on synthetic data in seconds on CPU.
For every fixtures/corpus/*.py:

1. ``convert_source`` must succeed, unless the script is in EXPECTED_REFUSALS (then it must be
   refused with a matching message); its TODOs must be exactly those listed in its Spec;
2. the output must compile;
3. the converted script runs under ``python -m torch.distributed.run --standalone
   --nproc-per-node=2`` on CPU (through ddpify/verify/tracer.py, which records what each
   process did), in a fresh working directory, with a timeout: exit 0, every process joined a
   2-process group and wrapped a model in DDP, only rank 0 called ``torch.save``;
4. the once-per-run final message appears exactly once in the combined stdout;
5. for DataLoader scripts, each complete pass over the training loader gives the two ranks
   disjoint, equal-sized shards that together cover the dataset;
6. both ranks hold bitwise identical parameters after every optimizer step and at the end
   (conftest.assert_replicas_identical: DDP's invariant; training without gradient sync fails it).

Besides, every original must run as-is under plain ``python`` on this CPU machine, with the same
final messages (test_original_runs_as_is_on_cpu).

Scripts that fail today are listed in KNOWN_BROKEN as ``{name: "<stage>: <reason>"}``: their
test asserts that they still fail, and first at that stage, so a fix (or a new way of failing)
flips the test loudly. Every corpus file must have a Spec, so a new script cannot go unchecked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from batched import run_cases
from conftest import assert_replicas_identical

from ddpify.engine import ConvertError, convert_source

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fixtures" / "corpus"
TRACE_RUN = ROOT / "ddpify" / "verify" / "tracer.py"
NPROC = 2
PARALLEL = 2  # plain-python runs of the originals at a time
TIMEOUT_S = 150  # per run; a hang fails the script instead of the suite

STAGES = ("convert", "todos", "compile", "run", "replicas", "message", "saves", "shards", "files")


@dataclass
class Spec:
    final: dict[str, int]  # regex -> times it must match the combined stdout of all runs
    todos: list[str] = field(default_factory=list)  # substrings of the expected TODO messages, in order
    train_size: int | None = None  # len(dataset) of the training DataLoader: checks the shards
    full_cover: bool = True  # each pass covers the whole dataset (False: a drop_last batch sampler)
    runs: list[list[str]] = field(default_factory=lambda: [[]])  # argv of each run, same cwd, in order
    files: dict[str, int] = field(default_factory=dict)  # path in the run's cwd -> expected line count


def once(regex: str) -> dict[str, int]:
    return {regex: 1}


SPECS: dict[str, Spec] = {
    "mnist_classifier": Spec(
        once(r"Finished training: final test accuracy"), train_size=256, runs=[["--save-model"]]
    ),
    "cifar_resnet": Spec(once(r"Best test accuracy: "), train_size=256),
    "vae": Spec(once(r"VAE training done, final test loss"), train_size=320),
    "dcgan": Spec(once(r"Finished DCGAN training after 2 epochs"), train_size=192),
    "word_language_model": Spec(once(r"\| End of training \| test loss")),
    "super_resolution": Spec(once(r"Super-resolution training finished"), train_size=160),
    "finetune_backbone": Spec(
        once(r"Saved finetuned model to finetuned\.pt"),
        train_size=192,
    ),
    "trainer_class": Spec(once(r"Trainer finished 2 epochs"), train_size=320, full_cover=False),
    "dataparallel_script": Spec(once(r"Saved PyTorch Model State to model\.pth"), train_size=300),
    "amp_accumulation": Spec(once(r"AMP run complete after \d+ optimizer steps"), train_size=512),
    "resume_checkpoint": Spec(
        {r"Run finished at epoch \d+ with best val_loss": 2, r"=> loaded checkpoint 'checkpoint\.pth\.tar'": 1},
        train_size=384,
        runs=[[], ["--resume", "checkpoint.pth.tar", "--epochs", "5", "--patience", "5"]],
    ),
    "logging_side_effects": Spec(
        once(r"all done, outputs in runs/exp1"),
        train_size=384,
        files={"runs/exp1/metrics.csv": 3},  # header + one row per epoch
    ),
    "gnn_fullbatch": Spec(once(r"Test set results:")),  # full-batch: replicated on purpose
    "regression_mlp": Spec(once(r"Final validation RMSE"), train_size=512),
    "transformer_classifier": Spec(once(r"Done training transformer classifier"), train_size=384),
    "nanogpt_style": Spec(once(r"training finished: best val loss")),
    "gan_tensor_types": Spec(once(r"tensor-type GAN training done"), train_size=512),
    # an IterableDataset: its sampler yields None, which tracer.py records as such (no shards to check)
    "iterable_stream": Spec(
        once(r"stream training complete"), todos=["streams an IterableDataset: give each rank its own part"]
    ),
}

# Refusals that are the right answer: the converter says why, and nothing is written.
EXPECTED_REFUSALS: dict[str, tuple[str, str]] = {}  # name -> (regex on the error message, why refusing is right)

# Scripts that fail today: "<first failing stage>: <what goes wrong>". See the module docstring.
KNOWN_BROKEN: dict[str, str] = {}


SCRIPTS = sorted(p.stem for p in CORPUS.glob("*.py"))


def test_every_corpus_script_has_a_spec():
    assert SCRIPTS, "fixtures/corpus is empty"
    assert set(SCRIPTS) == set(SPECS), (
        f"without a Spec: {sorted(set(SCRIPTS) - set(SPECS))}; Spec without a script: {sorted(set(SPECS) - set(SCRIPTS))}"
    )
    assert set(EXPECTED_REFUSALS) <= set(SCRIPTS) and set(KNOWN_BROKEN) <= set(SCRIPTS)
    assert not set(EXPECTED_REFUSALS) & set(KNOWN_BROKEN)
    for name, reason in KNOWN_BROKEN.items():
        assert reason.split(":", 1)[0] in STAGES, f"{name}: KNOWN_BROKEN reason must start with a stage: {STAGES}"


# --- running ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    name: str
    problems: list[tuple[str, str]] = field(default_factory=list)  # (stage, detail), in check order
    log: str = ""

    def fail(self, stage: str, detail: str) -> None:
        assert stage in STAGES
        self.problems.append((stage, detail))


def plan(spec: Spec, script: Path) -> list[dict]:
    """The torchrun runs of a converted script: every run of the spec, one after the other, in one cwd."""
    return [
        {"label": f"run{i}", "script": str(script), "args": list(args), "cwd": "cwd", "timeout": TIMEOUT_S}
        for i, args in enumerate(spec.runs)
    ]


def convert_stage(name: str, outcome: Outcome, work: Path) -> Path | None:
    spec = SPECS[name]
    source = (CORPUS / f"{name}.py").read_text()
    try:
        result = convert_source(source, f"{name}.py")
    except ConvertError as exc:
        if name in EXPECTED_REFUSALS:
            pattern = EXPECTED_REFUSALS[name][0]
            if not re.search(pattern, exc.message):
                outcome.fail("convert", f"refused, but not as expected ({pattern!r}): {exc}")
        else:
            outcome.fail("convert", f"ConvertError: {exc}")
        return None
    if name in EXPECTED_REFUSALS:
        outcome.fail("convert", f"expected a refusal ({EXPECTED_REFUSALS[name][0]!r}), but it converted")
        return None
    if result.already_distributed:
        outcome.fail("convert", "reported as already distributed")
        return None
    todos = [t.message for t in result.todos]
    if len(todos) != len(spec.todos) or not all(want in got for want, got in zip(spec.todos, todos)):
        outcome.fail("todos", f"TODOs {[(t.line, t.message) for t in result.todos]}, expected {spec.todos}")
    try:
        compile(result.code, f"{name}_ddp.py", "exec")
    except SyntaxError as exc:
        outcome.fail("compile", f"{exc}")
        return None
    work.mkdir(parents=True, exist_ok=True)
    out = work / f"{name}_ddp.py"
    out.write_text(result.code)
    return out


def run_stage(name: str, script: Path, outcome: Outcome, launch) -> None:
    """Judge the converted script's runs: launch is its case of the batched torchrun launch
    (tests/batched.py; always through the harness: every run's traces are checked, its replicas included)."""
    spec = SPECS[name]
    work = launch.cwd
    outcome.log = f"converted script: {script}\n{launch.log()}"
    traces = {}
    for i in range(len(spec.runs)):
        for rank in range(NPROC):
            if (f"run{i}", rank) in launch.traces:
                traces[(i, rank)] = launch.traces[(f"run{i}", rank)]
    hung = [f"{label} rank {r}" for (label, r), text in sorted(launch.stacks.items()) if text.startswith("Timeout (")]
    if launch.timed_out or hung:
        outcome.fail("run", f"timed out after {TIMEOUT_S}s: {', '.join(hung) or 'the launch'}")
        return
    if launch.returncode != 0:
        errors = [f"run{i} rank {r}: {t['error'].strip().splitlines()[-1]}" for (i, r), t in traces.items() if t["error"]]
        outcome.fail("run", f"exit {launch.returncode}: {'; '.join(errors) or launch.stderr.strip()[-500:]}")
        return
    for i in range(len(spec.runs)):
        for rank in range(NPROC):
            t = traces.get((i, rank))
            if t is None:
                outcome.fail("run", f"run{i} rank {rank}: no trace")
                return
            groups = t["init_process_group"]
            if [g["world_size"] for g in groups] != [NPROC]:
                outcome.fail("run", f"run{i} rank {rank}: init_process_group calls {groups}, expected one of size {NPROC}")
            if not t["ddp_wrapped"]:
                outcome.fail("run", f"run{i} rank {rank}: no model wrapped in DistributedDataParallel")
            if t["dist_initialized_at_exit"]:
                outcome.fail("run", f"run{i} rank {rank}: process group not destroyed at exit")
        try:
            assert_replicas_identical(work, f"run{i}", [traces[(i, rank)] for rank in range(NPROC)])
        except AssertionError as exc:
            outcome.fail("replicas", str(exc))

    for regex, count in spec.final.items():
        found = len(re.findall(regex, launch.stdout))
        if found != count:
            outcome.fail("message", f"{regex!r} printed {found} times, expected {count}")

    for (i, rank), t in sorted(traces.items()):
        if rank != 0 and t["saves"]:
            outcome.fail("saves", f"run{i} rank {rank} called torch.save: {[s['path'] for s in t['saves']]}")
        if rank == 0 and any(s["obj_type"] == "DistributedDataParallel" for s in t["saves"]):
            outcome.fail("saves", f"run{i}: a whole DDP-wrapped model pickled by torch.save (needs a process group "
                         f"to load; save the module): {[s['path'] for s in t['saves'] if s['obj_type'] == 'DistributedDataParallel']}")
        if rank == 0 and any(s["module_prefix"] for s in t["saves"]):
            outcome.fail("saves", f"run{i}: a state_dict saved with 'module.' keys: {[s['path'] for s in t['saves']]}")

    if spec.train_size is not None:
        check_shards(spec, traces, outcome)

    for rel, lines in spec.files.items():
        path = work / "cwd" / rel
        got = len(path.read_text().splitlines()) if path.exists() else None
        if got != lines:
            outcome.fail("files", f"{rel}: {got} lines, expected {lines}")


def check_shards(spec: Spec, traces: dict, outcome: Outcome) -> None:
    for i in range(len(spec.runs)):
        per_rank = []
        for rank in range(NPROC):
            t = traces[(i, rank)]
            loaders = [ld["id"] for ld in t["loaders"] if ld["dataset_len"] == spec.train_size]
            if len(loaders) != 1:
                outcome.fail("shards", f"run{i} rank {rank}: expected one DataLoader over {spec.train_size} samples, got {t['loaders']}")
                return
            per_rank.append([p["indices"] for p in t["passes"] if p["loader"] == loaders[0] and p["complete"]])
        counts = [len(p) for p in per_rank]
        if not counts[0] or len(set(counts)) != 1:
            outcome.fail("shards", f"run{i}: complete training passes per rank {counts}")
            return
        for epoch, shards in enumerate(zip(*per_rank)):
            sets = [set(s) for s in shards]
            union = set().union(*sets)
            if sum(len(s) for s in sets) != len(union) or any(len(s) != len(x) for s, x in zip(sets, shards)):
                outcome.fail("shards", f"run{i} pass {epoch}: ranks fetched overlapping or repeated samples "
                              f"(sizes {[len(s) for s in shards]}, {len(union)} distinct in all)")
                return
            if len({len(s) for s in shards}) != 1:
                outcome.fail("shards", f"run{i} pass {epoch}: shard sizes {[len(s) for s in shards]}")
                return
            if spec.full_cover and union != set(range(spec.train_size)):
                outcome.fail("shards", f"run{i} pass {epoch}: {len(union)} of {spec.train_size} samples fetched")
                return


def run_original(name: str, work: Path) -> str | None:
    """The unconverted script, as-is under plain `python` on CPU, every run of its spec in one cwd: None if fine."""
    spec = SPECS[name]
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    stdout = ""
    for args in spec.runs:
        cmd = [sys.executable, str(CORPUS / f"{name}.py"), *args]
        try:
            proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"{' '.join(cmd)}: timed out after {TIMEOUT_S}s"
        if proc.returncode != 0:
            return f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        stdout += proc.stdout
    for regex, count in spec.final.items():
        found = len(re.findall(regex, stdout))
        if found != count:
            return f"{regex!r} printed {found} times, expected {count}\n{stdout[-3000:]}"
    return None


@pytest.fixture(scope="module")
def corpus_outcomes(tmp_path_factory) -> tuple[dict[str, Outcome], dict[str, str | None], object]:
    """Every conversion, then ONE torchrun launch running every converted script (tests/batched.py:
    each script is judged on its own runs), and the plain-python runs of the originals, PARALLEL at a time."""
    base = tmp_path_factory.mktemp("corpus")
    outcomes = {name: Outcome(name) for name in SCRIPTS}
    originals: dict[str, str | None] = {}
    converted = {}
    for name in SCRIPTS:
        script = convert_stage(name, outcomes[name], base / name)
        if script is not None:
            converted[name] = script
    batch = run_cases({name: plan(SPECS[name], script) for name, script in converted.items()}, base / "torchrun", NPROC)
    for name, script in converted.items():
        run_stage(name, script, outcomes[name], batch[name])
    jobs = [lambda name=name: originals.__setitem__(name, run_original(name, base / "original" / name)) for name in SCRIPTS]
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        list(pool.map(lambda job: job(), jobs))
    return outcomes, originals, batch


def test_batched_launch_lost_nothing(corpus_outcomes):
    """Every converted script ran to the end in the batched launch, and the traces hold all that
    the launch printed (each script's stdout is read from its traces)."""
    batch = corpus_outcomes[2]
    assert not batch.lost, f"{batch.lost}\n{batch.log()}"
    for launch, extra in zip(batch.launches, batch.unattributed):
        assert not extra, f"printed by no run of the plan: {extra!r}\n{launch.log()}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_original_runs_as_is_on_cpu(name, corpus_outcomes):
    """The corpus is single-GPU scripts that also run on a CPU machine, offline, in seconds."""
    problem = corpus_outcomes[1][name]
    assert problem is None, f"fixtures/corpus/{name}.py under plain python: {problem}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_corpus_script(name, corpus_outcomes):
    outcome = corpus_outcomes[0][name]
    summary = "\n".join(f"  [{stage}] {detail}" for stage, detail in outcome.problems)
    if name in KNOWN_BROKEN:
        stage = KNOWN_BROKEN[name].split(":", 1)[0]
        assert outcome.problems, f"{name} now converts and runs: remove it from KNOWN_BROKEN\n{outcome.log}"
        assert outcome.problems[0][0] == stage, (
            f"{name} is in KNOWN_BROKEN for {KNOWN_BROKEN[name]!r} but now fails first at another stage; "
            f"update KNOWN_BROKEN:\n{summary}\n{outcome.log}"
        )
    else:
        assert not outcome.problems, f"{name}:\n{summary}\n{outcome.log}"
