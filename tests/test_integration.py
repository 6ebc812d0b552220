"""Converted scripts under real torchrun (2 CPU processes, gloo): the promises of PRODUCT.md hold.

Every case in CASES runs in one batched launch of each kind (tests/batched.py: one torchrun and
one python start-up for the whole module, each case read on its own):

* torchrun --standalone --nproc-per-node=2 over ddpify/verify/tracer.py, running the converted
  script twice in the same processes: shuffle on (run "shuffle") and shuffle off (run "ordered"),
  per-process batch B;
* plain python over tracer.py: the single-process reference with batch 2B and shuffle off
  (run "baseline": the original script, or the converted one where the original needs a GPU),
  and the converted script as one process (run "plain", same knobs as the baseline),

and the tests below read the traces (indices each process fetched per DataLoader pass, saves,
final optimizer parameters) and the combined stdout. Letters refer to the brief:
(a) disjoint complete shards per epoch, (b) a new order every epoch with shuffle on,
(c) same parameters as one process with batch 2B, (d) one voice, (e) one portable checkpoint,
(f) `python converted.py` is one process. Exclusions are stated per case with a reason.
Every torchrun run is also held to DDP's invariant, both ranks with bitwise identical parameters
after every optimizer step: the first Launch.trace() of a run checks it
(conftest.assert_replicas_identical), so every test above that reads the run fails if it breaks.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from batched import run_cases
from conftest import NPROC, ROOT, assert_replicas_identical

B = 16  # per-process batch in the torchrun runs; the single-process reference uses NPROC * B
ATOL = 1e-5


def env_knobs(epochs):
    def knobs(batch, shuffle):
        return [], {"BATCH_SIZE": str(batch), "SHUFFLE": "1" if shuffle else "0", "EPOCHS": str(epochs)}

    return knobs


def cli_knobs(batch_flag, epochs, shuffle_on=(), shuffle_off=("--no-shuffle",), extra=()):
    def knobs(batch, shuffle):
        return [batch_flag, str(batch), "--epochs", str(epochs), *(shuffle_on if shuffle else shuffle_off), *extra], {}

    return knobs


@dataclass
class Case:
    converted: str  # path under the repo root of the script that runs under torchrun
    original: str  # its single-GPU input
    knobs: object  # (batch, shuffle) -> (argv, env)
    epochs: int
    train_size: int  # len(dataset) of the training DataLoader; identifies it in the traces
    per_epoch: list[str]  # regexes that must match exactly `epochs` times in the combined stdout
    once: str | None  # regex that must match exactly once in the combined stdout
    checkpoint: str  # path (relative to the run's cwd) of the state_dict the script saves
    saves_per_run: int | None = 1  # torch.save calls per run; None: data dependent, compared to the baseline
    original_runs_on_cpu: bool = True  # False: the reference is the converted script under plain python
    equivalence: bool | str = True  # True, or the reason (c) does not apply
    eval_size: int | None = None  # len(dataset) of the evaluation DataLoader, if the script evaluates
    eval_metric: str | None = None  # regex whose numeric groups are the printed evaluation results
    notes: list[str] = field(default_factory=list)


def fixture(name, **kw):
    return Case(converted=f"fixtures/convert/{name}.out.py", original=f"fixtures/convert/{name}.in.py", **kw)


def example(name, **kw):
    return Case(converted=f"examples/{name}_ddp.py", original=f"examples/{name}.py", **kw)


BATCHNORM = "BatchNorm statistics are per process under DDP (no SyncBatchNorm on CPU/gloo), so results differ from one process with 2B by design"
NEEDS_GPU = "the original calls .cuda()/'cuda' without a fallback and cannot run on this CPU machine"

CASES = {
    "flat_script": fixture(
        "flat_script", knobs=env_knobs(3), epochs=3, train_size=512,
        per_epoch=[r"epoch \d/3 mean loss"], once=r"Training complete, saved model\.pt", checkpoint="model.pt",
    ),
    "main_argparse": fixture(
        "main_argparse", knobs=cli_knobs("--batch-size", 3), epochs=3, train_size=512,
        per_epoch=[r"epoch \d: val_loss="], once=r"best val_loss=", checkpoint="best.pt",
        saves_per_run=None,  # saves whenever val loss improves
        eval_size=128, eval_metric=r"epoch \d: val_loss=([\d.]+)",
    ),
    "mnist_examples": fixture(
        "mnist_examples", knobs=cli_knobs("--batch-size", 2, extra=("--save-model",)), epochs=2, train_size=512,
        per_epoch=[r"\[test\] mean nll", r"train \| epoch \d \| batch +0 of"],
        once=None,  # this shape prints nothing once per run; its per-epoch lines are checked
        checkpoint="small_cnn.pt",
        eval_size=200, eval_metric=r"\[test\] mean nll ([\d.]+)  accuracy (\d+)/(\d+)",
    ),
    "seed000_convnet": fixture(
        "seed000_convnet", knobs=cli_knobs("-b", 2), epochs=2, train_size=512,
        per_epoch=[r"epoch \d/2: \d+ steps, last loss"], once=r"done training after", checkpoint="convnet.ckpt",
        original_runs_on_cpu=False, equivalence=BATCHNORM,
    ),
    "device_cuda_string": fixture(
        "device_cuda_string", knobs=env_knobs(2), epochs=2, train_size=384,
        per_epoch=[r"\[epoch \d\] last batch loss"], once=r"(?m)^done$", checkpoint="logreg.pt",
        original_runs_on_cpu=False,
    ),
    "device_cuda0": fixture(
        "device_cuda0", knobs=env_knobs(2), epochs=2, train_size=256,
        per_epoch=[r"epoch=\d reconstruction_loss="], once=r"saved autoencoder\.pt", checkpoint="autoencoder.pt",
        original_runs_on_cpu=False,
    ),
    "device_ifexp": fixture(
        "device_ifexp", knobs=env_knobs(3), epochs=3, train_size=480,
        per_epoch=[r"epoch \d: loss"], once=r"finished training", checkpoint="mlp.pt",
    ),
    "device_dot_cuda": fixture(
        "device_dot_cuda", knobs=env_knobs(2), epochs=2, train_size=320,
        per_epoch=[r"epoch \d loss"], once=r"learned weights:", checkpoint="linear.pt",
        original_runs_on_cpu=False,
    ),
    "device_to_string": fixture(
        "device_to_string", knobs=env_knobs(2), epochs=2, train_size=256,
        per_epoch=[r"epoch \d: train acc"], once=r"all epochs done", checkpoint="tiny_cnn.pt",
        original_runs_on_cpu=False,
    ),
    "shuffle_runtime": fixture(
        "shuffle_runtime", knobs=cli_knobs("--batch-size", 2, shuffle_on=("--shuffle",)), epochs=2, train_size=448,
        per_epoch=[r"epoch \d done \("], once=r"checkpoint written to", checkpoint="shuffle_runtime.pt",
    ),
    "examples/mnist": example(
        "mnist", knobs=cli_knobs("--batch-size", 2, extra=("--save-model", "--train-size", "256", "--test-size", "64")),
        epochs=2, train_size=256,
        per_epoch=[r"\[eval\] epoch \d: mean loss", r"\[train\] epoch \d step 0/"], once=r"Final test accuracy:",
        checkpoint="digit_net.pt",
        eval_size=64, eval_metric=r"\[eval\] epoch \d: mean loss ([\d.]+), correct (\d+)/(\d+)",
    ),
    "examples/mnist_convnet": example(
        "mnist_convnet", knobs=cli_knobs("-b", 2, extra=("--train-size", "512")), epochs=2, train_size=512,
        per_epoch=[r"epoch \d/2  step 16/16  loss"], once=r"trained in [\d.]+ s", checkpoint="convnet.ckpt",
        equivalence=BATCHNORM,
    ),
}  # fmt: skip


@dataclass
class Results:
    case: Case
    dist: object  # Launch of torchrun: runs "shuffle" and "ordered"
    single: object  # Launch of python: runs "baseline" and "plain"

    def log(self):
        return f"=== torchrun ===\n{self.dist.log()}\n=== python ===\n{self.single.log()}"


def harness_runs(work):
    """The runs of the harness tests below: the hand-written DDP script and its broken variants,
    and the unconverted original (the last two tests of this module read them)."""
    script = ROOT / "fixtures" / "noop" / "multigpu_torchrun.py"
    args = ["2", "1", "--batch_size", str(B)]
    plan = [{"label": "ref", "script": str(script), "args": args}]
    for name, (edits, _, _) in MUTANTS.items():
        source = script.read_text()
        for old, new in edits:  # the test asserts that each edit applies
            source = source.replace(old, new) if source.count(old) == 1 else source
        work.mkdir(parents=True, exist_ok=True)
        (work / f"{name}.py").write_text(source)
        plan.append({"label": name, "script": str(work / f"{name}.py"), "args": args})
        if name == "no_ddp":
            plan[-1]["diverges"] = "no DDP: each rank trains alone (the replica check must fail, below)"
    raw = ROOT / "fixtures" / "convert" / "flat_script.in.py"
    env = {"BATCH_SIZE": str(B), "SHUFFLE": "0", "EPOCHS": "2"}
    return {HARNESS: plan, UNCONVERTED: [{"label": "raw", "script": str(raw), "env": env}]}


HARNESS, UNCONVERTED = "harness: hand-written DDP and mutants", "harness: unconverted original"


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """Every case's runs in ONE torchrun launch and ONE python launch (tests/batched.py): per case,

    * torchrun: the converted script twice, shuffle on (run "shuffle") and off (run "ordered"),
      per-process batch B; also the harness tests' scripts (last two tests of this module);
    * python: the single-process reference with batch 2B and shuffle off (run "baseline": the
      original script, or the converted one where the original needs a GPU), and the converted
      script as one process (run "plain", same knobs as the baseline).
    """
    work = tmp_path_factory.mktemp("integration")
    dist, single = {}, {}
    for name, case in CASES.items():
        converted = ROOT / case.converted
        if not converted.exists():
            continue  # its tests say so (results)

        def run(label, script, batch, shuffle, case=case):
            argv, env = case.knobs(batch, shuffle)
            return {"label": label, "script": str(script), "args": argv, "env": env}

        dist[name] = [run("shuffle", converted, B, True), run("ordered", converted, B, False)]
        reference = ROOT / case.original if case.original_runs_on_cpu else converted
        single[name] = [run("baseline", reference, NPROC * B, False)]
        if case.original_runs_on_cpu:  # otherwise the baseline already is the converted script under python
            single[name].append(run("plain", converted, NPROC * B, False))
    dist.update(harness_runs(work / "mutants"))
    return run_cases(dist, work / "torchrun", nproc=NPROC), run_cases(single, work / "python", nproc=None)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def results(request, batch):
    case = CASES[request.param]
    assert (ROOT / case.converted).exists(), f"{case.converted} missing: run pytest tests/test_golden.py --update-goldens"
    dist, single = batch
    return Results(CASES[request.param], dist[request.param], single[request.param])


@pytest.mark.parametrize("which", ["torchrun", "python"])
def test_batched_launches_lost_nothing(batch, which):
    """Every case ran to the end in the batch, and the traces hold all that the launches printed
    (each case's stdout is read from its traces)."""
    launches = batch[0] if which == "torchrun" else batch[1]
    assert not launches.lost, f"{launches.lost}\n{launches.log()}"
    for launch, extra in zip(launches.launches, launches.unattributed):
        assert not extra, f"printed by no run of the plan: {extra!r}\n{launch.log()}"


# --- helpers ---------------------------------------------------------------------------------


def train_passes(trace: dict, train_size: int) -> list[list[int]]:
    """The index order of each complete pass over the training loader, in one process."""
    loaders = [ld["id"] for ld in trace["loaders"] if ld["dataset_len"] == train_size]
    assert len(loaders) == 1, f"expected one DataLoader over {train_size} samples, got {trace['loaders']}"
    return [p["indices"] for p in trace["passes"] if p["loader"] == loaders[0] and p["complete"]]


def check_ran(launch, labels, world_size):
    assert launch.returncode == 0, f"exit {launch.returncode}\n{launch.log()}"
    for label in labels:
        for rank in range(world_size):
            t = launch.trace(label, rank)
            assert t["exit_code"] == 0, f"{label} rank {rank}: {t['error']}"


def check_disjoint_shards(launch, label, train_size, epochs):
    """(a) per epoch, the ranks' indices are disjoint, same-sized, and together the whole dataset."""
    per_rank = [train_passes(launch.trace(label, r), train_size) for r in range(NPROC)]
    for r, passes in enumerate(per_rank):
        assert len(passes) == epochs, f"rank {r}: {len(passes)} complete training passes, expected {epochs}"
    for epoch in range(epochs):
        shards = [passes[epoch] for passes in per_rank]
        assert not set(shards[0]) & set(shards[1]), f"epoch {epoch}: ranks share samples"
        for r, shard in enumerate(shards):
            assert len(shard) == len(set(shard)) == train_size // NPROC, (
                f"epoch {epoch} rank {r}: {len(shard)} indices ({len(set(shard))} distinct), "
                f"expected {train_size // NPROC}"
            )
        assert set(shards[0]) | set(shards[1]) == set(range(train_size)), f"epoch {epoch}: samples missed"


