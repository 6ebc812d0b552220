"""Print, log, save, write files and evaluate once: on global rank 0.

Covers print, logging calls and handlers, torch.save (with `convert --run`, also a call the run
saw save), figure/CSV/JSON writes (also `with open(path, "w")` blocks), W&B and TensorBoard
writers (made on rank 0 only).
Statements are guarded whole (adjacent ones share one `if`); an `if` whose body only
prints or saves gets `and dist.get_rank() == 0` added to its test instead. Nothing
that runs a collective or a DDP forward is put behind the guard: evaluation helpers
run on rank 0 through the unwrapped `model.module`.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis import side_effects
from ddpify.analysis.flow import flow
from ddpify.analysis.index import iter_nodes
from ddpify.analysis.multinode import cache_test, written_and_read_back
from ddpify.analysis.rank0_objects import RANK0_WRITERS, rank0_objects, rank0_uses
from ddpify.analysis.script import param_receiving, ref_of
from ddpify.convert.context import Context
from ddpify.convert.edits import append_arg, keyword_arg
from ddpify.convert.per_process import PerProcess, shared_temp_dirs

# Calls whose effect should happen once per run, by qualified name or by method name.
ONCE = N.PRINT | N.TORCH_SAVE | N.LOGGING_CALLS | N.SIDE_EFFECTS
ONCE_METHODS = frozenset({"savefig", "to_csv", "to_json", "addHandler", "writerow", "writerows", "save_pretrained"})
# Objects that write (TensorBoard, W&B runs) are made on rank 0 only; their calls are guarded.
WRITERS = RANK0_WRITERS
WRITE_MODES = ("w", "a", "x")
OPENERS = frozenset({"gzip.open", "bz2.open", "lzma.open", "io.open", "codecs.open", "wave.open", "tarfile.open",
                     "zipfile.ZipFile", "h5py.File", "soundfile.SoundFile"})  # (file, mode, ...)  # fmt: skip
FILE_SECOND = frozenset({"json.dump", "pickle.dump"})  # (obj, file): the file comes second
FILE_KEYWORDS = ("f", "fp", "file", "fname", "path", "filename")


PER_NODE = "runs once per node, on its local rank 0 (a file the script reads back; --shared-fs: once per job)"


def run(ctx: Context) -> None:
    script = ctx.script
    _makedirs_on_every_rank(ctx)
    rank0_eval = ctx.options.eval_on_rank0
    eval_helpers = {script.local_function(c) for c in script.eval_calls} if rank0_eval else set()
    writers = _rank0_writers(ctx)
    own = PerProcess(script, shared_temp_dirs(ctx))
    targets: dict[cst.CSTNode, str] = {}
    hoisted: set[cst.CSTNode] = set()  # statements whose model-running calls now run before them
    moved: set[cst.Call] = set()  # those calls
    for call in script.calls:
        writes = _opens_for_writing(ctx, call)
        line = None if writes else _once_statement(ctx, call, writers)
        if not writes and line is None or call in ctx.every_rank:
            continue  # no side effect to guard (the cheap tests first: most calls stop here), or a collective save
        if script.scope_of(call) in eval_helpers or D.guarded_by_rank(script, call):
            continue  # runs on rank 0 only already
        if script.is_call_to(call, N.PRINT) and flow(script.index).on_exit_path(call, returns=False):
            continue  # an error report right before the process gives up: each failing rank says why
        if own.in_pipeline(call):
            continue  # a Dataset method, collate_fn or worker_init_fn: runs per sample on every rank
        if own.prepares_data(call) and (writes or script.is_call_to(call, N.TORCH_SAVE)):
            continue  # a Dataset writing its own files: where it is built (once per node when it downloads)
        if writes:
            if own.path(_opened_path(ctx, call)):
                continue  # this process's own file (its rank or pid in the name, a temporary directory)
            stmt = script.parent(script.parent(call))  # Call -> WithItem -> With
            if isinstance(stmt, cst.With) and not _runs_model(ctx, stmt):
                targets[stmt] = _writer_condition(ctx, stmt, call)
                if _hoist_model_calls(ctx, stmt, stmt, moved):
                    hoisted.add(stmt)
            continue
        if _writes_own_file(ctx, own, call):
            continue  # every process writes its own copy
        targets[line] = _cache_writer(ctx, line) or ctx.rank0_condition(line)
        if _hoist_model_calls(ctx, line, call, moved):
            hoisted.add(line)
    _with_its_figure(ctx, targets, hoisted)
    _guard_rank0_values(ctx, targets, hoisted, moved)
    for call in script.eval_calls:
        if rank0_eval and not D.guarded_by_rank(script, call):
            line = script.statement_line(call)
            targets[line] = ctx.rank0_condition(line)
        _pass_unwrapped(ctx, call)
    if not ctx.fsdp2:  # a sharded model has no plain copy to run on rank 0 alone
        _unwrapped_on_rank0(ctx, targets, moved)
    _guard(ctx, targets, hoisted | ctx.collective_lines)


def _unwrapped_on_rank0(ctx: Context, guarded, moved: set[cst.Call]) -> None:
    """`print(sample(model, 3))` now runs on rank 0 only: a function of the project (this module's
    or another's) that gets the DDP model there and does not train it gets `model.module`, since
    a DDP forward on one rank waits for the others (buffers are broadcast) and DDP lacks the
    model's own methods. (Functions that read those get it from unwrap_model already.)"""
    script, edits = ctx.script, ctx.edits
    for stmt in guarded:
        for call in script.calls_in(stmt):
            if call in moved or any(script.inside(call, m) for m in moved):
                continue  # hoisted out of the guard: it runs on every rank
            target = script.summaries.callee(call)
            if target is None or target[0].trains(target[1]):
                continue
            for arg in call.args:
                owner = ref_of(arg.value)
                if owner is None or owner not in script.ddp_names.get(script.scope_of(call), ()):
                    continue
                if script.summaries.needs_plain(call, arg) is not None or not ctx.after_wrap(call, owner):
                    continue  # unwrap_model's already, or no wrapper here
                edits.replace(arg.value, edits.expression(f"{owner}.module"))
                edits.change(call, f"`{target[1].name.value}()` gets `{owner}.module`: it runs on rank 0 only")


def _with_its_figure(ctx: Context, targets: dict, hoisted: set) -> None:
    """A figure saved on rank 0 is drawn there too: the statements beside the save that call
    the library it saves with, or the figure it made (`plt.figure()`, `ax.plot(...)`,
    `plt.close()`; `fig, ax = plt.subplots()` when nothing else reads them) go under its guard,
    and a loop that then only draws and saves (`for i, frame in enumerate(frames):`) is guarded
    whole. The library is a plotting one (names.FIGURE_LIBRARIES), or the one of a writer
    known by its name (side_effects.writes_named_file)."""
    script = ctx.script
    for line, condition in list(targets.items()):
        call = _sole_call(line)
        root = side_effects.receiver_root(N.receiver(call)) if call is not None else None
        if root is None or line in hoisted or line not in getattr(script.parent(line), "body", ()):
            continue
        block = list(script.parent(line).body)
        made = [_sole_call(s) for s in block if N.sole_assign(s) and root.value in _bound(s)]  # `fig, ax = plt.subplots()`
        figure = any(_figure_library(ctx, c) for c in [call, *made] if c is not None)
        if not figure and not (script.index.is_import(root) and _library_writer(ctx, call)):
            continue
        for stmt in _drawing_run(ctx, block, block.index(line), root.value):
            targets.setdefault(stmt, condition)
        loop = script.parent(script.parent(line))
        body = getattr(getattr(loop, "body", None), "body", ())
        if isinstance(loop, cst.For) and loop.orelse is None and all(targets.get(s) == condition for s in body):
            if not any(s in hoisted for s in body) and not _reads_after(script, loop) and not _calls_project(ctx, loop.iter):
                for stmt in body:
                    targets.pop(stmt)
                targets[loop] = condition


def _drawing_run(ctx: Context, block: list, at: int, root: str) -> list:
    """The statements next to `block[at]` (each a call, or an assignment of one) whose receiver
    is `root` or a figure library's module, or a name such an assignment binds, and that call
    nothing of the project; none when a name they bind is read elsewhere in the block."""
    script = ctx.script
    roots, group = {root}, []
    for _ in range(3):  # `fig, ax = plt.subplots()`, `pen = ImageDraw.Draw(canvas)`: what draws the figure too
        for stmt in block:
            call = _sole_call(stmt)
            name = side_effects.receiver_root(N.receiver(call)) if call is not None else None
            if name is not None and (name.value in roots or _figure_library(ctx, call) or roots & _bound(stmt)):
                roots |= _bound(stmt)
    for step in (-1, 1):
        i = at + step
        while 0 <= i < len(block) and not _calls_project(ctx, block[i]):
            call = _sole_call(block[i])
            name = side_effects.receiver_root(N.receiver(call)) if call is not None else None
            if name is None or not _figure_library(ctx, call) and name.value not in roots:
                break
            roots |= _bound(block[i])
            group.append(block[i])
            i += step
    bound = set().union(*(_bound(s) for s in group), roots - {root})
    return [] if _read_elsewhere(bound, block, [*group, block[at]]) else group


def _figure_library(ctx: Context, call: cst.Call) -> bool:
    """Is `call` a function of a plotting library's module (`plt.figure()`, `sns.lineplot(...)`)?"""
    name = side_effects.receiver_root(N.receiver(call))
    return name is not None and ctx.script.index.is_import(name) and any(
        q.startswith(N.FIGURE_LIBRARIES) for q in ctx.script.names(name)
    )


def _bound(stmt: cst.CSTNode) -> set[str]:
    """The names a one-target assignment binds (`fig, ax = ...`: both)."""
    assign = N.sole_assign(stmt)
    return {n.value for n in _names(assign.targets[0].target)} if assign is not None else set()


def _sole_call(stmt: cst.CSTNode) -> cst.Call | None:
    """The call that is a simple statement's whole value (`plt.close()`, `fig = plt.figure()`)."""
    small = N.sole_statement(stmt)
    value = getattr(small, "value", None)
    return value if isinstance(value, cst.Call) and isinstance(small, (cst.Expr, cst.Assign)) else None


def _names(target: cst.BaseExpression) -> list[cst.Name]:
    if isinstance(target, cst.Name):
        return [target]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for e in target.elements for n in _names(e.value)]
    return []


