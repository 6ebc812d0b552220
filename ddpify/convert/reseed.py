"""Re-seeding code the passes share: each process draws its own batches and episodes once the
models are wrapped (they start alike: DDP sends rank 0's weights)."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.convert.context import Context

RESEED_AFTER_WRAP = "torch.manual_seed(torch.initial_seed() + {rank})  # each process draws its own batches and episodes\n"


def seed_after_wrap(ctx: Context, message: str) -> bool:
    """Batches drawn where the static view cannot follow (`convert --run` saw them): re-seed
    torch by rank after the last wrap, offset the other seeds the script sets. False when no
    wrap is known to anchor the seed."""
    script, edits = ctx.script, ctx.edits
    anchors = list(ctx.wrap_after.values())
    if not anchors:
        return False
    last = max(anchors, key=lambda s: (script.root_of(s) is not script.module, script.line(s) or 0))
    if not any(script.is_call_to(c, N.TORCH_SEED) and D.reads_rank(script, c) for c in script.calls):
        edits.insert_after(last, RESEED_AFTER_WRAP.format(rank=ctx.rank_and_world(last)[0]))
        edits.change(last, message)
    for call in script.calls:
        generator = script.is_call_to(call, N.SEEDS - N.TORCH_SEED)
        if not (generator or _seeds_environment(script, call)) or len(call.args) != 1 or D.reads_rank(script, call):
            continue
        if not generator and _passed_on(script, call):
            continue  # `def seed(self, value): self.rng.seed(value)`: its caller's seed is offset
        offset_by_rank(ctx, call, "the seed is offset by the rank: each process draws its own batches and episodes")
    return True


def offset_by_rank(ctx: Context, call: cst.Call, message: str) -> None:
    """`np.random.seed(s)` -> `np.random.seed(s + rank)`, in whichever module of the project it is."""
    value = call.args[0].value
    code = ctx.script.root_of(call).code_for_node(value)
    if not isinstance(value, (cst.Name, cst.Attribute, cst.Integer, cst.Call, cst.Subscript)):
        code = f"({code})"
    ctx.edits.replace(value, ctx.edits.expression(f"{code} + {ctx.rank_and_world(call)[0]}"))
    ctx.edits.change(call, message)


def _passed_on(script, call: cst.Call) -> bool:
    """Is the seed a parameter of the function that makes the call (the caller chooses it)?"""
    value, scope = call.args[0].value, script.scope_of(call)
    return isinstance(value, cst.Name) and isinstance(scope, cst.FunctionDef) and any(
        p.name.value == value.value for p in scope.params.params
    )


def _seeds_environment(script, call: cst.Call) -> bool:
    """`env.seed(s)`, `env.action_space.seed(s)`: an object of the script's own seeding its draws
    (not torch's, numpy's or random's module-level seed, nor a module's function)."""
    func = call.func
    if not (isinstance(func, cst.Attribute) and func.attr.value == "seed"):
        return False
    return not any(q.startswith(N.RANDOM_MODULES) for q in script.names(func)) and not (
        isinstance(func.value, cst.Name) and f"{func.value.value}." in N.RANDOM_MODULES
    )