def max_param_diff(a, b):
    assert len(a) == len(b), f"{len(a)} vs {len(b)} optimizers"
    diffs = []
    for opt_a, opt_b in zip(a, b):
        assert [t.shape for t in opt_a] == [t.shape for t in opt_b]
        diffs += [(x - y).abs().max().item() for x, y in zip(opt_a, opt_b)]
    return max(diffs)


# --- tests -------------------------------------------------------------------------------------


def test_runs_under_torchrun(results):
    print(results.log())
    check_ran(results.dist, ["shuffle", "ordered"], NPROC)
    for label in ("shuffle", "ordered"):
        for rank in range(NPROC):
            t = results.dist.trace(label, rank)
            assert [(g["backend"], g["world_size"], g["rank"]) for g in t["init_process_group"]] == [("gloo", NPROC, rank)]
            assert t["ddp_wrapped"] == 1
            assert t["destroy_process_group"] == 1 and not t["dist_initialized_at_exit"], "process group left open"


def test_a_disjoint_shards(results):
    print(results.log())
    check_ran(results.dist, ["shuffle", "ordered"], NPROC)
    for label in ("shuffle", "ordered"):
        check_disjoint_shards(results.dist, label, results.case.train_size, results.case.epochs)


def check_reshuffled(launch, label, train_size):
    """(b) with shuffle on: not in index order, and a different order every epoch (set_epoch)."""
    for rank in range(NPROC):
        shuffled = train_passes(launch.trace(label, rank), train_size)
        assert shuffled[0] != sorted(shuffled[0]), f"rank {rank}: shuffle on, but epoch 0 is in order"
        for epoch in range(1, len(shuffled)):
            assert shuffled[epoch] != shuffled[epoch - 1], f"rank {rank}: epoch {epoch} repeats the previous order (set_epoch?)"