def _read_elsewhere(names: set[str], block: list, group: list) -> bool:
    """Is one of `names` read in `block` outside the statements of `group`?"""
    return any(
        isinstance(n, cst.Name) and n.value in names
        for stmt in block if stmt not in group for n in iter_nodes(stmt)
    )  # fmt: skip


def _reads_after(script, loop: cst.For) -> bool:
    """Does the loop's block read a name the loop binds (`for i, frame in ...`) after it?"""
    names = {n.value for n in _names(loop.target)}
    block = list(getattr(script.parent(loop), "body", ()))
    return loop in block and _read_elsewhere(names, block[block.index(loop) + 1 :], [])


def _calls_project(ctx: Context, node: cst.CSTNode) -> bool:
    """Does `node` call a function of the project, or a model (which may run collectives)?"""
    script = ctx.script
    return _runs_model(ctx, node) or any(
        script.local_function(c) is not None or script.project_definition(c.func) is not None for c in script.calls_in(node)
    )


def _guard_rank0_values(ctx: Context, targets: dict, hoisted: set, moved: set[cst.Call]) -> None:
    """A writer exists on rank 0 only: every statement that reads it, or a value computed from
    it (`folder = os.path.join(self.writer.log_dir, "weights")`, then `os.makedirs(folder)`),
    runs on rank 0 only too; one that also trains or communicates cannot, and gets a TODO."""
    script, edits = ctx.script, ctx.edits
    for use in rank0_uses(script, rank0_objects(script)):
        stmt = use.statement
        if stmt in targets or D.guarded_by_rank(script, stmt):
            continue
        if use.every_rank:
            edits.todo(stmt, stmt, f"`{use.reads}` comes from `{use.source}`, which exists on rank 0 only: compute it on every rank")
            continue
        targets[stmt] = ctx.rank0_condition(stmt)
        if _hoist_model_calls(ctx, stmt, stmt, moved):
            hoisted.add(stmt)


