"""A local-rank guard around output meant once per job tests the global rank instead.

`if args.local_rank in [-1, 0]:` (the idiom of torch.distributed.launch days), `if local_rank
== 0:` or `if rank % ngpus_per_node == 0:` around a checkpoint, a log or a results file is true
once per node: on N nodes the output appears N times, and N processes write the same file at
once on a shared filesystem. The local-rank part of the test becomes `dist.get_rank() == 0`.
Guards that also prepare per-node data (a download, a file read back) stay as they are; the
analysis is `ddpify.analysis.multinode.output_once_per_node`, shared with check's DDP307.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.multinode import LOCAL, guard_kind, output_once_per_node
from ddpify.analysis.rank import RankAnalysis, rank_analysis
from ddpify.convert.context import Context


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    rank = rank_analysis(script.index)
    done: set[cst.CSTNode] = set()
    for guards in output_once_per_node(script.index, torchrun=True):
        for guard in guards:
            for part in _local_parts(rank, guard.test):
                sign = rank.rank_test(part)
                if part in done or sign == 0:
                    continue
                done.add(part)
                condition = ctx.rank0_condition(script.parent(guard.test))
                if sign < 0:
                    condition = condition.replace(" == 0", " != 0")
                if "os.environ" in condition:
                    edits.need_import("os")
                else:
                    edits.need_import(N.DIST_MODULE, asname="dist")
                old = script.module.code_for_node(part)
                edits.replace(part, edits.expression(condition))
                edits.change(part, f"`{old}` tests the local rank (once per node): job-wide output is guarded by `{condition}`")


def _local_parts(rank: RankAnalysis, test: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The parts of a guard's test that read the local rank (`local_rank in (-1, 0)` in
    `args.save and local_rank in (-1, 0)`)."""
    if isinstance(test, cst.BooleanOperation):
        if isinstance(test.operator, cst.Or) and rank.rank_test(test) and guard_kind(rank, test) == LOCAL:
            return [test]  # `local_rank == -1 or local_rank == 0`: one test
        return _local_parts(rank, test.left) + _local_parts(rank, test.right)
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        inner = _local_parts(rank, test.expression)
        return [test] if inner == [test.expression] else inner  # `not local_rank > 0`: one test
    return [test] if guard_kind(rank, test) == LOCAL else []
