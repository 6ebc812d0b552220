"""Shapes of code nobody here had seen (issue 21): one project per shape, converted at test time.

fixtures/unseen/<case>/        a small project of ours in that shape (one or several modules)
fixtures/unseen/<case>.toml    what the conversion must do (keys below)

A new case is new files: no test code. Every case is converted by the engine (`convert_project`,
the path `ddpify convert ENTRY -o DIR/` takes); every runnable one then trains under ONE
`torchrun --nproc-per-node=2` launch (a plan of every case) and the tests read what the ranks
did: exit 0, a DDP model and a process group on every rank, no training forward before the wrap, disjoint shards of the training
set in a new order each epoch, identical parameters on every rank after every optimizer step
(conftest's replica check), each listed line printed once in the job, each file written by
rank 0 only and loadable, the files named per process written on every rank.

Keys of <case>.toml:
  entry        the entry script, relative to the case's folder
  args         its arguments in the torchrun run
  runs         true, or why the case is not run under torchrun (a string)
  train_size   len(dataset) of the training loader (the first loader built); absent: no shard check
  endless_rounds  the training loader is one endless pass: its first N rounds (cut where verify
               cuts them) must each be split between the ranks, disjoint and together whole
  epochs       complete passes over it per rank (absent: as many as rank 0 made, the same on every rank)
  ddp_wrapped  DDP constructions per rank (default 1)
  hand_averaged  true: every optimizer's gradients outside DDP were all-reduced by hand after each
               backward (a model run with weights passed in is never wrapped); the forwards of
               its model before any wrap are then no fault
  once         substrings of lines printed exactly once in the job
  rank0_files  files (relative to the run's folder) written by rank 0 and no other rank (a glob
               pattern matches exactly one file)
  every_rank_files  parts of file names each rank writes (its own file: a name per process)
  todos        substrings, one for each TODO the conversion leaves (exactly that many)
  in_code      {"file" = ["substring", ...]}: the converted file holds each
  not_in_code  {"file" = ["substring", ...]}: the converted file holds none
  unchanged    files of the project the conversion leaves as they are
  not_in_summary  substrings no summary line may hold ("never uses a GPU")
  loads_into   {file = "checkpoint", module = "m", cls = "Net", key = "state_dict"}: the checkpoint loads into the original model
  saved_modules  [{file, key, module, cls}, ...]: the checkpoint's `key` unpickles as the network
               itself, an instance of the original class (not the DDP wrapper)
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tomllib
from pathlib import Path

import pytest
from cli_in_process import ddpify
from conftest import NPROC, ROOT, run_plan

from ddpify.projects import convert_project
from ddpify.verify.invariants import first_round, hand_averaged, sampler_rounds

UNSEEN = ROOT / "fixtures" / "unseen"
CASES = {path.stem: tomllib.loads(path.read_text()) for path in sorted(UNSEEN.glob("*.toml"))}
RUNNABLE = [name for name, case in CASES.items() if case.get("runs", True) is True]


def _convert(name: str):
    case = CASES[name]
    return convert_project(UNSEEN / name / case["entry"])


def test_every_case_has_its_project():
    """Each case is a project of its own: its entry, and a pyproject.toml marking its root (else
    the root would be this repository's, and `-o DIR/` would copy all of it)."""
    assert CASES, "no case in fixtures/unseen"
    for name, case in CASES.items():
        assert (UNSEEN / name / case["entry"]).is_file(), name
        assert (UNSEEN / name / "pyproject.toml").is_file(), name


@pytest.mark.parametrize("name", CASES)
def test_unseen_conversion(name):
    """What the conversion says and writes: exactly the TODOs listed, the code it must hold and
    must not, and no summary line that the case rules out."""
    case = CASES[name]
    result = _convert(name)
    root = (UNSEEN / name).resolve()
    changed = {path.relative_to(root).as_posix(): r for path, (r, _, _) in result.changed.items()}
    todos = [t.message for r in changed.values() for t in r.todos]
    expected = case.get("todos", [])
    assert len(todos) == len(expected), f"TODOs: {todos}"
    for want in expected:
        assert any(want in t for t in todos), f"no TODO says {want!r}: {todos}"
    summary = [c.message for r in changed.values() for c in r.changes + r.notes]
    for banned in case.get("not_in_summary", []):
        assert not any(banned in line for line in summary), f"summary says {banned!r}: {summary}"
    for file, wanted in case.get("in_code", {}).items():
        assert file in changed, f"{file} did not change"
        for text in wanted:
            assert text in changed[file].code, f"{file} lacks {text!r}:\n{changed[file].code}"
    for file in case.get("unchanged", []):
        assert file not in changed, f"{file} changed:\n{changed[file].code}"
    for file, unwanted in case.get("not_in_code", {}).items():
        code = changed[file].code if file in changed else (root / file).read_text()
        for text in unwanted:
            assert text not in code, f"{file} holds {text!r}:\n{code}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every runnable case converted with the CLI (`-o DIR/`) and trained in one torchrun launch."""
    work = tmp_path_factory.mktemp("unseen")
    plan, refused = [], {}
    for name in RUNNABLE:
        case, out = CASES[name], work / f"{name}-ddp"
        result = ddpify("convert", str(UNSEEN / name / case["entry"]), "-o", f"{out}/", cwd=work)
        if result.returncode != 0:
            refused[name] = result.stderr  # that case fails; the others still run
            continue
        (work / name).mkdir()
        env = {"PYTHONPATH": str(out), "CUDA_VISIBLE_DEVICES": ""}
        plan.append({"label": name, "script": str(out / case["entry"]), "args": case.get("args", []), "env": env, "timeout": 90})
    launch = run_plan(plan, work, nproc=NPROC, keep_going=True)  # one case's failure is that case's
    launch.refused = refused
    return launch


@pytest.mark.parametrize("name", RUNNABLE)
def test_unseen_under_torchrun(runs, name):
    case = CASES[name]
    assert name not in runs.refused, f"convert failed: {runs.refused.get(name)}"
    traces = [runs.trace(name, rank) for rank in range(NPROC)]  # also: every rank's parameters agree
    assert len(traces) == NPROC
    for rank, t in enumerate(traces):
        assert t["exit_code"] == 0, f"rank {rank}: {t['error']}\n{runs.log()}"
        assert t["init_process_group"], f"rank {rank}: no process group"
        assert t["ddp_wrapped"] == case.get("ddp_wrapped", 1), f"rank {rank}: {t['ddp_wrapped']} DDP models"
        assert t["optimizer_steps"] and all(t["optimizer_steps"]), f"rank {rank}: an optimizer never stepped"
        early = [f for f in t["unwrapped_forwards"] if not (case.get("hand_averaged") and set(f.get("optimizers") or [-1]) <= hand_averaged(t))]
        assert not early, f"rank {rank}: trained before the DDP wrap: {early[:1]}"
        if case.get("hand_averaged"):
            assert all(t["hand_averaged"]), f"rank {rank}: gradients outside DDP not averaged: {t['hand_averaged']}"
    if "endless_rounds" in case:
        _split_every_round(traces, case["train_size"], case["endless_rounds"])
    elif "train_size" in case:
        passes = [[p for p in t["passes"] if p["loader"] == 0 and p["complete"]] for t in traces]
        epochs = case.get("epochs", min(len(p) for p in passes))
        assert epochs and all(len(p) == epochs for p in passes), [len(p) for p in passes]
        for epoch in range(epochs):
            shards = [set(p[epoch]["indices"]) for p in passes]
            assert not shards[0] & shards[1], f"epoch {epoch}: the ranks' shards overlap"
            assert len(shards[0] | shards[1]) == case["train_size"], f"epoch {epoch}: the shards miss samples"
        if epochs > 1:
            assert passes[0][0]["indices"] != passes[0][1]["indices"], "the same order every epoch"
    printed = [line for t in traces for line in t["stdout"].splitlines()]
    for text in case.get("once", []):
        count = sum(text in line for line in printed)
        assert count == 1, f"{text!r} printed {count} times in the job"
    cwd = runs.cwd / name
    for file in case.get("rank0_files", []):
        if "*" in file:  # a name the run picks (a clock-named folder): exactly one file matches
            matches = sorted(cwd.glob(file))
            assert len(matches) == 1, f"{file} matches {[str(p.relative_to(cwd)) for p in matches]}"
            file = str(matches[0].relative_to(cwd))
        writers = [rank for rank, t in enumerate(traces) if os.path.normpath(cwd / file) in _written(t)]
        assert writers == [0], f"{file} written by ranks {writers}"
    for part in case.get("every_rank_files", []):
        for rank in range(NPROC):
            mine = [path for path in _written(traces[rank]) if part in os.path.basename(path)]
            assert mine, f"rank {rank} wrote no file named like {part!r}"
    if "loads_into" in case:
        _loads_into(name, cwd, case["loads_into"])
    for spec in case.get("saved_modules", []):
        _unpickles_as(name, cwd, spec)


def _split_every_round(traces: list[dict], size: int, rounds: int) -> None:
    """Every round of the first loader's endless pass is split between the ranks: disjoint, whole."""
    passes = [[p for p in t["passes"] if p["loader"] == 0 and p["indices"]][:1] for t in traces]
    assert all(passes), "a rank read no training batch from the first loader"
    length = min((n for p in passes if (n := first_round(p[0]))), default=None)
    assert length == size // len(traces), f"rounds of {length} samples per rank, not {size // len(traces)}"
    cut = [sampler_rounds(p, length) for p in passes]
    assert all(len(c) >= rounds for c in cut), [len(c) for c in cut]
    for r in range(rounds):
        parts = [set(c[r]["indices"]) for c in cut]
        assert not parts[0] & parts[1], f"round {r + 1}: the ranks' parts overlap"
        assert len(parts[0] | parts[1]) == size, f"round {r + 1}: the parts miss samples"
    assert cut[0][0]["indices"] != cut[0][1]["indices"], "the same order every round"


def _written(trace: dict) -> set[str]:
    """The files a rank wrote (opened to write, or `torch.save`d), as absolute paths."""
    opened = {f["path"] for f in trace["files"] if set(f["mode"]) & set("wax+")}
    saved = {os.path.normpath(os.path.join(trace["cwd"], s["path"])) for s in trace["saves"]}
    return opened | saved


def _loads_into(name: str, cwd: Path, spec: dict) -> None:
    import torch

    with _importable(name, spec["module"]) as module:
        model = getattr(module, spec["cls"])(*spec.get("args", []))
        [path] = sorted(cwd.glob(spec["file"]))  # one file (its name may be a glob pattern)
        saved = torch.load(path, map_location="cpu")
        model.load_state_dict(saved[spec["key"]] if spec.get("key") else saved)


def _unpickles_as(name: str, cwd: Path, spec: dict) -> None:
    import torch

    with _importable(name, spec["module"]) as module:
        saved = torch.load(cwd / spec["file"], map_location="cpu", weights_only=False)[spec["key"]]
        cls = getattr(module, spec["cls"])
        assert type(saved) is cls, f"{spec['file']}[{spec['key']!r}] is a {type(saved).__module__}.{type(saved).__name__}, not {spec['cls']}"


@contextlib.contextmanager
def _importable(name: str, dotted: str):
    """The case's module `dotted`, imported from its folder, forgotten afterwards."""
    sys.path.insert(0, str(UNSEEN / name))
    try:
        yield importlib.import_module(dotted)
    finally:
        sys.path.remove(str(UNSEEN / name))
        top = dotted.split(".")[0]
        for loaded in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            sys.modules.pop(loaded, None)