def _writes_own_file(ctx: Context, own: PerProcess, call: cst.Call) -> bool:
    """`torch.save(state, os.path.join(tempdir, "best.pt"))`, `print(..., file=rank_log)`,
    `logger.addHandler(logging.FileHandler(f"worker{os.getpid()}.log"))`: a file of this process's
    own. (A print or log message that names the rank still goes out once.)"""
    script = ctx.script
    if script.is_call_to(call, N.PRINT):
        target = N.keyword(call, "file")
        return target is not None and own.path(target.value)
    if script.is_call_to(call, N.LOGGING_CALLS):
        return False
    # The file, not what goes in it: `torch.save({"rank": args.rank, ...}, "ckpt.pt")` is one file.
    args = N.positional(call)
    second = script.is_call_to(call, N.TORCH_SAVE | FILE_SECOND)
    target = (args[1] if len(args) > 1 else None) if second else (args[0] if args else None)
    target = target or next((N.keyword(call, k) for k in FILE_KEYWORDS if N.keyword(call, k)), None)
    return target is not None and own.path(target.value)


def _guard(ctx: Context, targets: dict[cst.SimpleStatementLine, str], hoisted: set[cst.CSTNode]) -> None:
    script, edits = ctx.script, ctx.edits
    merged: set[cst.If] = set()
    for line, condition in targets.items():
        if any(other is not line and script.inside(line, other) for other in targets):
            continue  # already inside a guarded statement
        if "os.environ" in condition:
            edits.need_import("os")
        else:
            edits.need_import(N.DIST_MODULE, asname="dist")
        block = script.parent(line)
        owner = script.parent(block)
        if isinstance(line, cst.If) and isinstance(line.body, cst.SimpleStatementSuite):
            line, owner, block = None, line, line.body  # `if i % 50 == 0: print(loss)`: its test
        if isinstance(owner, cst.If) and line is None:
            merged.add(owner)
            edits.rewrite(owner, lambda updated, c=condition: updated.with_changes(test=_and(ctx, updated.test, c)))
            edits.change(owner, "runs on rank 0 only")
        elif (
            isinstance(owner, cst.If)
            and owner not in merged
            and owner.orelse is None
            and not isinstance(script.parent(owner), cst.If)
            and all(targets.get(s) == condition and s not in hoisted for s in block.body)
        ):
            merged.add(owner)
            edits.rewrite(owner, lambda updated, c=condition: updated.with_changes(test=_and(ctx, updated.test, c)))
            edits.change(owner, "runs on rank 0 only")
        elif not any(script.inside(line, o) for o in merged):
            edits.guard(line, condition)
            edits.change(line, "runs on rank 0 only" if "rank()" in condition or '"RANK"' in condition else PER_NODE)


