"""A file rank 0 saved and every rank then reads is read only after a barrier.

    if dist.get_rank() == 0:
        torch.save(model.module, args.save)
    ...
    dist.barrier()  # rank 0 has written this file
    model = torch.load(args.save, map_location=device)

The barrier sits right before the read, which every rank executes. With `convert --run`, a call
the run saw save (`write(state, path)` with `write=torch.save`) writes its second argument too.
"""

from __future__ import annotations

import re

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.analysis.multinode import file_key
from ddpify.convert.context import RANK0, Context
from ddpify.analysis.script import argument_for, ref_of
from ddpify.convert.per_process import PerProcess, before_setup, shared_temp_dirs

BARRIER = "dist.barrier()  # rank 0 has written this file\n"
# In code that may run without a process group (another module's function other scripts call as one process)
GUARDED_BARRIER = "if dist.is_initialized():\n    dist.barrier()  # rank 0 has written this file\n"
SHARE = (
    "{d}_of_rank0 = [{d}]\n"
    "dist.broadcast_object_list({d}_of_rank0)  # one folder for every rank: rank 0's (it writes, every rank reads)\n"
    "{d} = {d}_of_rank0[0]\n"
)
READ_BARRIER = "dist.barrier()  # every rank is done with rank 0's temporary folder before it goes\n"
BROADCAST_OBJECTS = N.BROADCAST_OBJECTS


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    written: dict[tuple, cst.Call] = {}  # the path (_key) -> the first call that writes it
    reads: list[tuple[tuple, cst.Call]] = []
    handles = _file_handles(script)
    shared = shared_temp_dirs(ctx)
    own = PerProcess(script, shared)  # every process writes (and reads back) its own file: no waiting
    for call in script.calls:
        args = N.positional(call)
        saves = script.is_call_to(call, N.TORCH_SAVE) or len(args) > 1 and ctx.saved_in_run(call)  # `write(state, path)`
        if saves and len(args) > 1:
            if not _is_handle(args[1].value, handles) and not own.path(args[1].value):
                written.setdefault(_key(ctx, args[1].value, call), call)
        elif script.is_call_to(call, N.OPEN) and args:
            if _mode(call).startswith(("w", "a", "x")):
                if not own.path(args[0].value):
                    written.setdefault(_key(ctx, args[0].value, call), call)
            else:
                reads.append((_key(ctx, args[0].value, call), call))
        elif script.is_call_to(call, N.TORCH_LOAD) and args and not _is_handle(args[0].value, handles):
            reads.append((_key(ctx, args[0].value, call), call))
        elif script.is_call_to(call, N.COMMANDS):
            if _redirects(ctx, call) and (stmt := _statement(script, call)) is not None:
                if not D.guarded_by_rank(script, call):
                    _run_on_rank0(ctx, stmt, call)  # rank 0 runs it after writing its inputs: nothing to wait for
                for name in _redirects(ctx, call):
                    written.setdefault(("command", name), call)
            elif not D.guarded_by_rank(script, call):
                reads.append((None, call))
    waited = set()  # statements that read after a barrier
    for path, call in reads:
        first_write, anywhere = _writer_of(ctx, path, call, written)
        if first_write is None or not (anywhere or script.before(first_write, call)) or script.index.exclusive(first_write, call):
            continue
        if _under_existence_test(script, call):
            continue  # `if os.path.exists(cache): load` / `else: build and write`: ranks may take either branch
        stmt = _statement(script, call)
        if stmt is None or stmt in waited:
            continue
        waited.add(stmt)
        previous = D.sibling(script, stmt, -1)
        waits = isinstance(previous, (cst.SimpleStatementLine, cst.If, cst.Try)) and D.barrier_in(script, previous)
        if (previous in waited or waits) and not (previous is not None and script.inside(first_write, previous)):
            continue  # every rank waits there already (or right before the read above), after the write
        edits.insert_before(stmt, BARRIER if ctx.rank0_condition(stmt) == RANK0 else GUARDED_BARRIER)
        edits.change(call, "every rank reads this file after rank 0 wrote it (barrier)")
    for name, stmt in shared.items():
        _share_temp_dir(ctx, name, stmt)


def _writer_of(ctx: Context, path: tuple | None, call: cst.Call, written: dict) -> tuple[cst.Call | None, bool]:
    """The write a read (`path` None: a command) waits for, and whether it counts wherever it is
    (the run saw it first; a helper elsewhere writes it, run before by the calls) rather than only
    before the read."""
    if path is not None and (writer := written.get(path)) is not None:
        return writer, False
    if path is not None and (writer := _written_in_run(ctx, call, written)) is not None:
        return writer, True
    writer = _same_file_name(ctx, call, written) if path is not None else _named_in_command(ctx, call, written)
    if writer is None and path is not None:
        writer = _written_by_command(ctx, call, written)
    return writer, writer is not None and ctx.script.scope_of(writer) is not ctx.script.scope_of(call)


