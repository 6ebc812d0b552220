"""`--to fsdp2`: checkpoints hold the whole model, gathered on every rank, saved by rank 0.

    model_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(model_state, "model.pt")       # loads into the single-GPU model

A sharded model's `state_dict()` holds each rank's shard (DTensors); gathering the whole is a
collective, so it runs on every rank before the guarded save (rank 0 keeps the result on the
CPU; the others get an empty dict). A state dict kept for later (`best = model.state_dict()`)
is gathered in full on every rank; one handed to a helper (`save_checkpoint({...})`) is gathered
before that statement, which may be rank 0's alone. Loading into the sharded model goes through
`set_model_state_dict` (each rank takes its shard of the full state dict); the optimizer's
state through `get_optimizer_state_dict` / `set_optimizer_state_dict`. With
`--sharded-checkpoints` a save is `dcp.save(...)` on every rank: a folder of every rank's shards.
A whole model object saved with `torch.save(model, f)` (a pickled sharded module loads only
under FSDP2) is saved as its whole state dict, and `model = torch.load(f)` of it loads into the
sharded model. A gather for a save inside `with open(path, "wb") as f:` goes before that block.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.script import data_parallel_modules, ref_of
from ddpify.convert.context import Context

TO_FILE = "StateDictOptions(full_state_dict=True, cpu_offload=True)"  # rank 0's copy, on the CPU
FULL = "StateDictOptions(full_state_dict=True)"  # every rank's copy


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    models = set(script.models) - set(script.run_with_weights)  # (one run with weights passed in is not sharded)
    optimizers = _optimizers(script)
    taken = set().union(*script.bound.values()) if script.bound else set()
    inner = {id(node): node.value for node in data_parallel_modules(script)}  # DataParallel's `model.module` is `model`
    for call in script.calls:
        receiver = N.receiver(call)
        owner = ref_of(inner.get(id(receiver), receiver)) if receiver is not None else None
        name = N.call_name(call)
        if owner is None or name not in ("state_dict", "load_state_dict"):
            continue
        here = models | set(script.ddp_names.get(script.scope_of(call), ()))  # `self.model` of a trainer too
        if owner in here and ctx.after_wrap(call, owner):
            model = owner
        elif owner in optimizers or owner.rsplit(".", 1)[-1] in {o.rsplit(".", 1)[-1] for o in optimizers}:
            scope = script.scope_of(call)
            candidates = sorted(set(script.ddp_names.get(scope, ())) | {m for m, s in script.models.items() if s is scope and m in models})
            candidates = candidates or sorted(m for m in models if _visible(script, m, call))
            if len(candidates) != 1:
                edits.todo(script.statement_line(call) or call, call, f"`{owner}.{name}()` of a sharded model's optimizer: use get/set_optimizer_state_dict with its model")
                continue
            model = candidates[0]
            if not ctx.after_wrap(call, model):
                continue
        else:
            continue
        line = script.statement_line(call)
        if line is None:
            edits.todo(script.top_statement(call, script.scope_of(call)) or call, call,
                       f"`{owner}.{name}()` of a sharded model: gather it with get_model_state_dict on every rank")  # fmt: skip
            continue
        edits.need_import(N.STATE_DICT_MODULE, "StateDictOptions")
        if name == "load_state_dict":
            _load(ctx, call, owner, model)
            continue
        getter = f"get_model_state_dict({model}" if owner == model else f"get_optimizer_state_dict({model}, {owner}"
        edits.need_import(N.STATE_DICT_MODULE, getter.split("(")[0])
        save = _saved(script, call, line)
        if save is not None and ctx.options.sharded_checkpoints:
            _sharded_save(ctx, save, call, getter)
        elif _kept(line, call):  # `best = model.state_dict()`: a value, never behind a rank guard
            edits.replace(call, edits.expression(f"{getter}, options={FULL})"))
            edits.change(call, f"`{owner}`'s whole state is gathered on every rank")
        else:  # gathered before the statement, which may be rank 0's alone (a save, a helper that saves)
            var = _free(taken, f"{owner.replace('self.', '').replace('.', '_')}_state")
            anchor = _outside_file_blocks(script, line)
            edits.insert_before(anchor, f"{var} = {getter}, options={TO_FILE if save is not None else FULL})\n")
            edits.replace(call, cst.Name(var))
            ctx.collective_lines.add(anchor)
            edits.change(call, f"`{owner}`'s whole state is gathered on every rank (a collective) before it is used")
    whole = [c for c in script.calls if script.is_call_to(c, N.TORCH_SAVE) and _saved_model(script, c, models)]
    for save in whole:
        _save_whole(ctx, save, _saved_model(script, save, models), taken)
    _reload_whole(ctx, models, saved_whole=bool(whole))


def _saved_model(script, save: cst.Call, models: set[str]) -> str | None:
    """The sharded model `torch.save(model, f)` pickles whole, if it does."""
    args = N.positional(save)
    owner = ref_of(args[0].value) if args else None
    return owner if owner in models else None


def _save_whole(ctx: Context, save: cst.Call, model: str, taken: set[str]) -> None:
    """`torch.save(model, f)`: a pickled sharded module loads nowhere without FSDP2 and the same
    world size, so the file gets the model's whole state dict, gathered on every rank before
    the statement rank 0 alone may run; a reload of the file loads it into the model."""
    script, edits = ctx.script, ctx.edits
    line = script.statement_line(save)
    if line is None or not ctx.after_wrap(save, model):
        edits.todo(script.statement_line(save) or save, save, "saves the whole sharded model object: save get_model_state_dict(...) instead")
        return
    anchor = _outside_file_blocks(script, line)
    var = _free(taken, f"{model.replace('self.', '').replace('.', '_')}_state")
    edits.need_import(N.STATE_DICT_MODULE, "StateDictOptions")
    edits.need_import(N.STATE_DICT_MODULE, "get_model_state_dict")
    edits.insert_before(anchor, f"{var} = get_model_state_dict({model}, options={TO_FILE})\n")
    edits.replace(N.positional(save)[0].value, cst.Name(var))
    ctx.collective_lines.add(anchor)
    edits.change(save, f"the file holds `{model}`'s whole state dict, gathered on every rank (a pickled sharded model loads only under FSDP2)")
    edits.note(save, "the checkpoint is a state dict now, not a model object: another script that loads it as a model builds the model and calls `model.load_state_dict(torch.load(f))`")


def _reload_whole(ctx: Context, models: set[str], saved_whole: bool) -> None:
    """`model = torch.load(f)` of the sharded model after the wrap: every rank loads its shard of
    the whole state into `model`, which stays sharded: the file's state dict when this script
    saves the model whole (`_save_whole` writes one), else the pickled model's `.state_dict()`."""
    script, edits = ctx.script, ctx.edits
    for call in script.calls:
        assign = script.parent(call)
        if not (script.is_call_to(call, N.TORCH_LOAD) and isinstance(assign, cst.Assign) and assign.value is call):
            continue
        owner = ref_of(assign.targets[0].target)
        if owner not in models or not ctx.after_wrap(assign, owner):
            continue
        edits.need_import(N.STATE_DICT_MODULE, "StateDictOptions")
        edits.need_import(N.STATE_DICT_MODULE, "set_model_state_dict")

        def reload(updated: cst.Assign, owner: str = owner) -> cst.Expr:
            load = script.module.code_for_node(updated.value) + ("" if saved_whole else ".state_dict()")
            return cst.Expr(edits.expression(f"set_model_state_dict({owner}, {load}, options={FULL})"))

        edits.rewrite(assign, reload)
        ctx.reloads.add(assign)
        edits.change(call, f"every rank loads its shard of the saved weights into `{owner}` (it stays sharded)")