def _hoist_model_calls(ctx: Context, line: cst.CSTNode, node: cst.CSTNode, moved: set[cst.Call]) -> bool:
    """`print(..., evaluate(val_data))`, `torch.save({"acc": evaluate(test_loader)}, path)`, or
    `with open(path, "w")` around such a call: the script's helper runs the model (and its
    collectives), so it runs on every rank before the guarded statement
    (`evaluate_result = evaluate(val_data)`), never behind it."""
    script, edits = ctx.script, ctx.edits
    hoisted = False
    for inner in script.calls_in(node):
        fn = script.local_function(inner)
        elsewhere = _trains_elsewhere(ctx, inner) if fn is None and inner is not node else None
        if inner is node or inner in moved or not (elsewhere or fn is not None and _runs_any_model(ctx, fn)):
            continue
        fn = fn or elsewhere
        outer = [a for a in script.ancestors(inner) if isinstance(a, cst.Call) and script.inside(a, node)]
        if any(script.local_function(a) for a in outer if a is not node):
            continue  # inside another helper call: that one is hoisted whole
        if _gets_plain_model(ctx, inner, fn):
            continue  # `print(generate(model, ...))`: it gets the plain `model.module` (unwrap_model), no DDP forward
        name = _free_name(script, f"{fn.name.value}_result")
        edits.insert_before(line, _in_its_context(ctx, line, inner, f"{name} = {script.module.code_for_node(inner)}\n"))
        edits.replace(inner, cst.Name(name))
        edits.change(inner, f"`{fn.name.value}(...)` runs the model: every rank calls it, then rank 0 uses the result")
        moved.add(inner)
        hoisted = True
    return hoisted


