"""A `--local_rank` argument (from torch.distributed.launch days) defaults to LOCAL_RANK.

torchrun sets the LOCAL_RANK environment variable and passes no `--local-rank`, so the
argument's default becomes `int(os.environ.get("LOCAL_RANK", 0))`: `args.local_rank`
stays right under torchrun, under the legacy launcher (which passes the flag) and alone.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.convert.context import Context
from ddpify.convert.edits import append_arg, keyword_arg

FLAGS = {"--local_rank", "--local-rank"}
FROM_ENV = 'int(os.environ.get("LOCAL_RANK", 0))'


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    for call in script.calls:
        if N.call_name(call) != "add_argument":
            continue
        flags = {a.value.evaluated_value for a in N.positional(call) if isinstance(a.value, cst.SimpleString)}
        if not flags & FLAGS:
            continue
        default = N.keyword(call, "default")
        if default is not None:
            edits.replace(default.value, edits.expression(FROM_ENV))
        else:
            edits.rewrite(call, lambda updated: append_arg(updated, keyword_arg("default", edits.expression(FROM_ENV))))
        edits.need_import("os")
        edits.change(call, "`--local_rank` defaults to LOCAL_RANK (torchrun sets it; the old launcher passes the flag)")