def _written_in_run(ctx: Context, call: cst.Call, written: dict) -> cst.Call | None:
    """`convert --run` saw this read take a file the run had written: the writing call at that
    site (`torch.save(model.state_dict(), f"{epoch}.pkl")` then `torch.load(f"{best}.pkl")`, paths
    the code spells differently)."""
    run = ctx.options.run
    if run is None or not ctx.ran("read_back", call):
        return None
    first, last = ctx.lines_of(call)
    sites = [w for r, w in run.read_back if first <= r.line <= last]
    for writer in written.values():
        low, high = ctx.lines_of(writer)
        if any(low <= site.line <= high for site in sites):
            return writer
    return None


def _same_file_name(ctx: Context, call: cst.Call, written: dict) -> cst.Call | None:
    """A write whose path ends in the same file name the read's does, spelled apart (an
    early-stopping helper saves `path + '/' + 'checkpoint.pth'`, the trainer loads
    `best_model_path = path + '/' + 'checkpoint.pth'`; a `filename=MODEL_FILE` default on both)."""
    names = _file_names(ctx, _path_arg(ctx, call))
    if not names:
        return None
    return next((w for w in written.values() if names & _file_names(ctx, _path_arg(ctx, w))), None)


def _written_by_command(ctx: Context, call: cst.Call, written: dict) -> cst.Call | None:
    """A command whose shell redirection writes the file the read opens (`... > eval/result.txt`,
    then `open(os.path.join(EVAL_DIR, "result.txt"))`)."""
    names = {text.rsplit("/", 1)[-1] for text in _strings(ctx, _path_arg(ctx, call))}
    return next((w for key, w in written.items() if key[0] == "command" and key[1] in names), None)


def _redirects(ctx: Context, call: cst.Call) -> set[str]:
    """The file names a command's shell redirection writes (`perl score.pl ... > {0}/result.txt`)."""
    texts = {text for arg in call.args for text in _strings(ctx, arg.value)}
    return {w.rsplit("/", 1)[-1] for text in texts for w in re.findall(r">>?\s*([\w./{}-]+\.\w+)", text)}


def _run_on_rank0(ctx: Context, stmt: cst.CSTNode, call: cst.Call) -> None:
    """A command that writes a file through its shell runs once: every rank would truncate and
    rewrite the same file while the others read it."""
    ctx.edits.guard(stmt, ctx.rank0_condition(stmt))
    ctx.edits.change(call, "the command writes its output file: it runs on rank 0 only, the others read that file after a barrier")


def _named_in_command(ctx: Context, call: cst.Call, written: dict) -> cst.Call | None:
    """A command the script runs (`os.system(f"perl score.pl {d}/answers.txt")`, the string bound
    just before) that names a file the script writes: the command reads it."""
    words = {
        w.rsplit("/", 1)[-1] for arg in call.args for text in _strings(ctx, arg.value) for w in re.findall(r"[\w./{}-]+\.\w+", text)
    }
    for writer in written.values():
        if words & {text.rsplit("/", 1)[-1] for text in _strings(ctx, _path_arg(ctx, writer))}:
            return writer
    return None


def _path_arg(ctx: Context, call: cst.Call) -> cst.BaseExpression | None:
    """What a save writes to or a load or open reads."""
    args = N.positional(call)
    saves = ctx.script.is_call_to(call, N.TORCH_SAVE) or ctx.saved_in_run(call)
    return args[1].value if saves and len(args) > 1 else args[0].value if args else None


def _file_names(ctx: Context, node: cst.BaseExpression | None) -> set[str]:
    """The file names (`checkpoint.pth`, `best_model.pt`, a template `{}.pkl` formatted with
    another variable on each side) a path expression spells as literals."""
    names = {text.rsplit("/", 1)[-1] for text in _strings(ctx, node)}
    return {n for n in names if re.fullmatch(r"[\w.{}%:-]+\.(pt|pth|ckpt|pkl|tar|bin|safetensors|npy|npz|json|pickle)", n)}


def _strings(ctx: Context, node: cst.BaseExpression | None, depth: int = 0) -> set[str]:
    """The string literals an expression spells, through the names in it: the value bound just
    before in its function, a parameter's default and what the function's callers hand it
    (`def save(model, filename=MODEL_FILE)`), a module's constant (`MODEL_FILE = "model.pt"`)."""
    found = set()
    if node is None or depth > 5:
        return found
    for n in iter_nodes(node):
        if isinstance(n, cst.SimpleString) and isinstance(n.evaluated_value, str):
            found.add(n.evaluated_value)
        elif isinstance(n, cst.Name):
            for value in _values_of_name(ctx, n):
                found |= _strings(ctx, value, depth + 1)
    return found


