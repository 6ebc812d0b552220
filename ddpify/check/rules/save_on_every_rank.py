import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import kwarg, positional
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import every_rank, library_code


class SaveOnEveryRank(Rule):
    """Checkpoint written by every rank.

    ## What it does
    Flags `torch.save(...)` outside a rank-0-only branch in a distributed script (unless the
    path mentions the rank, i.e. per-rank files on purpose, also through a name bound to such a
    path; or the target is an in-memory buffer such as `io.BytesIO()`, which writes no file).

    Code of a helper module that only other files call (no `__main__`, the function called
    nowhere in the file, no training of its own) is left to its caller's rank guard.

    ## Why is this bad?
    N processes write the same file at once: wasted I/O, and a corrupt or truncated
    checkpoint when writes interleave.

    ## Example
    ```python
    torch.save(model.module.state_dict(), "model.pt")
    ```

    ## Use instead
    ```python
    if rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/tutorials/intermediate/ddp_tutorial.html#save-and-load-checkpoints
    """

    CODE = "DDP301"
    NAME = "save-on-every-rank"
    MESSAGE = "`torch.save` on every rank writes the same file N times; guard it with `if rank == 0:`"
    VALID = [
        "import torch, torch.distributed as dist\nif dist.get_rank() == 0:\n    torch.save(sd, 'm.pt')\n",
        "import torch, torch.distributed as dist\ntorch.save(sd, f'm_rank{rank}.pt')\n",
    ]
    INVALID = [Invalid("import torch, torch.distributed as dist\ntorch.save(sd, 'm.pt')\n")]

    def check(self, ctx):
        buffers = {b.dotted for b in ctx.assignments if _is_buffer(ctx, b.value)}
        for ci in ctx.calls_to(*N.TORCH_SAVE):
            args = positional(ci.node)
            target = kwarg(ci.node, "f") or (args[1] if len(args) > 1 else None)
            target = target.value if target is not None else None
            if target is not None and (_is_buffer(ctx, target) or ctx.code(target) in buffers):
                continue  # serialised into memory (a copy, a broadcast): no file is written
            if every_rank(ctx, ci.node) and not library_code(ctx, ci.node):
                yield Report(ci.node)


def _is_buffer(ctx, expr) -> bool:
    return isinstance(expr, cst.Call) and expr in ctx.call_info and ctx.info(expr).is_("io.BytesIO")