def _in_its_context(ctx: Context, line: cst.CSTNode, call: cst.Call, code: str) -> str:
    """`code` (the hoisted `result = evaluate(...)`) wrapped as `call` runs within the guarded
    `line`: inside its `with torch.no_grad():` / autocast blocks, and after the `model.eval()` and
    before the `model.train()` beside it; else every rank would validate in training mode, with
    grads, and the `train()` left behind the guard would run on rank 0 only."""
    script = ctx.script
    models = set(script.models) | set().union(*script.ddp_names.values())
    child: cst.CSTNode = call
    for node in script.ancestors(call):
        if isinstance(node, cst.With) and node.items and all(
            isinstance(i.item, cst.Call) and script.is_call_to(i.item, N.NO_GRAD | N.AUTOCAST) for i in node.items
        ):
            header = ", ".join(
                script.module.code_for_node(i.item) + (f" as {script.module.code_for_node(i.asname.name)}" if i.asname else "")
                for i in node.items
            )
            code = f"with {header}:\n" + "".join(f"    {text}\n" if text else "\n" for text in code.rstrip("\n").split("\n"))
        if node is line:
            break
        if isinstance(node, cst.IndentedBlock) and child in node.body:
            at = node.body.index(child)
            before = [s for s in node.body[:at] if _switches_mode(s, "eval", models)][-1:]
            after = [s for s in node.body[at + 1 :] if _switches_mode(s, "train", models)][:1]
            code = "".join(f"{script.module.code_for_node(s).strip()}\n" for s in before) + code
            code += "".join(f"{script.module.code_for_node(s).strip()}\n" for s in after)
        child = node
    return code


def _switches_mode(stmt: cst.CSTNode, mode: str, models: set[str]) -> bool:
    """Is `stmt` just `model.eval()` (or `.train()`) of one of `models`?"""
    small = N.sole_statement(stmt)
    return (
        isinstance(small, cst.Expr)
        and N.is_method_call(small.value, mode)
        and ref_of(small.value.func.value) in models
    )


def _trains_elsewhere(ctx: Context, call: cst.Call) -> cst.FunctionDef | None:
    """The function of another module of the project a call reaches, when it trains
    (`trainer.step(x, y)` inside a print): every rank must run it."""
    script = ctx.script
    target = script.summaries.callee(call)
    if target is not None:
        return target[1] if target[0].trains(target[1]) else None
    receiver = call.func.value if isinstance(call.func, cst.Attribute) else None
    made = script.value_before(receiver) if isinstance(receiver, cst.Name) else None  # `trainer = Trainer(model)`
    cls = script.class_called(made) if isinstance(made, cst.Call) else None
    method = script.methods(cls).get(call.func.attr.value) if cls is not None else None
    return method if method in script.training_functions else None


def _gets_plain_model(ctx: Context, call: cst.Call, fn: cst.FunctionDef) -> bool:
    """Is a model handed to a helper that reads its own methods (so it gets `model.module`),
    and does the helper run no evaluation loop (whose sums are all-reduced on every rank)?"""
    script = ctx.script
    models = set(script.models) | set().union(*script.ddp_names.values())
    if ctx.fsdp2 or any(script.inside(loop, fn) for loops in script.eval_loops.values() for loop in loops):
        return False  # (a sharded forward is a collective: every rank runs it)
    return any(ref_of(a.value) in models and script.summaries.needs_plain(call, a) for a in call.args)


def _runs_any_model(ctx: Context, fn: cst.FunctionDef) -> bool:
    """Does the helper call a model, or hold an evaluation loop (whose sums get all-reduced)?"""
    script = ctx.script
    models = set(script.models) | set().union(*script.ddp_names.values())
    if any(ref_of(c.func) in models for c in script.calls_in(fn)):
        return True
    return any(script.inside(loop, fn) for loops in script.eval_loops.values() for loop in loops)


def _free_name(script, name: str) -> str:
    taken = set().union(*script.bound.values())
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name}{n}", n + 1
    return candidate


def _makedirs_on_every_rank(ctx: Context) -> None:
    """`os.makedirs` stays on every rank (they may all open files there): with exist_ok=True;
    `if not os.path.isdir(d): os.mkdir(d)` races between ranks: `os.makedirs(d, exist_ok=True)`."""
    script, edits = ctx.script, ctx.edits
    for call in script.calls:
        if script.is_call_to(call, N.MAKEDIRS) and N.keyword(call, "exist_ok") is None:
            edits.rewrite(call, lambda updated: append_arg(updated, keyword_arg("exist_ok", cst.Name("True"))))
            edits.change(call, "`os.makedirs(..., exist_ok=True)`: every rank may create it")
        elif script.is_call_to(call, N.MKDIR) and len(call.args) == 1 and call.args[0].keyword is None:
            path = script.module.code_for_node(call.args[0].value)
            edits.replace(call, edits.expression(f"os.makedirs({path}, exist_ok=True)"))
            edits.need_import("os")
            edits.change(call, "`os.makedirs(..., exist_ok=True)`: every rank may create it at once")


