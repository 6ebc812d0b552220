"""`convert --to fsdp2`: the converted fixtures shard their models with FSDP2 and train right under
real torchrun (2 CPU processes, gloo).

fixtures/fsdp2/<case>.in.py -> <case>.out.py (reviewed goldens; `--update-goldens` rewrites them).
One torchrun launch runs every case with shuffle off (and the transformer with shuffle on too);
one plain-python launch runs each converted script as one process with twice the batch (and the
fp32 originals). The tests read the traces (ddpify/verify/tracer.py): FSDP2's fully_shard wrapped
the model, each rank read its own half of the data, every rank's whole (gathered) parameters are
equal after every optimizer step (Launch.trace checks it), equal to the one-process run at 2x the
batch, one voice, one checkpoint that loads into the original model class, and a restart that
resumes from a full-state-dict checkpoint trains on as one uninterrupted run does.
"""

from __future__ import annotations

import ast
import re

import pytest
import torch

from cli_in_process import ddpify
from conftest import NPROC, ROOT, run_plan
from ddpify.engine import ConvertOptions, convert_source

FIXTURES = ROOT / "fixtures" / "fsdp2"
FSDP2 = ConvertOptions(target="fsdp2")
B = 16

# case -> (train set size, epochs, checkpoint file, model class, a line printed per epoch, tolerance vs one process)
CASES = {
    "mlp": (384, 2, "mlp.pt", "DeepMLP", r"epoch \d: mean batch loss", 1e-5),
    "tiny_gpt": (192, 2, "tiny_decoder.pt", "TinyDecoder", r"epoch \d: last loss", 2e-2),  # bf16 compute
    "cnn_stages": (256, 2, "staged_cnn.pt", "StagedCNN", r"epoch \d: \d+ images", 1e-5),
    "resume": (320, 2, "last.pt", "Classifier", r"epoch \d: loss", 1e-5),
    "factory": (256, 2, "denoiser.pt", "Denoiser", r"epoch \d: mse", 1e-5),  # sharded inside its builder
    "sampler_method": (256, 2, "refiner.pt", "Refiner", r"epoch \d: loss [\d.]+, refined probe mean", 1e-5),
    "own_method": (256, 2, "tagger.pt", "StepTagger", r"epoch \d: mean batch loss", 1e-5),  # a method of its own reads the parameters
    "whole_model": (256, 2, "curve.pt", "CurveFit", r"epoch \d: mse", 1e-5),  # the whole object saved, reloaded, probed on rank 0
    "penalty": (256, 2, "critic.pt", "Critic", r"epoch \d: critic", 1e-5),  # a gradient penalty: the critic replicated, the generator sharded
    "model_graph": (256, 2, "points.pt", "PointClassifier", r"epoch \d: loss", 1e-5),  # writer.add_graph(model, ...) dropped
}
MODELS = {"penalty": {"Sequential": "fsdp2", "Critic": "replicate"}}  # (the default: the model class, sharded)
FP32_ORIGINALS = ("mlp", "cnn_stages", "factory", "sampler_method", "own_method", "whole_model", "penalty", "model_graph")
# Inputs whose every TODO is pinned: what FSDP2 cannot do as the script does it (not run).
LEFT_TO_THE_USER = {
    "outside_forward": [
        "`critic.code_scale()` reads the model's parameters outside forward",
        "FSDP2 cannot deepcopy a sharded model",
        "FSDP2 shards contiguous parameters only",
    ],
}  # the original (no bf16) must give the same parameters too


def env(batch: int, epochs: int, shuffle: bool = False) -> dict:
    return {"BATCH_SIZE": str(batch), "EPOCHS": str(epochs), "SHUFFLE": "1" if shuffle else "0"}


PARAMETER_LOOPS = """\
import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
for step in range(3):
    loss = model(torch.randn(16, 4)).pow(2).mean()
    model.zero_grad()
    loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-0.1)
for name, p in model.named_parameters():
    print(name, p.norm())
"""


