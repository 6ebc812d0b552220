"""What a script already does with torch.distributed: the facts that let every conversion pass
recognise its own work (a process group, a DDP wrap, a DistributedSampler, a rank-0 guard, an
all-reduce of metrics, a barrier) by qualified name, so converting a converted script changes
nothing and a partly converted one gets only what it lacks.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes

# the API names live once, in analysis/names.py
INIT_PROCESS_GROUP = N.INIT_PROCESS_GROUP
DESTROY_PROCESS_GROUP = N.DESTROY_PROCESS_GROUP
DDP = N.DDP_CLASSES
FULLY_SHARD = N.FULLY_SHARD
REPLICATE = N.REPLICATE
DISTRIBUTED_SAMPLER = N.DISTRIBUTED_SAMPLER
BARRIER = N.BARRIERS
ALL_REDUCE = N.ALL_REDUCE
GET_RANK = N.GET_RANK
GET_WORLD_SIZE = N.GET_WORLD_SIZE
SYNC_BATCHNORM = N.SYNC_BATCHNORM
SPAWN = N.SPAWN
CURRENT_DEVICE = N.CURRENT_DEVICE

RANK_VARIABLES = frozenset({"RANK", "LOCAL_RANK"})
WORLD_VARIABLES = frozenset({"WORLD_SIZE"})


def calls_to(script, node: cst.CSTNode, qualified: frozenset[str]) -> list[cst.Call]:
    """The calls to `qualified` inside `node`."""
    return [c for c in script.calls_in(node) if script.is_call_to(c, qualified)]


def _env_strings(node: cst.CSTNode) -> set[str]:
    return {s.evaluated_value for s in iter_nodes(node) if isinstance(s, cst.SimpleString) and isinstance(s.evaluated_value, str)}


def reads_rank(script, node: cst.CSTNode) -> bool:
    """Does `node` compute this process's rank: `dist.get_rank()`, or RANK / LOCAL_RANK from the
    environment (torchrun's)?"""
    return bool(calls_to(script, node, GET_RANK)) or bool(_env_strings(node) & RANK_VARIABLES)


def reads_world_size(script, node: cst.CSTNode) -> bool:
    return bool(calls_to(script, node, GET_WORLD_SIZE)) or bool(_env_strings(node) & WORLD_VARIABLES)


def guarded_by_rank(script, node: cst.CSTNode) -> bool:
    """Does `node` run under a test of the rank (`if dist.get_rank() == 0:`, `... if rank0 else`,
    `if rank != 0: return` above it, a function only rank 0 calls)? The rank-0 reasoning `check`
    uses (`analysis.rank`)."""
    from ddpify.analysis.rank import rank_analysis

    return rank_analysis(script.index).under_rank_test(node)


def all_reduces(script, fn: cst.FunctionDef | None) -> bool:
    """Does the script's function `fn` run an all-reduce (a helper like `all_reduce_sum`)?"""
    return fn is not None and bool(calls_to(script, fn, ALL_REDUCE))


def reduction_of(script, stmt: cst.CSTNode, name: str) -> cst.Call | None:
    """`name = helper(name) ...` (a helper that all-reduces, or one not defined at all: the
    script lost it) or `dist.all_reduce(name)`: the call that sums `name` over ranks."""
    for call in script.calls_in(stmt):
        if script.is_call_to(call, ALL_REDUCE) and call.args and _refers(call.args[0].value, name):
            return call
    assign = N.sole_assign(stmt)
    if assign is None or not N.is_name(assign.targets[0].target, name):
        return None
    for call in script.calls_in(stmt):
        if not (call.args and _refers(call.args[0].value, name) and isinstance(call.func, cst.Name)):
            continue
        fn = script.local_function(call)
        if all_reduces(script, fn) or (fn is None and not script.names(call.func)):
            return call
    return None


def _refers(node: cst.CSTNode, name: str) -> bool:
    return isinstance(node, cst.Name) and node.value == name


def reduced_after(script, loop: cst.CSTNode, name: str) -> cst.Call | None:
    """The reduction of `name` among the statements that follow `loop` in its block."""
    block = script.parent(loop)
    body = list(getattr(block, "body", ()))
    if loop not in body:
        return None
    for stmt in body[body.index(loop) + 1 :]:
        found = reduction_of(script, stmt, name)
        if found is None and isinstance(stmt, cst.If) and isinstance(stmt.body, cst.IndentedBlock):
            # `if not scoring: total = all_reduce_sum(total)`: reduced on the pass that trains
            found = next((f for s in stmt.body.body if (f := reduction_of(script, s, name)) is not None), None)
        if found is not None:
            return found
    return None


def missing_helper(script, call: cst.Call | None) -> bool:
    """A reduction that calls a helper the script does not define (it must be added back)."""
    return call is not None and isinstance(call.func, cst.Name) and script.local_function(call) is None and not script.is_call_to(call, ALL_REDUCE)


def sibling(script, stmt: cst.CSTNode, offset: int) -> cst.CSTNode | None:
    """The statement `offset` places after (negative: before) `stmt` in its block."""
    block = script.parent(stmt)
    body = list(getattr(block, "body", ()))
    if stmt not in body:
        return None
    index = body.index(stmt) + offset
    return body[index] if 0 <= index < len(body) else None


def barrier_in(script, stmt: cst.CSTNode | None) -> bool:
    return stmt is not None and bool(calls_to(script, stmt, BARRIER))


def is_per_process_device(script, node: cst.CSTNode, local_rank: str | None = None) -> bool:
    """`torch.device("cuda", torch.cuda.current_device())` or `torch.device("cuda", local_rank)`:
    a GPU already chosen per process."""
    if not (isinstance(node, cst.Call) and script.is_call_to(node, N.TORCH_DEVICE)):
        return False
    args = N.positional(node)
    if len(args) < 2:
        return False
    index = args[1].value
    if isinstance(index, cst.Call) and script.is_call_to(index, CURRENT_DEVICE):
        return True
    return local_rank is not None and isinstance(index, cst.Name) and index.value == local_rank
