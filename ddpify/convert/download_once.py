"""Datasets built with `download=True` are fetched by rank 0 first, then read by the rest.

    if dist.get_rank() != 0:
        dist.barrier()  # wait for rank 0 to download
    train_set = datasets.MNIST(root, train=True, download=True)
    if dist.get_rank() == 0:
        dist.barrier()  # downloaded: let the other ranks read it

Consecutive downloads share one pair of barriers. The barriers sit outside any step loop.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.convert.context import RANK0, Context

BEFORE = "if dist.get_rank() != 0:\n    dist.barrier()  # wait for rank 0 to download\n"
AFTER = "if dist.get_rank() == 0:\n    dist.barrier()  # downloaded: let the other ranks read it\n"


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    statements = []
    for call in script.calls:
        flag = N.keyword(call, "download")
        if flag is None or isinstance(flag.value, cst.Name) and flag.value.value == "False":
            continue
        stmt = script.statement_line(call)
        if stmt is None or stmt in statements:
            continue
        if ctx.rank0_condition(stmt) != RANK0:
            edits.todo(stmt, script.line(stmt), "every rank downloads here, before the process group exists: download once beforehand")
            continue
        statements.append(stmt)
    for stmt in statements:
        block = list(script.parent(stmt).body)
        index = block.index(stmt)
        if (index == 0 or block[index - 1] not in statements) and not D.barrier_in(script, D.sibling(script, stmt, -1)):
            edits.insert_before(stmt, BEFORE)
        if (index == len(block) - 1 or block[index + 1] not in statements) and not D.barrier_in(script, D.sibling(script, stmt, 1)):
            edits.insert_after(stmt, AFTER)
        edits.change(script.line(stmt), "rank 0 downloads the dataset first; the others wait at a barrier")