def _values_of_name(ctx: Context, name: cst.Name) -> list[cst.BaseExpression]:
    """What a name may hold where it is read (see `_strings`)."""
    script = ctx.script
    bound = script.value_before(name)
    if bound is not name:
        return [bound]
    fn = script.scope_of(name)
    params = [p for p in fn.params.params] if isinstance(fn, cst.FunctionDef) else []
    named = [p for p in params if p.name.value == name.value]
    if named:
        found = [named[0].default] if named[0].default is not None else []
        calls = [c for c in script.calls if script.local_function(c) is fn]
        return found + [given for c in calls if (given := argument_for(fn, c, name.value)) is not None]
    module = script.root_of(name)
    return [a.value for a in script.assigns.get(module, []) if N.is_name(a.targets[0].target, name.value) and isinstance(a.value, cst.SimpleString)]


def _under_existence_test(script, call: cst.Call) -> bool:
    """Is the read in a branch of an `if` that tests whether a file exists? Which branch a rank
    takes depends on when it looks, so a barrier there could wait for ranks that never come."""
    for node in script.ancestors(call):
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            return False
        if isinstance(node, cst.If) and not script.inside(call, node.test):
            if any(N.call_name(c) in N.EXISTENCE_TESTS for c in script.calls_in(node.test)):
                return True
    return False


def _share_temp_dir(ctx: Context, name: str, stmt: cst.CSTNode) -> None:
    """Every rank takes rank 0's temporary folder; a `with TemporaryDirectory()` waits at its end
    until every rank is done with the folder (rank 0 removes it on leaving)."""
    script, edits = ctx.script, ctx.edits
    shared_already = any(
        script.is_call_to(c, BROADCAST_OBJECTS) and any(ref_of(a.value) == f"{name}_of_rank0" for a in c.args)
        for c in script.calls_in(script.scope_of(stmt))
    )
    if isinstance(stmt, cst.With):
        body = stmt.body.body
        if not shared_already:
            edits.insert_before(body[0], SHARE.format(d=name))
            edits.change(stmt, f"`{name}` is rank 0's temporary folder on every rank (rank 0 writes, every rank reads)")
        last = body[-1]
        if isinstance(N.sole_statement(last), cst.Return):
            previous = D.sibling(script, last, -1)
            if not (isinstance(previous, cst.SimpleStatementLine) and D.barrier_in(script, previous)):
                edits.insert_before(last, READ_BARRIER)
        elif not (isinstance(last, cst.SimpleStatementLine) and D.barrier_in(script, last)):
            edits.insert_after(last, READ_BARRIER)
        return
    if shared_already:
        return
    if before_setup(ctx, stmt):  # made before the process group: shared right after it is set up
        edits.insert_before(list(script.block_of(ctx.setup_scope).body)[ctx.init_index], SHARE.format(d=name))
    else:
        edits.insert_after(stmt, SHARE.format(d=name))
    edits.change(stmt, f"`{name}` is rank 0's temporary folder on every rank (rank 0 writes, every rank reads)")


def _file_handles(script) -> set[str]:
    """Names bound by `with open(...) as name`."""
    names = set()
    for call in script.calls:
        item = script.parent(call)
        if script.is_call_to(call, N.OPEN) and isinstance(item, cst.WithItem) and item.asname is not None:
            if isinstance(item.asname.name, cst.Name):
                names.add(item.asname.name.value)
    return names


def _is_handle(node: cst.CSTNode, handles: set[str]) -> bool:
    """`f` of `with open(path) as f`: the `open` call names the file, not this."""
    return isinstance(node, cst.Name) and node.value in handles


def _key(ctx: Context, path: cst.CSTNode, call: cst.Call) -> tuple:
    return file_key(ctx.script.index, path, call, _code(ctx, path))


def _code(ctx: Context, node: cst.CSTNode) -> str:
    """The path as code; `self.path` set from an `__init__` parameter with a default (an
    EarlyStopping's `path="checkpoint.pt"`) reads as that default."""
    script = ctx.script
    if isinstance(node, cst.Attribute) and N.is_name(node.value, "self"):
        cls = script.class_of(node)
        init = script.methods(cls).get("__init__") if cls is not None else None
        params = {p.name.value: p for p in init.params.params} if init is not None else {}
        for assign in script.assigns.get(init, []):
            value = assign.value
            if script.module.code_for_node(assign.targets[0].target) == f"self.{node.attr.value}" and isinstance(value, cst.Name):
                default = getattr(params.get(value.value), "default", None)
                if isinstance(default, cst.SimpleString):
                    return script.module.code_for_node(default)
    return script.module.code_for_node(node)


def _mode(call: cst.Call) -> str:
    args = N.positional(call)
    mode = args[1].value if len(args) > 1 else getattr(N.keyword(call, "mode"), "value", None)
    return mode.evaluated_value if isinstance(mode, cst.SimpleString) else "r"


def _statement(script, call: cst.Call) -> cst.CSTNode | None:
    """The statement to put the barrier in front of: the `with` opening the file, or the line."""
    parent = script.parent(call)
    if isinstance(parent, cst.WithItem):
        return script.parent(parent)
    return script.statement_line(call)
