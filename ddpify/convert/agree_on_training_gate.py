"""Every rank takes the same training steps: a gate on data each rank gathers itself is agreed.

    for episode in range(episodes):
        memory.extend(rollout(env))              # each rank plays its own episodes
        if all_ranks(len(memory) > warmup):      # inserted: the same decision on every rank
            learn(model, memory, optimizer)

A reinforcement learner's replay buffer (or rollout) fills at its own pace on each rank, so a
gate like `len(memory) > warmup` opens at different episodes on different ranks: one rank steps
while the others do not, and DDP's next all-reduce waits for ever. The gate holds only where it
holds on every rank (one all-reduce per pass of the loop around it). A gate inside a loop whose
length differs between ranks (`while not done:`) cannot be agreed this way: a TODO says so.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.convert.context import Context
from ddpify.convert.emit import define_function

ALL_RANKS = '''

def all_ranks(flag):
    """True where `flag` holds on every process: the processes take the same decision."""
    agreed = torch.tensor(1.0 if flag else 0.0)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())
'''

SIZE_CALLS = {"len", "size", "qsize", "full", "ready", "is_full"}


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    if not script.models:
        return
    for gate in script.nodes_of(cst.If):
        if not _gates_training(ctx, gate) or not _reads_gathered_size(gate.test):
            continue
        if _agreed(gate.test):
            continue
        scope = script.scope_of(gate)
        loops = [a for a in script.ancestors(gate) if isinstance(a, (cst.For, cst.While)) and script.scope_of(a) is scope]
        if not loops:
            continue
        if any(isinstance(loop, cst.While) for loop in loops):
            edits.todo(gate, gate, "each rank decides here on its own data whether to train: every rank must take the same "
                       "optimizer steps (agree with an all_reduce of the decision, outside loops whose length differs by rank)")  # fmt: skip
            continue
        edits.rewrite(gate.test, lambda test: cst.Call(cst.Name("all_ranks"), [cst.Arg(test)]))
        edits.change(gate, "the training gate reads data this rank gathered: it opens only where it holds on every rank")
        define_function(ctx, "all_ranks", ALL_RANKS, gate)
        edits.need_import(N.DIST_MODULE, asname="dist")


def _gates_training(ctx: Context, gate: cst.If) -> bool:
    """Does the `if` body run an optimizer step: a backward in it, or a call to a training function?"""
    script = ctx.script
    for call in script.calls_in(gate.body):
        if N.call_name(call) == "backward" and N.receiver(call) is not None:
            return True
        if script.local_function(call) in script.training_functions:
            return True
    return False


def _reads_gathered_size(test: cst.BaseExpression) -> bool:
    """Does the test read how much a buffer holds (`len(memory) > N`, `buffer.size() >= batch`)?"""
    for node in iter_nodes(test):
        if isinstance(node, cst.Call) and N.call_name(node) in SIZE_CALLS:
            if N.call_name(node) == "size" and node.args:
                continue  # `x.size(0)`: a tensor's shape
            return True
    return False


def _agreed(test: cst.BaseExpression) -> bool:
    return isinstance(test, cst.Call) and N.is_name(test.func, "all_ranks")