def check_replicas_agree(launch, label):
    """DDP keeps the replicas identical after every step (with BatchNorm too: its buffers are not
    parameters). Launch.trace() already checks this on the first read of a run; this is the
    explicit form, which also runs for a run marked "diverges" in its plan entry."""
    ranks = [launch.params(label, r) for r in range(NPROC)]
    assert ranks[0] and ranks[0][0], "no optimizer parameters recorded"
    assert_replicas_identical(launch.cwd, label, [launch.traces[(label, r)] for r in range(NPROC)])


def check_portable_saves(saves, label):
    """(e) every save is a state_dict without the DDP 'module.' prefix."""
    for s in saves:
        assert s["keys"] is not None, f"{label}: saved something other than a state_dict: {s['obj_type']}"
        assert not s["module_prefix"], f"{label}: keys carry the DDP 'module.' prefix: {s['keys'][:3]}"


def test_b_new_order_every_epoch_when_shuffling(results):
    print(results.log())
    check_ran(results.dist, ["shuffle", "ordered"], NPROC)
    case = results.case
    check_reshuffled(results.dist, "shuffle", case.train_size)
    for rank in range(NPROC):
        ordered = train_passes(results.dist.trace("ordered", rank), case.train_size)
        for epoch, order in enumerate(ordered):
            assert order == list(range(rank, case.train_size, NPROC)), f"rank {rank} epoch {epoch}: shuffle off, but not in order"


