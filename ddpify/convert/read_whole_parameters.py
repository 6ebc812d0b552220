"""`--to fsdp2`: parameters read outside the model's forward are gathered whole, or flagged.

Outside forward, a sharded model's parameters are DTensors holding one rank's shard.

    print("learned:", fc.weight.view(-1))          # single-GPU script

    fc_weight = fc.weight.full_tensor()            # every rank gathers (a collective)
    if dist.get_rank() == 0:
        print("learned:", fc_weight.view(-1))

A print or log message that reads `model...weight` / `.bias` gets the gathered value, computed
on every rank before the rank-0 guard. A method of the model's own class other than forward
that reads its parameters (`model.init_hidden(bsz)` calling `next(self.parameters())`) would
make DTensors out of them: it is registered as a forward method
(`register_fsdp_forward_method(model, "init_hidden")`), so FSDP2 gathers the parameters for it
as for forward (a TODO where the model is not sharded in this file); a loop over the model's
parameters that hands each to a writer (`writer.add_histogram(name, p)`), which would see one
shard, reads them gathered whole (`get_model_state_dict(..., full_state_dict=True)` on every
rank, before the loop).
"""

from __future__ import annotations

import re

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.literals import string_value
from ddpify.analysis.script import ref_of
from ddpify.convert.context import Context

PARAMETER_ATTRIBUTES = frozenset({"weight", "bias"})
OUTPUT = N.PRINT | N.LOGGING_CALLS
NN_MODULE_METHODS = frozenset(dir(object)) | N.NN_MODULE_API | N.FSDP_MODULE_API


def run(ctx: Context) -> None:
    script = ctx.script
    for call in script.calls:
        if script.is_call_to(call, OUTPUT):
            _gather_printed(ctx, call)
        elif isinstance(call.func, cst.Attribute):
            _flag_own_method(ctx, call)
    for loop in script.nodes_of(cst.For):
        _flag_parameters_handed_out(ctx, loop)


def _sharded_root(ctx: Context, node: cst.CSTNode) -> str | None:
    """The sharded model an attribute chain starts from (`model`, `self.model`), if any."""
    script = ctx.script
    scope = script.scope_of(node)
    local = script.bound.get(scope, set())  # (`model = parser.add_argument_group(...)` in another function is not it)
    models = {m for m, where in script.models.items() if where is scope or m not in local}
    here = (models - set(script.run_with_weights)) | set(script.ddp_names.get(scope, ()))
    here -= ctx.replicated.keys()  # (whole on every rank)
    while isinstance(node, (cst.Attribute, cst.Subscript)):  # `model.body[2].bias`
        ref = ref_of(node)
        if ref in here:
            return ref
        node = node.value
    ref = ref_of(node)
    return ref if ref in here else None


def _gather_printed(ctx: Context, call: cst.Call) -> None:
    script, edits = ctx.script, ctx.edits
    line = script.statement_line(call)
    if line is None:
        return
    hoisted: list[cst.Call] = []
    for inner in script.calls_in(call):
        if inner is call or any(script.inside(inner, h) for h in hoisted) or not _runs_sharded(ctx, inner):
            continue
        hoisted.append(inner)  # `print(model.sample(4))`: a sharded forward is a collective
        name = re.sub(r"\W+", "_", script.module.code_for_node(inner.func).replace("self.", "")).strip("_") + "_result"
        edits.insert_before(line, f"{name} = {script.module.code_for_node(inner)}  # runs the sharded model: on every rank\n")
        edits.replace(inner, cst.Name(name))
        ctx.collective_lines.add(line)
        edits.change(inner, f"`{script.module.code_for_node(inner.func)}(...)` runs the sharded model: every rank calls it, then rank 0 shows the result")
    for node in script.nodes_in(call, cst.Attribute):
        if node.attr.value not in PARAMETER_ATTRIBUTES or isinstance(script.parent(node), cst.Attribute) and script.parent(node).attr.value in ("data", "grad"):
            continue
        model = _sharded_root(ctx, node.value)
        if model is None or not ctx.after_wrap(call, model):
            continue
        name = re.sub(r"\W+", "_", script.module.code_for_node(node).replace("self.", "")).strip("_")
        edits.insert_before(line, f"{name} = {script.module.code_for_node(node)}.full_tensor()  # a sharded parameter, gathered whole\n")
        edits.replace(node, cst.Name(name))
        ctx.collective_lines.add(line)
        edits.change(node, f"`{script.module.code_for_node(node)}` is gathered whole on every rank before it is shown")


