"""`ddpify convert --launch slurm|torchrun`: how to start the converted script on several nodes.

One function builds torchrun's command line (`torchrun_argv`); the Slurm batch file written
beside the script and the commands the summary prints are both rendered from it, so they
cannot disagree. Values are strings, so a shell variable ("$SLURM_NNODES") can stand for one.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

RDZV_PORT = 29500  # torchrun's default master port, as pytorch/examples' Slurm script uses
CPUS_PER_PROCESS = 4  # DataLoader workers per process, a common starting point


def torchrun_argv(
    script: str,
    args: list[str],
    *,
    nproc_per_node: str,
    nnodes: str | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    node_rank: str | None = None,
    standalone: bool = False,
) -> list[str]:
    """`torchrun [options] SCRIPT ARGS` as a list, each option one `--name=value` item.

    argv[0] is "torchrun"; `[sys.executable, "-m", "torch.distributed.run", *argv[1:]]` runs the
    same with a given Python. A rendezvous endpoint brings `--rdzv-backend=c10d`. `standalone`
    (one node, a rendezvous on a free local port) excludes the multi-node options.
    """
    if standalone and (nnodes or rdzv_endpoint or rdzv_id or node_rank):
        raise ValueError("a standalone torchrun takes no --nnodes, --node-rank or rendezvous options")
    argv = ["torchrun"]
    if standalone:
        argv.append("--standalone")
    if nnodes is not None:
        argv.append(f"--nnodes={nnodes}")
    argv.append(f"--nproc-per-node={nproc_per_node}")
    if node_rank is not None:
        argv.append(f"--node-rank={node_rank}")
    if rdzv_id is not None:
        argv.append(f"--rdzv-id={rdzv_id}")
    if rdzv_endpoint is not None:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
    return [*argv, script, *args]


def shell_join(argv: list[str], variables: tuple[str, ...] = ()) -> str:
    """`argv` as one shell command line: every word quoted with shlex.quote, except that an
    `--option=value` whose value holds one of `variables` ("$SLURM_NNODES") is double-quoted
    so the shell expands it."""
    words = []
    for word in argv:
        name, equals, value = word.partition("=")
        if equals and name.startswith("--") and any(v in value for v in variables):
            if not re.fullmatch(r"[\w$:./-]*", value):  # only names, ports and hosts: nothing to escape
                raise ValueError(f"cannot put {value!r} in double quotes as it is")
            words.append(f'{name}="{value}"')
        else:
            words.append(shlex.quote(word))
    return " ".join(words)


@dataclass(frozen=True)
class LaunchPlan:
    """What `--launch`, `--nodes`, `--nproc-per-node` and `-- ARGS` asked for."""

    kind: str | None = None  # "slurm", "torchrun" or None (only the summary's one-node line)
    nodes: int = 2
    nproc_per_node: int = 8
    args: tuple[str, ...] = ()  # the script's own arguments
    pythonpath: str | None = None  # the root of a converted copy of a project (`-o DIR/`): its imports
    shared_fs: bool = False  # `--shared-fs`: downloads once per job, not once per node

    def sbatch_path(self, script: Path) -> Path:
        """The batch file beside the converted script: train_ddp.py -> train_ddp.sbatch."""
        return script.with_suffix(".sbatch")

    def sbatch(self, script: str) -> str:
        """A Slurm batch file that starts one torchrun per node with srun; the rendezvous is
        on the first node of the allocation."""
        name = re.sub(r"[^\w.-]", "_", Path(script).stem) or "ddp"
        n = str(self.nproc_per_node)
        run = torchrun_argv(
            script, list(self.args), nproc_per_node=n, nnodes="$SLURM_NNODES", rdzv_id="$SLURM_JOB_ID",
            rdzv_endpoint=f"$head_node_ip:{RDZV_PORT}",
        )  # fmt: skip
        line = shell_join(["srun", *run], ("$SLURM_NNODES", "$SLURM_JOB_ID", "$head_node_ip"))
        return "\n".join([
            "#!/bin/bash",
            f"# Written by `ddpify convert --launch slurm`: nodes: {self.nodes}, processes (GPUs) per node: {n}.",
            "# Paths are relative to the folder you submit from: sbatch " + shlex.quote(str(self.sbatch_path(Path(script)))),
            f"#SBATCH --job-name={name}",
            f"#SBATCH --nodes={self.nodes}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --gpus-per-node={n}",
            f"#SBATCH --cpus-per-task={CPUS_PER_PROCESS * self.nproc_per_node}",
            "",
            "set -eu",
            "",
            "# torchrun's rendezvous runs on the first node of the allocation.",
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            'head_node_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | cut -d " " -f 1)',
            'echo "rendezvous: $head_node ($head_node_ip:' + str(RDZV_PORT) + ')"',
            "",
            *([
                "# The converted copy of the project imports its own modules from its root.",
                f'export PYTHONPATH={shlex.quote(self.pythonpath)}"${{PYTHONPATH:+:$PYTHONPATH}}"',
                "",
            ] if self.pythonpath else []),
            f"# One task per node: srun starts torchrun on every node, and each torchrun {n} processes.",
            line,
            "",
        ])  # fmt: skip

    def summary(self, script: str) -> list[str]:
        """The summary's launch lines for `--launch torchrun` (one node, then several) or
        `--launch slurm` (the batch file to submit)."""
        args = list(self.args)
        n = str(self.nproc_per_node)
        if self.kind == "slurm":
            sbatch = shlex.quote(str(self.sbatch_path(Path(script))))
            return [f"Slurm: sbatch {sbatch}  ({self.nodes} nodes x {n} GPUs; srun starts torchrun on each node)", self.choices()]
        one = torchrun_argv(script, args, nproc_per_node=n, standalone=True)
        many = torchrun_argv(
            script, args, nproc_per_node=n, nnodes=str(self.nodes), rdzv_id="JOB", rdzv_endpoint=f"HOST:{RDZV_PORT}"
        )
        return [
            f"Launch on one node: {shell_join(one)}",
            f"Launch on {self.nodes} nodes, the same command on every node (HOST: the first node's address; "
            "JOB: any id the nodes share):",
            f"  {shell_join(many)}",
            self.choices(),
        ]

    def choices(self) -> str:
        """What the conversion chose for several nodes."""
        data = "once per job, by rank 0 (--shared-fs)" if self.shared_fs else "once per node, by its local rank 0 (--shared-fs: once per job)"
        return (
            "On several nodes: logs, checkpoints and result files on global rank 0; each process's GPU from "
            f"LOCAL_RANK; samplers over every rank of every node; downloads {data}."
        )
