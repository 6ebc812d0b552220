"""A script that picks its GPUs itself gets a TODO at the line that does, never a silent crash.

    os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu_id    # "0" by default

Under torchrun every process runs that line: each then sees only the GPUs listed and takes
`cuda:<local_rank>` among them, so a list shorter than the processes per node fails on the
ranks past its end ("invalid device ordinal"). What the option will hold is known only at run
time, so the line stays (it still chooses the node's GPUs) and says what it must list.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.convert.context import Context

VARIABLE = "CUDA_VISIBLE_DEVICES"
ENVIRON = frozenset({"os.environ"})
SETTERS = frozenset({"os.environ.setdefault", "os.putenv"})
MESSAGE = (
    f"every process sees only the GPUs {VARIABLE} lists here and takes cuda:<local_rank> among them: list at "
    "least as many as processes per node, or choose them at launch (`CUDA_VISIBLE_DEVICES=0,1 torchrun ...`)"
)


def run(ctx: Context) -> None:
    script = ctx.script
    for assign in script.nodes_of(cst.Assign):
        for target in assign.targets:
            subscript = target.target
            if N.is_string(N.sole_index(subscript), VARIABLE) and script.names(subscript.value) & ENVIRON:
                _flag(ctx, assign)
    for call in script.calls:
        if script.is_call_to(call, SETTERS) and call.args and N.is_string(call.args[0].value, VARIABLE):
            _flag(ctx, call)


def _flag(ctx: Context, node: cst.CSTNode) -> None:
    line = ctx.script.statement_line(node)
    if line is not None:
        ctx.edits.todo(line, line, MESSAGE)