def _runs_sharded(ctx: Context, call: cst.Call) -> bool:
    """`model(x)`, `model.sample(n)`, `model.encoder(x)`: a call that runs the sharded model."""
    func = call.func
    if _sharded_root(ctx, func) == ref_of(func) and ref_of(func) is not None:
        return ctx.after_wrap(call, ref_of(func))  # the model itself
    if isinstance(func, cst.Attribute) and func.attr.value not in NN_MODULE_METHODS:
        owner = ref_of(func.value)
        return owner is not None and _sharded_root(ctx, func.value) == owner and ctx.after_wrap(call, owner)
    return False


def _flag_own_method(ctx: Context, call: cst.Call) -> None:
    script, edits = ctx.script, ctx.edits
    method = call.func.attr.value
    owner = ref_of(call.func.value)
    if method in NN_MODULE_METHODS or owner is None or _sharded_root(ctx, call.func.value) != owner:
        return
    if not ctx.after_wrap(call, owner):
        return
    target = script.summaries.callee(call)
    fn = target[1] if target is not None else None
    if fn is None:
        models = [owner] if owner in script.models else list(script.models)
        cls = ctx.model_class(models[0]) if len(models) == 1 else None
        fn = ctx.script.methods(cls).get(method) if cls is not None else None
    found = [fn] if fn is not None else _definitions(ctx, method)
    if found and not any(_reads_parameters(ctx, f) for f in found) or _registered(ctx, owner, method):
        return
    stmt = script.statement_line(call) or script.top_statement(call, script.scope_of(call)) or call
    units = ctx.shard_units.get(owner)
    if units is not None and script.root_of(call) is script.module and not any(_reads_unit(ctx, f, units) for f in found):
        _register_forward_method(ctx, owner, method, stmt)
        return
    reads = "reads" if found else "may read (its code is not in sight)"
    edits.todo(stmt, call, f"`{owner}.{method}()` {reads} the model's parameters outside forward: under FSDP2 they are sharded DTensors there (run it through forward, or build what it makes from plain tensors)")


def _register_forward_method(ctx: Context, model: str, method: str, stmt: cst.CSTNode) -> None:
    """`register_fsdp_forward_method(model, "init_hidden")` after the model is sharded: calling
    the method gathers the parameters whole, as forward does (a collective: every rank calls it)."""
    ctx.collective_lines.add(stmt)
    if (model, method) in ctx.forward_methods:
        return
    ctx.forward_methods.add((model, method))
    ctx.edits.insert_after(ctx.wrap_after[model], f'register_fsdp_forward_method({model}, "{method}")\n')
    ctx.edits.need_import(N.FSDP_MODULE, "register_fsdp_forward_method")
    ctx.edits.change(ctx.wrap_after[model], f"`{model}.{method}()` reads the parameters outside forward: registered as a forward method, FSDP2 gathers them whole for it")


def _registered(ctx: Context, model: str, method: str) -> bool:
    """Is `register_fsdp_forward_method(model, "method")` in the script already?"""
    return any(
        N.call_name(c) == "register_fsdp_forward_method" and len(c.args) == 2
        and ref_of(c.args[0].value) == model and string_value(c.args[1].value) == method
        for c in ctx.script.calls
    )  # fmt: skip


def _reads_unit(ctx: Context, fn: cst.FunctionDef, units: list[str]) -> bool:
    """Does the method read parameters a registered forward method would not gather: those of a
    submodule sharded as a unit of its own (`self.code.weight`), or any of them
    (`next(self.parameters())`) when the model has such units?"""
    if not units:
        return False
    for node in ctx.script.nodes_in(fn, cst.Attribute):
        if node.attr.value in ("parameters", "named_parameters") and N.is_name(node.value, "self"):
            return True
        if node.attr.value in PARAMETER_ATTRIBUTES:
            path = ctx.script.module.code_for_node(node.value)
            if path.startswith("self.") and any(path[5:] == u or path[5:].startswith(u + ".") or u == "*" for u in units):
                return True
    return False


