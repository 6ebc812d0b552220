"""`--to fsdp2`: shard the model over the processes with FSDP2's `fully_shard`.

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:             # each repeated block is its own unit
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)          # then the root: what is left (embeddings, head)
    optimizer = torch.optim.AdamW(model.parameters(), ...)

The blocks are the entries of an `nn.ModuleList` / `nn.Sequential` of one class that the model's
class (of the script or its project) builds in `__init__` (`--shard CLASS` names the class
instead). `fully_shard` replaces the parameters with DTensors, so it goes before the optimizer
is built: an optimizer built earlier would step the old ones. A `torch.autocast(...,
dtype=torch.bfloat16)` becomes a `MixedPrecisionPolicy` (bf16 parameters in forward and
backward, gradients reduced in fp32); fp16 with a GradScaler is left with a TODO.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.functional import is_weights, weight_names
from ddpify.analysis.index import iter_nodes
from ddpify.analysis.script import mentions, ref_of, returns
from ddpify.convert.context import Context
from ddpify.convert.unwrapped import send_unwrapped
from ddpify.convert.wrap_point import wrap_point

BACKEND_DEVICE = '"cuda" if "nccl" in dist.get_backend() else "cpu"'  # where the setup's device is not in sight
CONTAINERS = frozenset({"ModuleList", "Sequential"})
DOUBLE_BACKWARD = "takes a gradient of a gradient (create_graph=True), which FSDP2 does not support"
POLICY = "mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)\n"


def run(ctx: Context) -> None:
    mixed = _bf16_autocasts(ctx)
    scalar = _zero_dim_parameter(ctx)
    if scalar is not None:  # (where the models' classes come from is not followed: all of them)
        root = ctx.script.root_of(scalar)
        where = f"`{_short(root.code_for_node(scalar))}` in {ctx.script.index.roots.get(root) or 'this script'}"
        for model in set(ctx.script.models) - set(ctx.script.run_with_weights):
            ctx.replicated[model] = f"may hold a 0-dimensional parameter ({where}), which fully_shard refuses"
    for model in _differentiated_twice(ctx):
        ctx.replicated[model] = DOUBLE_BACKWARD
    for model, scope in ctx.script.models.items():
        if model in ctx.script.run_with_weights:
            send_unwrapped(ctx, model, scope)  # run with weights passed in: replicated, averaged by hand
        else:
            _shard(ctx, model, scope, policy=bool(mixed))
    if mixed:
        _drop_autocasts(ctx, mixed)
    _flag_unsupported(ctx)


def _flag_unsupported(ctx: Context) -> None:
    """What FSDP2 does not do as the script does it: a TODO at the line."""
    script = ctx.script
    sharded = {m for m in script.models if m not in script.run_with_weights}
    for call in script.calls:
        if N.call_name(call) == "to" and any(mentions(call.func, m) for m in ctx.replicated):
            continue  # (a replicated model keeps any memory format)
        create_graph = N.keyword(call, "create_graph")
        if script.is_call_to(call, N.AUTOGRAD_GRAD) and _of_unsharded(script, call):
            continue  # the parameters of a model run with weights passed in: it is not sharded
        if script.is_call_to(call, N.AUTOGRAD_GRAD) and _models_differentiated(ctx, call) & ctx.replicated.keys():
            continue  # that model is replicated, not sharded
        if script.is_call_to(call, N.AUTOGRAD_GRAD) and create_graph is not None and script.module.code_for_node(create_graph.value) != "False":
            why = "a gradient of a gradient (create_graph=True, e.g. a gradient penalty) through a model FSDP2 shards is not supported: convert with --to ddp"
        elif script.is_call_to(call, N.DEEPCOPY) and call.args and ref_of(call.args[0].value) in sharded and ctx.after_wrap(call, ref_of(call.args[0].value)):
            why = "FSDP2 cannot deepcopy a sharded model: copy it before fully_shard (and shard the copy the same way)"
        elif N.call_name(call) == "to" and _channels_last(script, call) and any(mentions(call.func, m) for m in sharded):
            why = "FSDP2 shards contiguous parameters only: keep the model in the default memory format (channels_last inputs are fine)"
        elif script.is_call_to(call, N.GRAD_SCALER) and sharded - ctx.replicated.keys():
            why = "fp16 with a GradScaler under FSDP2: train in bf16 (a MixedPrecisionPolicy) or check that this scaler unscales DTensor gradients"
        else:
            continue
        ctx.edits.todo(script.statement_line(call) or call, call, why)


def _differentiated_twice(ctx: Context) -> set[str]:
    """The models a gradient of a gradient runs through (`torch.autograd.grad(outputs=D(x), ...,
    create_graph=True)`: a gradient penalty). FSDP2 does not support double backward, so they
    are replicated instead (DDP's all-reduce of gradients, no wrapper), the others sharded."""
    found: set[str] = set()
    for call in ctx.script.calls:
        create_graph = N.keyword(call, "create_graph")
        if ctx.script.is_call_to(call, N.AUTOGRAD_GRAD) and create_graph is not None and ctx.script.module.code_for_node(create_graph.value) != "False":
            found |= _models_differentiated(ctx, call)
    return found - set(ctx.script.run_with_weights)


def _zero_dim_parameter(ctx: Context) -> cst.Call | None:
    """A parameter of the program built 0-dimensional (`nn.Parameter(torch.tensor(0.07))`,
    `nn.Parameter(torch.ones(()))`): fully_shard refuses it (it shards along dimension 0)."""
    script = ctx.script
    for root in script.index.roots:
        for node in iter_nodes(root):
            if isinstance(node, cst.Call) and N.call_name(node) == "Parameter" and node.args and _zero_dim(node.args[0].value):
                return node
    return None


def _zero_dim(value: cst.BaseExpression) -> bool:
    """`torch.tensor(x)` of a plain number or expression (not a list), `torch.ones(())`, `torch.zeros([])`,
    also inside arithmetic or a call around it (`torch.log(torch.tensor(t))`, `torch.ones(()) * 0.01`)."""
    for call in (n for n in iter_nodes(value) if isinstance(n, cst.Call)):
        name, args = N.call_name(call), N.positional(call)
        if name == "tensor" and len(args) == 1 and not isinstance(args[0].value, (cst.List, cst.Tuple, cst.ListComp)):
            return isinstance(args[0].value, (cst.Integer, cst.Float, cst.BinaryOperation, cst.UnaryOperation, cst.Name))
        if name in ("ones", "zeros", "empty", "randn", "rand", "full") and args and isinstance(args[0].value, (cst.Tuple, cst.List)) and not args[0].value.elements:
            return True
    return False


def _models_differentiated(ctx: Context, grad: cst.Call) -> set[str]:
    """The models whose forward gives `grad`'s outputs: `d = D(x)` in its function, where `D` is
    a model or a parameter every call of the function fills with one."""
    script = ctx.script
    outputs = N.keyword(grad, "outputs") or next(iter(N.positional(grad)[:1]), None)
    if outputs is None:
        return set()
    scope = script.scope_of(grad)
    name = ref_of(outputs.value)
    values = [outputs.value] + [  # `grad(D(x).sum(), x, ...)`, or `d = D(x)` (`d, _ = D(x)`) before `grad(d, x, ...)`
        a.value for a in script.assigns.get(scope, []) if name is not None and name in _targets(a.targets[0].target)
    ]
    calls = [c for v in values for c in [*([v] if isinstance(v, cst.Call) else []), *script.calls_in(v)]]
    callers = {ref_of(_forward_of(c.func)) for c in calls}
    found = {c for c in callers if c in script.models}
    fn = scope if isinstance(scope, cst.FunctionDef) else None
    for param in callers - found if fn is not None else ():  # `penalty(critic, ...)` fills `def penalty(D, ...)`
        for site in script.index.call_sites(fn):
            given = script.index.argument_for(fn, site, param)
            if given is not None and ref_of(given[0]) in script.models:
                found.add(ref_of(given[0]))
    return found


def _forward_of(func: cst.BaseExpression) -> cst.BaseExpression:
    """`D` of `D.forward(x)` (a forward that skips the module's hooks, as a converted penalty runs it)."""
    if isinstance(func, cst.Attribute) and func.attr.value == "forward":
        return func.value
    return func


def _targets(target: cst.BaseExpression) -> set[str]:
    """The names an assignment target binds (`out, _, _ = ...`: out and _)."""
    if isinstance(target, (cst.Tuple, cst.List)):
        return set().union(*(_targets(e.value) for e in target.elements))
    ref = ref_of(target)
    return {ref} if ref else set()


def _of_unsharded(script, grad: cst.Call) -> bool:
    """`torch.autograd.grad(loss, net.parameters())` (or weights computed from them) for a model
    run with weights passed in, which stays whole on every rank."""
    inputs = N.keyword(grad, "inputs") or next(iter(N.positional(grad)[1:2]), None)
    scope = script.scope_of(grad)
    return inputs is not None and any(
        is_weights(inputs.value, name, weight_names(script, scope, name)) for name in script.synced_by_hand.get(scope, {})
    )


def _channels_last(script, call: cst.Call) -> bool:
    fmt = N.keyword(call, "memory_format")
    return fmt is not None and script.module.code_for_node(fmt.value).endswith("channels_last")


def _shard(ctx: Context, model: str, scope, policy: bool) -> None:
    script, edits = ctx.script, ctx.edits
    body = list(script.block_of(scope).body)
    existing = [s for s in body if any(script.is_call_to(c, N.FULLY_SHARD | N.REPLICATE) for c in script.calls_in(s))]
    if existing:
        ctx.wrap_after[model] = existing[-1]
        return
    factory = _factory(ctx, model, scope)
    if factory is not None:
        fn, before, local = factory
        ctx.wrap_after[model] = next(s for s in body if any(script.local_function(c) is fn for c in script.calls_in(s)))
        if any(script.is_call_to(c, N.FULLY_SHARD) for c in script.calls_in(fn)):
            return  # sharded there already
        code, what = _code(ctx, local, ctx.options.shard, _units(ctx, local, fn, list(fn.body.body)), policy, BACKEND_DEVICE)
        edits.insert_before(script.top_statement(before, fn), code)
        _imports(ctx)
        edits.change(before, f"FSDP2 shards {what} in `{fn.name.value}()`, before its optimizer is built (no wrapper)")
        if policy:
            edits.change(before, "bf16 autocast becomes a MixedPrecisionPolicy (bf16 parameters, gradients reduced in fp32)")
        return
    last = wrap_point(ctx, model, scope, body, into_blocks=True)  # (inside `if not args.eval_only:` that builds and trains it)
    if model in ctx.replicated:
        _replicate(ctx, model, scope, last)
        return
    nested = last not in body
    body = list(script.parent(last).body) if nested else body
    optimizer = _optimizer_built(ctx, model, body, last)
    anchor = last
    if optimizer is not None:
        at = body.index(optimizer)
        floor = ctx.init_index - 1 if scope is ctx.setup_scope and not nested else -1
        if at - 1 > floor and _built_before(body, at, model):
            anchor = body[at - 1]  # before the optimizer: it must see the sharded parameters
        else:
            edits.todo(optimizer, optimizer, f"the optimizer is built before `{model}` can be sharded: build it after `fully_shard({model})`")
    ctx.wrap_after[model] = anchor
    units = _units(ctx, model, scope, body)
    device_type = ctx.device_type if ctx.device_visible(scope) else BACKEND_DEVICE
    code, what = _code(ctx, model, ctx.options.shard, units, policy, device_type)
    edits.insert_after(anchor, code)
    _imports(ctx)
    edits.change(anchor, f"FSDP2 shards {what} over the processes (no wrapper: `{model}` keeps its own attributes)")
    if not units and not ctx.options.shard:
        edits.note(anchor, f"`{model}` has no repeated blocks ddpify can see: one unit, gathered whole for every forward (--shard CLASS names its blocks; if it fits one GPU, --to ddp is faster)")
    if policy:
        edits.change(anchor, "bf16 autocast becomes a MixedPrecisionPolicy (bf16 parameters, gradients reduced in fp32)")


def _replicate(ctx: Context, model: str, scope, last: cst.CSTNode) -> None:
    """`replicate(model)`: DDP's gradient all-reduce in place (no wrapper, `model` keeps its own
    attributes, as a sharded one does), for a model FSDP2 cannot shard."""
    ctx.wrap_after[model] = last
    reason = "cannot take a gradient of a gradient" if ctx.replicated[model] == DOUBLE_BACKWARD else "cannot shard 0-dim parameters"
    ctx.edits.insert_after(last, f"replicate({model})  # FSDP2 {reason}: DDP's all-reduce, in place\n")
    ctx.edits.need_import(N.REPLICATE_MODULE, "replicate")
    ctx.edits.need_import(N.DIST_MODULE, asname="dist")
    ctx.edits.change(last, f"`{model}` {ctx.replicated[model]}: it is replicated (DDP's gradient averaging, in place), not sharded")


def _imports(ctx: Context) -> None:
    ctx.edits.need_import(N.FSDP_MODULE, "fully_shard")
    ctx.edits.need_import(N.MESH_MODULE, "init_device_mesh")
    ctx.edits.need_import(N.DIST_MODULE, asname="dist")


def _code(ctx: Context, model: str, cls: str | None, units: list, policy: bool, device_type: str) -> tuple[str, str]:
    """The sharding code, and what it shards in words."""
    script = ctx.script
    kwargs = ", mesh=mesh" + (", mp_policy=mp_policy" if policy else "")
    code = f"mesh = init_device_mesh({device_type}, (dist.get_world_size(),))\n"
    if policy:
        code += POLICY
        ctx.edits.need_import(N.FSDP_MODULE, "MixedPrecisionPolicy")
    if cls:
        test = f"isinstance(module, {cls})" if _bound_at_top(script, cls) else f'type(module).__name__ == "{cls}"'
        code += f"for module in [module for module in {model}.modules() if {test} and module is not {model}]:\n"
        code += f"    fully_shard(module{kwargs})\n"
        what = f"each `{cls}` it finds in `{model}` at run time, then `{model}` itself"
    elif units:
        for path, cls in units:
            if cls is None:  # a submodule the script runs outside the model's forward
                code += f"fully_shard({model}.{path}{kwargs})  # runs outside `{model}`'s forward\n"
            else:
                code += f"for block in {model}.{path}:  # each {cls} is its own unit\n    fully_shard(block{kwargs})\n"
        what = ", ".join(f"each `{cls}` of `{model}.{path}`" if cls else f"`{model}.{path}`" for path, cls in units)
        what += f", then `{model}` itself"
    else:
        what = f"`{model}` as one unit"
    code += f"fully_shard({model}{kwargs})\n"
    ctx.shard_units[model] = ["*"] if cls else [path for path, _ in units]
    return code, what


def _factory(ctx: Context, model: str, scope) -> tuple[cst.FunctionDef, cst.Call, str] | None:
    """`dataset, model, optimizer = load_train_objs()`: the script's function that builds the
    model and its optimizer and returns both; the model is sharded there, before the optimizer
    (the function, the optimizer's call, the model's name in it). Only for a function that runs
    once the process group exists."""
    script = ctx.script
    for assign in script.assigns.get(scope, []):
        if not (isinstance(assign.value, cst.Call) and mentions(assign.targets[0].target, model)):
            continue
        fn = script.local_function(assign.value)
        if fn is None or fn in ctx.called_before_init():
            continue
        for call in script.calls_in(fn):
            if not N.is_optimizer(set(script.names(call.func))) or not call.args:
                continue
            params = [c for c in script.calls_in(call.args[0].value) if N.call_name(c) in ("parameters", "named_parameters")]
            local = ref_of(N.receiver(params[0])) if params and N.receiver(params[0]) is not None else None
            if local and any(mentions(r.value, local) for r in returns(fn) if r.value is not None):
                return fn, call, local
    return None


def _optimizer_built(ctx: Context, model: str, body: list, last: cst.CSTNode) -> cst.CSTNode | None:
    """The first statement up to `last` that builds an optimizer over the model's parameters."""
    script = ctx.script
    for stmt in body[: body.index(last) + 1]:
        if stmt is script.optimizer_stmt:
            return stmt
        if mentions(stmt, model) and any(
            N.is_optimizer(set(script.names(c.func))) and c.args and mentions(c.args[0].value, model) for c in script.calls_in(stmt)
        ):
            return stmt  # (a loop that freezes parameters is not one: it stays before the shard)
    return None


def _built_before(body: list, at: int, model: str) -> bool:
    """Is the model bound by a statement before index `at`?"""
    return any(mentions(s, model) for s in body[:at] if not isinstance(s, (cst.FunctionDef, cst.ClassDef)))


def _units(ctx: Context, model: str, scope, body: list) -> list[tuple[str, str]]:
    """(attribute path, block class) of each stack of one block class the model's class builds."""
    cls = ctx.model_class(model, scope)
    init = ctx.script.methods(cls).get("__init__") if cls is not None else None
    if init is None:
        return []
    found = []
    for assign in ctx.script.nodes_in(init, cst.Assign):
        target = assign.targets[0].target
        if len(assign.targets) == 1 and isinstance(target, cst.Attribute) and N.is_name(target.value, "self"):
            for path, block in _stacks(assign.value):
                found.append((".".join([target.attr.value, *path]), block))
    tied = _tied(init)
    stacks = [(path, block) for path, block in found if path.split(".")[0] not in tied]
    return stacks + [(child, None) for child in _run_outside_forward(ctx, model, cls) if child not in tied]


def _run_outside_forward(ctx: Context, model: str, cls: cst.ClassDef) -> list[str]:
    """The submodules the script runs without the model's forward: `model.encoder(x)`, or through
    a method of the model other than forward (`model.sample()` calling `self.net(x, t)`). FSDP2
    gathers a unit's parameters in that unit's forward, so each becomes a unit of its own."""
    script = ctx.script
    methods, children = script.methods(cls), ctx.children(cls)
    aliases = {model, *script.models, *(n for names in script.ddp_names.values() for n in names)}
    used: list[str] = []
    for call in script.calls:
        if not (isinstance(call.func, cst.Attribute) and ref_of(call.func.value) in aliases):
            continue
        name = call.func.attr.value
        if name in children:
            used.append(name)
        elif name in methods and name not in ("forward", "__init__"):
            used += [c.func.attr.value for c in script.calls_in(methods[name])
                     if isinstance(c.func, cst.Attribute) and ref_of(c.func.value) == "self" and c.func.attr.value in children]  # fmt: skip
    return list(dict.fromkeys(used))


def _stacks(value: cst.BaseExpression) -> list[tuple[list[str], str]]:
    """`nn.ModuleList([Block(c) for _ in range(n)])`, `nn.Sequential(*[...])`, or one of those in
    an `nn.ModuleDict(dict(h=...))`: ([keys below the attribute], the block class)."""
    if not isinstance(value, cst.Call):
        return []
    name = N.call_name(value)
    if name == "ModuleDict" and value.args:
        inner = value.args[0].value
        pairs = []
        if isinstance(inner, cst.Call) and N.call_name(inner) == "dict":
            pairs = [(a.keyword.value, a.value) for a in inner.args if a.keyword is not None]
        elif isinstance(inner, cst.Dict):
            pairs = [(e.key.evaluated_value, e.value) for e in inner.elements
                     if isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString)]  # fmt: skip
        return [([key, *path], block) for key, v in pairs for path, block in _stacks(v)]
    if name not in CONTAINERS or not value.args:
        return []
    items = [a.value for a in value.args]
    if len(items) == 1 and isinstance(items[0], (cst.ListComp, cst.GeneratorExp)):
        items = [items[0].elt]  # `[Block(c) for _ in range(n)]`
    elif len(items) == 1 and isinstance(items[0], cst.List):
        items = [e.value for e in items[0].elements]
    elif len(items) == 1 and value.args[0].star == "*" and isinstance(items[0], cst.ListComp):
        items = [items[0].elt]
    classes = {N.call_name(i) for i in items if isinstance(i, cst.Call)}
    if len(classes) != 1 or not all(isinstance(i, cst.Call) for i in items) or None in classes:
        return []
    (block,) = classes
    if block in CONTAINERS or not block[:1].isupper():
        return []
    if len(items) == 1 and not isinstance(value.args[0].value, (cst.ListComp, cst.GeneratorExp)):
        return []  # one block: nothing repeats
    return [([], block)]


