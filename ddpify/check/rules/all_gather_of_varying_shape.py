import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes, last_name
from ddpify.check.context import kwarg, positional
from ddpify.check.rule import Invalid, Report, Rule


class AllGatherOfVaryingShape(Rule):
    """`all_gather` of a tensor whose shape comes from this rank's data.

    ## What it does
    Flags `dist.all_gather(out, t)` (and `all_gather_into_tensor`) when `t`, as the function
    builds it, is cut to a length read from the rank's own batch (`x[:, :max(lengths).item()]`),
    picked by a mask (`preds[labels != -100]`, `nonzero`, `masked_select`, `unique`), or made
    by `generate(...)` (sequences end where each rank's samples end). Not when the tensor is
    padded on the way (a call named `pad`), nor when the function exchanges the sizes first (a
    collective on a `.shape`, `.size()` or `len(...)`).

    ## Why is this bad?
    `all_gather` needs the same shape on every rank. When one rank's tensor is longer the
    collective fails (gloo: "Received data size doesn't match expected size") or NCCL reads
    past the buffer and hangs or returns garbage.

    ## Example
    ```python
    generated = model.module.generate(batch["input_ids"], max_new_tokens=64)
    out = [torch.zeros_like(generated) for _ in range(world_size)]
    dist.all_gather(out, generated)
    ```

    ## Use instead
    ```python
    generated = model.module.generate(batch["input_ids"], max_new_tokens=64)
    generated = F.pad(generated, (0, 64 + prompt_len - generated.shape[1]), value=pad_id)
    out = [torch.zeros_like(generated) for _ in range(world_size)]
    dist.all_gather(out, generated)
    ```
    (or `dist.all_gather_object`, which pickles any size).

    ## Fix safety
    No automatic fix.

    ## References
    - https://github.com/pytorch/pytorch/issues/56112
    - https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_gather
    """

    CODE = "DDP163"
    NAME = "all-gather-of-varying-shape"
    DISTRIBUTED_ONLY = False
    MESSAGE = (
        "all_gather of a tensor whose shape comes from this rank's data: ranks pass different sizes and the "
        "collective fails or hangs; pad to a shared size (exchange the sizes first) or use all_gather_object"
    )
    VALID = [
        "import torch.distributed as dist\nimport torch.nn.functional as F\n\ndef f(x, n, world):\n"
        "    y = F.pad(x[: n.item()], (0, 8))\n    out = [y.clone() for _ in range(world)]\n    dist.all_gather(out, y)\n",
        "import torch.distributed as dist\n\ndef f(x, world):\n    y = x[:, :16]\n"
        "    out = [y.clone() for _ in range(world)]\n    dist.all_gather(out, y)\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\n\ndef f(x, lengths, world):\n    n = max(lengths).item()\n"
                "    y = x[:, :n]\n    out = [y.clone() for _ in range(world)]\n    dist.all_gather(out, y)\n"),
        Invalid("import torch.distributed as dist\n\ndef f(preds, labels, world):\n    kept = preds[labels != -100]\n"
                "    out = [kept.clone() for _ in range(world)]\n    dist.all_gather(out, kept)\n"),
    ]

    def check(self, ctx):
        for ci in ctx.calls_to(*N.SHAPED_GATHERS):
            given = kwarg(ci.node, "tensor") or kwarg(ci.node, "input_tensor") or next(iter(positional(ci.node)[1:2]), None)
            if given is None or _sizes_exchanged_before(ctx, ci):
                continue
            if _varying(ctx, given.value, ci.func, ctx.line(ci.node)):
                yield Report(ci.node)


_PICKS = {"nonzero", "masked_select", "unique", "unique_consecutive", "generate"}  # shape set by the values
_SIZES = {"shape", "size", "numel"}


def _varying(ctx, node: cst.CSTNode, func, line: int, depth: int = 0) -> bool:
    """Is the shape of what `node` computes set by this rank's values (followed through the names
    the function binds before `line`, a few steps)?"""
    if isinstance(node, cst.Call):
        name = last_name(node.func) or ""
        if "pad" in name.lower():
            return False  # padded to a shared size on the way
        if name in _PICKS or name == "where" and len(node.args) == 1:
            return True
    if isinstance(node, cst.Subscript) and any(_data_cut(ctx, e.slice, func, line) for e in node.slice):
        return True
    if isinstance(node, cst.Name) and depth < 4:
        return any(_varying(ctx, v, func, line, depth + 1) for v in _values(ctx, node.value, func, line))
    return any(_varying(ctx, child, func, line, depth) for child in node.children)


def _data_cut(ctx, s: cst.BaseSlice, func, line: int) -> bool:
    """`[:, :n]` with `n` read from the rank's data (`.item()`, `.tolist()`, `max(...)`), or
    `[mask]` with a comparison for mask."""
    if isinstance(s, cst.Slice):
        return any(b is not None and _read_from_data(ctx, b, func, line) for b in (s.lower, s.upper))
    value = s.value
    if isinstance(value, cst.Name):
        return any(isinstance(v, cst.Comparison) for v in _values(ctx, value.value, func, line))
    return isinstance(value, cst.Comparison)


def _read_from_data(ctx, bound: cst.BaseExpression, func, line: int, depth: int = 0) -> bool:
    for n in iter_nodes(bound):
        if isinstance(n, cst.Call) and (last_name(n.func) in {"item", "tolist"} or _max_of_values(n)):
            return True
        if isinstance(n, cst.Name) and n is bound and depth < 3:
            return any(_read_from_data(ctx, v, func, line, depth + 1) for v in _values(ctx, n.value, func, line))
    return False


def _max_of_values(call: cst.Call) -> bool:
    """`max(lengths)`: the longest of this rank's items (not `max(a, 1)` of plain numbers)."""
    return isinstance(call.func, cst.Name) and call.func.value in {"max", "min"} and len(call.args) == 1


def _values(ctx, name: str, func, line: int) -> list[cst.BaseExpression]:
    return [b.value for b in ctx.assignments if b.dotted == name and b.func is func and b._node is not None and b.line < line]


def _sizes_exchanged_before(ctx, ci) -> bool:
    """Does the function run a collective on a size before this gather (`dist.all_gather(sizes,
    torch.tensor([t.shape[0]]))`, an all_reduce of `len(...)` with MAX): the classic fix."""
    line = ctx.line(ci.node)
    for other in ctx.calls:
        if other.func is not ci.func or other is ci or not other.qnames & N.COLLECTIVES or ctx.line(other.node) >= line:
            continue
        for arg in other.node.args:
            exprs = [arg.value, *(v for n in iter_nodes(arg.value) if isinstance(n, cst.Name) for v in _values(ctx, n.value, ci.func, line))]
            if any(_mentions_size(e) for e in exprs):
                return True
    return False


def _mentions_size(expr: cst.BaseExpression) -> bool:
    return any(
        isinstance(n, cst.Attribute) and n.attr.value in _SIZES
        or isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value == "len"
        for n in iter_nodes(expr)
    )
