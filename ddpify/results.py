"""What a conversion returns, and the error it raises."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


class ConvertError(Exception):
    """Input that cannot be converted safely; carries the file and line to report."""

    def __init__(self, path: str, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = path
        self.line = line
        self.message = message


@dataclass(frozen=True)
class ConvertOptions:
    """What the user asked for beyond the default conversion."""

    sync_batchnorm: bool = False  # convert BatchNorm layers to SyncBatchNorm before wrapping
    global_batch: bool = False  # the script's batch size is global: divide it by the world size
    launcher: str = "torchrun"  # "spawn": also start processes with mp.spawn when not under torchrun
    eval_on_rank0: bool = False  # evaluate on rank 0 through model.module instead of on every rank
    shared_fs: bool = False  # every node sees the same files: data is prepared once per job, not per node
    target: str = "ddp"  # "fsdp2": shard the model with fully_shard instead of wrapping it in DDP
    shard: str | None = None  # fsdp2: the block class whose instances become their own units
    sharded_checkpoints: bool = False  # fsdp2: torch.distributed.checkpoint folders, each rank writing its shard
    # `convert --run`: what a brief run of the original did (ddpify.analysis.run_facts.RunFacts);
    # the passes ask it first, the static analysis second
    run: object = field(default=None, compare=False, hash=False)
    # convert the output again and fail if that would change it (a fixed point): the test suite
    # and `ddpify verify` do; DDPIFY_SELF_CHECK=1 turns it on for every conversion
    self_check: bool = field(default_factory=lambda: os.environ.get("DDPIFY_SELF_CHECK") == "1")


@dataclass(frozen=True)
class Note:
    """One line of the conversion summary."""

    line: int
    message: str
    in_output: bool = False  # the line is in the converted script, not the input


@dataclass
class ConvertResult:
    """The converted code and what the conversion did and left for the user."""

    code: str
    changes: list[Note] = field(default_factory=list)
    todos: list[Note] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)  # what the user should know: options left without effect
    already_distributed: bool = False
    planned: list[tuple[str, int, str]] = field(default_factory=list)  # shortcut off: (pass, line, edit) of every code change
    pending: list[tuple[str, int, str]] = field(default_factory=list)  # already distributed: what was left undone
    # each process now trains on batches of its own (a sampler or a slice was added somewhere in
    # the program), so the global batch is the script's batch x processes; False for full-batch
    # training replicated on every rank, or data the conversion could not shard
    per_process_batches: bool = False