def _rank0_writers(ctx: Context) -> set[str]:
    """`writer = SummaryWriter(...)` -> `... if <rank 0> else None`; returns the names bound."""
    script, edits = ctx.script, ctx.edits
    names = set()
    for call in script.calls:
        assign = script.parent(call)
        if not (script.is_call_to(call, WRITERS) and isinstance(assign, cst.Assign) and assign.value is call):
            continue
        ref = ref_of(assign.targets[0].target)
        if ref is None:
            continue
        names.add(ref)
        if D.guarded_by_rank(script, call):
            continue  # `SummaryWriter(...) if dist.get_rank() == 0 else None` already
        condition = ctx.rank0_condition(assign)
        edits.rewrite(
            call,
            lambda updated, c=condition: cst.IfExp(
                test=edits.expression(c), body=updated, orelse=cst.Name("None")
            ),
        )
        edits.change(call, f"`{ref}` is made on rank 0 only (None elsewhere)")
    return names


def _once_statement(ctx: Context, call: cst.Call, writers: set[str]) -> cst.SimpleStatementLine | cst.If | None:
    """The statement line that is only `call` (or the one-line `if` around it: `if args.tb:
    configure(...)`), when the call is a side effect meant once per job (a print, a save, a
    log, a tracker's or writer's method), else None."""
    script = ctx.script
    line = script.statement_line(call) or _one_line_if(script, call)
    small = line.body.body if isinstance(line, cst.If) else line.body if line is not None else ()
    if len(small) != 1 or getattr(small[0], "value", None) is not call:
        return None
    owner = N.receiver(call)
    once = (
        script.is_call_to(call, ONCE)
        or (owner is not None and N.call_name(call) in ONCE_METHODS)
        or (owner is not None and ref_of(owner) in writers)
        or isinstance(small[0], cst.Expr)  # a writer object a statement makes is _rank0_writers'
        and side_effects.writes(
            script.names(call.func), N.call_name(call) or "",
            side_effects.bound_call_roots(script.names, script.assigns.get(script.scope_of(call), []), owner),
            method=owner is not None,
        )  # fmt: skip
        or isinstance(small[0], cst.Expr) and _library_writer(ctx, call)
        or isinstance(small[0], cst.Expr) and ctx.saved_in_run(call)  # a save the code hides: once per job too
    )
    return line if once else None


def _library_writer(ctx: Context, call: cst.Call) -> bool:
    """`save_sample(root / ("clip_%d.wav" % i), rate, audio)` of a package outside the project:
    a call the analysis cannot follow whose name says it writes and that gets an output file's
    name (side_effects.writes_named_file). The project's own functions are converted where
    they are defined."""
    script = ctx.script
    name = N.call_name(call)
    if name is None or script.is_call_to(call, ONCE) or script.local_function(call) is not None:
        return False  # (a known writer: `torch.save(state, "last.pt")` is no library's unknown one)
    if script.summaries.callee(call) is not None:
        return False
    args = [script.index.code(a.value) for a in call.args]
    return script.project_definition(call.func) is None and side_effects.writes_named_file(name, args)


def _one_line_if(script, call: cst.Call) -> cst.If | None:
    """`if i % 50 == 0: print(loss)` (the body on the `if`'s line, no `else`): that `if`."""
    suite = script.parent(script.parent(call))
    owner = script.parent(suite)
    if isinstance(suite, cst.SimpleStatementSuite) and isinstance(owner, cst.If) and owner.orelse is None:
        return owner
    return None


def _writer_condition(ctx: Context, stmt: cst.With, call: cst.Call) -> str:
    """Rank 0 of the job writes; but a file the script writes before the model is wrapped and
    reads back (a vocabulary, a prepared split) is data on the node's disk: its local rank 0
    writes it on every node (with --shared-fs, rank 0 once)."""
    script = ctx.script
    if _cache_writer(ctx, stmt):
        return _cache_writer(ctx, stmt)
    wraps = list(ctx.wrap_after.values())
    if ctx.options.shared_fs or not wraps or not all(script.before(stmt, w) for w in wraps):
        return ctx.rank0_condition(stmt)
    info = script.index.call_info.get(call)
    if info is not None and written_and_read_back(script.index, info):  # the reasoning DDP307 uses
        return f"{ctx.local_rank_at(stmt)} == 0"
    return ctx.rank0_condition(stmt)


