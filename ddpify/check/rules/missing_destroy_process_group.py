from ddpify.analysis import names as N
from ddpify.check.rule import Invalid, Report, Rule


class MissingDestroyProcessGroup(Rule):
    """Process group never destroyed.

    ## What it does
    Flags `init_process_group` in a program that never calls `destroy_process_group`: not in
    the file, nor in the project modules it imports, nor elsewhere in the programs that import
    it (a helper module's `init_distributed()` is finished by the training script that calls it).

    ## Why is this bad?
    Without it NCCL may hang or print warnings at exit, and resources (ports, communicators)
    are leaked; since PyTorch 2.4 it warns `ProcessGroupNCCL.cpp: process group has NOT been destroyed`.

    ## Example
    ```python
    dist.init_process_group("nccl")
    train()
    ```

    ## Use instead
    ```python
    dist.init_process_group("nccl")
    try:
        train()
    finally:
        dist.destroy_process_group()
    ```

    ## Fix safety
    No automatic fix: where the script ends (and ends early) is for the author to say.

    ## References
    - https://pytorch.org/docs/stable/distributed.html#shutdown
    """

    CODE = "DDP105"
    NAME = "missing-destroy-process-group"
    MESSAGE = "`init_process_group` without `destroy_process_group`; destroy the group when training ends"
    SEVERITY = "warning"
    VALID = ["import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.destroy_process_group()\n"]
    INVALID = [Invalid("import torch.distributed as dist\ndist.init_process_group('gloo')\n")]

    def check(self, ctx):
        if ctx.program_calls_to(*N.DESTROY_PROCESS_GROUP) or any(
            c.name in ("cleanup", "destroy_process_group", "ddp_cleanup", "cleanup_distributed") and not ctx.local_callees(c)
            for c in ctx.calls
        ):
            return
        for ci in ctx.calls_to(*N.INIT_PROCESS_GROUP):
            if not ctx.rank0_or_idle(ci.node) and not ctx.group_never_started:  # (nor a helper nothing calls, nor dead code)
                yield Report(ci.node)
