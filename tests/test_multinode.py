"""Beyond one machine, on one machine: two torchrun agents as two nodes, and an elastic restart.

Two nodes: two agents (`--nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d
--rdzv-endpoint=127.0.0.1:PORT`, the command `ddpify convert --launch` prints, built by the
same `torchrun_argv`), each in its own folder standing for its node's local disk, with a shared
folder for checkpoints. Converted fixtures and an example train on the four ranks; the tracer
records what each rank did: disjoint shards over both nodes, identical parameters everywhere,
one copy of each log line and checkpoint for the whole job, each node's data prepared once, on
that node.

Elastic: a converted script whose first attempt dies mid-epoch under `--max-restarts=1` goes on
from its last checkpoint and ends with the parameters of an uninterrupted run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TORCHRUN_TIMEOUT_S, assert_replicas_identical, progress

from ddpify.engine import convert_source
from ddpify.launch_files import torchrun_argv
from ddpify.verify.launch import TORCHRUN_ENV, TRACER, stop

PER_NODE = 2
WORLD = 2 * PER_NODE
# label -> (converted script, its arguments (SHARED: the shared folder), training set size, epochs, checkpoint)
RUNS = {
    "download_dataset": (ROOT / "fixtures" / "patterns" / "download_dataset.out.py", ["--epochs", "2"], 256, 2, None),
    "resume_checkpoint": (
        ROOT / "fixtures" / "patterns" / "resume_checkpoint.out.py",
        ["--epochs", "2", "--checkpoint", "SHARED/resume.pt"], 320, 2, "resume.pt",
    ),
    "mnist": (
        ROOT / "examples" / "mnist_ddp.py",
        ["--epochs", "1", "--train-size", "128", "--test-size", "64", "--save-model"], 128, 1, None,
    ),
    # an input, converted when the launch is set up
    "vocab_at_start": (ROOT / "fixtures" / "nodes" / "vocab_at_start.py", ["--epochs", "2"], 96, 2, None),
    # `if args.local_rank in [-1, 0]:` around the log and the checkpoint: once per node as written
    "local_rank_guard": (
        ROOT / "fixtures" / "nodes" / "local_rank_guard.py",
        ["--epochs", "2", "--output-dir", "SHARED/out"], 128, 2, "out/model.pt",
    ),
}  # fmt: skip


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def clean_env(trace_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DDPIFY_TRACE_DIR=str(trace_dir))
    return env


def run_agents(commands: list[tuple[list[str], Path]], env: dict) -> list[subprocess.CompletedProcess]:
    """Start every agent at once (a rendezvous waits for all); wait for all, stop all on a hang."""
    procs = [
        subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for cmd, cwd in commands
    ]  # fmt: skip
    done = []
    for proc, (cmd, cwd) in zip(procs, commands):
        try:
            out, err = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in procs:
                stop(other, cwd)
            out, err = proc.communicate()
        done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    return done


def traces_of(trace_dir: Path, label: str, ranks: int) -> list[dict]:
    import json

    found = []
    for rank in range(ranks):
        path = trace_dir / f"trace-{label}-{rank}.json"
        assert path.exists(), f"no trace of {label} rank {rank}"
        found.append(json.loads(path.read_text()))
    return found


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """One launch of two agents, two processes each, running every run of RUNS in turn."""
    import json

    work = tmp_path_factory.mktemp("nodes")
    shared, traces = work / "shared", work / "traces"
    shared.mkdir()
    traces.mkdir()
    port = free_port()
    commands = []
    for node in range(2):
        disk = work / f"node{node}"
        plan = []
        for label, (script, args, *_rest) in RUNS.items():
            (disk / label).mkdir(parents=True)
            if not script.name.endswith(("_ddp.py", ".out.py")):
                converted = work / f"{script.stem}_ddp.py"
                converted.write_text(convert_source(script.read_text(), script.name).code)
                script = converted
            args = [a.replace("SHARED", str(shared)) for a in args]
            plan.append({"label": label, "script": str(script), "args": args, "cwd": str(disk / label)})
        (disk / "plan.json").write_text(json.dumps(plan, indent=1))
        argv = torchrun_argv(
            str(TRACER), ["--plan", str(disk / "plan.json")], nproc_per_node=str(PER_NODE), nnodes="2",
            node_rank=str(node), rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="ddpify-two-nodes",
        )  # fmt: skip
        commands.append(([sys.executable, "-m", "torch.distributed.run", *argv[1:]], disk))
    progress(f"two torchrun agents (2 nodes x {PER_NODE} processes): {len(RUNS)} runs in {work}/")
    results = run_agents(commands, clean_env(traces))
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node} agent failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    return work, results, [cmd for cmd, _ in commands]


@pytest.mark.parametrize("label", RUNS)
def test_two_nodes_train_as_one_job(two_nodes, label):
    work, *_ = two_nodes
    script, _args, train_size, epochs, checkpoint = RUNS[label]
    traces = traces_of(work / "traces", label, WORLD)
    for rank, trace in enumerate(traces):
        assert trace["exit_code"] == 0, f"{label} rank {rank}: {trace['error']}"
        assert trace["init_process_group"] and trace["init_process_group"][0]["world_size"] == WORLD
        assert trace["ddp_models"], f"{label} rank {rank}: no DDP model"
    # disjoint shards over both nodes, every sample once per epoch
    for epoch in range(epochs):
        shards = [_train_passes(t, train_size)[epoch] for t in traces]
        seen = [i for shard in shards for i in shard]
        assert sorted(seen) == list(range(train_size)), f"{label} epoch {epoch}: shards overlap or miss samples"
    # identical parameters on all four ranks, after every step
    assert_replicas_identical(work / "traces", label, traces)
    # one voice for the whole job: global rank 0 alone prints and saves
    assert traces[0]["stdout"].strip(), f"{label}: rank 0 printed nothing"
    for rank in range(1, WORLD):
        assert not traces[rank]["stdout"].strip(), f"{label} rank {rank} printed:\n{traces[rank]['stdout']}"
        assert traces[rank]["saves"] == [], f"{label} rank {rank} saved {[s['path'] for s in traces[rank]['saves']]}"
    if checkpoint:
        assert (work / "shared" / checkpoint).exists()
        assert all(s["path"] == str(work / "shared" / checkpoint) for s in traces[0]["saves"])


def test_a_local_rank_guard_around_output_became_one_for_the_job(two_nodes):
    """`if args.local_rank in [-1, 0]:` opened a log file and wrote to it once per node; the
    conversion made both guards global: one writer in the whole job, every epoch's line once."""
    work, *_ = two_nodes
    traces = traces_of(work / "traces", "local_rank_guard", WORLD)
    assert sorted(t["env_local_rank"] for t in traces) == [0, 0, 1, 1]  # two nodes: two local rank 0s
    lines = (work / "shared" / "out" / "loss.txt").read_text().splitlines()
    assert [line.split()[:2] for line in lines] == [[str(e), str(s)] for e in range(2) for s in (0, 2)]
    assert [line.split()[0] for line in traces[0]["stdout"].split("epoch ")[1:]] == ["0:", "1:"]