def _cache_writer(ctx: Context, stmt: cst.CSTNode) -> str | None:
    """The node's local rank 0 writes a cache (`if os.path.exists(cached): load / else: build,
    save`): its other ranks read it from the node's disk (download_once's barriers); with
    --shared-fs, rank 0 of the job. None outside such an `if`."""
    script = ctx.script
    if not any(isinstance(a, cst.If) and cache_test(script.index, a) for a in script.ancestors(stmt)):
        return None
    return ctx.rank0_condition(stmt) if ctx.options.shared_fs else f"{ctx.local_rank_at(stmt)} == 0"


def _opens_for_writing(ctx: Context, call: cst.Call) -> bool:
    """`open(path, "w")` (or "a"/"x"; also `gzip.open(path, "wt")`, `codecs.open(...)`) or
    pathlib's `path.open("w")` as the item of a `with` statement."""
    if not isinstance(ctx.script.parent(call), cst.WithItem) or _opened_path(ctx, call) is None:
        return False
    args = N.positional(call)
    mode = getattr(N.keyword(call, "mode"), "value", None)
    if mode is None and ctx.script.is_call_to(call, N.OPEN | OPENERS):
        mode = args[1].value if len(args) > 1 else None
    elif mode is None:
        mode = args[0].value if args else None  # `path.open("w")`
    return isinstance(mode, cst.SimpleString) and mode.evaluated_value.startswith(WRITE_MODES)


def _opened_path(ctx: Context, call: cst.Call) -> cst.BaseExpression | None:
    """The file an opening call opens: `open(path, ...)`'s first argument, `path.open(...)`'s
    receiver (not a module's: `Image.open(path)` reads), None for other calls."""
    if ctx.script.is_call_to(call, N.OPEN | OPENERS):
        args = N.positional(call)
        return args[0].value if args else getattr(N.keyword(call, "file"), "value", None)
    if not N.is_method_call(call, "open") or _a_module(ctx, call.func.value):
        return None  # `Image.open(...)`, `tarfile.open(...)`: a library's function
    return call.func.value


def _a_module(ctx: Context, node: cst.BaseExpression) -> bool:
    """Does `node` name what its module imports (`Image` of `from PIL import Image`, `tarfile`)?"""
    return isinstance(node, cst.Name) and ctx.script.index.is_import(node)


def _runs_model(ctx: Context, stmt: cst.CSTNode) -> bool:
    model = ctx.script.model_name
    return any(ref_of(c.func) == model for c in ctx.script.calls_in(stmt))


def _and(ctx: Context, test: cst.BaseExpression, condition: str) -> cst.BaseExpression:
    if isinstance(test, (cst.BooleanOperation, cst.IfExp, cst.Lambda, cst.NamedExpr)) and not test.lpar:
        test = test.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return cst.BooleanOperation(left=test, operator=cst.And(), right=ctx.edits.expression(condition))


def _pass_unwrapped(ctx: Context, call: cst.Call) -> None:
    """A helper that gets the model and does not train it gets the network itself; the summary
    says it evaluates only where the helper runs the model (`save_checkpoint(epoch, model)` keeps
    or saves it)."""
    model = ctx.script.model_name
    plain = ctx.plain(call, model)
    if plain is None:
        return
    said = False  # unwrap_model's summary line says it already (the helper reads the model's own methods)
    for arg in call.args:
        if ref_of(arg.value) == model:
            ctx.edits.replace(arg.value, ctx.edits.expression(plain))
            said = said or ctx.script.summaries.needs_plain(call, arg) is not None
    where = "on rank 0" if ctx.options.eval_on_rank0 else "on every rank"
    if said and not ctx.options.eval_on_rank0:
        return
    fn = ctx.script.local_function(call)
    param = param_receiving(fn, call, model) if fn is not None else None
    if param is not None and any(N.is_name(c.func, param) for c in ctx.script.calls_in(fn)):
        ctx.edits.change(call, f"evaluates `{plain}` {where}")
    else:
        name = fn.name.value if fn is not None else ctx.script.module.code_for_node(call.func)
        ctx.edits.change(call, f"`{name}()` gets `{plain}` {where}: it does not train the model")