def test_a_loop_that_shows_the_parameters_reads_them_whole_one_that_updates_them_is_left():
    """Under FSDP2 each parameter is this rank's shard: a loop that hands them to a print reads
    them gathered whole; a loop that updates them by hand (`p.data.add_(p.grad, ...)`) must keep
    the model's own parameters."""
    code = convert_source(PARAMETER_LOOPS, "train.py", FSDP2).code
    assert "for p in model.parameters():\n        p.data.add_(p.grad, alpha=-0.1)" in code
    assert "for name, p in ((name, model_whole[name]) for name, _ in model.named_parameters()):" in code
    assert code.index("model_whole = get_model_state_dict(model") < code.index("for name, p in ((name, model_whole")


@pytest.mark.parametrize("case", sorted([*CASES, *LEFT_TO_THE_USER]))
def test_golden_conversion(case, update_goldens):
    src, golden = FIXTURES / f"{case}.in.py", FIXTURES / f"{case}.out.py"
    result = convert_source(src.read_text(), str(src), FSDP2)
    if update_goldens and (not golden.exists() or golden.read_text() != result.code):
        golden.write_text(result.code)
    assert result.code == golden.read_text(), f"{golden.name} is stale: pytest tests/test_fsdp2.py --update-goldens"
    todos = [t.message for t in result.todos]
    wanted = LEFT_TO_THE_USER.get(case, [])
    assert len(todos) == len(wanted) and all(any(w in t for t in todos) for w in wanted), todos
    again = convert_source(result.code, str(golden), FSDP2)
    assert again.code == result.code, "converting the FSDP2 script again changed it"
    lint = ddpify("check", "--to", "fsdp2", str(golden))
    assert lint.returncode == 0, f"the converted script trips ddpify check:\n{lint.stdout}"
    code = result.code
    assert "fully_shard(" in code and "DistributedDataParallel" not in code and ".module" not in code
    assert code.index("fully_shard(") < code.index("torch.optim."), "the optimizer must be built after fully_shard"


def test_golden_sharded_checkpoints(update_goldens):
    """`--sharded-checkpoints`: the save becomes dcp.save on every rank (never behind a rank guard)."""
    src, golden = FIXTURES / "mlp.in.py", FIXTURES / "mlp.dcp.out.py"
    result = convert_source(src.read_text(), str(src), ConvertOptions(target="fsdp2", sharded_checkpoints=True))
    if update_goldens and golden.read_text() != result.code:
        golden.write_text(result.code)
    assert result.code == golden.read_text(), f"{golden.name} is stale: pytest tests/test_fsdp2.py --update-goldens"
    assert 'dcp.save({"model": get_model_state_dict(model)}' not in result.code  # the script saves the bare state dict
    assert "\ndcp.save(get_model_state_dict(model), checkpoint_id=" in result.code


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("fsdp2")
    out = {case: str(FIXTURES / f"{case}.out.py") for case in CASES}
    dist_plan = [{"label": case, "script": out[case], "args": [], "env": env(B, CASES[case][1])} for case in CASES if case != "resume"]
    dist_plan += [
        {"label": "tiny_gpt_shuffled", "script": out["tiny_gpt"], "args": [], "env": env(B, 2, shuffle=True)},
        {"label": "resume_first", "script": out["resume"], "args": [], "env": env(B, 1), "cwd": "resume"},
        {"label": "resume", "script": out["resume"], "args": [], "env": env(B, 2), "cwd": "resume"},
        {"label": "mlp_dcp", "script": str(FIXTURES / "mlp.dcp.out.py"), "args": [], "env": env(B, 2)},
    ]
    single_plan = [{"label": case, "script": out[case], "args": [], "env": env(NPROC * B, CASES[case][1])} for case in CASES]
    single_plan += [
        {"label": f"{case}_original", "script": str(FIXTURES / f"{case}.in.py"), "args": [], "env": env(NPROC * B, CASES[case][1])}
        for case in FP32_ORIGINALS
    ]  # fmt: skip
    project = _converted_project(work / "seq2seq")
    dist_plan.append({"label": "seq2seq", "script": str(project), "args": [], "env": env(B, 2)})
    single_plan.append({"label": "seq2seq", "script": str(project), "args": [], "env": env(NPROC * B, 2)})
    dist = run_plan(dist_plan, work / "torchrun", nproc=NPROC)
    single = run_plan(single_plan, work / "python", nproc=None)
    return dist, single