def _definitions(ctx: Context, method: str) -> list[cst.FunctionDef]:
    """The methods of this name of the classes of the script and its project (the model's class
    is chosen at run time among them: `RNNModel` or `TransformerModel` by a flag)."""
    found = []
    for root in ctx.script.index.roots:
        for cls in (s for s in root.body if isinstance(s, cst.ClassDef)):
            fn = ctx.script.methods(cls).get(method)
            if fn is not None:
                found.append(fn)
    return found


def _flag_parameters_handed_out(ctx: Context, loop: cst.For) -> None:
    """`for name, p in model.named_parameters(): writer.add_histogram(name, p)`: each parameter
    would be this rank's shard (and a writer's `.numpy()` would pin an unsharded one's storage):
    the loop reads the parameters gathered whole instead, fetched on every rank before it."""
    script, edits = ctx.script, ctx.edits
    if not (isinstance(loop.iter, cst.Call) and N.call_name(loop.iter) in ("parameters", "named_parameters")):
        return
    owner = N.receiver(loop.iter)
    model = _sharded_root(ctx, owner) if owner is not None else None
    if model is None or not ctx.after_wrap(loop, model):
        return
    target = loop.target.elements[-1].value if isinstance(loop.target, cst.Tuple) else loop.target
    if not isinstance(target, cst.Name):
        return
    if any(  # `p.data.add_(p.grad, alpha=-lr)`: the loop updates the parameters, it does not show them
        isinstance(node.value, cst.Name) and node.value.value == target.value and (node.attr.value in ("grad", "data") or node.attr.value.endswith("_"))
        for node in script.nodes_in(loop.body, cst.Attribute)
    ):
        return
    for call in script.calls_in(loop.body):
        if any(isinstance(a.value, cst.Name) and a.value.value == target.value for a in call.args) or script.is_call_to(call, OUTPUT) and any(
            isinstance(n, cst.Name) and n.value == target.value for a in call.args for n in script.nodes_in(a, cst.Name)
        ):
            break  # `writer.add_histogram(name, p)`, `print(f"{name}: {p.norm()}")`
    else:
        return
    if loop.iter.args:
        edits.todo(loop, call, f"each parameter of `{model}` is handed to `{script.module.code_for_node(call.func)}`: under FSDP2 it is this rank's shard (gather it with `.full_tensor()` on every rank)")
        return
    holder = script.module.code_for_node(owner)
    whole = re.sub(r"\W+", "_", holder.replace("self.", "")).strip("_") + "_whole"
    edits.insert_before(loop, f"{whole} = get_model_state_dict({holder}, options=StateDictOptions(full_state_dict=True))  # every rank: the parameters gathered whole\n")
    pairs = f"(name, {whole}[name]) for name, _ in {holder}.named_parameters()"
    edits.replace(loop.iter, cst.parse_expression(f"({pairs})" if N.call_name(loop.iter) == "named_parameters" else f"({whole}[name] for name, _ in {holder}.named_parameters())"))
    edits.need_import(N.STATE_DICT_MODULE, "get_model_state_dict")
    edits.need_import(N.STATE_DICT_MODULE, "StateDictOptions")
    ctx.collective_lines.add(loop)
    edits.change(loop, f"each parameter of `{model}` handed to `{script.module.code_for_node(call.func)}` is gathered whole first (on every rank)")


def _reads_parameters(ctx: Context, fn: cst.FunctionDef) -> bool:
    """Does a method read its own parameters (`self.parameters()`, `self.<layer>.weight`) or run
    another method that may? (Its submodules, `self.net(x)`, are units of their own: shard_model
    shards what runs outside forward.)"""
    script = ctx.script
    cls = script.class_of(fn)
    children = ctx.children(cls) if cls is not None else set()
    for call in script.calls_in(fn):
        if isinstance(call.func, cst.Attribute) and isinstance(call.func.value, cst.Name) and call.func.value.value == "self":
            name = call.func.attr.value
            if name not in children and (name not in NN_MODULE_METHODS or name == "forward"):
                return True  # another method of the model, which may
    for node in script.nodes_in(fn, cst.Attribute):
        if node.attr.value in PARAMETER_ATTRIBUTES | {"parameters", "named_parameters"}:
            root = node.value
            while isinstance(root, cst.Attribute):
                root = root.value
            if isinstance(root, cst.Name) and root.value == "self":
                return True
    return False