def _tied(init: cst.FunctionDef) -> set[str]:
    """Attributes whose weights are tied to another's (`self.head.weight = self.wte.weight`):
    a tie stays inside one unit, so their stacks are not split off."""
    tied = set()
    for assign in iter_nodes(init):
        if not (isinstance(assign, cst.Assign) and isinstance(assign.value, cst.Attribute) and assign.value.attr.value == "weight"):
            continue
        for node in (assign.targets[0].target, assign.value):
            parts = []
            while isinstance(node, cst.Attribute):
                parts.append(node.attr.value)
                node = node.value
            if isinstance(node, cst.Name) and node.value == "self" and parts:
                tied.add(parts[-1])
    return tied


def _bound_at_top(script, name: str) -> bool:
    return name in script.classes or any(
        isinstance(s, cst.SimpleStatementLine) and any(
            isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(small.names, cst.ImportStar)
            and any((a.asname.name.value if a.asname else a.name.value.split(".")[0]) == name for a in small.names)
            for small in s.body
        )
        for s in script.module.body
    )  # fmt: skip


def _bf16_autocasts(ctx: Context) -> list[tuple[cst.With, cst.WithItem]]:
    """`with torch.autocast(..., dtype=torch.bfloat16):` items (the dtype spelled out)."""
    script = ctx.script
    found = []
    for with_ in script.nodes_of(cst.With):
        for item in with_.items:
            call = item.item
            if isinstance(call, cst.Call) and script.is_call_to(call, N.AUTOCAST):
                dtype = N.keyword(call, "dtype")
                if dtype is not None and script.names(dtype.value) & N.BFLOAT16:
                    found.append((with_, item))
    return found


def _drop_autocasts(ctx: Context, found: list[tuple[cst.With, cst.WithItem]]) -> None:
    """The policy casts instead: a `with` of the autocast alone gives way to its body; an
    autocast among other items is dropped from them."""
    edits = ctx.edits
    for with_, item in found:
        if len(with_.items) == 1 and isinstance(with_.body, cst.IndentedBlock):
            edits.dissolve(with_)
        elif len(with_.items) == 1:
            continue  # `with torch.autocast(...): loss = step(x)` on one line: harmless under the policy
        else:
            items = [i for i in with_.items if i is not item]
            items[-1] = items[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            edits.rewrite(with_, lambda updated, kept=items: updated.with_changes(items=kept))
        edits.change(with_, "autocast to bf16 is the MixedPrecisionPolicy's work under FSDP2")


def _short(code: str) -> str:
    return code if len(code) <= 50 else code[:47] + "..."