def test_each_node_prepares_its_own_data_once(two_nodes):
    """Each node's disk gets the dataset once, from that node's local rank 0."""
    work, *_ = two_nodes
    traces = traces_of(work / "traces", "download_dataset", WORLD)
    by_node = {}
    for trace in traces:
        by_node.setdefault(trace["cwd"], []).append(trace)
    assert len(by_node) == 2, f"expected two node folders, got {sorted(by_node)}"
    for cwd, ranks in by_node.items():
        assert len(ranks) == PER_NODE
        fetched = (Path(cwd) / "data" / "downloaded_by.txt").read_text().split()
        assert len(fetched) == 1, f"{cwd}: downloaded {len(fetched)} times ({fetched})"
        local_zero = [t["env_rank"] for t in ranks if t["env_local_rank"] == 0]
        assert fetched == [str(r) for r in local_zero], f"{cwd}: downloaded by rank {fetched}, not its local rank 0"


def test_files_written_at_start_and_read_back_are_written_on_every_node(two_nodes):
    """vocab.json, written before training and read back, is node data: each node's local
    rank 0 writes it on its own disk; results.json is written once for the job."""
    work, *_ = two_nodes
    traces = traces_of(work / "traces", "vocab_at_start", WORLD)
    for trace in traces:
        assert trace["exit_code"] == 0, trace["error"]

    def writers(name):
        return sorted(t["env_rank"] for t in traces for f in t["files"] if f["path"].endswith(name) and f["mode"] != "r")

    local_zeros = sorted(t["env_rank"] for t in traces if t["env_local_rank"] == 0)
    assert writers("vocab.json") == local_zeros, "vocab.json: not written once on each node by its local rank 0"
    assert writers("results.json") == [0]
    for node in range(2):
        assert (work / f"node{node}" / "vocab_at_start" / "vocab.json").exists()


