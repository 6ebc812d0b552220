"""Every rank splits the dataset the same way.

`random_split(dataset, [n_train, n_val])` draws from torch's global generator. A script that
never seeds it gets a different split in every process: samples one rank validates on, another
trains on, and the DistributedSampler shards a different dataset on each rank. Unless torch is
seeded before the split (or the split has its own `generator=`), the split gets a generator
seeded the same in every process.
"""

from __future__ import annotations


from ddpify.analysis import names as N
from ddpify.convert.context import Context
from ddpify.convert.edits import append_arg, keyword_arg

GENERATOR = "torch.Generator().manual_seed(0)"


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    seeded = [c for c in script.calls if script.is_call_to(c, N.TORCH_SEED)]
    for call in script.calls:
        if not script.is_call_to(call, N.RANDOM_SPLIT) or N.keyword(call, "generator") is not None:
            continue
        if len(N.positional(call)) > 2 or any(script.before(seed, call) for seed in seeded):
            continue
        edits.rewrite(call, lambda updated: append_arg(updated, keyword_arg("generator", edits.expression(GENERATOR))))
        edits.need_import("torch")
        edits.change(call, "`random_split` gets a seeded generator: every rank splits the data the same way")