def _outside_file_blocks(script, line: cst.CSTNode) -> cst.CSTNode:
    """The statement to gather before: `line`, or the outermost `with open(...)` block around it
    (rank 0 alone runs that block once it is guarded; a collective inside it would hang)."""
    anchor, node = line, script.parent(line)
    while isinstance(node, cst.IndentedBlock) and isinstance(outer := script.parent(node), cst.With):
        if not any(isinstance(i.item, cst.Call) and N.call_name(i.item) == "open" for i in outer.items):
            break
        anchor, node = outer, script.parent(outer)
    return anchor


def _load(ctx: Context, call: cst.Call, owner: str, model: str) -> None:
    script, edits = ctx.script, ctx.edits
    args = [script.module.code_for_node(a.value) for a in N.positional(call)]
    strict = N.keyword(call, "strict")
    options = FULL if strict is None else FULL[:-1] + f", strict={script.module.code_for_node(strict.value)})"
    if not args:
        edits.todo(script.statement_line(call), call, f"`{owner}.load_state_dict(...)` of a sharded model: use set_model_state_dict")
        return
    if owner == model:
        template = edits.expression(f"set_model_state_dict({model}, STATE, options={options})")
        edits.need_import(N.STATE_DICT_MODULE, "set_model_state_dict")
    else:
        template = edits.expression(f"set_optimizer_state_dict({model}, {owner}, STATE, options={FULL})")
        edits.need_import(N.STATE_DICT_MODULE, "set_optimizer_state_dict")
    at = len(template.args) - 2

    def loading(updated: cst.Call) -> cst.Call:
        """The state as the other passes left it (`torch.load(path, map_location=device)`)."""
        state = N.positional(updated)[0].value
        return template.with_changes(args=[*template.args[:at], template.args[at].with_changes(value=state), template.args[-1]])

    edits.rewrite(call, loading)
    if ctx.options.sharded_checkpoints:
        edits.todo(script.statement_line(call), call, "--sharded-checkpoints writes torch.distributed.checkpoint folders: read one with dcp.load(state, checkpoint_id=path) into get_model_state_dict(model) (and the optimizer's), then set_model_state_dict")
    edits.change(call, f"every rank loads its shard of `{owner}`'s whole state")


