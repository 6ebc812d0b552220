"""Make every "the GPU" in the script mean this process's device.

`.cuda()`, `.cuda(0)`, `.to("cuda")`, `.to("cuda:0")`, `.to(0)`, `torch.device("cuda")`, `torch.device(0)` and
`device="cuda"` become the process's device where the code can name it; elsewhere the
explicit index is dropped, so `torch.cuda.set_device(local_rank)` picks the GPU.
`torch.load` gets a `map_location` so no rank loads onto GPU 0 (not where a `**mapping` may
carry one: a note instead).
A parameter's default (or a decorator) is evaluated when the `def` runs, before any run-time
name of the setup exists: there the index is dropped (`torch.device("cuda")`), never `device`.
The script's own `torch.cuda.set_device(...)` calls are removed: setup does it.
Legacy tensor types (`torch.cuda.FloatTensor(...)`, `x.type(torch.cuda.LongTensor)`) allocate
on the current device, which setup's `set_device` makes this process's GPU: they stay.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.index import names_in
from ddpify.analysis.script import ref_of
from ddpify.convert.context import Context
from ddpify.convert.edits import append_arg, keyword_arg


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    _compare_device_types(ctx)
    _note_tensor_types(ctx)
    for call in script.calls:
        if ctx.device_stmt is not None and script.inside(call, ctx.device_stmt):
            continue
        if ctx.gpus_per_process > 1 and any(
            isinstance(a.value, cst.SimpleString) and N.is_cuda_string(a.value) and ":" in a.value.evaluated_value
            for a in call.args
        ):
            continue  # spread_model_over_gpus gives each process its own GPUs
        visible = ctx.device_visible(script.scope_of(call)) and not _at_definition(script, call)
        device = ctx.device if visible else None  # the code that names this process's device here
        name = N.call_name(call)
        if script.is_call_to(call, N.SET_DEVICE):
            if _selects_own_gpu(ctx, call):
                continue  # the setup's own `torch.cuda.set_device(device)`
            line = script.statement_line(call)
            if line is not None and len(line.body) == 1 and isinstance(line.body[0], cst.Expr):
                edits.remove(line)
                edits.change(call, "removed the script's `torch.cuda.set_device`: setup selects LOCAL_RANK's GPU")
        elif name == "cuda" and isinstance(call.func, cst.Attribute):
            _cuda_call(ctx, call, device)
        elif name == "to" and N.positional(call) and _means_gpu(ctx, N.positional(call)[0].value):
            target = N.positional(call)[0]
            if device is None and _plain_cuda(target.value):
                continue  # "cuda" already: the current device, which setup makes this process's
            edits.replace(target.value, edits.expression(device or '"cuda"'))
            edits.change(call, f"`.to(...)` now targets `{ctx.device if visible else 'cuda'}`")
        elif script.is_call_to(call, N.TORCH_LOAD) and N.keyword(call, "map_location") is None:
            if any(a.star == "**" for a in call.args):
                edits.note(call, "`torch.load(..., **mapping)`: give it `map_location=` in the mapping, or each rank may load onto GPU 0")
            else:
                _map_location(ctx, call, ctx.device if visible else '"cpu"')
        elif script.is_call_to(call, N.TORCH_DEVICE) and _means_gpu(ctx, call):
            if device is not None:
                edits.replace(call, edits.expression(device))
                edits.change(call, f"`torch.device(...)` is now `{ctx.device}`")
            elif not _plain_cuda(call.args[0].value) or len(call.args) > 1:
                edits.replace(call, call.with_changes(args=[cst.Arg(cst.SimpleString('"cuda"'))]))
                edits.change(call, '`torch.device("cuda")`: the current device, LOCAL_RANK\'s GPU once set up')
        else:
            arg = N.keyword(call, "device")
            if arg is not None and N.is_cuda_string(arg.value) and not _per_process_string(ctx, arg.value):
                if device is None and _plain_cuda(arg.value):
                    continue
                edits.replace(arg.value, edits.expression(device or '"cuda"'))
                edits.change(call, f"`device=` now names `{ctx.device if visible else 'cuda'}`")


def _at_definition(script, node: cst.CSTNode) -> bool:
    """Is `node` in a parameter's default or annotation, or a decorator, of a `def`: code run
    when the `def` runs (at import, for a module's functions), not when the function does?"""
    held = False
    for anc in script.ancestors(node):
        if isinstance(anc, (cst.Param, cst.Decorator)):
            held = True
        elif isinstance(anc, cst.Lambda):
            held = False  # a lambda's defaults are evaluated where the lambda is
        elif isinstance(anc, (cst.FunctionDef, cst.BaseSuite)):
            return held and isinstance(anc, cst.FunctionDef)
    return False


def _plain_cuda(node: cst.BaseExpression) -> bool:
    """`"cuda"` or `'cuda'`: no index, so the current device (this process's once set up)."""
    return isinstance(node, cst.SimpleString) and node.evaluated_value == "cuda"


def _compare_device_types(ctx: Context) -> None:
    """`device == "cuda"` (a string device, now "cuda:<local_rank>") compares its type."""
    if not ctx.device_type.startswith("torch.device("):
        return
    for node in ctx.script.nodes_of(cst.Comparison):
        if len(node.comparisons) != 1 or not isinstance(node.comparisons[0].operator, (cst.Equal, cst.NotEqual)):
            continue
        sides = (node.left, node.comparisons[0].comparator)
        if any(isinstance(a, cst.Name) and a.value == ctx.device for a in sides) and any(
            isinstance(b, cst.SimpleString) and b.evaluated_value == "cuda" for b in sides
        ):
            side = next(a for a in sides if isinstance(a, cst.Name))
            ctx.edits.replace(side, ctx.edits.expression(ctx.device_type))
            ctx.edits.change(node, f'`{ctx.device_type} == "cuda"`: the device now carries its index')


def _note_tensor_types(ctx: Context) -> None:
    script = ctx.script
    for node in script.nodes_of(cst.Attribute):
        if not node.attr.value.endswith("Tensor"):
            continue
        names = [n for n in script.names(node) if n.startswith(N.CUDA_PREFIX) and n.count(".") == 2]
        if names:
            ctx.edits.change(
                node,
                f"`{names[0]}` allocates on the current GPU, which setup's set_device makes this process's",
            )
            return


def _cuda_call(ctx: Context, call: cst.Call, device: str | None) -> None:
    """`x.cuda(i, non_blocking=b)` -> `x.to(device, non_blocking=b)` (or `x.cuda(non_blocking=b)`)."""
    edits = ctx.edits
    if device is not None:

        def to_device(updated: cst.Call) -> cst.Call:
            keywords = [a for a in updated.args if a.keyword is not None]
            comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")) if keywords else cst.MaybeSentinel.DEFAULT
            return updated.with_changes(
                func=updated.func.with_changes(attr=cst.Name("to")), args=[cst.Arg(edits.expression(device), comma=comma), *keywords]
            )

        edits.rewrite(call, to_device)
        edits.change(call, f"`.cuda()` is now `.to({ctx.device})`")
    elif N.positional(call):
        edits.rewrite(call, lambda updated: updated.with_changes(args=[a for a in updated.args if a.keyword]))
        edits.change(call, "`.cuda(i)` is now `.cuda()`: the current device is LOCAL_RANK's GPU")


def _map_location(ctx: Context, call: cst.Call, where: str) -> None:
    """`torch.load(f)` -> `torch.load(f, map_location=device)`: not every rank onto GPU 0."""
    arg = keyword_arg("map_location", ctx.edits.expression(where))
    ctx.edits.rewrite(call, lambda updated: append_arg(updated, arg))
    callee = ctx.script.module.code_for_node(call.func)  # `torch.load`, or `load` imported from torch.serialization
    ctx.edits.change(call, f"`{callee}(..., map_location={where})`")


def _selects_own_gpu(ctx: Context, call: cst.Call) -> bool:
    """`torch.cuda.set_device(device)` / `(local_rank)`: this process's GPU, as setup selects it."""
    args = N.positional(call)
    if not args:
        return False
    value = args[0].value
    return ref_of(value) in (ctx.device, ctx.local_rank) or D.reads_rank(ctx.script, value)


def _means_gpu(ctx: Context, node: cst.BaseExpression) -> bool:
    """A "cuda"/"cuda:N" string, `torch.device("cuda"...)`, or a bare GPU index."""
    if N.is_cuda_string(node):
        return not _per_process_string(ctx, node)
    if D.is_per_process_device(ctx.script, node, ctx.local_rank):
        return False  # `torch.device("cuda", torch.cuda.current_device())`: chosen per process already
    if isinstance(node, cst.Call) and ctx.script.is_call_to(node, N.TORCH_DEVICE):
        args = N.positional(node)
        return bool(args) and (N.is_cuda_string(args[0].value) or isinstance(args[0].value, cst.Integer))
    return isinstance(node, cst.Integer)  # `.to(0)`: GPU 0


def _per_process_string(ctx: Context, node: cst.BaseExpression) -> bool:
    """`f"cuda:{local_rank}"`: an f-string whose index is this process's (LOCAL_RANK's)."""
    return isinstance(node, cst.FormattedString) and any(
        isinstance(p, cst.FormattedStringExpression)
        and (ref_of(p.expression) == ctx.local_rank or D.reads_rank(ctx.script, p.expression)
             or ctx.local_rank in names_in(p.expression))
        for p in node.parts
    )  # fmt: skip
