"""Collectives that reduce or overwrite their tensor in place (shared by DDP137-DDP139)."""

from __future__ import annotations

from typing import Optional

import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import is_false, kwarg, positional

# `dist.all_reduce(t)`, `dist.reduce(t, dst)`, `dist.broadcast(t, src)`: the result is written into `t`.
IN_PLACE = frozenset({"all_reduce", "reduce", "broadcast"})


def in_place_collectives(ctx):
    """The calls of torch.distributed's in-place collectives in the file."""
    return [ci for ci in ctx.calls if ci.name in IN_PLACE and ci.qnames & N.COLLECTIVES]


def tensor_arg(ci) -> Optional[cst.BaseExpression]:
    """The tensor an in-place collective writes into: its first positional or `tensor=` argument."""
    k = kwarg(ci.node, "tensor")
    if k is not None:
        return k.value
    args = positional(ci.node)
    return args[0].value if args else None


def asynchronous(ci) -> bool:
    """`async_op=` given and not a literal False: the call returns a work handle."""
    k = kwarg(ci.node, "async_op")
    return k is not None and not is_false(k.value)