def _converted_project(folder):
    """fixtures/fsdp2/seq2seq_project converted in place in a copy: its model comes from a factory in
    another module, and the training step runs the model's parts through its own methods."""
    import shutil

    from ddpify.projects import convert_project

    shutil.copytree(FIXTURES / "seq2seq_project", folder)
    result = convert_project(folder / "train.py", FSDP2)
    for path, (outcome, _, _) in result.changed.items():
        assert not outcome.todos, outcome.todos
        path.write_text(outcome.code)
    assert "fully_shard(model.source" in (folder / "train.py").read_text()
    return folder / "train.py"


def ran(launch, label: str, ranks: int) -> list[dict]:
    traces = []
    for rank in range(ranks):
        assert (label, rank) in launch.traces, f"no trace of {label} rank {rank}\n{launch.log()}"
        t = launch.trace(label, rank)  # also checks that the ranks' whole parameters agree after every step
        assert t["exit_code"] == 0, f"{label} rank {rank}: {t['error']}\n{launch.log()}"
        traces.append(t)
    return traces


def train_passes(trace: dict, size: int) -> list[list[int]]:
    loaders = [ld["id"] for ld in trace["loaders"] if ld["dataset_len"] == size]
    assert len(loaders) == 1, trace["loaders"]
    return [p["indices"] for p in trace["passes"] if p["loader"] == loaders[0] and p["complete"]]


def max_diff(a: list, b: list) -> float:
    assert [[t.shape for t in g] for g in a] == [[t.shape for t in g] for g in b]
    return max((x.double() - y.double()).abs().max().item() for ga, gb in zip(a, b) for x, y in zip(ga, gb))


def original_model(case: str):
    """An instance of the model class of the single-GPU script (its classes and constants, not its training)."""
    tree = ast.parse((FIXTURES / f"{case}.in.py").read_text())
    keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.ClassDef)) or (
        isinstance(n, ast.Assign) and _literal(n.value))]  # fmt: skip
    namespace: dict = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(FIXTURES / f"{case}.in.py"), "exec"), namespace)
    return namespace[CASES[case][3]]()


def _literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("case", [c for c in CASES if c != "resume"])
def test_sharded_training_matches_one_process_with_double_batch(runs, case):
    dist, single = runs
    size, epochs, _, model_class, _, tolerance = CASES[case]
    traces = ran(dist, case, NPROC)
    for rank, t in enumerate(traces):
        assert [(g["backend"], g["world_size"], g["rank"]) for g in t["init_process_group"]] == [("gloo", NPROC, rank)]
        wrapped = {m["module"]: m.get("kind") for m in t["ddp_models"]}  # the roots, their blocks folded into them
        assert t["ddp_wrapped"] == len(wrapped) and wrapped == MODELS.get(case, {model_class: "fsdp2"}), t["ddp_models"]
        assert t["uncovered"] == [], "an optimizer trains parameters fully_shard never sharded"
        assert t["destroy_process_group"] == 1 and not t["dist_initialized_at_exit"]
        assert all(len(steps) > 0 for steps in t["optimizer_steps"]) and t["optimizer_steps"]
    shards = [train_passes(t, size) for t in traces]
    for epoch in range(epochs):
        halves = [set(s[epoch]) for s in shards]
        assert not halves[0] & halves[1] and halves[0] | halves[1] == set(range(size)), f"epoch {epoch}: not two disjoint halves"
    (alone,) = ran(single, case, 1)
    assert [g["world_size"] for g in alone["init_process_group"]] == [1], "plain python must be one process"
    diff = max_diff(dist.params(case, 0), single.params(case, 0))
    assert diff <= tolerance, f"{case}: max |param - one process at batch {NPROC * B}| = {diff:g}"
    if case in FP32_ORIGINALS:
        ran(single, f"{case}_original", 1)
        diff = max_diff(dist.params(case, 0), single.params(f"{case}_original", 0))
        assert diff <= tolerance, f"{case}: max |param - the original at batch {NPROC * B}| = {diff:g}"


