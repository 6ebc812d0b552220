import libcst as cst

from ddpify.analysis.flow import flow
from ddpify.analysis.index import iter_nodes
from ddpify.check.context import COLLECTIVES, dotted_name, is_false, kwarg
from ddpify.check.rule import Invalid, Report, Rule


class CollectiveInRankZeroBranch(Rule):
    """Collective call that only rank 0 (or only some ranks) reaches.

    ## What it does
    Flags `barrier`, `all_reduce`, `broadcast`, `all_gather`, ... inside a rank-0-only branch
    (`if rank == 0:`, `if dist.get_rank() == 0:`, `if is_main_process():`, after
    `if rank != 0: return`), including in functions that are only called from such branches,
    and in a branch of any test of a per-rank value (`if rank % 2 == 0:`, `if device.index < 2:`)
    whose other branch calls no collective. Tests of the run's mode (`if local_rank != -1:`,
    `if args.distributed:`) are the same on every rank and are not flagged, nor is a collective
    the other ranks meet with the same collective in their branch (a "rank 0 first" barrier, a
    leader/worker loop where rank 0 broadcasts a signal and the others receive it in `else:`).

    ## Why is this bad?
    A collective completes only when every rank calls it. Rank 0 waits forever for the
    others: the job hangs until the NCCL timeout.

    ## Example
    ```python
    if rank == 0:
        dist.all_reduce(loss)
        print(loss.item())
    ```

    ## Use instead
    ```python
    dist.all_reduce(loss)
    if rank == 0:
        print(loss.item())
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/distributed.html#collective-functions
    """

    CODE = "DDP116"
    FOLLOWS_CALLS = True
    NAME = "collective-in-rank-zero-branch"
    MESSAGE = "collective inside a branch only some ranks take (rank 0 only, or a test of the rank) hangs the other ranks; call it on every rank, outside the branch"
    VALID = [
        "import torch.distributed as dist\ndist.all_reduce(t)\nif dist.get_rank() == 0:\n    print(t)\n",
        "import torch.distributed as dist\nif dist.get_rank() != 0:\n    dist.barrier()\nprepare()\n"
        "if dist.get_rank() == 0:\n    dist.barrier()\n",
        "import torch.distributed as dist, torchmetrics\nacc = torchmetrics.Accuracy(task='binary', sync_on_compute=False)\n"
        "if dist.get_rank() == 0:\n    print(acc.compute())\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nif dist.get_rank() == 0:\n    dist.barrier()\n"),
        Invalid("import torch.distributed as dist\ndef report(t):\n    dist.all_reduce(t)\n"
                "if args.local_rank in (-1, 0):\n    report(t)\n"),
        Invalid("import torch.distributed as dist\nrank = dist.get_rank()\nif rank % 2 == 0:\n    dist.all_reduce(t)\n"),
        Invalid("import torch.distributed as dist, torchmetrics\nacc = torchmetrics.Accuracy(task='binary').to(device)\n"
                "if dist.get_rank() == 0:\n    print(acc.compute())\n"),
    ]

    def check(self, ctx):
        collectives = ctx.calls_to(*COLLECTIVES)
        for ci in collectives:
            if ci.name in ("destroy_process_group",) or _over_subgroup(ci):
                continue
            if (ctx.in_rank0(ci.node) or _in_rank_split(ctx, ci, collectives)) and not _paired(ctx, ci, collectives):
                yield Report(ci.node)
        metrics = _synced_metrics(ctx)
        for ci in ctx.method_calls("compute") if metrics else ():
            if ctx.index.is_bound(ci.receiver, metrics) and ctx.in_rank0(ci.node):
                yield Report(ci.node, _METRIC_MESSAGE)


def _over_subgroup(ci) -> bool:
    """A collective given a group (`group=pg`, not `None` or `dist.group.WORLD`): its members are
    the ranks of that group, which the code here does not show, so a branch on the rank may be
    exactly them (`if tp_rank == 0: broadcast(..., group=dp_group)`)."""
    group = kwarg(ci.node, "group")
    if group is None:
        return False
    code = dotted_name(group.value) or ""
    return code != "None" and not code.endswith("WORLD")


_METRIC_MESSAGE = (
    "torchmetrics `compute()` gathers every rank's state (a collective): on rank 0 only it hangs the"
    " other ranks; compute on every rank and print on rank 0, or build the metric with `sync_on_compute=False`"
)


def _synced_metrics(ctx) -> list:
    """Names bound to a torchmetrics metric (or collection) that syncs on `compute()` (its default
    when a process group is up): `acc = torchmetrics.Accuracy(...).to(device)`."""
    found = []
    for b in ctx.assignments:
        value = b.value
        while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value in ("to", "cuda"):
            value = value.func.value  # `.to(device)`
        if not isinstance(value, cst.Call):
            continue
        names = ctx.info(value).qnames
        if any(q.startswith("torchmetrics.") and not q.startswith("torchmetrics.functional.") for q in names):
            sync = kwarg(value, "sync_on_compute")
            if sync is None or not is_false(sync.value):
                found.append(b)
    return found


def _in_rank_split(ctx, ci, collectives) -> bool:
    """In one branch of a test of a per-rank value (not of the run's mode) whose other branch
    calls no collective: the ranks that take the other branch never join."""
    ranks, modes = ctx._rank, flow(ctx.index)
    child = ci.node
    for p in ctx.ancestors(ci.node):
        if isinstance(p, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return False
        if isinstance(p, cst.If) and child in (p.body, p.orelse):
            if ranks.per_rank(p.test, ctx.enclosing_func(p)) and not modes.mode_test(p.test):
                other = p.orelse if child is p.body else p.body
                inside = set(iter_nodes(p))
                if ci.name == "barrier" and any(o.name == "barrier" and o.func is ci.func and o.node not in inside for o in collectives):
                    return False  # "rank 0 first": the others wait at a barrier of their own
                return other is None or not any(o.node in set(iter_nodes(other)) for o in collectives)
        child = p
    return False


def _paired(ctx, ci, collectives) -> bool:
    """A collective on rank 0 matched by the same collective on the other ranks, in its function
    or one around it: "rank 0 first" barriers (downloads), a leader/worker protocol (rank 0
    broadcasts a signal in `if rank == 0:`, the others receive it in the `else:` loop)."""
    around = {ci.func, *(p for p in ctx.ancestors(ci.node) if isinstance(p, cst.FunctionDef))}
    return any(
        other.name == ci.name and other.func in around and _off_rank0(ctx, other.node) for other in collectives
    )


def _off_rank0(ctx, node) -> bool:
    """Inside `if <not rank 0>:` or the `else:` of `if <rank 0>:` (the branch the other ranks take)."""
    child = node
    for parent in ctx.ancestors(node):
        if isinstance(parent, cst.If) and child is parent.body and ctx.rank_test(parent.test) == -1:
            return True
        if isinstance(parent, cst.Else) and isinstance(ctx.parent(parent), cst.If) and ctx.rank_test(ctx.parent(parent).test) == 1:
            return True
        child = parent
    return False