def test_c_same_parameters_as_one_process_with_double_batch(results):
    print(results.log())
    check_ran(results.dist, ["shuffle", "ordered"], NPROC)
    check_ran(results.single, ["baseline"], 1)
    check_replicas_agree(results.dist, "ordered")
    if results.case.equivalence is not True:
        return  # reason in CASES: results.case.equivalence
    diff = max_param_diff(results.dist.params("ordered", 0), results.single.params("baseline", 0))
    assert diff <= ATOL, f"max |param - single-process(batch {NPROC * B})| = {diff:g} > {ATOL}"


def test_d_one_voice(results):
    print(results.log())
    check_ran(results.dist, ["shuffle", "ordered"], NPROC)
    case = results.case
    out = results.dist.stdout
    runs = 2  # "shuffle" and "ordered" print into the same stdout
    for pattern in case.per_epoch:
        count = len(re.findall(pattern, out))
        assert count == runs * case.epochs, f"{pattern!r}: {count} times, expected {runs} runs x {case.epochs} epochs"
    if case.once is not None:
        count = len(re.findall(case.once, out))
        assert count == runs, f"{case.once!r}: {count} times, expected once per run ({runs} runs)"
    for label in ("shuffle", "ordered"):
        for rank in range(1, NPROC):
            assert results.dist.trace(label, rank)["stdout"] == "", f"{label}: rank {rank} printed"
        assert results.dist.trace(label, 0)["stdout"], f"{label}: rank 0 printed nothing"


