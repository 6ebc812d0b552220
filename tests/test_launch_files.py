"""`ddpify convert --launch slurm|torchrun`: the Slurm batch file beside the script and the
torchrun commands in the summary, both from `torchrun_argv` (no torch needed, but for the
test that hands the options to torchrun's own parser)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_in_process import ddpify

from ddpify.launch_files import LaunchPlan, shell_join, torchrun_argv

ROOT = Path(__file__).resolve().parents[1]
FLAT = ROOT / "fixtures" / "convert" / "flat_script.in.py"
MAIN = ROOT / "fixtures" / "convert" / "main_argparse.in.py"
NOOP_DDP = ROOT / "fixtures" / "noop" / "multigpu_torchrun.py"
PROJECT = ROOT / "fixtures" / "projects" / "library_trainer"
ARGS = ["--epochs", "10", "a b", "it's"]  # a space and a quote: shell quoting is needed
SLURM = {"$SLURM_NNODES": "2", "$head_node_ip": "127.0.0.1", "$SLURM_JOB_ID": "job"}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(FLAT.read_text())
    return tmp_path


def srun_argv(sbatch: Path, values: dict[str, str] = SLURM) -> list[str]:
    """The `srun torchrun ...` line of a batch file as the shell would pass it, the SLURM
    variables replaced by `values`."""
    [line] = [line for line in sbatch.read_text().splitlines() if line.startswith("srun torchrun ")]
    for name, value in values.items():
        line = line.replace(name, value)
    return shlex.split(line)


def test_torchrun_argv_spells_options_as_torchrun_does() -> None:
    assert torchrun_argv("t.py", ["--lr", "1"], nproc_per_node="4", standalone=True) == [
        "torchrun", "--standalone", "--nproc-per-node=4", "t.py", "--lr", "1",
    ]  # fmt: skip
    assert torchrun_argv(
        "t.py", [], nproc_per_node="1", nnodes="2", node_rank="1", rdzv_endpoint="127.0.0.1:29400", rdzv_id="x"
    ) == [
        "torchrun", "--nnodes=2", "--nproc-per-node=1", "--node-rank=1", "--rdzv-id=x", "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29400", "t.py",
    ]  # fmt: skip
    with pytest.raises(ValueError):
        torchrun_argv("t.py", [], nproc_per_node="1", nnodes="2", standalone=True)


def test_torchrun_parses_the_options() -> None:
    from torch.distributed import run  # torch is in the test extra: a missing torch fails, never skips

    argv = torchrun_argv(
        "t.py", ["--lr", "1"], nproc_per_node="2", nnodes="3", node_rank="1", rdzv_endpoint="h:29500", rdzv_id="7"
    )
    parsed = run.get_args_parser().parse_args(argv[1:])
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.node_rank) == ("3", "2", 1)
    assert (parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id) == ("c10d", "h:29500", "7")
    assert (parsed.training_script, parsed.training_script_args) == ("t.py", ["--lr", "1"])
    standalone = run.get_args_parser().parse_args(torchrun_argv("t.py", [], nproc_per_node="2", standalone=True)[1:])
    assert standalone.standalone and standalone.nproc_per_node == "2"


def test_shell_join_expands_only_the_named_variables() -> None:
    line = shell_join(["srun", "--n=$A", "$B", "a b"], ("$A",))
    assert line == "srun --n=\"$A\" '$B' 'a b'"
    with pytest.raises(ValueError):
        shell_join(["--n=$A`x`"], ("$A",))


def test_slurm_batch_file_beside_the_script_starts_torchrun_on_every_node(folder: Path) -> None:
    result = ddpify("convert", "train.py", "-o", "train_ddp.py", "--launch", "slurm", "--", *ARGS, cwd=folder)
    assert result.returncode == 0, result.stderr
    sbatch = folder / "train_ddp.sbatch"
    assert sorted(p.name for p in folder.iterdir()) == ["train.py", "train_ddp.py", "train_ddp.sbatch"]
    check = subprocess.run(["bash", "-n", str(sbatch)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    text = sbatch.read_text()
    assert text.startswith("#!/bin/bash\n")
    for directive in ("--job-name=train_ddp", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task="):
        assert f"#SBATCH {directive}" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text
    expected = torchrun_argv(
        "train_ddp.py", ARGS, nproc_per_node="8", nnodes="2", rdzv_endpoint="127.0.0.1:29500", rdzv_id="job"
    )
    assert srun_argv(sbatch) == ["srun", *expected]
    assert expected[-len(ARGS) - 1 :] == ["train_ddp.py", *ARGS]
    assert "Slurm: sbatch train_ddp.sbatch  (2 nodes x 8 GPUs" in result.stdout
    assert f"Launch: torchrun --nproc-per-node=N train_ddp.py {shlex.join(ARGS)}" in result.stdout


def test_nodes_and_processes_per_node(folder: Path) -> None:
    (folder / "out").mkdir()
    result = ddpify(
        "convert", "train.py", "-o", "out/ddp.py", "--launch", "slurm", "--nodes", "3", "--nproc-per-node", "4",
        cwd=folder,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    sbatch = folder / "out" / "ddp.sbatch"
    assert "#SBATCH --nodes=3\n" in sbatch.read_text() and "#SBATCH --gpus-per-node=4\n" in sbatch.read_text()
    assert srun_argv(sbatch, {**SLURM, "$SLURM_NNODES": "3"}) == ["srun", *torchrun_argv(
        "out/ddp.py", [], nproc_per_node="4", nnodes="3", rdzv_endpoint="127.0.0.1:29500", rdzv_id="job"
    )]  # fmt: skip


def test_converting_twice_gives_the_same_batch_file(folder: Path) -> None:
    argv = ("convert", "train.py", "-o", "train_ddp.py", "--launch", "slurm", "--", *ARGS)
    assert ddpify(*argv, cwd=folder).returncode == 0
    first = (folder / "train_ddp.sbatch").read_bytes()
    assert ddpify(*argv, cwd=folder).returncode == 0
    assert (folder / "train_ddp.sbatch").read_bytes() == first
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]  # the atomic writes left nothing behind


def test_check_reports_a_missing_or_stale_batch_file_and_writes_nothing(folder: Path) -> None:
    argv = ("convert", "train.py", "-o", "train_ddp.py", "--launch", "slurm", "--check", "--", *ARGS)
    missing = ddpify(*argv, cwd=folder)
    assert missing.returncode == 1
    assert "would write train_ddp.sbatch: it does not exist" in missing.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["train.py"]

    assert ddpify("convert", "train.py", "-o", "train_ddp.py", cwd=folder).returncode == 0  # the script, no batch file
    only_batch = ddpify(*argv, cwd=folder)
    assert only_batch.returncode == 1 and "would write train_ddp.sbatch" in only_batch.stderr
    assert "would rewrite train_ddp.py" not in only_batch.stderr and not (folder / "train_ddp.sbatch").exists()

    assert ddpify(*argv[:6], "--", *ARGS, cwd=folder).returncode == 0  # written, without --check
    assert ddpify(*argv, cwd=folder).returncode == 0  # up to date
    sbatch = folder / "train_ddp.sbatch"
    written = sbatch.read_bytes()
    stale = ddpify(*argv[:-1], "other", cwd=folder)  # other script arguments: a different srun line
    assert stale.returncode == 1 and "would rewrite train_ddp.sbatch" in stale.stderr
    assert "+srun torchrun" in stale.stdout and sbatch.read_bytes() == written


def test_torchrun_prints_one_node_and_multi_node_commands(folder: Path) -> None:
    result = ddpify(
        "convert", "train.py", "-o", "train_ddp.py", "--launch", "torchrun", "--nodes", "4", "--", *ARGS, cwd=folder
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["train.py", "train_ddp.py"]  # no file for torchrun
    lines = result.stdout.splitlines()
    [one] = [line for line in lines if line.startswith("Launch on one node: ")]
    assert shlex.split(one.split(": ", 1)[1]) == torchrun_argv("train_ddp.py", ARGS, nproc_per_node="8", standalone=True)
    at = lines.index(next(line for line in lines if line.startswith("Launch on 4 nodes, the same command on every node")))
    many = lines[at + 1].replace("HOST", "127.0.0.1").replace("JOB", "job")
    assert shlex.split(many) == torchrun_argv(
        "train_ddp.py", ARGS, nproc_per_node="8", nnodes="4", rdzv_endpoint="127.0.0.1:29500", rdzv_id="job"
    )
    assert "Launch: torchrun --nproc-per-node=N" not in result.stdout  # the concrete commands replace it


def test_torchrun_commands_go_to_stderr_when_the_script_goes_to_stdout(folder: Path) -> None:
    result = ddpify("convert", "train.py", "--launch", "torchrun", "--nproc-per-node", "2", cwd=folder)
    assert result.returncode == 0, result.stderr
    compile(result.stdout, "out.py", "exec")
    assert "Launch on one node: torchrun --standalone --nproc-per-node=2 OUT.py" in result.stderr
    assert "  torchrun --nnodes=2 --nproc-per-node=2 " in result.stderr and "torchrun" not in result.stdout.split("\n")[0]


def test_spawn_line_stays_with_the_one_node_command(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(MAIN.read_text())  # spawn needs the training in a function under __main__
    result = ddpify("convert", "train.py", "-o", "o.py", "--launcher", "spawn", "--launch", "torchrun", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("Launch on one node"))
    assert lines[at + 1].startswith("    or: python o.py")
    assert lines[at + 2].startswith("Launch on 2 nodes") and lines[at + 3].startswith("  torchrun --nnodes=2")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--launch", "slurm"], "error: --launch slurm needs -o OUT.py"),
        (["--launch", "slurm", "--diff"], "error: --launch slurm needs -o OUT.py"),
        (["--launch", "torchrun", "--diff"], "error: --launch torchrun prints its commands in the summary"),
        (["-o", "o.py", "--nodes", "2"], "error: --nodes and --nproc-per-node go with --launch slurm|torchrun"),
        (["-o", "o.py", "--nproc-per-node", "2"], "error: --nodes and --nproc-per-node go with --launch"),
        (["-o", "o.sbatch", "--launch", "slurm"], "error: o.sbatch: the Slurm batch file would be the script itself"),
    ],
)
def test_usage_errors_are_one_line_and_write_nothing(folder: Path, argv: list[str], message: str) -> None:
    result = ddpify("convert", "train.py", *argv, cwd=folder)
    assert result.returncode == 2, result
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(message), result.stderr
    assert result.stdout == "" and sorted(p.name for p in folder.iterdir()) == ["train.py"]


def test_the_batch_file_never_overwrites_the_input(folder: Path) -> None:
    shutil.move(folder / "train.py", folder / "job.sbatch")  # a script named like the batch file
    before = (folder / "job.sbatch").read_bytes()
    result = ddpify("convert", "job.sbatch", "-o", "job.py", "--launch", "slurm", cwd=folder)
    assert result.returncode == 2 and "refusing to overwrite the input" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert (folder / "job.sbatch").read_bytes() == before and not (folder / "job.py").exists()


def test_in_place_writes_the_batch_file_beside_the_script(folder: Path) -> None:
    result = ddpify("convert", "train.py", "--in-place", "--launch", "slurm", cwd=folder)
    assert result.returncode == 0, result.stderr
    assert srun_argv(folder / "train.sbatch")[-1] == "train.py"


def test_an_already_distributed_script_still_gets_its_batch_file(tmp_path: Path) -> None:
    result = ddpify("convert", str(NOOP_DDP), "-o", "ddp.py", "--launch", "slurm", "--", "5", "10", cwd=tmp_path)
    assert result.returncode == 0 and "already distributed" in result.stderr
    assert srun_argv(tmp_path / "ddp.sbatch")[-3:] == ["ddp.py", "5", "10"]
    assert "Slurm: sbatch ddp.sbatch" in result.stderr


def test_a_converted_copy_of_a_project_finds_its_modules(tmp_path: Path) -> None:
    out = tmp_path / "copy"
    result = ddpify("convert", "projects/regress/regress.py", "-o", f"{out}/", "--launch", "slurm", cwd=PROJECT)
    assert result.returncode == 0, result.stderr
    sbatch = out / "projects" / "regress" / "regress.sbatch"
    assert f"export PYTHONPATH={out}" in sbatch.read_text()
    assert srun_argv(sbatch)[-1] == str(out / "projects" / "regress" / "regress.py")
    assert subprocess.run(["bash", "-n", str(sbatch)]).returncode == 0


def test_script_args_fill_the_launch_line_and_do_not_leak_into_the_next_call(folder: Path) -> None:
    first = ddpify("convert", "train.py", "-o", "o.py", "--", "--epochs", "3", cwd=folder)
    assert "Launch: torchrun --nproc-per-node=N o.py --epochs 3\n" in first.stdout
    second = ddpify("convert", "train.py", "-o", "o.py", cwd=folder)
    assert "Launch: torchrun --nproc-per-node=N o.py [script args]\n" in second.stdout


def test_the_plan_renders_without_the_cli() -> None:
    plan = LaunchPlan("slurm", nodes=2, nproc_per_node=1, args=("x",))
    assert plan.sbatch_path(Path("a/b.py")) == Path("a/b.sbatch")
    assert plan.sbatch("a/b.py") == plan.sbatch("a/b.py") and "--rdzv-endpoint=\"$head_node_ip:29500\" a/b.py x\n" in plan.sbatch("a/b.py")


def test_the_docs_document_the_launch_options() -> None:
    """The convert page documents them in full (the README names them and links there)."""
    page = (ROOT / "docs" / "convert.md").read_text(encoding="utf-8")
    for option in ("`--launch slurm`", "`--launch torchrun`", "`--nodes", "`--nproc-per-node", "`--shared-fs`"):
        assert option in page, option
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "`--launch slurm|torchrun`" in readme and "(docs/convert.md)" in readme


def test_help_of_the_launch_options_is_short_sentences() -> None:
    text = ddpify("convert", "--help").stdout
    assert "--launch [slurm|torchrun]" in text and "--nodes N" in text and "--nproc-per-node N" in text


def test_the_summary_says_what_several_nodes_get(folder: Path) -> None:
    """Where rank-0 work runs, how devices and samplers are chosen, and how often data is fetched."""
    per_node = ddpify("convert", "train.py", "-o", "train_ddp.py", "--launch", "torchrun", cwd=folder)
    assert "On several nodes: logs, checkpoints and result files on global rank 0" in per_node.stdout
    assert "downloads once per node, by its local rank 0" in per_node.stdout
    per_job = ddpify("convert", "train.py", "-o", "train_ddp.py", "--launch", "slurm", "--shared-fs", cwd=folder)
    assert "downloads once per job, by rank 0 (--shared-fs)" in per_job.stdout
