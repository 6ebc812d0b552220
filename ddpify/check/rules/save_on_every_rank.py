import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.flow import flow
from ddpify.analysis.rank import rank_analysis
from ddpify.check.context import iter_nodes, kwarg, positional
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import every_rank, library_code


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
        buffers = {b.dotted for b in ctx.assignments if _is_buffer(ctx, b.value)}
        for ci in ctx.calls_to(*N.TORCH_SAVE):
            args = positional(ci.node)
            target = kwarg(ci.node, "f") or (args[1] if len(args) > 1 else None)
            target = target.value if target is not None else None
            if target is not None and (_is_buffer(ctx, target) or ctx.code(target) in buffers):
                continue  # serialised into memory (a copy, a broadcast): no file is written
            if flow(ctx.index).in_error_handler(ci.node):
                continue  # a failing process dumps what it had (`except: save_batch(batch); raise`)
            if every_rank(ctx, ci.node) and not library_code(ctx, ci.node) and not _callers_decide(ctx, ci, target):
                yield Report(ci.node)


def _callers_decide(ctx, ci, target) -> bool:
    """A save helper whose file comes from its parameters (`def save_state_dict(dir, fname, sd):
    torch.save(sd, Path(dir) / fname)`), every call of which is rank 0's (or under another test
    of the rank) or names a per-rank file (`fname=f"rank{rank}.pt"`): the callers decide."""
    func = ci.func
    if func is None or target is None:
        return False
    params = ctx.index.param_names(func)
    names = {n.value for n in iter_nodes(target) if isinstance(n, cst.Name)}
    for b in ctx.assignments:  # `target_path = checkpoint_dir / fname`
        if b.func is func and b.dotted in names:
            names |= {n.value for n in iter_nodes(b.value) if isinstance(n, cst.Name)}
    used = names & params
    sites = ctx.call_sites(func)
    ranks = rank_analysis(ctx.index)

    def per_rank_file(site) -> bool:
        return any(
            ctx.index.param_for(func, i, arg) in used and ranks.per_rank(arg.value, site.func)
            for i, arg in enumerate(site.node.args)
        )

    return bool(used) and bool(sites) and all(ctx.under_rank_test(s.node) or per_rank_file(s) for s in sites)


def _is_buffer(ctx, expr) -> bool:
    return isinstance(expr, cst.Call) and expr in ctx.call_info and ctx.info(expr).is_("io.BytesIO")