def _visible(script, model: str, node: cst.CSTNode) -> bool:
    """Can code at `node` read the name `model`: the model is bound in `node`'s own function, at
    the top level of `node`'s module or in a function around it (not in another module or
    another function)?"""
    where, scope = script.models.get(model), script.scope_of(node)
    outer = where is script.root_of(node) or any(a is where for a in script.ancestors(scope))  # (a closure reads it too)
    return where is scope or outer and model not in script.bound.get(scope, set())


def _kept(line: cst.SimpleStatementLine, call: cst.Call) -> bool:
    """`state = model.state_dict()`: the statement only binds the state dict to a name."""
    small = line.body[0] if len(line.body) == 1 else None
    return isinstance(small, cst.Assign) and small.value is call


def _saved(script, call: cst.Call, line: cst.SimpleStatementLine) -> cst.Call | None:
    """The torch.save in `line` that saves the state dict (or a dict/list literal holding it)."""
    node = script.parent(call)
    while isinstance(node, (cst.DictElement, cst.Dict, cst.Element, cst.List, cst.Tuple, cst.Arg)):
        if isinstance(node, cst.Arg):
            outer = script.parent(node)
            if isinstance(outer, cst.Call) and script.is_call_to(outer, N.TORCH_SAVE) and node is outer.args[0]:
                return outer
            return None
        node = script.parent(node)
    return None


def _sharded_save(ctx: Context, save: cst.Call, call: cst.Call, getter: str) -> None:
    """`--sharded-checkpoints`: every rank writes its shards into a torch.distributed.checkpoint
    folder (`dcp.save(state, checkpoint_id=path)`); the state dict stays sharded."""
    script, edits = ctx.script, ctx.edits
    edits.replace(call, edits.expression(f"{getter})"))
    if save not in ctx.every_rank:
        ctx.every_rank.add(save)
        args = N.positional(save)
        target = args[1] if len(args) > 1 else N.keyword(save, "f")
        if target is None:
            edits.todo(script.statement_line(save), save, "a sharded checkpoint needs a folder: pass its path as checkpoint_id")
            return
        edits.rewrite(save, lambda updated: _dcp_save(edits, updated))
        edits.need_import(N.DCP_MODULE, asname="dcp")
        edits.change(save, "every rank writes its shards into a torch.distributed.checkpoint folder (dcp.save)")


def _dcp_save(edits, updated: cst.Call) -> cst.Call:
    """`torch.save(state, path)` -> `dcp.save(state, checkpoint_id=path)`."""
    args = N.positional(updated)
    target = args[1].value if len(args) > 1 else N.keyword(updated, "f").value
    return cst.Call(
        func=edits.expression("dcp.save"),
        args=[args[0].with_changes(comma=cst.MaybeSentinel.DEFAULT, whitespace_after_arg=cst.SimpleWhitespace("")).with_changes(
            comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), cst.Arg(keyword=cst.Name("checkpoint_id"), value=target,
            equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))],
    )  # fmt: skip


def _optimizers(script) -> set[str]:
    """Names bound to a torch.optim optimizer in the script."""
    found = set()
    for assigns in script.assigns.values():
        for a in assigns:
            target = ref_of(a.targets[0].target)
            if target and isinstance(a.value, cst.Call) and N.is_optimizer(set(script.names(a.value.func))):
                found.add(target)
    return found


def _free(taken: set[str], name: str) -> str:
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name}{n}", n + 1
    taken.add(candidate)
    return candidate