@pytest.mark.parametrize("case", [c for c in CASES if c != "resume"])
def test_one_voice_and_one_checkpoint_that_loads_into_the_original_model(runs, case):
    dist, _ = runs
    _, epochs, checkpoint, _, per_epoch, _ = CASES[case]
    traces = ran(dist, case, NPROC)
    assert traces[1]["stdout"] == "" and traces[1]["saves"] == [], "rank 1 printed or saved"
    assert len(re.findall(per_epoch, traces[0]["stdout"])) == epochs
    assert [s["path"] for s in traces[0]["saves"]] == [checkpoint]
    state = torch.load(dist.cwd / case / checkpoint, map_location="cpu", weights_only=True)
    model = original_model(case)
    model.load_state_dict(state)  # strict: every key, every shape, no DTensor left
    assert all(type(v) is torch.Tensor for v in state.values())
    final = [p for group in dist.params(case, 0) for p in group]
    assert any(torch.equal(p.detach(), f) for p in model.parameters() for f in final), "saved weights are not the trained ones"


def test_shuffled_epochs_differ(runs):
    dist, _ = runs
    traces = ran(dist, "tiny_gpt_shuffled", NPROC)
    for rank, t in enumerate(traces):
        passes = train_passes(t, CASES["tiny_gpt"][0])
        assert len(passes) == 2 and passes[0] != passes[1], f"rank {rank}: the same order twice (set_epoch?)"
        assert passes[0] != sorted(passes[0])
    assert t["no_sync_steps"] == 0, "an optimizer step used gradients that were never reduced"


def test_a_restart_resumes_from_the_full_state_dict_checkpoint(runs):
    dist, single = runs
    ran(dist, "resume_first", NPROC)
    traces = ran(dist, "resume", NPROC)
    assert traces[0]["stdout"].count("resumed after epoch 0") == 1 and traces[1]["stdout"] == ""
    assert len(traces[0]["passes"]) == 1, "the resumed run trains the one epoch left"
    ran(single, "resume", 1)  # two epochs in one go, one process, batch 2B
    diff = max_diff(dist.params("resume", 0), single.params("resume", 0))
    assert diff <= CASES["resume"][5], f"resumed training is {diff:g} away from one uninterrupted run"
    state = torch.load(dist.cwd / "resume" / "last.pt", map_location="cpu", weights_only=True)
    original_model("resume").load_state_dict(state["model"])
    assert state["epoch"] == 1


# --- `ddpify verify --to fsdp2`: the same invariants, read the FSDP2 way -----------------------


def _verify(tmp_path, monkeypatch, converted=None):
    from ddpify.verify.session import VerifyOptions, verify

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BATCH_SIZE", "16")
    original = FIXTURES / "mlp.in.py"
    return verify(original, converted, VerifyOptions(timeout=90, convert_options=FSDP2))


@pytest.mark.torchrun
def test_verify_passes_the_fsdp2_conversion(tmp_path, monkeypatch):
    result = _verify(tmp_path, monkeypatch)
    statuses = {r.number: r.status for r in result.results}
    assert [n for n, s in statuses.items() if s == "FAIL"] == [], [(r.number, r.summary) for r in result.results]
    assert {n for n, s in statuses.items() if s == "PASS"} >= {1, 2, 3, 4, 5, 6, 7, 9, 10}
    assert "DeepMLP sharded with FSDP2 before training" in result.results[1].summary
    assert "equal one process at 2x the batch" in result.results[4].summary
    assert result.exit_code == 0


