"""A script that picks its GPUs itself keeps doing so as one process, and leaves it to the launch under torchrun.

    os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu_id    # "0" by default

Under torchrun every process would run that line: each would then see only the GPUs listed and
take `cuda:<local_rank>` among them, so a list shorter than the processes per node fails on the
ranks past its end ("invalid device ordinal"), and a list of one puts every rank on one GPU.
The line runs only when torchrun did not start the process (no LOCAL_RANK); under torchrun the
launch chooses the node's GPUs (`CUDA_VISIBLE_DEVICES=0,1 torchrun ...`). A setting the code
makes in a way this pass does not read (`os.environ.update(...)`, a key held in a variable),
seen by `convert --run`, gets a TODO at its line.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.convert.context import Context

VARIABLE = "CUDA_VISIBLE_DEVICES"
ENVIRON = frozenset({"os.environ"})
SETTERS = frozenset({"os.environ.setdefault", "os.putenv"})
NOT_UNDER_TORCHRUN = '"LOCAL_RANK" not in os.environ'
CHANGE = (
    f"{VARIABLE} is set only when torchrun did not start the process: under torchrun each process takes "
    "cuda:<local_rank> among the GPUs the launch shows (`CUDA_VISIBLE_DEVICES=0,1 torchrun ...`)"
)
TODO = (
    f"the run set {VARIABLE} here: under torchrun every process sees only the GPUs it lists and takes "
    "cuda:<local_rank> among them; set it only when LOCAL_RANK is not in os.environ, and choose the GPUs at launch"
)


def run(ctx: Context) -> None:
    script = ctx.script
    done: set[cst.CSTNode] = set()
    for assign in script.nodes_of(cst.Assign):
        for target in assign.targets:
            subscript = target.target
            if N.is_string(N.sole_index(subscript), VARIABLE) and script.names(subscript.value) & ENVIRON:
                _guard(ctx, assign, done)
    for call in script.calls:
        if script.is_call_to(call, SETTERS) and call.args and N.is_string(call.args[0].value, VARIABLE):
            _guard(ctx, call, done)
    for module in script.index.roots:
        for line in sorted(ctx.run_sites(f"env:{VARIABLE}", module)):
            stmt = _statement_at(script, module, line)
            if stmt is not None and stmt not in done and not _guarded(script, stmt):
                ctx.edits.todo(stmt, stmt, TODO)


def _guard(ctx: Context, node: cst.CSTNode, done: set[cst.CSTNode]) -> None:
    stmt = ctx.script.statement_line(node)
    if stmt is None or stmt in done:
        return
    done.add(stmt)
    if _guarded(ctx.script, stmt):
        return  # converted already
    ctx.edits.guard(stmt, NOT_UNDER_TORCHRUN)
    ctx.edits.change(stmt, CHANGE)


def _guarded(script, stmt: cst.CSTNode) -> bool:
    """Does an `if` around the statement test whether torchrun started the process?"""
    return any(
        isinstance(a, cst.If) and "LOCAL_RANK" in script.root_of(stmt).code_for_node(a.test) for a in script.ancestors(stmt)
    )


def _statement_at(script, module: cst.Module, line: int) -> cst.SimpleStatementLine | None:
    return next(
        (s for s in script.nodes_of(cst.SimpleStatementLine) if script.root_of(s) is module and script.line(s) == line), None
    )