def test_g_evaluation_adds_up(results):
    """Evaluation covers the evaluation set exactly as one process does, and reports the same numbers."""
    print(results.log())
    check_ran(results.dist, ["shuffle", "ordered"], NPROC)
    check_ran(results.single, ["baseline"], 1)
    case = results.case
    loaders = {ld["dataset_len"] for r in range(NPROC) for ld in results.dist.trace("ordered", r)["loaders"]}
    if case.eval_size is None:
        assert loaders == {case.train_size}, f"unexpected extra DataLoaders: {loaders}"
        return
    assert loaders == {case.train_size, case.eval_size}

    def eval_indices(trace):
        ids = [ld["id"] for ld in trace["loaders"] if ld["dataset_len"] == case.eval_size]
        return Counter(i for p in trace["passes"] if p["loader"] in ids and p["complete"] for i in p["indices"])

    baseline = results.single.trace("baseline", 0)
    seen = sum((eval_indices(results.dist.trace("ordered", r)) for r in range(NPROC)), Counter())
    assert seen == eval_indices(baseline), "evaluation skipped or repeated samples across ranks"
    if case.equivalence is True:  # same parameters, so the same metrics
        got = [m.groups() for m in re.finditer(case.eval_metric, results.dist.trace("ordered", 0)["stdout"])]
        want = [m.groups() for m in re.finditer(case.eval_metric, baseline["stdout"])]
        assert len(got) == len(want) == case.epochs
        got, want = [float(x) for g in got for x in g], [float(x) for g in want for x in g]
        assert got == pytest.approx(want, rel=1e-3, abs=2e-5), "evaluation results differ from one process"


def test_e_one_portable_checkpoint(results):
    print(results.log())
    check_ran(results.dist, ["shuffle", "ordered"], NPROC)
    check_ran(results.single, ["baseline"], 1)
    case = results.case
    reference = [s for s in results.single.trace("baseline", 0)["saves"] if s["path"] == case.checkpoint]
    assert reference, f"the single-process run never saved {case.checkpoint}"
    for label in ("shuffle", "ordered"):
        assert results.dist.trace(label, 1)["saves"] == [], f"{label}: rank 1 saved a file"
        saves = results.dist.trace(label, 0)["saves"]
        assert {s["path"] for s in saves} == {case.checkpoint}
        if case.saves_per_run is not None:
            assert len(saves) == case.saves_per_run, f"{label}: {len(saves)} saves, expected {case.saves_per_run}"
        else:
            assert saves, f"{label}: nothing saved"
        check_portable_saves(saves, label)
        for s in saves:
            assert s["shapes"] == reference[-1]["shapes"], "keys/shapes differ from the single-process checkpoint"
    ordered = results.dist.trace("ordered", 0)["saves"]
    if case.saves_per_run is None:  # data-dependent count: same data order as the baseline, same saves
        assert len(ordered) == len(reference)
    # the file on disk loads into the single-GPU model's keys
    state = torch.load(results.dist.cwd / "ordered" / case.checkpoint, map_location="cpu", weights_only=True)
    assert {k: list(v.shape) for k, v in state.items()} == reference[-1]["shapes"]