@pytest.mark.torchrun
def test_verify_fails_an_optimizer_built_before_fully_shard(tmp_path, monkeypatch):
    code = (FIXTURES / "mlp.out.py").read_text()
    build = "optimizer = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.5)\n"
    assert build in code
    broken = code.replace(build, "").replace("mesh = init_device_mesh(", build + "mesh = init_device_mesh(", 1)
    path = tmp_path / "mlp_broken.py"
    path.write_text(broken)
    result = _verify(tmp_path, monkeypatch, path)
    two = result.results[1]
    assert two.status == "FAIL" and "parameters outside DDP" in two.summary, two.summary
    assert result.exit_code == 1


HAND_UPDATES = """\
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
data = TensorDataset(torch.randn(128, 4), torch.randn(128, 1))
loader = DataLoader(data, batch_size=16, shuffle=True)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
for epoch in range(2):
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
    print(f"epoch {epoch}: loss {loss.item():.4f}")
"""


@pytest.mark.torchrun
def test_verify_reads_a_sharded_model_updated_by_hand_whole(tmp_path, monkeypatch):
    """No optimizer: the parameters updated by hand are each rank's shard; verify gathers them
    whole before it compares the ranks (they agree), as it does for an optimizer's."""
    from ddpify.verify.session import VerifyOptions, verify

    monkeypatch.chdir(tmp_path)
    original = tmp_path / "hand.py"
    original.write_text(HAND_UPDATES)
    result = verify(original, None, VerifyOptions(timeout=90, convert_options=FSDP2))
    four = result.results[3]
    assert four.status == "PASS", (four.summary, [(r.number, r.status, r.summary) for r in result.results])


