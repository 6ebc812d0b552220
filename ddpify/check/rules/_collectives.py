"""Does a call make the ranks meet: a collective, or a project function that runs one."""

from __future__ import annotations

from ddpify.analysis import names as N


def runs_collective(ctx, ci, depth: int = 0) -> bool:
    """A collective (`dist.barrier()`, `dist.all_reduce(...)`), or a call of a function of the
    project that runs one, a few calls down (`sync()`, `all_ranks(flag)`)."""
    if ci.qnames & N.COLLECTIVES:
        return True
    return depth < 2 and any(
        runs_collective(ctx, inner, depth + 1) for f in ctx.local_callees(ci) for inner in ctx.calls if inner.func is f
    )
