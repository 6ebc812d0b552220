"""Helpers shared by several rules."""

from __future__ import annotations

import re

import libcst as cst

from ddpify.check.context import FileContext, dotted_name

_RANK_TEXT = re.compile(r"rank|gpu_id|\bgpu\b|device_id|local_gpu|process_index", re.IGNORECASE)


def mentions_rank(ctx: FileContext, call: cst.Call) -> bool:
    """Output tagged with the rank (``print(f"[rank {rank}] ...")``) is per-rank on purpose."""
    return any(_RANK_TEXT.search(ctx.code(a.value)) for a in call.args)


def every_rank(ctx: FileContext, call: cst.Call) -> bool:
    """A side effect that runs on every rank (not rank-0-only, not tagged with the rank)."""
    return not ctx.in_rank0(call) and not mentions_rank(ctx, call)


def iterated_name(for_node: cst.For) -> str | None:
    """``loader`` in ``for x in loader``, ``enumerate(loader)``, ``tqdm(loader)``, ``iter(loader)``."""
    it = for_node.iter
    while isinstance(it, cst.Call) and it.args and (dotted_name(it.func) or "").split(".")[-1] in (
        "enumerate",
        "tqdm",
        "iter",
        "zip",
        "track",
    ):
        it = it.args[0].value
    return dotted_name(it)
