"""Checkpoints go through the unwrapped model, so they load into the single-GPU script.

After the wrap, `model.state_dict()` and `model.load_state_dict(...)` on the DDP model
become `model.module....`: saved keys have no `module.` prefix, and a resume after the
wrap loads into the wrapped module.
"""

from __future__ import annotations

from ddpify.analysis import names as N
from ddpify.analysis.script import ref_of
from ddpify.convert.context import Context

METHODS = {"state_dict", "load_state_dict"}


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    for call in script.calls:
        owner = N.receiver(call)
        if N.call_name(call) not in METHODS or owner is None:
            continue
        ddp = script.ddp_names.get(script.scope_of(call), set())
        if ref_of(owner) in ddp and ctx.after_wrap(call, ref_of(owner)):
            edits.replace(owner, edits.expression(f"{ref_of(owner)}.module"))
            edits.change(script.line(call), f"`{ref_of(owner)}.module.{N.call_name(call)}(...)`: no `module.` prefix")
