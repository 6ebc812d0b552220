from ddpify.analysis import names as N
from ddpify.analysis.flow import flow
from ddpify.check.context import kwarg, positional
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import callers_decide, every_rank, in_memory, library_code


class SaveOnEveryRank(Rule):
    """Checkpoint written by every rank.

    ## What it does
    Flags `torch.save(...)` outside a rank-0-only branch in a distributed script (unless the
    path mentions the rank, i.e. per-rank files on purpose, also through a name bound to such a
    path; or the target is an in-memory buffer such as `io.BytesIO()`, which writes no file).

    Code of a helper module that only other files call (no `__main__`, the function called
    nowhere in the file, no training of its own) is left to its caller's rank guard, and so is
    a save helper whose file comes from its parameters when every call of it is rank 0's (or
    under another test of the rank) or names a per-rank file, and a save on a failure path (in an
    `except` handler, or a function only handlers call) that dumps what the failing process had.

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
        "import torch, torch.distributed as dist\n\ndef keep(sd, folder, name):\n    torch.save(sd, f'{folder}/{name}')\n\n"
        "rank = dist.get_rank()\nkeep(sd, 'ckpt', f'shard{rank}.pt')\nif rank == 0:\n    keep(full, 'ckpt', 'model.pt')\n",
        "import torch, torch.distributed as dist\nif dist.get_rank() == 0:\n    torch.save(sd, 'm.pt')\n",
        "import torch, torch.distributed as dist\ntorch.save(sd, f'm_rank{rank}.pt')\n",
    ]
    INVALID = [Invalid("import torch, torch.distributed as dist\ntorch.save(sd, 'm.pt')\n")]

    def check(self, ctx):
        for ci in ctx.calls_to(*N.TORCH_SAVE):
            args = positional(ci.node)
            target = kwarg(ci.node, "f") or (args[1] if len(args) > 1 else None)
            target = target.value if target is not None else None
            if target is not None and in_memory(ctx, target):
                continue  # serialised into memory (a copy, a broadcast): no file is written
            if flow(ctx.index).in_error_handler(ci.node):
                continue  # a failing process dumps what it had (`except: save_batch(batch); raise`)
            if every_rank(ctx, ci.node) and not library_code(ctx, ci.node) and not callers_decide(ctx, ci, target):
                yield Report(ci.node)
