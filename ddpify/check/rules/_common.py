"""Helpers shared by several rules."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis import rank
from ddpify.analysis.flow import flow
from ddpify.analysis.index import iter_nodes, main_guard
from ddpify.check.context import FileContext, dotted_name, int_value, is_false, last_name, launching_functions


def mentions_rank(ctx: FileContext, call: cst.Call) -> bool:
    """Output tagged with the rank (``print(f"[rank {rank}] ...")``) is per-rank on purpose."""
    return rank.mentions_rank(ctx.index, call)


def every_rank(ctx: FileContext, call: cst.Call) -> bool:
    """A side effect that runs on every rank (not rank-0-only, not under another test of the rank
    (`if rank == 0 or cfg.log_all_ranks:`: every rank only when asked), not tagged with the rank,
    not in the branch a one-process run takes, not in a helper the program calls only on rank 0
    or never, nor only in the launcher process before it spawns the workers, nor in a program
    whose every `init_process_group` is switched off by a constant, nor in the function that
    starts the workers itself: `if args.generate: ...; return` before its `mp.spawn(...)`)."""
    func = ctx.enclosing_func(call)
    return (
        not ctx.under_rank_test(call) and not mentions_rank(ctx, call) and not single_process_branch(ctx, call)
        and not ctx.rank0_or_idle(call) and not ctx.launcher_only(call) and not ctx.group_never_started
        and not self_test_block(ctx, call) and not (func is not None and _starts_workers(ctx, func))
        and not never_taken(ctx, call) and not built_by_first_process(ctx, call)
    )  # fmt: skip


def built_by_first_process(ctx: FileContext, node: cst.CSTNode) -> bool:
    """Is `node` in the branch that builds a cache missing on disk (`else:` of `if
    os.path.exists(cached_file) ...:`) between the other ranks' wait (`if local_rank not in [-1,
    0]: dist.barrier()`) and rank 0's release (`if local_rank == 0: dist.barrier()`)? The first
    process builds it; the others find it when they pass the barrier (HuggingFace's idiom)."""
    child = node
    for p in ctx.ancestors(node):
        if isinstance(p, cst.If) and child is p.orelse and "exists(" in ctx.code(p.test):
            block = ctx.parent(p)
            body = list(block.body) if isinstance(block, (cst.IndentedBlock, cst.Module)) else []
            if p in body:
                at = body.index(p)
                return any(_barrier_under(ctx, s, -1) for s in body[:at]) and any(_barrier_under(ctx, s, 1) for s in body[at + 1 :])
        if isinstance(p, cst.FunctionDef):
            return False
        child = p
    return False


def _barrier_under(ctx: FileContext, stmt: cst.CSTNode, side: int) -> bool:
    """`if <test>: dist.barrier()` where the test is true only on rank 0 (side 1) or only off it (-1)."""
    return isinstance(stmt, cst.If) and ctx.rank_test(stmt.test) == side and any(
        isinstance(n, cst.Call) and last_name(n.func) == "barrier" for n in iter_nodes(stmt.body)
    )


def never_taken(ctx: FileContext, node: cst.CSTNode) -> bool:
    """Is `node` under `if False:`, or under `if flag:` where `flag` is a parameter whose default
    is off (`False`, `None`, `0`) and no call of its function in the program passes it
    (`wrap_tqdm=False` that every caller leaves out)? That branch never runs. A call with
    `*args`/`**kwargs` may pass it."""
    child = node
    for parent in ctx.ancestors(node):
        if isinstance(parent, (cst.If, cst.While)) and child is parent.body and (is_false(parent.test) or int_value(parent.test) == 0):
            return True  # `if False:` (code switched off by hand)
        if isinstance(parent, cst.If) and child is parent.body and isinstance(parent.test, cst.Name):
            func = ctx.enclosing_func(parent)
            if func is not None and _default_never_passed(ctx, func, parent.test.value):
                return True
        child = parent
    return False


def _default_never_passed(ctx: FileContext, func: cst.FunctionDef, name: str) -> bool:
    params = [*func.params.posonly_params, *func.params.params, *func.params.kwonly_params]
    param = next((p for p in params if p.name.value == name), None)
    if param is None or param.default is None or not (is_false(param.default) or int_value(param.default) == 0
                                                      or isinstance(param.default, cst.Name) and param.default.value == "None"):
        return False
    sites = [c for index in [ctx.index, *ctx.program_indexes] for c in index.calls if c.name == func.name.value]
    return bool(sites) and all(passes(c.node, name, argument_position(func, name)) is False for c in sites)


def argument_position(func: cst.FunctionDef, name: str) -> int | None:
    """The place of parameter `name` among a call's positional arguments (`self`/`cls` not
    passed); None when it is keyword-only or not there."""
    positional = [p.name.value for p in [*func.params.posonly_params, *func.params.params]]
    if name not in positional:
        return None
    return positional.index(name) - (1 if positional[0] in ("self", "cls") else 0)


def passes(call: cst.Call, name: str, position: int | None) -> bool | None:
    """Does the call give parameter `name` a value (by keyword, or at `position`)? None where
    `*args`/`**kwargs` may."""
    if any(a.keyword is not None and a.keyword.value == name for a in call.args):
        return True
    if any(a.star for a in call.args):
        return None
    return position is not None and len([a for a in call.args if a.keyword is None]) > position


def self_test_block(ctx: FileContext, node: cst.CSTNode) -> bool:
    """Is `node` in the file's `if __name__ == "__main__":` block, and does that block start no
    process group and no workers (a module's self-test, run by hand as one process)?"""
    block = main_guard(ctx.module)
    if block is None or not any(p is block for p in ctx.ancestors(node)):
        return False
    inside = [ci for ci in ctx.calls if any(p is block for p in ctx.ancestors(ci.node))]
    return not any(
        starts_group(ctx, ci) or ci.qnames & (N.SPAWN | N.START_PROCESSES) or any(_starts_workers(ctx, f) for f in ctx.local_callees(ci))
        for ci in inside
    )


def single_process_branch(ctx: FileContext, node: cst.CSTNode) -> bool:
    """Is `node` in a branch that runs without a process group (`else` of `if args.distributed:`,
    after `assert not dist.is_initialized()`, a flag the script asserts off under DDP)?"""
    return flow(ctx.index).single_process(node)


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


def funcs_with_step_loops(ctx: FileContext) -> set:
    return {ctx.loop_func[l] for l in ctx.step_loops if ctx.loop_func.get(l) is not None}


def trains(ctx: FileContext, ci) -> bool:
    """Does this call run training steps (a backward, or a local function that loops over steps)?"""
    if ctx.is_backward(ci):
        return True
    looping = funcs_with_step_loops(ctx)
    return any(ctx.step_function(f) or f in looping for f in ctx.local_callees(ci))


def in_worker(ctx: FileContext, node: cst.CSTNode, _depth: int = 0) -> bool:
    """Code that surely runs in every training process: inside a loop, a training function, or
    after the group is started in the same function or at the module's top level (by
    ``init_process_group`` or a call that reaches it: ``utils.init_distributed()``); launcher
    code before spawn is not."""
    func = ctx.enclosing_func(node)
    if func is not None and _starts_workers(ctx, func):
        return False  # the parent that starts the worker processes and waits for them: one process
    func = None
    for p in ctx.ancestors(node):
        if isinstance(p, (cst.For, cst.While)):
            return True
        if isinstance(p, cst.FunctionDef):
            func = p
            break
    if func is not None and (ctx.step_function(func) or func in funcs_with_step_loops(ctx)):
        return True
    root, owner, paths = ctx.index.root_of(node), ctx.enclosing_func(node), flow(ctx.index)
    if any(
        c.func is owner and ctx.index.root_of(c.node) is root and starts_group(ctx, c) and paths.reaches(c.node, node)
        for c in ctx.calls
    ):
        return True
    if func is not None and _depth < 3:
        return any(in_worker(ctx, s.node, _depth + 1) for s in ctx.call_sites(owner))
    return False


def _starts_workers(ctx: FileContext, func: cst.FunctionDef) -> bool:
    """Does this function start the worker processes, itself or through the functions it calls
    (`mp.spawn(...)`, `mp.Process(target=run, ...).start()`)? It is the launcher, run once."""
    return func in launching_functions(ctx.index)


def starts_group(ctx: FileContext, ci) -> bool:
    """Is this call `init_process_group`, or a call of a function (of this file or a project
    module) that reaches it?"""
    return bool(ci.qnames & N.INIT_PROCESS_GROUP) or any(f in group_starters(ctx) for f in ctx.local_callees(ci))


def group_starters(ctx: FileContext) -> set:
    """The functions that start the process group, directly or through the functions they call."""
    found = ctx.__dict__.get("group_starters")
    if found is None:
        found = {c.func for c in ctx.calls_to(*N.INIT_PROCESS_GROUP) if c.func is not None}
        for _ in range(4):  # callers of callers, a few levels up
            more = {c.func for c in ctx.calls if c.func is not None and c.func not in found and any(f in found for f in ctx.local_callees(c))}
            if not more:
                break
            found |= more
        ctx.__dict__["group_starters"] = found
    return found


def in_conditional_inside_loop(ctx: FileContext, node: cst.CSTNode) -> bool:
    """Under an ``if`` (e.g. ``if step % log_every == 0``) before reaching the loop or function,
    or after one that skips the rest of the step (``if step % 2 == 0: continue``)."""
    child = node
    for p in ctx.ancestors(node):
        if isinstance(p, (cst.If, cst.IfExp)):
            return True
        if isinstance(p, cst.IndentedBlock) and child in p.body:
            earlier = p.body[: p.body.index(child)]
            if any(isinstance(s, cst.If) and _skips_step(s.body) for s in earlier):
                return True
        if isinstance(p, (cst.For, cst.While, cst.FunctionDef)):
            return False
        child = p
    return False


def _skips_step(block: cst.BaseSuite) -> bool:
    """Does the block end with `continue`?"""
    body = getattr(block, "body", ())
    last = body[-1] if body else None
    if isinstance(last, cst.SimpleStatementLine):
        return isinstance(last.body[-1], cst.Continue)
    return False


def assigned_name(ctx: FileContext, node: cst.CSTNode) -> str | None:
    """``loader`` in ``loader = DataLoader(...)``."""
    parent = ctx.parent(node)
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
        return dotted_name(parent.targets[0].target)
    if isinstance(parent, cst.AnnAssign):
        return dotted_name(parent.target)
    return None


# order of statements in one function -----------------------------------------------------------
def before(ctx: FileContext, a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """Does `a` start before `b` in the source (no line numbers needed)?"""
    start = ctx.index.source_order()[0]
    return start[a] < start[b]


def exclusive(ctx: FileContext, a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """Are `a` and `b` in different branches of one `if`: no run goes through both?"""
    return ctx.index.exclusive(a, b)


def may_precede(ctx: FileContext, a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """Can `a` run before `b` in one pass through their function (same function, earlier, not in
    the other branch of an `if`, no `return`/`raise`/`break`/`sys.exit()` between)?"""
    return flow(ctx.index).reaches(a, b)


def dominates(ctx: FileContext, stmt: cst.CSTNode, node: cst.CSTNode) -> bool:
    """Does `stmt` run on every path to `node` in their function?"""
    return flow(ctx.index).dominates(stmt, node)


def library_code(ctx: FileContext, node: cst.CSTNode, setup_helper: bool = False) -> bool:
    """Code of a helper module that only other files run: the file has no ``__main__`` block,
    and the function around the node is called nowhere in it (for a method: its class is
    never instantiated in it). Whether such code runs on rank 0 only, or after the caller set
    the device, is decided by the caller, which this file cannot see. A function that trains
    (DDP, backward) or starts the process group is an entry, not a helper; with
    ``setup_helper`` a function whose job is to start the group (`init_distributed()`) is one."""
    if ctx.is_script:
        return False
    outer_func = outer_class = None
    for p in ctx.ancestors(node):
        if isinstance(p, cst.FunctionDef) and outer_class is None:
            outer_func = p
        elif isinstance(p, cst.ClassDef):
            outer_class = p
    if outer_class is not None:
        name = outer_class.name.value
        return not any(ci.name == name or last_name(ci.node.func) == name for ci in ctx.calls)
    if outer_func is None or _trains_itself(ctx, outer_func, setup_helper):
        return False
    return not ctx.call_sites(outer_func)


def _trains_itself(ctx: FileContext, func: cst.FunctionDef, setup_helper: bool = False) -> bool:
    """A training function (it wraps a model in DDP, calls backward, or starts the process
    group unless that is all a setup helper does): an entry, not a helper."""
    marks = N.DDP_CLASSES if setup_helper else N.DDP_CLASSES | N.INIT_PROCESS_GROUP
    for ci in ctx.calls:
        if (ci.qnames & marks or ci.name == "backward") and func in ctx.ancestors(ci.node):
            return True
    return False


def name_reads(scope: cst.CSTNode, name: str) -> list[cst.Name]:
    """Reads of `name` under `scope` (not the targets of its assignments)."""
    found: list[cst.Name] = []

    class _Reads(cst.CSTVisitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> bool:
            return False

        def visit_Name(self, node: cst.Name) -> None:
            if node.value == name:
                found.append(node)

    scope.visit(_Reads())
    return found


def in_memory(ctx: FileContext, expr: cst.BaseExpression, depth: int = 0) -> bool:
    """`io.BytesIO(...)`, or a name bound to one (`buf = io.BytesIO()`, `with io.BytesIO(data) as
    buf:`): a buffer in memory, not a file."""
    if isinstance(expr, cst.Call):
        return expr in ctx.call_info and ctx.info(expr).is_("io.BytesIO")
    name = dotted_name(expr)
    if name is None or depth > 3:
        return False
    if any(b.dotted == name and in_memory(ctx, b.value, depth + 1) for b in ctx.assignments):
        return True
    return any(
        isinstance(item, cst.WithItem) and item.asname is not None and dotted_name(item.asname.name) == name and in_memory(ctx, item.item)
        for item in ctx.index.parents
    )  # fmt: skip


def class_of_call(ctx: FileContext, call: cst.Call) -> cst.ClassDef | None:
    """The program's class a call makes: a project module's (by qualified name), or this file's."""
    if call not in ctx.call_info:
        return None
    definitions = ctx.index.definitions() if len(ctx.index.roots) > 1 else {}
    for q in ctx.info(call).qnames:
        found = definitions.get(q)
        if isinstance(found, cst.ClassDef):
            return found
    name = dotted_name(call.func)
    if name is None or "." in name:
        return None
    local = [c for c in ctx.index.classes if c.name.value == name and ctx.index.root_of(c) is ctx.module]
    return local[0] if len(local) == 1 else None


def callers_decide(ctx, ci, target) -> bool:
    """A save helper whose file comes from its parameters (`def save_state_dict(dir, fname, sd):
    torch.save(sd, Path(dir) / fname)`), every call of which is rank 0's (or under another test
    of the rank), names a per-rank file (`fname=f"rank{rank}.pt"`), or is in a helper whose own
    callers decide so (`torch_persistent_save(obj, path)` -> `_save(obj, f)`, a recursive retry
    adding no caller), here or in the programs that import this file: the callers decide."""
    func = ci.func
    if func is None or target is None:
        return False
    return _decided(ctx, func, _file_params(ctx, func, target), set())


def _file_params(ctx, func, target) -> set[str]:
    """The parameters of `func` the file name (or handle) `target` is made from: through names
    bound in `func` (`target_path = checkpoint_dir / fname`, `with open(path, "wb") as f:`)."""
    names = {n.value for n in iter_nodes(target) if isinstance(n, cst.Name)}
    made = [(b.dotted, b.value) for b in ctx.assignments if b.func is func]
    made += [
        (item.asname.name.value, item.item) for item in iter_nodes(func.body)
        if isinstance(item, cst.WithItem) and item.asname is not None and isinstance(item.asname.name, cst.Name)
    ]  # fmt: skip
    for _ in range(2):
        names |= {n.value for name, value in made if name in names for n in iter_nodes(value) if isinstance(n, cst.Name)}
    return names & ctx.index.param_names(func)


def _decided(ctx, func, used: set[str], seen: set) -> bool:
    if func in seen:
        return True  # a recursive call: no caller that is not already asked
    seen.add(func)
    sites, remote = ctx.call_sites(func), ctx.remote_call_sites(func) if isinstance(ctx.parent(func), cst.Module) else []
    if not used:
        return False
    if not (sites or remote):
        return ctx.rank0_or_idle(func.body)  # nothing in the program calls it
    ranks = rank.rank_analysis(ctx.index)
    for site in sites:
        args = [a for i, a in enumerate(site.node.args) if ctx.index.param_for(func, i, a) in used]
        if ctx.under_rank_test(site.node) or any(ranks.per_rank(a.value, site.func) for a in args):
            continue
        caller = site.func
        passed = set().union(*(_file_params(ctx, caller, a.value) for a in args)) if caller is not None else set()
        if caller is None or not _decided(ctx, caller, passed, seen):
            return False
    return all(rank.rank_analysis(index).under_rank_test(site.node) for index, site in remote)


def dataset_classes(ctx, value: cst.BaseExpression, func) -> list[cst.ClassDef]:
    """The program's classes that make `value` (a call, or a name the function binds to one)."""
    values = [value]
    if isinstance(value, cst.Name):
        values = [b.value for b in ctx.assignments if b.dotted == value.value and b.func is func]
    return [cls for v in values if isinstance(v, cst.Call) and (cls := class_of_call(ctx, v)) is not None]


def is_iterable_dataset(ctx, cls: cst.ClassDef, depth: int = 0) -> bool:
    """Does the class derive from `IterableDataset` (directly, or through classes of the file)?"""
    for base in cls.bases:
        if ctx.qnames(base.value) & N.ITERABLE_DATASET:
            return True
        local = [c for c in ctx.index.classes if c.name.value == getattr(base.value, "value", None)]
        if depth < 4 and any(is_iterable_dataset(ctx, c, depth + 1) for c in local):
            return True
    return False


MOVES = frozenset({"to", "cuda", "cpu", "half", "float", "double", "bfloat16"})


def strip_moves(expr: cst.BaseExpression, also: frozenset[str] = frozenset()) -> cst.BaseExpression:
    """The module under `.to(device).cuda()` (and the methods in `also`): `net` of `net.to(device)`."""
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in MOVES | also:
        expr = expr.func.value
    return expr
