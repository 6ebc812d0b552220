"""What the FSDP2 rules share: where the program shards modules with `fully_shard`, which names
then hold a module with sharded parameters, and what an optimizer is built from.

`fully_shard(module)` shards `module` in place: it stays the same object, of a subclass of its
class, and its parameters become DTensor shards. So the names the rules follow are the ones the
script already has (`model`, `self.model`), from the `fully_shard` call on: the module passed,
the modules that hold it (`model` when `model.layers[i]` is sharded), and the parameters of
local functions that receive one. Everything is read from the shared index (qualified names,
bindings, call sites), and cached on the file's context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.check.context import Binding, CallInfo, FileContext, dotted_name, is_false, is_true, kwarg, positional

# `for layer in enumerate(model.layers)`, `reversed(...)`: the modules iterated are still those of the container.
_ITER_WRAPPERS = frozenset({"enumerate", "reversed", "list", "tuple", "sorted", "iter", "tqdm"})
# `model.modules()`, `model.layers.children()`, `blocks.values()`: modules inside the receiver.
_CONTAINER_METHODS = frozenset({"modules", "children", "named_modules", "named_children", "values", "items"})
PARAMETER_METHODS = frozenset({"parameters", "named_parameters"})


@dataclass(frozen=True)
class Shard:
    """One place the program shards modules: a `fully_shard(...)` call, or the call of a local
    function that shards (modules inside) its argument (`apply_fsdp(model)`)."""

    node: cst.Call
    func: Optional[cst.FunctionDef]  # the function it runs in (None: the module's top level)
    path: str  # the module, as the code names it there: `model`, `model.layers`, `self.net`
    exact: bool  # `path` itself is sharded; False: modules inside it (`for b in model.layers: fully_shard(b)`)


def shards(ctx: FileContext) -> list[Shard]:
    """The checked file's shards (each `fully_shard` call, and each call of a helper that shards
    its argument), in source order."""
    return _analysis(ctx)[0]


def unresolved(ctx: FileContext) -> bool:
    """Does the program shard something this analysis cannot name (`fully_shard(get_block(i))`)?"""
    return _analysis(ctx)[1]


def sharded_bindings(ctx: FileContext) -> list[Binding]:
    """Names that hold a module with sharded parameters, from the shard on (the parameters of
    local functions that receive one included)."""
    found = ctx.__dict__.get("_fsdp2_bindings")
    if found is None:
        bindings = [
            Binding(name, s.func, None, s.node, s.node, ctx.index) for s in shards(ctx) for name in prefixes(s.path)
        ]
        found = ctx.__dict__["_fsdp2_bindings"] = ctx.index.propagate(bindings) if bindings else []
    return found


def is_sharded(ctx: FileContext, expr: cst.CSTNode) -> bool:
    """Does this expression (a name or `self.attr`) hold a module with sharded parameters where it
    is read? A name that may hold a DDP wrapper instead (`if fsdp: ... else: model = DDP(model)`)
    is left to the DDP rules."""
    bindings = sharded_bindings(ctx)
    if not bindings or not ctx.index.is_bound(expr, bindings) or ctx.is_ddp(expr):
        return False
    return not _rebound(ctx, expr, bindings)


def _rebound(ctx: FileContext, expr: cst.CSTNode, bindings: list[Binding]) -> bool:
    """Is the name assigned something else after its last shard in this function, before this
    read (`model = fully_shard(...)` ... `model = Net()` for a fresh copy)?"""
    name = dotted_name(expr)
    func = ctx.enclosing_func(expr)
    start = ctx.index.source_order()[0]
    here = start[expr]
    shard_at = [start[b._node] for b in bindings if b.dotted == name and b.func is func and isinstance(b._node, cst.Call)]
    shard_at = [at for at in shard_at if at < here]
    if not shard_at:
        return False
    last = max(shard_at)
    return any(
        b.dotted == name and b.func is func and last < start[b._node] < here and not _holds_shard(ctx, b.value)
        for b in ctx.assignments
    )


def _holds_shard(ctx: FileContext, value: cst.BaseExpression) -> bool:
    """A value that is the sharded module again: a shard call, or a name."""
    if isinstance(value, (cst.Name, cst.Attribute)):
        return True
    return isinstance(value, cst.Call) and any(s.node is value for s in shards(ctx))


def prefixes(path: str) -> list[str]:
    """`model.layers` -> [`model.layers`, `model`]; `self.net.blocks` -> [`self.net.blocks`, `self.net`]."""
    parts = path.split(".")
    first = 2 if parts[0] in ("self", "cls") and len(parts) > 1 else 1
    return [".".join(parts[:n]) for n in range(len(parts), first - 1, -1)]


def root_of(path: str) -> str:
    """The variable a path starts from: `model` of `model.layers`, `self.net` of `self.net.blocks`."""
    return prefixes(path)[-1]


def overlap(a: str, b: str) -> bool:
    """Is one of the two modules inside the other (or are they the same)?"""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def first_arg(call: cst.Call, keyword: str) -> Optional[cst.BaseExpression]:
    args = positional(call)
    if args:
        return args[0].value
    arg = kwarg(call, keyword)
    return arg.value if arg is not None else None


# --- full state dicts ----------------------------------------------------------------------------


def full_state_dict(ctx: FileContext, ci: CallInfo) -> Optional[bool]:
    """Does a `get_model_state_dict` / `get_optimizer_state_dict` / `get_state_dict` call ask for
    the full state dict (`options=StateDictOptions(full_state_dict=True, ...)`, also through a
    name bound to one)? None: it cannot be told (`full_state_dict=args.full`, options from
    elsewhere)."""
    arg = kwarg(ci.node, "options")
    if arg is None:
        return False
    value = arg.value
    if isinstance(value, cst.Name):
        value = last_value(ctx, value.value, ci.func, ci.node)
    if isinstance(value, cst.Call) and ctx.info(value).qnames & N.STATE_DICT_OPTIONS:
        full = kwarg(value, "full_state_dict")
        if full is None or is_false(full.value):
            return False
        return True if is_true(full.value) else None
    return None


def last_value(ctx: FileContext, name: str, func, before: cst.CSTNode) -> Optional[cst.BaseExpression]:
    """The value `name` was last assigned before `before`, in the same function (or at the top
    level, for a name the function does not assign)."""
    start = ctx.index.source_order()[0]
    found = [b for b in ctx.assignments if b.dotted == name and b.func is func and start[b._node] < start[before]]
    if not found and func is not None:
        module = ctx.index.root_of(before)
        found = [b for b in ctx.assignments if b.dotted == name and b.func is None and ctx.index.root_of(b._node) is module]
    if not found:
        return None
    return max(found, key=lambda b: start[b._node]).value


# --- what an optimizer is built from -------------------------------------------------------------


def optimizer_sources(ctx: FileContext, ci: CallInfo, _depth: int = 0) -> list[str]:
    """The modules whose parameters a call hands to an optimizer it builds: `AdamW(model.parameters())`
    -> [`model`]; `[p for n, p in net.head.named_parameters()]` -> [`net.head`] (also through a
    name assigned just before); a local function or method that builds one from its argument or
    from `self` (`model.configure_optimizers(...)`) -> the module passed there. Empty: not an
    optimizer, or built from something this cannot name."""
    if N.is_optimizer(ci.qnames):
        return _parameter_receivers(ctx, ci.node, ci.func)
    if _depth > 1:
        return []
    callees = ctx.local_callees(ci)
    if not callees and ci.receiver is not None and ci.name in ctx.functions:  # `model.configure_optimizers()`
        callees = [f for f in ctx.functions[ci.name] if _first_param(f) == "self"]
    found = []
    for fn in callees:
        inner = [o for o in ctx.calls if o.func is fn and (N.is_optimizer(o.qnames))]
        for o in inner:
            for source in optimizer_sources(ctx, o, _depth + 1):
                mapped = _at_call_site(ctx, ci, fn, source)
                if mapped is not None:
                    found.append(mapped)
    return found


def _parameter_receivers(ctx: FileContext, node: cst.CSTNode, func, _depth: int = 0) -> list[str]:
    found = []
    for sub in iter_nodes(node):
        if isinstance(sub, cst.Call) and isinstance(sub.func, cst.Attribute) and sub.func.attr.value in PARAMETER_METHODS:
            name = dotted_name(sub.func.value)
            if name is not None:
                found.append(name)
        elif isinstance(sub, cst.Name) and _depth < 2 and sub is not node and _is_read(ctx, sub):
            value = last_value(ctx, sub.value, func, node)
            if value is not None:
                found += _parameter_receivers(ctx, value, func, _depth + 1)
    return found


def _is_read(ctx: FileContext, name: cst.Name) -> bool:
    """Is this name read (not an attribute's name, not a keyword)?"""
    parent = ctx.parent(name)
    if isinstance(parent, cst.Attribute):
        return parent.value is name
    if isinstance(parent, cst.Arg):
        return parent.value is name
    return True


def _first_param(fn: cst.FunctionDef) -> Optional[str]:
    params = [*fn.params.posonly_params, *fn.params.params]
    return params[0].name.value if params else None


def _at_call_site(ctx: FileContext, site: CallInfo, fn: cst.FunctionDef, path: str) -> Optional[str]:
    """`path` as named inside `fn` (from one of its parameters, or `self`) as the call site names it."""
    head, _, rest = path.partition(".")
    rest = "." + rest if rest else ""
    if head == "self" and _first_param(fn) == "self":
        if site.receiver is not None and not (isinstance(site.receiver, cst.Name) and site.receiver.value == "self"):
            outer = dotted_name(site.receiver)
            return outer + rest if outer else None
        return path  # `self.build_optimizer()` inside the class: the same `self`
    for i, arg in enumerate(site.node.args):
        if arg.star:
            continue
        if ctx.index.param_for(fn, i, arg) == head:
            outer = dotted_name(arg.value)
            return outer + rest if outer else None
    return None


# --- the analysis ---------------------------------------------------------------------------------


def _analysis(ctx: FileContext) -> tuple[list[Shard], bool]:
    found = ctx.__dict__.get("_fsdp2_shards")
    if found is None:
        found = ctx.__dict__["_fsdp2_shards"] = _find_shards(ctx)
    return found


def _find_shards(ctx: FileContext) -> tuple[list[Shard], bool]:
    unknown = False
    every: list[Shard] = []  # in every module of the program: a helper's shards name its parameters
    for ci in ctx.calls_to(*N.FULLY_SHARD):
        arg = first_arg(ci.node, "module")
        got = _resolve(ctx, arg, ci.func) if arg is not None else None
        if got is None:
            unknown = unknown or ctx.index.root_of(ci.node) is ctx.module
            continue
        every.append(Shard(ci.node, ci.func, *got))
        every += _assigned(ctx, ci, got)
    done = {(s.node, s.path) for s in every}
    for _ in range(3):  # helpers of helpers
        more = []
        for s in every:
            if s.func is None:
                continue
            head = root_of(s.path)
            if head not in ctx.index.param_names(s.func) and head.split(".")[0] != "self":
                continue
            for site in ctx.call_sites(s.func):
                suffix = s.path[len(head):]
                arg_node = _arg_for(ctx, site, s.func, head)
                resolved = _resolve(ctx, arg_node, site.func) if arg_node is not None else None
                if resolved is not None:
                    base, base_exact = resolved
                    outer, exact = (base + suffix, s.exact) if base_exact else (base, False)
                else:
                    outer, exact = _at_call_site(ctx, site, s.func, s.path), s.exact
                if outer is None:
                    continue
                new = Shard(site.node, site.func, outer, exact)
                if (new.node, new.path) not in done:
                    done.add((new.node, new.path))
                    more.append(new)
                    if s.exact and s.path == head and _returns(s.func, head):
                        more += _assigned(ctx, site, (outer, exact))
        if not more:
            break
        every += more
    start = ctx.index.source_order()[0]
    mine = sorted((s for s in every if ctx.index.root_of(s.node) is ctx.module), key=lambda s: start[s.node])
    return mine, unknown


def _assigned(ctx: FileContext, ci: CallInfo, got: tuple[str, bool]) -> list[Shard]:
    """`fsdp_model = fully_shard(model)`: the name assigned holds the same (sharded) module."""
    parent = ctx.parent(ci.node)
    if not got[1] or not isinstance(parent, cst.Assign) or len(parent.targets) != 1:
        return []
    name = dotted_name(parent.targets[0].target)
    return [Shard(ci.node, ci.func, name, True)] if name and name != got[0] else []


def _returns(fn: cst.FunctionDef, name: str) -> bool:
    returns = (n for n in iter_nodes(fn.body) if isinstance(n, cst.Return) and n.value is not None)
    return any(dotted_name(n.value) == name for n in returns)


def _arg_for(ctx: FileContext, site: CallInfo, fn: cst.FunctionDef, param: str) -> Optional[cst.BaseExpression]:
    for i, arg in enumerate(site.node.args):
        if not arg.star and ctx.index.param_for(fn, i, arg) == param:
            return arg.value
    return None


def _resolve(ctx: FileContext, expr: cst.BaseExpression, func, _depth: int = 0) -> Optional[tuple[str, bool]]:
    """The module an argument of `fully_shard` names: (`model`, True) for `model`; (`model.layers`,
    False) for `model.layers[i]`, for the loop variable of `for block in model.layers:` and for
    `block = model.layers[i]`; None when it cannot be named."""
    if isinstance(expr, cst.Subscript):
        base = dotted_name(expr.value)
        return (base, False) if base else None
    name = dotted_name(expr)
    if name is None:
        return None
    if isinstance(expr, cst.Name):
        loop_iter = _loop_binding(ctx, expr)
        if loop_iter is not None:
            source = _iterated(loop_iter)
            return (source, False) if source else None
        if _depth < 3:
            value = last_value(ctx, name, func, expr)
            if isinstance(value, (cst.Subscript, cst.Attribute)) or (isinstance(value, cst.Name) and value.value != name):
                found = _resolve(ctx, value, func, _depth + 1)
                if found is not None:
                    return found
    return name, True


def _loop_binding(ctx: FileContext, name: cst.Name) -> Optional[cst.BaseExpression]:
    """The iterable of the `for` (or comprehension) around `name` whose target binds it."""
    child: cst.CSTNode = name
    for p in ctx.ancestors(name):
        if isinstance(p, cst.For) and child is p.body and name.value in _target_names(p.target):
            return p.iter
        if isinstance(p, (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)):
            comp = p.for_in
            while comp is not None:
                if name.value in _target_names(comp.target):
                    return comp.iter
                comp = comp.inner_for_in
        if isinstance(p, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return None
        child = p
    return None


def _target_names(target: cst.BaseExpression) -> set[str]:
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, (cst.Tuple, cst.List)):
        return {n for el in target.elements for n in _target_names(el.value)}
    return set()


def _iterated(it: cst.BaseExpression) -> Optional[str]:
    """The container a loop takes modules from: `model.layers` in `for b in model.layers`,
    `enumerate(model.layers)`, `model.layers.children()`, `model.modules()` (`model`)."""
    while isinstance(it, cst.Call):
        if isinstance(it.func, cst.Name) and it.func.value in _ITER_WRAPPERS and it.args:
            it = it.args[0].value
        elif isinstance(it.func, cst.Attribute) and it.func.attr.value in _CONTAINER_METHODS:
            it = it.func.value
            break
        else:
            return None
    if isinstance(it, cst.Subscript):  # `model.layers[:4]`
        it = it.value
    return dotted_name(it)
