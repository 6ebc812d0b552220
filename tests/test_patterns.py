"""One golden fixture and one torchrun run per training-script pattern (issue 4).

fixtures/patterns/<case>.in.py   a single-GPU script of ours (synthetic data, runs on CPU with plain python)
fixtures/patterns/<case>.args    optional: one line of `ddpify convert` options
fixtures/patterns/<case>.out.py  the converter's output (golden; `pytest --update-goldens` rewrites it)

Golden tests: the conversion equals the golden, compiles, is a fixed point, and leaves exactly the
TODOs listed in CASES. Integration tests: every runnable golden runs under ONE
`torchrun --standalone --nproc-per-node=2` launch (ddpify/verify/tracer.py plan, through
tests/batched.py: a case that fails or kills its process does not hide the others), the
single-process references run under ONE plain-python launch, and the --launcher spawn case runs
once on its own (it starts its own processes); the tests then assert, per case, the invariants
of PRODUCT.md that apply. Exclusions carry their reason in CASES (`runs`, `equivalence`).
Every read of a torchrun (or mp.spawn) run's traces also checks that both ranks hold bitwise
identical parameters after every optimizer step (conftest.assert_replicas_identical).

BUG_CHECKS keeps a check for every converter bug these fixtures found (all fixed), run as
regular tests so none comes back.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from batched import ByLabel, run_cases
from conftest import NPROC, ROOT, run_plan

from ddpify.engine import ConvertError, ConvertOptions, convert_source

PATTERNS = ROOT / "fixtures" / "patterns"
B = 16  # per-process batch in the torchrun runs
ATOL = 1e-5

CPU_ONLY = "golden only: {}"


@dataclass
class Case:
    todos: list[str] = field(default_factory=list)  # exact TODO messages the conversion reports
    runs: bool | str = True  # True, or why the output is not run under torchrun here
    args: list[str] = field(default_factory=list)  # argv of the torchrun run (per-process batch B)
    train_size: int | None = None  # len(dataset) of the training DataLoader; None: no DataLoader
    epochs: int | None = None  # complete training passes per rank; None: checked by the case's own test
    per_epoch: list[str] = field(default_factory=list)  # regexes matching `epochs` times in rank 0's stdout
    once: list[str] = field(default_factory=list)  # regexes matching exactly once in the combined stdout
    checkpoints: dict[str, int | None] = field(default_factory=dict)  # path -> saves on rank 0 (None: >= 1)
    ddp_wrapped: int = 1  # DDP constructions per rank
    equivalence: tuple[list[str], list[str]] | str | None = None  # (dist args, original single-process args)
    in_code: list[str] = field(default_factory=list)  # substrings the golden output must contain


CASES: dict[str, Case] = {
    "trainer_class": Case(
        args=["--batch-size", str(B), "--epochs", "2"], train_size=384, epochs=2,
        per_epoch=[r"trainer epoch \d: mean loss"], once=[r"trainer saved trainer\.pt"],
        checkpoints={"trainer.pt": 1}, in_code=["DistributedSampler(self.train_set", "self.sampler_train.set_epoch(epoch)"],
    ),
    "data_parallel": Case(
        args=["--batch-size", str(B), "--epochs", "2", "--no-shuffle"], train_size=512, epochs=2,
        per_epoch=[r"dp epoch \d: train mse"], once=[r"dp saved dp_model\.pt"], checkpoints={"dp_model.pt": 1},
        equivalence=(["--batch-size", str(B), "--epochs", "2", "--no-shuffle"],
                     ["--batch-size", str(NPROC * B), "--epochs", "2", "--no-shuffle"]),
    ),
    "gan_two_models": Case(  # summed D loss of two forwards, one backward: DDP without the unused-parameter search reduces it fine
        args=["--batch-size", str(B), "--epochs", "2"], train_size=512, epochs=2,
        per_epoch=[r"(?m)^gan epoch \d: lossD="], once=[r"(?m)^gan done: ema sample radius"],
        checkpoints={"netG.pt": 1, "netD.pt": 1, "netG_ema.pt": 1}, ddp_wrapped=2,
    ),
    "gan_dcgan": Case(
        args=["--batch-size", str(B), "--epochs", "2"], train_size=512, epochs=2,
        per_epoch=[r"dcgan epoch \d: lossD="], once=[r"dcgan done: ema sample radius"],
        checkpoints={"dcgan_G.pt": 1, "dcgan_D.pt": 1, "dcgan_G_ema.pt": 1}, ddp_wrapped=2,
    ),
    "eval_early_stopping": Case(
        args=["--batch-size", str(B)], train_size=384, epochs=None,  # early stopping: see its own test
        once=[r"early stopping at epoch \d+", r"final val_loss="], checkpoints={"best_model.pt": None},
    ),
    "resume_checkpoint": Case(  # two torchrun runs (first, resumed) in the same directory: see its own test
        args=["--batch-size", str(B), "--epochs", "2"], train_size=320, epochs=2,
        per_epoch=[r"epoch \d: loss .* checkpoint saved"], once=[r"training finished at epoch 2"],
        checkpoints={"checkpoint.pt": 2},
    ),
    "side_effects": Case(  # logs to stderr and files: see its own test
        args=["--batch-size", str(B), "--epochs", "3"], train_size=256, epochs=3,
        checkpoints={"out/model.pt": 1},
    ),
    "download_dataset": Case(
        args=["--batch-size", str(B), "--epochs", "2"], train_size=256, epochs=2,
        per_epoch=[r"download epoch \d: loss"], once=[r"download case finished"],
        checkpoints={"signals_model.pt": 1},
    ),
    "amp_accumulation": Case(
        args=["--batch-size", str(B), "--epochs", "2", "--no-shuffle"], train_size=512, epochs=2,
        per_epoch=[r"amp epoch \d: last micro-batch loss"], once=[r"amp training done"],
        checkpoints={"amp_model.pt": 1}, in_code=[".no_sync()"],
        equivalence=(["--batch-size", str(B), "--epochs", "2", "--no-shuffle"],
                     ["--batch-size", str(NPROC * B), "--epochs", "2", "--no-shuffle"]),
    ),
    "global_batch": Case(  # --global-batch: the script's --batch-size is the global batch
        args=["--batch-size", str(NPROC * B), "--epochs", "2", "--no-shuffle"], train_size=512, epochs=2,
        per_epoch=[r"global-batch epoch \d: loss"], once=[r"global-batch done"], checkpoints={"global_batch.pt": 1},
        in_code=["batch_size=args.batch_size // dist.get_world_size()"],
        equivalence=(["--batch-size", str(NPROC * B), "--epochs", "2", "--no-shuffle"],
                     ["--batch-size", str(NPROC * B), "--epochs", "2", "--no-shuffle"]),
    ),
    "spawn_launcher": Case(
        runs="starts its own processes with mp.spawn: run with plain python and NPROC_PER_NODE=2 in "
        "test_spawn_launcher (the harness hooks are not in the children: stdout and files are checked)",
        in_code=["mp.spawn(spawned_main"],
    ),
    "accelerator_api": Case(
        args=["--batch-size", str(B), "--epochs", "2"], train_size=320, epochs=2,
        per_epoch=[r"accel epoch \d: loss"], once=[r"accel run saved accel_net\.pt"], checkpoints={"accel_net.pt": 1},
    ),
    "accelerator_ifelse": Case(
        args=["--batch-size", str(B), "--epochs", "2", "--save-model"], train_size=320, epochs=2,
        per_epoch=[r"Train Epoch: \d \[0/320\]"], once=[r"accel if/else run finished"],
        checkpoints={"accel_ifelse.pt": 1},
        in_code=["device = torch.device(torch.accelerator.current_accelerator().type, local_rank)"],
    ),
    "legacy_local_rank": Case(
        args=["--batch-size", str(B), "--epochs", "2"], train_size=256, epochs=2,
        per_epoch=[r"local_rank epoch \d: loss"], once=[r"legacy run done \(local_rank=0\)"],
        checkpoints={"local_rank_model.pt": 1},
        in_code=['parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))'],
    ),
    "hand_batches": Case(  # nanoGPT-style random batches: the seed is offset by rank
        args=["--max-iters", "30", "--eval-interval", "10", "--batch-size", str(B)], train_size=None,
        once=[r"bigram training done"], checkpoints={"bigram.pt": 1},
        in_code=["torch.manual_seed(torch.initial_seed() + dist.get_rank())  # each process draws its own batches\nfor it in range("],
    ),
    "hand_batches_sequential": Case(  # batchify + bptt steps: each rank a block of rows
        args=["--batch-size", "8", "--epochs", "2"], train_size=None,
        per_epoch=[r"seq epoch \d: last loss"], epochs=2, once=[r"sequential batches done"],
        checkpoints={"seq_model.pt": 1}, in_code=["rows_per_rank = len(train_data) // dist.get_world_size()"],
    ),
    "full_batch": Case(  # replicated on purpose: every rank takes the same full-batch step
        args=["--epochs", "40"], train_size=None, once=[r"full-batch training done"], checkpoints={"gcn.pt": 1},
        equivalence=(["--epochs", "40"], ["--epochs", "40"]),
    ),
    "compiled_model": Case(  # torch.compile'd model, OneCycle over epochs * len(loader), clipping
        args=["--batch-size", str(B), "--epochs", "2"], train_size=512, epochs=2,
        per_epoch=[r"compiled epoch \d: loss"], once=[r"compiled training done"], checkpoints={"compiled.pt": 1},
        in_code=["model = torch.compile(model)\n"],
        equivalence=(["--batch-size", str(B), "--epochs", "2", "--no-shuffle"],
                     ["--batch-size", str(NPROC * B), "--epochs", "2", "--no-shuffle"]),
    ),
    "split_loaders": Case(  # {x: DataLoader(...) for x in splits}, one loop over the phases
        args=["--batch-size", str(B), "--epochs", "2"], train_size=384, epochs=2,
        per_epoch=[r"epoch \d train loss", r"epoch \d val loss"], once=[r"(?m)^split loaders done"],
        checkpoints={"split_best.pt": 1}, in_code=["sampler=samplers[x]", 'samplers = {\n    "train": DistributedSampler('],
        equivalence=(["--batch-size", str(B), "--epochs", "2", "--no-shuffle"],
                     ["--batch-size", str(NPROC * B), "--epochs", "2", "--no-shuffle"]),
    ),
    "split_loaders_named": Case(  # {"train": train_loader, "val": val_loader}, built in main()
        args=["--batch-size", str(B), "--epochs", "2"], train_size=384, epochs=2,
        per_epoch=[r"epoch \d train loss", r"epoch \d val loss"], once=[r"named split loaders done"],
        checkpoints={"named_best.pt": 1}, in_code=["sampler=train_sampler"],
        equivalence=(["--batch-size", str(B), "--epochs", "2", "--no-shuffle"],
                     ["--batch-size", str(NPROC * B), "--epochs", "2", "--no-shuffle"]),
    ),
    "train_metrics_stop": Case(  # stop on the training loss; test() for two loaders; evaluation inside saves
        args=["--batch-size", str(B), "--no-shuffle"], train_size=384, epochs=None,  # early stop: see its own test
        once=[r"converged at epoch \d+", r"train-metrics run done"], checkpoints={"stop_best.pt": None},
        equivalence=(["--batch-size", str(B), "--no-shuffle"], ["--batch-size", str(NPROC * B), "--no-shuffle"]),
    ),
    "step_based": Case(  # three step-based loops, no epochs: see its own test (shuffled run: "step_based_shuffled")
        args=["--batch-size", str(B)], train_size=None, ddp_wrapped=3, checkpoints={"step_based.pt": 1},
        equivalence=(["--batch-size", str(B), "--no-shuffle"], ["--batch-size", str(NPROC * B), "--no-shuffle"]),
    ),
    "early_stopping_class": Case(  # an EarlyStopping object saves the best model; reloaded at the end
        args=["--batch-size", str(B), "--no-shuffle"], train_size=256, epochs=None,  # early stop: see its own test
        once=[r"EarlyStopping stopped training at epoch \d+", r"reloaded the best model"], checkpoints={"es_checkpoint.pt": None},
        equivalence=(["--batch-size", str(B), "--no-shuffle"], ["--batch-size", str(NPROC * B), "--no-shuffle"]),
    ),
    "trainer_constructor": Case(  # the DDP tutorial's Trainer: model and loaders handed to its constructor
        args=["--batch-size", str(B), "--epochs", "3"], train_size=320, epochs=3,
        per_epoch=[r"Epoch \d \| train_loss", r"Epoch \d \| val_loss"], once=[r"tutorial trainer done"],
        checkpoints={"trainer_ckpt.pt": 2},
        in_code=["self.train_data.sampler.set_epoch(epoch)", "model = DDP(model.to(device), device_ids=[local_rank]"],
        equivalence=(["--batch-size", str(B), "--epochs", "3", "--no-shuffle"],
                     ["--batch-size", str(NPROC * B), "--epochs", "3", "--no-shuffle"]),
    ),
    "sampler_branches": Case(  # RandomSampler / SequentialSampler / DistributedSampler picked in an if/elif/else
        args=["--batch-size", str(B), "--epochs", "2", "--shuffle"], train_size=384, epochs=2,
        per_epoch=[r"branches epoch \d: last loss"], checkpoints={"branches.pt": 1},  # once: in the shuffled run's test
        in_code=["train_sampler = DistributedSampler(train_set, shuffle=True)",
                 "train_sampler = DistributedSampler(train_set, shuffle=False)",
                 "for epoch in range(args.epochs):\n        train_sampler.set_epoch(epoch)\n"],
        equivalence=(["--batch-size", str(B), "--epochs", "2"], ["--batch-size", str(NPROC * B), "--epochs", "2"]),
    ),
    "warmup_scheduler": Case(  # `if epoch <= args.warm: warmup_scheduler.step()` is no accumulation boundary
        args=["--batch-size", str(B), "--epochs", "3"], train_size=320, epochs=3,
        per_epoch=[r"warmup epoch \d: loss"], once=[r"warm-up run done"], checkpoints={"warmup_best.pth": None},
        equivalence=(["--batch-size", str(B), "--epochs", "3", "--no-shuffle"],
                     ["--batch-size", str(NPROC * B), "--epochs", "3", "--no-shuffle"]),
    ),
    "transfer_tempdir": Case(  # best weights in a TemporaryDirectory: rank 0's folder on every rank
        args=["--batch-size", str(B), "--epochs", "3"], train_size=256, epochs=3,
        per_epoch=[r"(?m)^train Loss: ", r"(?m)^val Loss: "], once=[r"transfer learning done", r"Best val Acc"],
        checkpoints={"transfer_best.pt": 1}, in_code=["dist.broadcast_object_list(tempdir_of_rank0)"],
        equivalence=(["--batch-size", str(B), "--epochs", "3", "--no-shuffle"],
                     ["--batch-size", str(NPROC * B), "--epochs", "3", "--no-shuffle"]),
    ),
    "per_process_effects": Case(  # Dataset / collate_fn / worker_init_fn / pid- and rank-named files: every rank
        args=["--batch-size", str(B), "--epochs", "2", "--workers", "1"], train_size=256, epochs=2,
        per_epoch=[r"per-process epoch \d: loss"], once=[r"per-process run done", r"per-process dataset of 256 samples"],
        checkpoints={"per_process_model.pt": 1},
    ),
    "factory_objects": Case(  # make_training_parts() returns dataset, model, optimizer; Trainer(device_index: int)
        args=["3", "2", "--batch_size", str(B)], train_size=320, epochs=3,
        per_epoch=[r"\[cpu\] epoch \d: 10 steps, batch 16"], once=[r"factory run done"],
        checkpoints={"factory_ckpt.pt": 2}, in_code=["net = DDP(net.to(device), device_ids=[local_rank]"],
        equivalence=(["3", "2", "--batch_size", str(B), "--no-shuffle"],
                     ["3", "2", "--batch_size", str(NPROC * B), "--no-shuffle"]),
    ),
    "chained_generators": Case(  # Adam(itertools.chain(G_AB.parameters(), G_BA.parameters())): both wrapped
        args=["--batch-size", str(B), "--epochs", "2"], train_size=256, epochs=2,
        per_epoch=[r"cycle epoch \d: loss_G="], once=[r"chained generators done"],
        checkpoints={"G_AB.pth": 1, "G_BA.pth": 1}, ddp_wrapped=3,
        equivalence=(["--batch-size", str(B), "--epochs", "2", "--no-shuffle"],
                     ["--batch-size", str(NPROC * B), "--epochs", "2", "--no-shuffle"]),
    ),
    "hand_updates": Case(  # no optimizer, random batches, a per-step stop test: see its own test
        args=["--max-steps", "300", "--batch-size", str(B)], train_size=None,
        once=[r"Loss: [\d.]+ after \d+ batches"], checkpoints={"poly_fc.pt": 1},
        in_code=["loss = all_reduce_sum(loss) / dist.get_world_size()", "dist.broadcast_object_list(_shared, src=0)"],
    ),
    "endless_loader": Case(  # RandomSampler(replacement=True) behind batch_loader.next(); generate(model.module)
        args=["--max-steps", "30", "--batch-size", str(B)], train_size=None,
        once=[r"endless loader done", r"sample: \[\["], checkpoints={"bigram_endless.pt": 1},
        in_code=["generate(model.module, "],
    ),
    "trainer_late_device": Case(  # the device is chosen in the Trainer's constructor, which also prints
        args=["--max-iters", "30", "--batch-size", str(B)], train_size=None,
        once=[r"running on device", r"late device run done"], checkpoints={"late_device.pt": 1},
    ),
    "two_finetunes": Case(  # one train_model() trains two models in turn: both wrapped, set_epoch once
        args=["--batch-size", str(B)], train_size=128, epochs=4,
        per_epoch=[r"(?m)^epoch \d loss"], once=[r"two fine-tunings done"], checkpoints={"conv.pt": 1}, ddp_wrapped=2,
        equivalence=(["--batch-size", str(B), "--no-shuffle"], ["--batch-size", str(NPROC * B), "--no-shuffle"]),
    ),
    "main_returns_model": Case(  # main() trains and returns the model: the caller gets model.module
        args=["--batch-size", str(B), "--epochs", "2"], train_size=192, epochs=2,
        per_epoch=[r"returned-model epoch \d done"], once=[r"saved the returned model: 5 parameters"],
        checkpoints={"returned.pt": 1}, in_code=["return model.module"],
        equivalence=(["--batch-size", str(B), "--epochs", "2", "--no-shuffle"],
                     ["--batch-size", str(NPROC * B), "--epochs", "2", "--no-shuffle"]),
    ),
    "late_device": Case(  # `device = ...` only after training: setup and the wrap still come before it
        args=["--batch-size", str(B), "--epochs", "2"], train_size=256, epochs=2,
        per_epoch=[r"Epoch \d\n---"], once=[r"Done!", r"prediction for ones"], checkpoints={"late_model.pth": 1},
        equivalence=(["--batch-size", str(B), "--epochs", "2", "--no-shuffle"],
                     ["--batch-size", str(NPROC * B), "--epochs", "2", "--no-shuffle"]),
    ),
    "own_methods_step": Case(  # model.encode(...)/model.decode(...) in the step: gradients averaged by hand
        args=["--batch-size", str(B), "--epochs", "2"], train_size=256, epochs=2,
        per_epoch=[r"vae epoch \d: last loss"], once=[r"own-methods run done"], checkpoints={"vae_methods.pt": 1},
        in_code=["average_gradients(model)  # the step runs the model through its own methods"],
        equivalence=(["--batch-size", str(B), "--epochs", "2", "--no-shuffle"],
                     ["--batch-size", str(NPROC * B), "--epochs", "2", "--no-shuffle"]),
    ),
    "sync_batchnorm": Case(
        runs=CPU_ONLY.format("SyncBatchNorm needs CUDA tensors (gloo/CPU cannot run it)"),
        in_code=["SyncBatchNorm.convert_sync_batchnorm("],
    ),
    "model_parallel": Case(
        runs=CPU_ONLY.format("the model is placed on cuda:0 and cuda:1, so even the original needs 2 GPUs "
                             "(the one fixture that does not run on CPU)"),
        in_code=["DDP(model)"],
    ),
}  # fmt: skip

ORIGINALS_ON_CPU = [name for name in CASES if name != "model_parallel"]

RUNNABLE = [name for name, case in CASES.items() if case.runs is True]

# Converter bugs these fixtures found, all fixed since; each check below states the correct
# behaviour and runs as a regular test: gan_dcgan (EMA deep-copied from the DDP wrapper),
# data_parallel (DDP before model.to(device)), hand_batches (a module-level script refused),
# gan_two_models (refused over a ddpify check finding), accelerator_api (one-line form left
# unconverted), side_effects (makedirs on rank 0 only, the log file opened on every rank).


def options_for(name: str) -> ConvertOptions:
    """ConvertOptions from fixtures/patterns/<name>.args (the CLI's spelling)."""
    args_file = PATTERNS / f"{name}.args"
    tokens = shlex.split(args_file.read_text()) if args_file.exists() else []
    kwargs: dict = {}
    while tokens:
        token = tokens.pop(0)
        if token == "--sync-batchnorm":
            kwargs["sync_batchnorm"] = True
        elif token == "--global-batch":
            kwargs["global_batch"] = True
        elif token == "--eval-on-rank0":
            kwargs["eval_on_rank0"] = True
        elif token == "--launcher":
            kwargs["launcher"] = tokens.pop(0)
        else:
            raise AssertionError(f"{args_file.name}: unknown option {token!r}")
    return ConvertOptions(**kwargs)


def source(name: str) -> Path:
    return PATTERNS / f"{name}.in.py"


def golden(name: str) -> Path:
    return PATTERNS / f"{name}.out.py"


# --- golden -------------------------------------------------------------------------------------


def test_every_fixture_has_a_case():
    on_disk = {p.name[: -len(".in.py")] for p in PATTERNS.glob("*.in.py")}
    assert on_disk == set(CASES), "fixtures/patterns and CASES disagree"
    for args_file in PATTERNS.glob("*.args"):
        assert args_file.name[: -len(".args")] in CASES, f"{args_file.name} has no case"


@pytest.mark.parametrize("name", list(CASES))
def test_golden(name, update_goldens):
    result = convert_source(source(name).read_text(), str(source(name)), options_for(name))
    out = golden(name)
    if update_goldens and (not out.exists() or out.read_text() != result.code):
        out.write_text(result.code)
    assert out.exists(), f"{out.relative_to(ROOT)} missing: run pytest --update-goldens and review it"
    assert result.code == out.read_text(), f"conversion of {name} differs from its golden (--update-goldens to accept)"
    assert not result.already_distributed and result.changes
    assert [t.message for t in result.todos] == CASES[name].todos
    compile(result.code, str(out), "exec")
    again = convert_source(result.code, str(out), options_for(name))
    assert again.already_distributed and again.code == result.code and not again.todos
    assert "ddpify" not in result.code.replace("TODO(ddpify)", "")
    for needle in CASES[name].in_code:
        assert needle in result.code, f"{needle!r} missing from the conversion of {name}"
    for todo in CASES[name].todos:
        assert f"# TODO(ddpify): {todo}" in result.code, f"no TODO comment for {todo!r}"


def test_sync_batchnorm_before_wrapping():
    code = golden("sync_batchnorm").read_text()
    assert code.index("SyncBatchNorm.convert_sync_batchnorm(") < code.index("DDP(model")
    assert "device_ids=[local_rank]" in code


def test_model_parallel_wrapped_without_device_ids():
    code = golden("model_parallel").read_text()
    assert "model = DDP(model)" in code and "device_ids=" not in code


# --- checks that state the correct behaviour where the converter once went wrong ---------------


def bug_gan_two_models(runs):
    try:
        result = convert_source(source("gan_two_models").read_text(), str(source("gan_two_models")))
    except ConvertError as exc:
        raise AssertionError(f"convert failed: {exc}") from None
    assert result.code.count("DDP(") >= 2


def bug_hand_batches(runs):
    try:
        result = convert_source(source("hand_batches").read_text(), str(source("hand_batches")))
    except ConvertError as exc:
        raise AssertionError(f"convert failed: {exc}") from None
    assert [t.message for t in result.todos] == CASES["hand_batches"].todos


def bug_gan_dcgan(runs):
    code = golden("gan_dcgan").read_text()
    assert code.index("copy.deepcopy(netG") < code.index("netG = DDP(") or "copy.deepcopy(netG.module)" in code
    saves = [s for s in runs.dist.trace("gan_dcgan", 0)["saves"] if s["path"] == "dcgan_G_ema.pt"]
    assert saves and not saves[0]["module_prefix"], f"EMA checkpoint keys: {saves and saves[0]['keys'][:2]}"


def bug_accelerator_api(runs):
    code = golden("accelerator_api").read_text()
    assert "device = torch.accelerator.current_accelerator() if use_accel" not in code, "device line left unconverted"


def bug_side_effects(runs):
    code = golden("side_effects").read_text()
    # every rank opens out/train.log (FileHandler), so every rank must be able to create out/
    assert 'os.makedirs("out", exist_ok=True)' in code
    lines = code.splitlines()
    at = next(i for i, line in enumerate(lines) if "os.makedirs(" in line)
    assert "get_rank" not in lines[at - 1] and "RANK" not in lines[at - 1], "makedirs guarded by rank 0"


def bug_data_parallel(runs):
    code = golden("data_parallel").read_text()
    assert code.index("model.to(device)") < code.index("model = DDP(model"), "wrapped before model.to(device)"


BUG_CHECKS = {
    "hand_batches": bug_hand_batches,
    "gan_two_models": bug_gan_two_models,
    "gan_dcgan": bug_gan_dcgan,
    "accelerator_api": bug_accelerator_api,
    "side_effects": bug_side_effects,
    "data_parallel": bug_data_parallel,
}


# --- integration: one torchrun launch, one python launch, one spawn run --------------------------


@dataclass
class Runs:
    dist: object  # ByLabel over the torchrun batch: every runnable golden (+ the resumed run)
    single: object  # ByLabel over the python batch: the references
    work: Path
    batches: dict = field(default_factory=dict)  # "torchrun" / "python" -> tests/batched.Batch

    def log(self):
        return f"=== torchrun ===\n{self.dist.log()}\n=== python ===\n{self.single.log()}"


def eval_checkpoint(work: Path) -> Path:
    return work / "torchrun-cwd" / "eval_early_stopping" / "best_model.pt"


def resume_checkpoint(work: Path) -> Path:
    return work / "torchrun-cwd" / "resume" / "checkpoint.pt"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every runnable golden in ONE torchrun launch, the references and originals in ONE python
    launch (tests/batched.py: a case that fails or dies cannot hide the others' runs)."""
    work = tmp_path_factory.mktemp("patterns")
    dist_cwd, single_cwd = work / "torchrun-cwd", work / "python-cwd"
    dist = {}
    for name in RUNNABLE:
        case = CASES[name]
        args = case.equivalence[0] if isinstance(case.equivalence, tuple) else case.args
        entry = {"label": name, "script": str(golden(name)), "args": args, "cwd": str(dist_cwd / name)}
        if name == "resume_checkpoint":
            entry["cwd"] = str(dist_cwd / "resume")
        dist[name] = [entry]
        if name in ("step_based", "sampler_branches"):  # equivalence runs without shuffling; this one shuffles
            dist[name].append({"label": f"{name}_shuffled", "script": str(golden(name)), "args": case.args,
                               "cwd": str(dist_cwd / f"{name}_shuffled")})  # fmt: skip
        if name == "resume_checkpoint":  # a second converted run resumes from the first one's checkpoint
            resumed = ["--batch-size", str(B), "--epochs", "4", "--resume", "checkpoint.pt", "--checkpoint", "resumed.pt"]
            dist[name].append({"label": "resume_again", "script": str(golden(name)), "args": resumed, "cwd": str(dist_cwd / "resume")})
    # per_process_effects forks DataLoader workers: after accelerator_ifelse, whose tqdm monitor
    # thread lives on in the processes, a forked worker can deadlock or crash on a lock it
    # inherited (seen: "DataLoader worker ... killed by signal: Segmentation fault", and a worker
    # that never answered). A script starts in a fresh process in real life: so does this one.
    dist_batch = run_cases(dist, work / "torchrun", nproc=NPROC, alone=("per_process_effects",))

    single_plan = [
        {"label": f"{name}_reference", "script": str(source(name)), "args": CASES[name].equivalence[1]}
        for name in RUNNABLE
        if isinstance(CASES[name].equivalence, tuple)
    ]
    single_plan += [
        {"label": "eval_only_original", "script": str(source("eval_early_stopping")),
         "args": ["--eval-only", str(eval_checkpoint(work))]},
        {"label": "resume_original", "script": str(source("resume_checkpoint")),
         "args": ["--batch-size", str(B), "--epochs", "3", "--resume", str(resume_checkpoint(work)),
                  "--checkpoint", "original_resumed.pt"]},
    ]  # fmt: skip
    # every original runs as-is with plain python on CPU (model_parallel needs 2 GPUs: see CASES)
    single_plan += [
        {"label": f"{name}_original", "script": str(source(name)), "args": CASES[name].args}
        for name in ORIGINALS_ON_CPU
    ]
    single = {run["label"]: [dict(run, cwd=str(single_cwd / run["label"]))] for run in single_plan}
    single_batch = run_cases(single, work / "python", nproc=None)
    return Runs(ByLabel(dist_batch, dist_cwd), ByLabel(single_batch, single_cwd), work,
                {"torchrun": dist_batch, "python": single_batch})  # fmt: skip


@pytest.mark.parametrize("which", ["torchrun", "python"])
def test_batched_launches_lost_nothing(runs, which):
    """Every case ran to the end in its batched launch (its tests read its own runs)."""
    batch = runs.batches[which]
    assert not batch.lost, f"{batch.lost}\n{batch.log()}"


def ran(launch, label, world_size=NPROC) -> list[dict]:
    """Every rank's trace of a run that exited 0; launch.trace() checks the ranks' parameters agree."""
    traces = [launch.trace(label, r) for r in range(world_size)]
    for rank, t in enumerate(traces):
        assert t["exit_code"] == 0, f"{label} rank {rank} failed: {t['error']}\n{launch.log()}"
    return traces


def train_passes(trace: dict, train_size: int) -> list[list[int]]:
    loaders = [ld["id"] for ld in trace["loaders"] if ld["dataset_len"] == train_size]
    assert len(loaders) == 1, f"expected one DataLoader over {train_size} samples, got {trace['loaders']}"
    return [p["indices"] for p in trace["passes"] if p["loader"] == loaders[0] and p["complete"]]


def check_disjoint_shards(traces, train_size, epochs):
    per_rank = [train_passes(t, train_size) for t in traces]
    for r, passes in enumerate(per_rank):
        assert len(passes) == epochs, f"rank {r}: {len(passes)} complete training passes, expected {epochs}"
    for epoch in range(epochs):
        shards = [passes[epoch] for passes in per_rank]
        assert not set(shards[0]) & set(shards[1]), f"epoch {epoch}: ranks share samples"
        for r, shard in enumerate(shards):
            assert len(shard) == len(set(shard)) == train_size // NPROC, f"epoch {epoch} rank {r}: {len(shard)} indices"
        assert set(shards[0]) | set(shards[1]) == set(range(train_size)), f"epoch {epoch}: samples missed"


def check_checkpoints(traces, checkpoints):
    assert traces[1]["saves"] == [], f"rank 1 saved: {[s['path'] for s in traces[1]['saves']]}"
    saves = traces[0]["saves"]
    for path, count in checkpoints.items():
        mine = [s for s in saves if s["path"] == path]
        if count is None:
            assert mine, f"{path} never saved"
        else:
            assert len(mine) == count, f"{path} saved {len(mine)} times, expected {count}"
        for s in mine:
            assert s["keys"], f"{path}: not a state_dict ({s['obj_type']})"
            assert not s["module_prefix"], f"{path}: keys carry the DDP 'module.' prefix: {s['keys'][:2]}"


def max_param_diff(a, b):
    assert len(a) == len(b) and a, f"{len(a)} vs {len(b)} optimizers"
    diffs = []
    for opt_a, opt_b in zip(a, b):
        assert [t.shape for t in opt_a] == [t.shape for t in opt_b]
        diffs += [(x - y).abs().max().item() for x, y in zip(opt_a, opt_b)]
    return max(diffs)


@pytest.mark.parametrize("name", RUNNABLE)
def test_runs_under_torchrun(runs, name):
    """Exit 0 on both ranks, one process group of 2 (gloo) made and destroyed, the right number of DDP wraps."""
    case = CASES[name]
    traces = ran(runs.dist, name)
    for rank, t in enumerate(traces):
        assert [(g["backend"], g["world_size"], g["rank"]) for g in t["init_process_group"]] == [("gloo", NPROC, rank)]
        assert t["ddp_wrapped"] == case.ddp_wrapped, f"rank {rank}: {t['ddp_wrapped']} DDP constructions"
        assert t["destroy_process_group"] == 1 and not t["dist_initialized_at_exit"], "process group left open"


@pytest.mark.parametrize("name", [n for n in RUNNABLE if CASES[n].train_size and CASES[n].epochs])
def test_disjoint_shards(runs, name):
    case = CASES[name]
    check_disjoint_shards(ran(runs.dist, name), case.train_size, case.epochs)


@pytest.mark.parametrize("name", RUNNABLE)
def test_one_voice(runs, name):
    case = CASES[name]
    traces = ran(runs.dist, name)
    assert traces[1]["stdout"] == "", f"rank 1 printed: {traces[1]['stdout'][:300]}"
    out = traces[0]["stdout"]
    for pattern in case.once:
        assert len(re.findall(pattern, runs.dist.stdout)) == 1, f"{pattern!r} not exactly once\n{runs.dist.stdout}"
    for pattern in case.per_epoch:
        assert len(re.findall(pattern, out)) == case.epochs, f"{pattern!r}: not once per epoch ({case.epochs})\n{out}"


@pytest.mark.parametrize("name", [n for n in RUNNABLE if CASES[n].checkpoints])
def test_checkpoints_once_without_module_prefix(runs, name):
    check_checkpoints(ran(runs.dist, name), CASES[name].checkpoints)


@pytest.mark.parametrize("name", [n for n in RUNNABLE if isinstance(CASES[n].equivalence, tuple)])
def test_same_parameters_as_original_single_process(runs, name):
    """2 processes x batch B == the original, one process, batch 2B (global batch: B), no shuffle."""
    ran(runs.dist, name)  # also: both ranks hold the same parameters after every step (conftest)
    ran(runs.single, f"{name}_reference", world_size=1)
    diff = max_param_diff(runs.dist.params(name, 0), runs.single.params(f"{name}_reference", 0))
    assert diff <= ATOL, f"max |param - original single process| = {diff:g} > {ATOL}"


# --- case-specific integration checks -------------------------------------------------------------


def test_gan_two_ddp_models_and_unwrapped_ema(runs):
    traces = ran(runs.dist, "gan_dcgan")
    assert all(t["optimizers"] == 2 and t["ddp_wrapped"] == 2 for t in traces)
    bug_gan_dcgan(runs)


def test_eval_early_stopping(runs):
    traces = ran(runs.dist, "eval_early_stopping")
    train = [train_passes(t, 384) for t in traces]
    stopped = re.findall(r"early stopping at epoch (\d+)", traces[0]["stdout"])
    assert len(stopped) == 1 and len(train[0]) == len(train[1]) == int(stopped[0]) + 1 < 30, (
        f"ranks ran {len(train[0])} / {len(train[1])} epochs; printed {stopped}"
    )
    check_disjoint_shards(traces, 384, len(train[0]))
    # validation: each pass (one per epoch, plus the final one) covers the 203 samples once across ranks
    val = [[p["indices"] for p in t["passes"] if p["loader"] in [ld["id"] for ld in t["loaders"] if ld["dataset_len"] == 203]] for t in traces]
    assert len(val[0]) == len(val[1]) == len(train[0]) + 1
    for k, (a, b) in enumerate(zip(*val)):
        assert sorted(a + b) == list(range(203)), f"validation pass {k}: not every sample exactly once"
    # the distributed metrics equal the original script evaluating the saved checkpoint in one process
    final = r"final val_loss=([\d.]+) acc=([\d.]+)"
    got = [tuple(map(float, m)) for m in re.findall(final, runs.dist.stdout)]
    reference = ran(runs.single, "eval_only_original", world_size=1)[0]
    want = [tuple(map(float, m)) for m in re.findall(final, reference["stdout"])]
    assert len(got) == len(want) == 1
    assert got[0] == pytest.approx(want[0], rel=1e-6)


def test_resume_checkpoint(runs):
    first = ran(runs.dist, "resume_checkpoint")
    again = ran(runs.dist, "resume_again")
    out = again[0]["stdout"]
    assert re.findall(r"resumed from epoch (\d+)", out) == ["2"], out
    assert len(re.findall(r"epoch [23]: loss .* checkpoint saved", out)) == 2, out
    check_disjoint_shards(again, 320, 2)
    check_checkpoints(again, {"resumed.pt": 2})
    import torch

    sd = torch.load(resume_checkpoint(runs.work), map_location="cpu", weights_only=True)
    assert sd["epoch"] == 2 and not any(k.startswith("module.") for k in sd["model"])
    # the original single-GPU script resumes from the converted run's checkpoint
    original = ran(runs.single, "resume_original", world_size=1)[0]
    assert re.findall(r"resumed from epoch (\d+)", original["stdout"]) == ["2"]
    assert len(train_passes(original, 320)) == 1
    assert first[0]["saves"][0]["keys"] == original["saves"][0]["keys"]


def test_side_effects_files(runs):
    ran(runs.dist, "side_effects")
    out = runs.dist.cwd / "side_effects" / "out"
    log = (out / "train.log").read_text().splitlines()
    for epoch in range(3):
        assert sum(bool(re.fullmatch(rf"INFO epoch {epoch} train_loss=[\d.]+", line)) for line in log) == 1, log
    assert len((out / "metrics.csv").read_text().splitlines()) == 3 + 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] == 3


def test_download_dataset_once(runs):
    traces = ran(runs.dist, "download_dataset")
    assert (runs.dist.cwd / "download_dataset" / "data" / "downloaded_by.txt").read_text() == "0\n"
    assert all(len(train_passes(t, 256)) == 2 for t in traces)


def test_amp_accumulation_no_sync_in_the_loop():
    code = golden("amp_accumulation").read_text()
    loop = code[code.index("for step, (x, y) in enumerate(train_loader):") :]
    assert ".no_sync()" in loop[: loop.index("scheduler.step()")]


@pytest.mark.parametrize("name", ["split_loaders", "split_loaders_named"])
def test_split_metrics_equal_single_process(runs, name):
    """Validation over per-rank slices (203 samples: no padding) prints what one process prints."""
    traces = ran(runs.dist, name)
    val = [[p["indices"] for p in t["passes"] if p["loader"] in [ld["id"] for ld in t["loaders"] if ld["dataset_len"] == 203]] for t in traces]
    assert len(val[0]) == len(val[1]) == 2
    for a, b in zip(*val):
        assert sorted(a + b) == list(range(203)), "a validation pass missed or repeated samples"
    metrics = r"epoch (\d) (train|val) loss: ([\d.]+) acc: ([\d.]+)"
    got = re.findall(metrics, traces[0]["stdout"])
    want = re.findall(metrics, ran(runs.single, f"{name}_reference", world_size=1)[0]["stdout"])
    assert [g[:2] for g in got] == [w[:2] for w in want] and len(got) == 4
    for g, w in zip(got, want):
        assert float(g[2]) == pytest.approx(float(w[2]), abs=2e-6) and g[3] == w[3], (g, w)


def test_train_metrics_stop_like_one_process(runs):
    """Training sums and evaluation sums add up over ranks: rank 0 prints what one process with
    twice the batch prints, both ranks stop at the same epoch (no hang), and the evaluation called
    inside torch.save(...) and json.dump(...) ran on every rank."""
    name = "train_metrics_stop"
    traces = ran(runs.dist, name)
    reference = ran(runs.single, f"{name}_reference", world_size=1)[0]
    metric = r"(?m)^(epoch \d+ train_loss|val loss|test loss|final loss)=([\d.]+)(?: correct=(\d+)/\d+)?$"
    got, want = re.findall(metric, traces[0]["stdout"]), re.findall(metric, reference["stdout"])
    assert [g[0] for g in got] == [w[0] for w in want] and len(got) > 6, (got, want)
    for g, w in zip(got, want):
        assert float(g[1]) == pytest.approx(float(w[1]), abs=2e-6) and g[2] == w[2], (g, w)
    stopped = re.findall(r"converged at epoch (\d+)", reference["stdout"])
    assert stopped and re.findall(r"converged at epoch (\d+)", traces[0]["stdout"]) == stopped
    passes = [len(train_passes(t, 384)) for t in traces]
    assert passes == [int(stopped[0]) + 1] * NPROC, f"training passes per rank: {passes}"
    summary = json.loads((runs.dist.cwd / name / "stop_summary.json").read_text())
    assert summary == json.loads((runs.single.cwd / f"{name}_reference" / "stop_summary.json").read_text())


def test_step_based_passes_are_sharded_and_reshuffled(runs):
    """2.5 passes over each loader without an epoch loop: every complete pass gives the ranks
    disjoint halves, and each new pass is a new shuffle (set_epoch advanced per pass)."""
    traces = ran(runs.dist, "step_based_shuffled")
    assert len(re.findall(r"step-based done", traces[0]["stdout"])) == 1 and traces[1]["stdout"] == ""
    for size in (256, 320, 384):  # next()/iter(), while + for, generator
        check_disjoint_shards(traces, size, 2)
        for rank, t in enumerate(traces):
            first, second = train_passes(t, size)
            assert first != second, f"loader over {size}: rank {rank} saw the same order in both passes"


def test_early_stopping_object_like_one_process(runs):
    """The EarlyStopping object gets `model.module`: its checkpoint has no `module.` prefix and
    reloads (after a barrier); every rank stops at the epoch one process stops at."""
    name = "early_stopping_class"
    traces = ran(runs.dist, name)
    reference = ran(runs.single, f"{name}_reference", world_size=1)[0]
    losses = r"(?m)^epoch (\d+) valid_loss=([\d.]+)$"
    got, want = re.findall(losses, traces[0]["stdout"]), re.findall(losses, reference["stdout"])
    assert [g[0] for g in got] == [w[0] for w in want] and len(got) > 3, (got, want)
    for g, w in zip(got, want):
        assert float(g[1]) == pytest.approx(float(w[1]), abs=2e-6), (g, w)
    passes = [len(train_passes(t, 256)) for t in traces]
    assert passes == [len(want)] * NPROC, f"training passes per rank: {passes}"


def test_trainer_constructor_metrics_like_one_process(runs):
    """The Trainer's training and validation sums add up over ranks: rank 0 prints what one
    process with twice the batch prints."""
    name = "trainer_constructor"
    metric = r"(?m)^Epoch (\d) \| (train_loss|val_loss) ([\d.]+)$"
    got = re.findall(metric, ran(runs.dist, name)[0]["stdout"])
    want = re.findall(metric, ran(runs.single, f"{name}_reference", world_size=1)[0]["stdout"])
    assert [g[:2] for g in got] == [w[:2] for w in want] and len(got) == 6, (got, want)
    for g, w in zip(got, want):
        assert float(g[2]) == pytest.approx(float(w[2]), abs=2e-6), (g, w)


def test_sampler_branches_shuffled_shards(runs):
    """`--shuffle` picks the RandomSampler branch: it is a DistributedSampler too, so the ranks
    read disjoint halves, reshuffled every epoch (set_epoch outside the script's `if distributed:`)."""
    traces = ran(runs.dist, "sampler_branches_shuffled")
    assert traces[0]["stdout"].count("sampler branches done") == 1 and traces[1]["stdout"] == ""
    check_disjoint_shards(traces, 384, 2)
    for rank, t in enumerate(traces):
        first, second = train_passes(t, 384)
        assert first != second, f"rank {rank}: the same order in both epochs"
        assert first != sorted(first), f"rank {rank}: --shuffle did not shuffle"


def test_warmup_scheduler_is_no_accumulation():
    """The warm-up scheduler's `if` steps no optimizer: no micro-step skips DDP's all-reduce
    (the ranks' parameters are compared after every step by the replica check of the runs)."""
    assert "no_sync" not in golden("warmup_scheduler").read_text()


def test_transfer_tempdir_one_folder_for_every_rank(runs):
    """The best weights go to a TemporaryDirectory, a different folder on every rank: every rank
    takes rank 0's, rank 0 saves there, and every rank reloads the same weights after a barrier
    (then waits before rank 0 removes the folder). The replica check and the single-process
    equivalence of the run cover the reloaded weights."""
    traces = ran(runs.dist, "transfer_tempdir")
    temp = [s["path"] for s in traces[0]["saves"] if s["path"].endswith("best_model_params.pt")]
    assert len(temp) >= 2 and len(set(temp)) == 1, temp  # the initial weights, then every better epoch
    assert traces[1]["saves"] == [], [s["path"] for s in traces[1]["saves"]]
    assert not Path(temp[0]).parent.exists(), "rank 0's temporary folder was left behind"


def test_per_process_effects_stay_on_every_rank(runs):
    """The Dataset's sample log (named after the pid), the collate_fn and worker_init_fn messages
    and the RANK-named run log come from both ranks; the dataset's own message comes once."""
    traces = ran(runs.dist, "per_process_effects")
    work = runs.dist.cwd / "per_process_effects"
    logs = sorted(work.glob("samples_*.log"))
    assert len(logs) == NPROC, f"sample logs: {[p.name for p in logs]}"
    served = [[int(line) for line in p.read_text().split()] for p in logs]
    assert all(len(s) == 2 * 128 for s in served), [len(s) for s in served]
    for epoch in range(2):
        halves = [s[epoch * 128 : (epoch + 1) * 128] for s in served]
        assert sorted(halves[0] + halves[1]) == list(range(256)), f"epoch {epoch}: the logs do not cover the data once"
    assert sorted(p.name for p in work.glob("run_*.log")) == ["run_0.log", "run_1.log"]
    assert len(re.findall(r"per-process collate: first batch of 16", runs.dist.stderr)) == NPROC * 2
    assert len(re.findall(r"per-process worker 0 seeded", runs.dist.stderr)) == NPROC * 2
    assert all(len(train_passes(t, 256)) == 2 for t in traces)


def test_hand_batches_ranks_draw_their_own_batches(runs):
    """Random batches from a seeded generator: with the seed offset by rank the ranks differ."""
    traces = ran(runs.dist, "hand_batches")
    assert all(t["loaders"] == [] for t in traces)
    assert len(re.findall(r"step \d+: train loss", traces[0]["stdout"])) == 3
    tokens = [t["trained_tokens"] for t in traces]
    assert len(tokens[0]) == len(tokens[1]) == 30, "one training forward per step on each rank"
    same = sum(a == b for a, b in zip(*tokens))
    assert same == 0, f"{same} of 30 steps trained both ranks on the same batch"


def test_hand_batches_sequential_disjoint_rows(runs):
    """Every token is its own position: the ranks train on disjoint, equal blocks of the stream."""
    traces = ran(runs.dist, "hand_batches_sequential")
    seen = [[set(), set()] for _ in traces]  # per rank, per epoch
    for rank, t in enumerate(traces):
        forwards = t["trained_tokens"]
        assert len(forwards) % 2 == 0 and forwards, f"rank {rank}: {len(forwards)} training forwards"
        half = len(forwards) // 2
        for epoch, chunk in enumerate((forwards[:half], forwards[half:])):
            seen[rank][epoch] = {token for forward in chunk for token in forward}
    assert len(traces[0]["trained_tokens"]) == len(traces[1]["trained_tokens"]), "ranks took different step counts"
    for epoch in range(2):
        a, b = seen[0][epoch], seen[1][epoch]
        assert not a & b, f"epoch {epoch}: ranks share {len(a & b)} tokens"
        assert len(a) == len(b) and len(a | b) >= 0.95 * 1024, (len(a), len(b))


@pytest.mark.torchrun
def test_spawn_launcher(tmp_path):
    """`NPROC_PER_NODE=2 python converted.py`: the script starts its 2 processes itself.

    Run through tracer.py under plain python: the harness traces mp.spawn's children as ranks
    0 and 1 (and the launching process as rank "launcher"), so the replicas are checked too."""
    args = ["--batch-size", str(B), "--epochs", "2"]
    plan = [{"label": "spawn", "script": str(golden("spawn_launcher")), "args": args, "env": {"NPROC_PER_NODE": str(NPROC)}}]
    for attempt in range(3):
        work = tmp_path / f"attempt{attempt}"
        launch = run_plan(plan, work, nproc=None, ranks=NPROC)
        # Known upstream flake (about 1 run in 10 here): a spawned gloo process can abort in C++ at
        # interpreter exit, after training finished and the checkpoint was written. Only that case
        # is run again; anything else fails at once, and three aborts in a row fail too.
        exit_abort = "terminate called without an active exception" in launch.stderr and "spawn run saved" in launch.stdout
        if launch.returncode == 0 or not exit_abort:
            break
        print(f"attempt {attempt + 1}: gloo aborted at exit after a complete run; running again")
    log = launch.log()
    assert launch.returncode == 0, log
    traces = ran(launch, "spawn")  # the children, checked for identical parameters after every step
    assert [t["env_rank"] for t in traces] == list(range(NPROC)), log
    for rank, t in enumerate(traces):
        assert [(g["backend"], g["world_size"], g["rank"]) for g in t["init_process_group"]] == [("gloo", NPROC, rank)]
        assert t["ddp_wrapped"] == 1 and t["optimizer_steps"] and t["optimizer_steps"][0], f"rank {rank}: {t}"
    assert (work / "trace-spawn-launcher.json").exists(), "the launching process wrote no trace"
    assert len(re.findall(r"spawn epoch \d: loss", launch.stdout)) == 2, log
    assert len(re.findall(r"spawn run saved spawn_model\.pt", launch.stdout)) == 1, log
    import torch

    state = torch.load(work / "spawn" / "spawn_model.pt", map_location="cpu", weights_only=True)
    assert state and not any(k.startswith("module.") for k in state)


@pytest.mark.parametrize("name", ORIGINALS_ON_CPU)
def test_original_runs_with_plain_python_on_cpu(runs, name):
    t = ran(runs.single, f"{name}_original", world_size=1)[0]
    assert t["init_process_group"] == [] and t["ddp_wrapped"] == 0 and t["saves"], "not a single-GPU script?"


@pytest.mark.parametrize("name", list(BUG_CHECKS))
def test_once_broken_now_right(runs, name):
    """Each converter bug these fixtures found stays fixed."""
    BUG_CHECKS[name](runs)


def test_data_parallel_wrapped_after_to_device(runs):
    bug_data_parallel(runs)


def test_no_dataparallel_left():
    assert "DataParallel(" not in golden("data_parallel").read_text()
    assert "DataParallel(" not in golden("trainer_class").read_text()


def test_hand_updates_stop_together_on_the_mean_loss(runs):
    """Hand-written SGD without torch.optim over per-rank random batches: both ranks stop at the
    same step (the stop test reads the loss averaged over ranks; no hang) and end with the same
    weights (DDP averaged the gradients the hand update applies; checked by ran())."""
    traces = ran(runs.dist, "hand_updates")
    assert traces[1]["stdout"] == ""
    stopped = re.findall(r"Loss: ([\d.]+) after (\d+) batches", traces[0]["stdout"])
    assert len(stopped) == 1 and int(stopped[0][1]) < 300, traces[0]["stdout"]
    assert all(t["ddp_final"] for t in traces)  # ran(): the DDP model's final checksum agrees across ranks


def test_endless_loader_passes_are_sharded(runs):
    """Each pass of the endless loader gives the ranks disjoint halves of the 96 samples, in a new
    order each pass (the replacement sampler became a DistributedSampler advanced per pass)."""
    traces = ran(runs.dist, "endless_loader")
    per_rank = [train_passes(t, 96) for t in traces]
    assert min(len(p) for p in per_rank) >= 5, [len(p) for p in per_rank]
    for first, second in zip(*per_rank):
        assert not set(first) & set(second) and len(first) == len(second) == 48
        assert set(first) | set(second) == set(range(96))
    assert per_rank[0][0] != per_rank[0][1], "the same order in two passes"