def test_the_slurm_batch_file_runs_what_the_agents_ran(two_nodes, tmp_path):
    """The `srun torchrun ...` line `--launch slurm` writes, with Slurm's variables filled in
    as this machine's, has the options the two agents above were started with."""
    import shlex

    from cli_in_process import ddpify

    _, _, commands = two_nodes
    (tmp_path / "train.py").write_text((ROOT / "fixtures" / "convert" / "flat_script.in.py").read_text())
    done = ddpify("convert", "train.py", "-o", "train_ddp.py", "--launch", "slurm", "--nproc-per-node", str(PER_NODE), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    subprocess.run(["bash", "-n", str(tmp_path / "train_ddp.sbatch")], check=True)
    [line] = [ln for ln in (tmp_path / "train_ddp.sbatch").read_text().splitlines() if ln.startswith("srun torchrun ")]
    endpoint = next(a for a in commands[0] if a.startswith("--rdzv-endpoint=")).split("=", 1)[1]
    values = {"$SLURM_NNODES": "2", "$head_node_ip:29500": endpoint, "$SLURM_JOB_ID": "ddpify-two-nodes"}
    for name, value in values.items():
        line = line.replace(name, value)
    slurm = shlex.split(line)
    assert slurm[:2] == ["srun", "torchrun"] and slurm[-1] == "train_ddp.py"
    for node, agent in enumerate(commands):
        start = agent.index("torch.distributed.run") + 1
        options = [a for a in agent[start:] if a.startswith("--") and not a.startswith("--node-rank=")]
        options = options[: options.index(next(a for a in options if a.startswith("--rdzv-endpoint="))) + 1]
        assert slurm[2:-1] == options, f"node {node} agent ran {options}, the batch file runs {slurm[2:-1]}"


def _train_passes(trace: dict, train_size: int) -> list[list[int]]:
    loaders = [ld["id"] for ld in trace["loaders"] if ld["dataset_len"] == train_size]
    assert len(loaders) == 1, f"expected one DataLoader over {train_size} samples, got {trace['loaders']}"
    return [p["indices"] for p in trace["passes"] if p["loader"] == loaders[0] and p["complete"]]


def test_a_restarted_worker_goes_on_from_the_last_checkpoint(tmp_path):
    """--max-restarts=1: the first attempt dies in epoch 2; the restart resumes from the epoch-2
    checkpoint and ends where an uninterrupted run ends, on both ranks."""
    import torch

    source = (ROOT / "fixtures" / "nodes" / "elastic_resume.py").read_text()
    result = convert_source(source, "elastic_resume.py")
    assert "TORCHELASTIC_RESTART_COUNT\", 0)) > 0" in result.code
    script = tmp_path / "elastic_resume_ddp.py"
    script.write_text(result.code)
    runs = {"uninterrupted": [], "restarted": ["--fail-at-epoch", "2"]}
    commands = []
    for label, extra in runs.items():
        (tmp_path / label).mkdir()
        traces = tmp_path / label / "traces"
        traces.mkdir()
        plan = [{"label": label, "script": str(script), "args": ["--epochs", "4", *extra], "cwd": str(tmp_path / label)}]
        (tmp_path / label / "plan.json").write_text(__import__("json").dumps(plan))
        argv = torchrun_argv(str(TRACER), ["--plan", str(tmp_path / label / "plan.json")], nproc_per_node="2", standalone=True)
        commands.append(([sys.executable, "-m", "torch.distributed.run", "--max-restarts=1", *argv[1:]], tmp_path / label))
    progress(f"elastic restart: torchrun --max-restarts=1, 2 launches in {tmp_path}/")
    done = {}
    for (cmd, cwd), label in zip(commands, runs):
        (result_,) = run_agents([(cmd, cwd)], clean_env(cwd / "traces"))
        assert result_.returncode == 0, f"{label}:\n{result_.stdout[-4000:]}\n{result_.stderr[-8000:]}"
        done[label] = result_
    restarted = done["restarted"]
    assert "failed (exitcode: 1)" in restarted.stderr, restarted.stderr[-4000:]  # torchrun saw the first attempt die
    traces = traces_of(tmp_path / "restarted" / "traces", "restarted", 2)
    assert "resumed at epoch 2" in traces[0]["stdout"], traces[0]["stdout"]
    assert len(_train_passes(traces[0], 256)) == 2  # epochs 2 and 3 only: the restart did not start over
    assert [t["restart_count"] for t in traces] == [1, 1]
    assert_replicas_identical(tmp_path / "restarted" / "traces", "restarted", traces)
    for rank in range(2):
        a = torch.load(tmp_path / "uninterrupted" / "traces" / f"params-uninterrupted-{rank}.pt")
        b = torch.load(tmp_path / "restarted" / "traces" / f"params-restarted-{rank}.pt")
        assert len(a) == len(b)
        for group_a, group_b in zip(a, b):
            for x, y in zip(group_a, group_b):
                assert torch.equal(x, y), f"rank {rank}: parameters differ from the uninterrupted run"