def test_f_plain_python_is_one_process(results):
    print(results.log())
    label = "plain" if results.case.original_runs_on_cpu else "baseline"  # baseline = converted under python
    check_ran(results.single, [label], 1)
    case = results.case
    t = results.single.trace(label, 0)
    assert t["script"].endswith(case.converted)
    assert all(g["world_size"] == 1 for g in t["init_process_group"]), t["init_process_group"]
    assert not t["dist_initialized_at_exit"], "process group left open"
    passes = train_passes(t, case.train_size)
    assert len(passes) == case.epochs
    assert all(p == list(range(case.train_size)) for p in passes), "one process must read the whole dataset in order"
    assert [s["path"] for s in t["saves"]] and all(not s["module_prefix"] for s in t["saves"])
    if case.once is not None:
        assert len(re.findall(case.once, results.single.stdout)) == len(
            [r for r in ("baseline", "plain") if (r, 0) in results.single.traces]
        )
    if case.original_runs_on_cpu:  # the converted script alone behaves like the original
        diff = max_param_diff(results.single.params("plain", 0), results.single.params("baseline", 0))
        assert diff <= ATOL, f"converted under python differs from the original by {diff:g}"
        same = ("path", "obj_type", "keys", "shapes", "module_prefix")  # not the line that saved it
        assert [{k: s[k] for k in same} for s in t["saves"]] == [
            {k: s[k] for k in same} for s in results.single.trace("baseline", 0)["saves"]
        ]


# --- the harness itself: it accepts a hand-written DDP script and rejects an unconverted one ------


# Broken variants of the hand-written DDP script: (old, new) edits, and the check each must fail.
MUTANTS = {
    "no_set_epoch": (
        [("self.loader.sampler.set_epoch(epoch)", "pass")],
        lambda launch, label: check_reshuffled(launch, label, 512),
        "repeats the previous order",
    ),
    "saves_ddp_state_dict": (
        [("self.net.module.state_dict()", "self.net.state_dict()")],
        lambda launch, label: check_portable_saves(launch.trace(label, 0)["saves"], label),
        "DDP 'module.' prefix",
    ),
    "no_ddp": (
        [
            ("self.net = DDP(self.net, device_ids=[self.local_rank] if on_gpu else None)", "pass"),
            ("self.net.module.state_dict()", "self.net.state_dict()"),
        ],
        lambda launch, label: check_replicas_agree(launch, label),
        "optimizer 0: ranks first differ after step 1 ",  # each rank steps on its own shard's gradients
    ),
}


def test_harness_accepts_hand_written_ddp_script_and_rejects_broken_variants(batch):
    """A hand-written torchrun trainer in the DDP-tutorial style (fixtures/noop) passes the checks; each mutant fails its check."""
    launch = batch[0][HARNESS]
    print(launch.log())
    source = (ROOT / "fixtures" / "noop" / "multigpu_torchrun.py").read_text()
    for name, (edits, _, _) in MUTANTS.items():
        for old, _ in edits:
            assert source.count(old) == 1, f"mutant {name}: {old!r} not found once"
    check_ran(launch, ["ref", *MUTANTS], NPROC)

    check_disjoint_shards(launch, "ref", 512, 2)  # its extra next(iter(loader)) per epoch is an incomplete pass
    check_reshuffled(launch, "ref", 512)
    check_replicas_agree(launch, "ref")
    saves = launch.trace("ref", 0)["saves"]
    check_portable_saves(saves, "ref")
    assert [s["path"] for s in saves] == ["snapshot.pt", "snapshot.pt"] and launch.trace("ref", 1)["saves"] == []
    assert saves[0]["keys"] == ["weight", "bias"]
    for rank in range(NPROC):  # it prints on every rank: the case's stdout holds both processes' output
        assert len(re.findall(rf"rank {rank}: epoch \d", launch.stdout)) == 2 * (1 + len(MUTANTS))

    for name, (_, check, message) in MUTANTS.items():
        with pytest.raises(AssertionError, match=re.escape(message)):
            check(launch, name)


def test_harness_rejects_unconverted_script(batch):
    """The single-GPU original under torchrun: every rank trains on everything, prints and saves."""
    launch = batch[0][UNCONVERTED]
    print(launch.log())
    check_ran(launch, ["raw"], NPROC)
    with pytest.raises(AssertionError, match="ranks share samples"):
        check_disjoint_shards(launch, "raw", 512, 2)
    assert len(re.findall(r"Training complete", launch.stdout)) == NPROC
    assert all(len(launch.trace("raw", r)["saves"]) == 1 for r in range(NPROC))
    assert all(launch.trace("raw", r)["init_process_group"] == [] for r in range(NPROC))
