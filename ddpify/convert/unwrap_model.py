"""After the wrap, what belongs to the model itself goes through `model.module`.

Where the model may still be plain on some path (a trainer's method that can run before the
method that wraps its model), through `unwrap(model)` instead, a helper defined once in the
module (`model.module if isinstance(model, DDP) else model`): never `.module` on a plain model.

`model.state_dict()` / `model.load_state_dict(...)` (checkpoints with no `module.`
prefix, loadable by the single-GPU script), the model's own methods and attributes
(`model.init_hidden(...)`, `model.fc = ...`), `torch.save(model, ...)` of the whole
model, and the model handed to an object that keeps or saves it (`early_stopping(loss,
model)`). What DDP itself provides (`train()`, `eval()`, `parameters()`, `to()`, ...) and
calling the model stay on the wrapper. `model = model.eval()` (or `.train()`, `.to(...)`,
`.float()`: nn.Module's methods that return the module itself) after the wrap keeps the DDP model,
and `scorer = model.eval()` names it too (`scorer.latent_dim` -> `scorer.module.latent_dim`);
bound before the wrap, `scorer` is the plain network and stays as it is.
With `convert --run`, a save the run saw store a trained model's state_dict (or the model itself)
where the static view saw none (`torch.save({k: v.state_dict() for k, v in parts.items()}, path)`)
saves the network inside the wrapper too: `getattr(v, "module", v)`.
Only what was wrapped gets `.module`: the network a wrapper module keeps (`model =
LossWrapper(model)`, then DDP around the wrapper) is never wrapped itself.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.analysis.script import data_parallel_modules, ref_of
from ddpify.convert.context import Context

ON_WRAPPER = N.DDP_ATTRIBUTES


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    if ctx.fsdp2:
        _no_data_parallel_module(ctx)
        return
    _reload_into_module(ctx)
    _plain_before_wrap(ctx)
    _unwrapped_to_objects(ctx)
    _unwrapped_to_helpers(ctx)
    _saved_by_helpers(ctx)
    for node in script.nodes_of(cst.Attribute):
        owner = ref_of(node.value)
        if owner is None or node.attr.value in ON_WRAPPER:
            continue
        if owner in script.ddp_names.get(script.scope_of(node), ()) and (plain := _plain(ctx, node, owner)):
            edits.replace(node.value, edits.expression(plain))
            edits.change(node, f"`{plain}.{node.attr.value}`: the model's own, not the DDP wrapper's")
    for call in script.calls:
        args = N.positional(call)
        if script.is_call_to(call, N.TORCH_SAVE) and args:
            owner = ref_of(args[0].value)
            if owner in script.ddp_names.get(script.scope_of(call), ()) and (plain := _plain(ctx, call, owner)):
                edits.replace(args[0].value, edits.expression(plain))
                edits.change(call, f"saves `{plain}`, not the DDP wrapper")
    _unwrapped_in_saved_containers(ctx)
    _saved_as_the_run_saw(ctx)


def _saved_as_the_run_saw(ctx: Context) -> None:
    """`convert --run`: a save the run saw store a trained model's state_dict (or the whole model),
    in code the passes above left as it was: each `x.state_dict()` the saved value holds (itself,
    or the value its name was last bound to) reads the network inside a DDP wrapper, whichever
    `x` is at run time, and so does a saved module; what cannot be found gets a TODO."""
    script, edits, run = ctx.script, ctx.edits, ctx.options.run
    if run is None or not ctx.wrap_after or not any(s.holds_model for s in run.saves):
        return
    for call in script.calls:
        args = N.positional(call)
        if not args or not ctx.saved_in_run(call, "model_save"):
            continue
        stmt = script.statement_line(call)
        saved = run.saved_at(script.index.roots.get(script.root_of(call), ""), *ctx.lines_of(call))
        value, scope = args[0].value, script.scope_of(call)
        bound = _bound_value(script, value, scope, call)
        if _edited(edits, value) or _edited(edits, bound) or _unwrapped_by_callers(ctx, scope):
            continue  # the static view saw it: unwrapped here or by the callers
        plain = [c for c in script.calls_in(bound) if N.call_name(c) == "state_dict" and _reads_model(N.receiver(c))]
        plain += _saved_modules(bound, [x for s in saved for x in s.stores if x.kind == "module" and x.trained])
        for node in plain:
            target = N.receiver(node) if isinstance(node, cst.Call) else node
            code = script.root_of(call).code_for_node(target)
            edits.replace(target, edits.expression(f'getattr({code}, "module", {code})'))
        what = "; ".join(str(x) for s in saved for x in s.stores if x.kind != "optimizer")
        if plain:
            edits.change(call, f"the run saw this save store {what}: it saves the network inside the DDP wrapper (no `module.` keys)")  # fmt: skip
        else:
            edits.todo(stmt, call, f"the run saw this save store {what}; save the network inside the DDP wrapper "
                       "(`model.module`), or its keys start with `module.` and the single-GPU model cannot load them")  # fmt: skip


def _bound_value(script, value: cst.BaseExpression, scope, call: cst.Call) -> cst.BaseExpression:
    """`value`, or what its name was last bound to before `call` in the same scope."""
    if isinstance(value, cst.Name):
        bound = [a for a in script.assigns.get(scope, [])
                 if len(a.targets) == 1 and N.is_name(a.targets[0].target, value.value) and script.ends_before(a, call)]  # fmt: skip
        return bound[-1].value if bound else value
    return value


def _reads_model(receiver: cst.BaseExpression | None) -> bool:
    """`x.state_dict()` of what may be a model: a name or attribute, not already `.module`, no
    optimizer, scheduler or scaler by its name."""
    if not isinstance(receiver, (cst.Name, cst.Attribute)) or _is_module(receiver):
        return False
    name = receiver.value if isinstance(receiver, cst.Name) else receiver.attr.value
    return not any(word in name.lower() for word in ("opt", "sched", "scaler"))


def _saved_modules(value: cst.BaseExpression, modules: list) -> list[cst.BaseExpression]:
    """The expressions of `value` that the run saw hold a trained module: `value` itself, or the
    entry of a dict literal under the key it saw."""
    found = []
    for stored in modules:
        if stored.key is None and isinstance(value, (cst.Name, cst.Attribute)):
            found.append(value)
        elif stored.key is not None and isinstance(value, cst.Dict):
            entries = [e for e in value.elements if isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString)]
            found += [e.value for e in entries if e.key.evaluated_value == stored.key and isinstance(e.value, (cst.Name, cst.Attribute))]
    return [v for v in found if not _is_module(v)]


def _edited(edits, node: cst.CSTNode) -> bool:
    """Has a pass rewritten `node` or anything in it?"""
    return any(n in edits.rewrites for n in iter_nodes(node))


def _is_module(node: cst.BaseExpression) -> bool:
    """`x.module`: the network inside a wrapper already."""
    return isinstance(node, cst.Attribute) and node.attr.value == "module"


def _unwrapped_by_callers(ctx: Context, scope) -> bool:
    """Is the function holding a save handed `x.module` by a call the passes rewrote?"""
    if not isinstance(scope, cst.FunctionDef):
        return False
    script, rewrites = ctx.script, ctx.edits.rewrites
    return any(script.local_function(c) is scope and any(a.value in rewrites for a in c.args) for c in script.calls)


def _plain(ctx: Context, node: cst.CSTNode, model: str) -> str | None:
    """`ctx.plain`, followed through `model = model.eval()` (and the other methods that return
    the module itself) after the wrap: still the DDP model, so `model.module`."""
    found = ctx.plain(node, model)
    script, wrapped = ctx.script, ctx.wrap_after.get(model)
    scope = script.models.get(model)
    if found is not None or ctx.fsdp2 or wrapped is None or script.scope_of(node) is not scope:
        return found
    if not script.ends_before(wrapped, node):
        return None
    rebinds = [a for a in script.assigns.get(scope, [])
               if ref_of(a.targets[0].target) == model and script.ends_before(wrapped, a) and script.ends_before(a, node)]  # fmt: skip
    return f"{model}.module" if rebinds and all(_returns_itself(a.value, model) for a in rebinds) else None


def _returns_itself(value: cst.BaseExpression, model: str) -> bool:
    """`model.eval()`, `model.to(device).train()`: `model` itself, whatever it is."""
    value = N.module_itself(value)
    return ref_of(value) == model and not isinstance(value, cst.Call)


def _saved_by_helpers(ctx: Context) -> None:
    """`torch.save(model.state_dict(), path)` in a helper that gets the model as a parameter
    (an early-stopping object's `save_checkpoint(model, path)`), called from where the model may
    be the DDP wrapper: the state dict is the network's own, whichever it gets at run time
    (`getattr(model, "module", model)`), so the checkpoint has no `module.` keys and loads into
    the model the script reloads."""
    script, edits = ctx.script, ctx.edits
    if not script.models:
        return
    for save in script.calls:
        if not script.is_call_to(save, N.TORCH_SAVE):
            continue
        scope = script.scope_of(save)
        if not isinstance(scope, cst.FunctionDef) or scope in script.models.values():
            continue
        params = {p.name.value for p in scope.params.params} - {"self"}
        for call in script.calls_in(save):
            receiver = N.receiver(call)
            if N.call_name(call) != "state_dict" or not isinstance(receiver, cst.Name) or receiver.value not in params:
                continue
            if any(word in receiver.value.lower() for word in ("opt", "sched", "scaler")):
                continue  # an optimizer's or a scheduler's state
            if receiver.value in script.ddp_names.get(scope, ()):
                continue  # the DDP model by name: `.module` below
            edits.replace(receiver, edits.expression(f'getattr({receiver.value}, "module", {receiver.value})'))
            edits.change(call, f"saves the network inside a DDP wrapper if `{receiver.value}` is one (no `module.` keys)")


def _unwrapped_in_saved_containers(ctx: Context) -> None:
    """`torch.save({"epoch": epoch, "model": model}, path)`, or that dict bound to a name first
    (`state = {...}`) and saved by `torch.save(state, ...)` or by a project function that saves
    it (`save_checkpoint(state)`): the whole model pickled in a checkpoint is the network itself,
    which the single-GPU script loads back, not the DDP wrapper around it."""
    script, edits = ctx.script, ctx.edits
    done: set[cst.CSTNode] = set()
    for call in script.calls:
        scope = script.scope_of(call)
        wrapped = script.ddp_names.get(scope, ())
        saves = script.is_call_to(call, N.TORCH_SAVE)
        for index, arg in enumerate(call.args):
            if arg.star or saves and (index > 0 or arg.keyword is not None):
                continue
            items = [i for i in _items(script, arg.value, scope, call) if ref_of(i) in wrapped and i not in done]
            if not items or not (saves or script.summaries.saves(call, arg)):
                continue  # (the containers first: asking what a callee saves costs more)
            for item in items:
                if plain := _plain(ctx, call, ref_of(item)):
                    done.add(item)
                    edits.replace(item, edits.expression(plain))
                    edits.change(item, f"the checkpoint holds `{plain}`, not the DDP wrapper")


def _items(script, value: cst.BaseExpression, scope, call: cst.Call) -> list[cst.BaseExpression]:
    """The values a saved container literal holds: `value`'s own, or those of the literal its
    name was last bound to before `call` in the same scope."""
    value = _bound_value(script, value, scope, call)
    if isinstance(value, cst.Dict):
        return [e.value for e in value.elements if isinstance(e, cst.DictElement)]
    if isinstance(value, (cst.List, cst.Tuple, cst.Set)):
        return [e.value for e in value.elements if isinstance(e, cst.Element)]
    return []


def _plain_before_wrap(ctx: Context) -> None:
    """`model = nn.DataParallel(net).cuda(); model.module.load_state_dict(...)`: DataParallel is
    gone and the DDP wrap comes later, so before it `model` is the network itself."""
    script, edits = ctx.script, ctx.edits
    for node in data_parallel_modules(script):
        owner = ref_of(node.value)
        if owner in ctx.wrap_after and not ctx.after_wrap(node, owner):
            edits.replace(node, node.value)
            edits.change(node, f"`{owner}` before the DDP wrap is the network itself (no `.module`)")


def _no_data_parallel_module(ctx: Context) -> None:
    """FSDP2 keeps the model itself: DataParallel's `model.module` is the model everywhere."""
    for node in data_parallel_modules(ctx.script):
        ctx.edits.replace(node, node.value)
        ctx.edits.change(node, f"`{ref_of(node.value)}` is the network itself under FSDP2 (no `.module`)")


def _unwrapped_to_objects(ctx: Context) -> None:
    """`early_stopping(val_loss, model)`: an object of the script's own classes that does not
    train (it tracks, saves, evaluates) gets `model.module`, so what it saves has no `module.`
    prefix and loads back into the single-GPU model."""
    script, edits = ctx.script, ctx.edits
    instances = script.objects()
    for call in script.calls:
        func = call.func
        if isinstance(func, cst.Name) and func.value in instances:
            cls, method = instances[func.value], "__call__"
        elif isinstance(func, cst.Attribute) and ref_of(func.value) in instances:
            cls, method = instances[ref_of(func.value)], func.attr.value
        else:
            continue
        methods = script.methods(cls)
        if method not in methods or any(fn in script.training_functions for fn in methods.values()):
            continue  # an object that trains needs the DDP model
        for arg in call.args:
            owner = ref_of(arg.value)
            if owner in script.ddp_names.get(script.scope_of(call), ()) and (plain := _plain(ctx, call, owner)):
                edits.replace(arg.value, edits.expression(plain))
                edits.change(call, f"`{cls.name.value}` gets `{plain}`: it keeps or saves the model, it does not train it")


def _unwrapped_to_helpers(ctx: Context) -> None:
    """`generate(model, idx, ...)`: a function of the project, in this module or another
    (`sampling.generate(model, 3)`), that does not train but reads the model's own methods or
    attributes (`model.get_block_size()`, `decoder.init_hidden(1)`), itself or in a function it
    hands the model to, gets `model.module`; DDP has none of them."""
    script, edits = ctx.script, ctx.edits
    for call in script.calls:
        for arg in call.args:
            owner = ref_of(arg.value)
            if owner is None or owner not in script.ddp_names.get(script.scope_of(call), ()):
                continue
            fn = script.summaries.needs_plain(call, arg)
            if fn is None or not (plain := _plain(ctx, call, owner)):
                continue
            edits.replace(arg.value, edits.expression(plain))
            edits.change(call, f"`{fn.name.value}()` gets `{plain}`: it uses the model's own methods")


def _reload_into_module(ctx: Context) -> None:
    """`model = torch.load(path)` of a whole saved model, after the wrap, loads its weights
    into `model.module` instead, so `model` stays the DDP model everywhere."""
    script, edits = ctx.script, ctx.edits
    for call in script.calls:
        assign = script.parent(call)
        if not (script.is_call_to(call, N.TORCH_LOAD) and isinstance(assign, cst.Assign) and assign.value is call):
            continue
        owner = ref_of(assign.targets[0].target)
        if owner in script.models and owner not in script.run_with_weights and ctx.after_wrap(assign, owner):
            def reload(updated: cst.Assign, owner: str = owner) -> cst.Expr:
                load = script.module.code_for_node(updated.value)
                return cst.Expr(edits.expression(f"{owner}.module.load_state_dict({load}.state_dict())"))

            edits.rewrite(assign, reload)
            ctx.reloads.add(assign)
            edits.change(call, f"the reloaded model's weights go into `{owner}.module` (it stays wrapped)")
