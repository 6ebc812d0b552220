"""`--launcher spawn`: the script starts its own processes with `mp.spawn` when not under torchrun.

    if __name__ == "__main__":
        if "LOCAL_RANK" in os.environ:  # launched by torchrun
            main()
        else:  # one process per GPU (NPROC_PER_NODE on CPU) on a free port
            ...
            mp.spawn(spawned_main, args=(nprocs,), nprocs=nprocs)

Each spawned process describes itself the way torchrun would (RANK, LOCAL_RANK,
WORLD_SIZE), so the setup the other passes wrote works unchanged. `nprocs` always
equals the world size (a mismatch hangs). Needs the training in a function called
from the `__main__` block.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.script import AnalysisError
from ddpify.convert.context import Context

HELPERS = '''

def free_port():
    """A free TCP port on this machine for the processes to meet on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawned_main(local_rank, world_size{params}):
    """One process of mp.spawn, described the way torchrun would describe it."""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size))
    {call}
'''

LAUNCH = '''if "LOCAL_RANK" in os.environ:  # launched by torchrun
    {call}
else:  # no torchrun: one process per GPU (NPROC_PER_NODE of them on CPU)
    nprocs = int(os.environ.get("NPROC_PER_NODE", torch.cuda.device_count() or 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(spawned_main, args=(nprocs,{args}), nprocs=nprocs)
'''


def run(ctx: Context) -> None:
    if ctx.options.launcher != "spawn":
        return
    script, edits = ctx.script, ctx.edits
    if any(script.is_call_to(c, D.SPAWN) for c in script.calls):
        return  # starts its own processes already
    stmt, call = _entry_call(ctx)
    names = [a.value.value for a in call.args]
    code = script.module.code_for_node(call)
    edits.replace(stmt, edits.statements(LAUNCH.format(call=code, args="".join(f" {n}," for n in names)))[0])
    guard = script.parent(script.parent(stmt))
    edits.insert_before(guard, HELPERS.format(params="".join(f", {n}" for n in names), call=code))
    edits.need_import("socket")
    edits.need_import(N.MP_MODULE, asname="mp")
    edits.change(stmt, "without torchrun the script starts its own processes with mp.spawn (nprocs = world size)")


def _entry_call(ctx: Context) -> tuple[cst.SimpleStatementLine, cst.Call]:
    """The `main(...)` call in the `__main__` block that runs the training."""
    script = ctx.script
    for stmt in script.module.body:
        if not (isinstance(stmt, cst.If) and "__name__" in script.module.code_for_node(stmt.test)):
            continue
        for line in reversed(stmt.body.body):
            call = line.body[0].value if isinstance(line, cst.SimpleStatementLine) and isinstance(line.body[0], cst.Expr) else None
            if (
                isinstance(call, cst.Call)
                and script.local_function(call) is not None
                and all(isinstance(a.value, cst.Name) and not a.keyword and not a.star for a in call.args)
            ):
                return line, call
    raise AnalysisError(1, "--launcher spawn needs the training in a function called from the `__main__` block")