def test_sharded_checkpoint_folder_holds_every_rank_and_converts_to_the_original_model(runs, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dist, _ = runs
    ran(dist, "mlp_dcp", NPROC)
    folder = dist.cwd / "mlp_dcp" / "mlp.pt"
    assert folder.is_dir() and (folder / ".metadata").exists()
    assert sorted(p.name for p in folder.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(NPROC)], "a rank wrote no shard"
    dcp_to_torch_save(folder, tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=True)
    model = original_model("mlp")
    model.load_state_dict(state)
    final = [p for group in dist.params("mlp_dcp", 0) for p in group]
    assert all(torch.equal(p.detach(), f) for p, f in zip(model.parameters(), final))
    assert max_diff(dist.params("mlp_dcp", 0), dist.params("mlp", 0)) == 0, "the save changed the training"


def test_a_project_keeps_its_notes(tmp_path):
    """The summary of a project (an entry that imports its model from a module of its own) has the
    same notes as a single file: here, that the model has no blocks ddpify can see."""
    from ddpify.projects import convert_project

    (tmp_path / "net.py").write_text(
        "import torch.nn as nn\n\n\nclass Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = nn.Linear(4, 1)\n\n    def forward(self, x):\n        return self.fc(x)\n"
    )
    (tmp_path / "train.py").write_text(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\nfrom net import Net\n\n"
        "loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=True)\n"
        "model = Net()\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\nfor epoch in range(2):\n"
        "    for x, y in loader:\n        optimizer.zero_grad()\n"
        "        torch.nn.functional.mse_loss(model(x), y).backward()\n        optimizer.step()\n"
    )
    result = convert_project(tmp_path / "train.py", FSDP2)
    notes = [n.message for outcome, _, _ in result.changed.values() for n in outcome.notes]
    assert any("has no repeated blocks ddpify can see" in n for n in notes), notes


def test_a_step_through_the_models_own_methods_trains_in_step(runs):
    """The submodules `encode`/`decode`/`project` run become units of their own: every rank's whole
    parameters agree after every step (Launch.trace checks it) and equal one process at 2x the batch."""
    dist, single = runs
    traces = ran(dist, "seq2seq", NPROC)
    assert all(t["uncovered"] == [] and t["optimizer_steps"][0] for t in traces)
    ran(single, "seq2seq", 1)
    diff = max_diff(dist.params("seq2seq", 0), single.params("seq2seq", 0))
    assert diff <= 1e-5, f"max |param - one process at batch {NPROC * B}| = {diff:g}"
    state = torch.load(dist.cwd / "seq2seq" / "translator.pt", map_location="cpu", weights_only=True)
    assert sorted(state) == sorted(["source.weight", "target.0.weight", "target.0.bias", "head.weight", "head.bias"])


def test_shard_names_the_block_class():
    """`--shard CLASS`: every CLASS inside the model becomes a unit (by isinstance when the script
    binds the name, by class name when the class is a library's), then the root."""
    src = (FIXTURES / "tiny_gpt.in.py").read_text()
    code = convert_source(src, "tiny_gpt.py", ConvertOptions(target="fsdp2", shard="DecoderBlock")).code
    assert "for module in [module for module in model.modules() if isinstance(module, DecoderBlock) and module is not model]:" in code
    assert code.index("fully_shard(module, mesh=mesh, mp_policy=mp_policy)") < code.index("fully_shard(model, mesh=mesh, mp_policy=mp_policy)")
    code = convert_source(src, "tiny_gpt.py", ConvertOptions(target="fsdp2", shard="TransformerEncoderLayer")).code
    assert 'if type(module).__name__ == "TransformerEncoderLayer" and module is not model]' in code
    compile(code, "tiny_gpt.py", "exec")


BUILT_IN_A_BRANCH = """\
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--eval-only", action="store_true")
args = parser.parse_args()


def main():
    if not args.eval_only:
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        model = model.to("cpu")
        for step in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def options():
    model = parser.add_argument_group("model")
    model.add_argument("--width", type=int)


if __name__ == "__main__":
    main()
"""


def test_a_model_built_and_trained_inside_a_branch_is_sharded_there_before_its_optimizer():
    """`if not args.eval_only:` builds, then trains: the model is sharded inside that block,
    before the optimizer is built over it (after the block it would be after training); a local
    `model` of another function (an argparse group) is no model of the script."""
    code = convert_source(BUILT_IN_A_BRANCH, "train.py", FSDP2).code
    assert code.index("    fully_shard(model, mesh=mesh)") < code.index("optimizer = torch.optim.Adam")
    assert "register_fsdp_forward_method" not in code and "TODO" not in code
    compile(code, "train.py", "exec")


WRAPPED_AND_PENALISED = """\
import torch
import torch.nn as nn


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Scaled(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return self.net(x) * self.scale


model = Body()
model = Scaled(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
average = torch.optim.swa_utils.AveragedModel(model)
for step in range(3):
    x = torch.randn(8, 4).requires_grad_(True)
    out = model(x)
    grads = torch.autograd.grad(out.sum(), x, create_graph=True)[0]
    loss = out.pow(2).mean() + grads.pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    average.update_parameters(model)
torch.save(average.state_dict(), "average.pt")
"""


def test_a_model_fsdp2_cannot_shard_is_replicated_and_its_class_is_the_outer_wrapper():
    """`model = Scaled(model)` is a `Scaled` (no `model.blocks` to shard); a 0-dim parameter
    (`nn.Parameter(torch.tensor(1.0))`) or a gradient of its gradient makes it `replicate(model)`
    (DDP in place) with a line in the summary; `AveragedModel` is a model, not an optimizer."""
    result = convert_source(WRAPPED_AND_PENALISED, "train.py", FSDP2)
    assert "replicate(model)" in result.code and "fully_shard(model" not in result.code and "model.blocks" not in result.code
    assert "get_optimizer_state_dict" not in result.code
    assert any("replicated" in c.message for c in result.changes), result.changes
    compile(result.code, "train.py", "exec")
