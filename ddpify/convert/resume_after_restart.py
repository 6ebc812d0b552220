"""Under `torchrun --max-restarts`, restarted workers go on from the script's last checkpoint.

A script that saves checkpoints and can resume from one gets, right before its resume gate, a
line that points the gate at the checkpoint it saves once torchrun has restarted the workers:

    # torchrun restarted the workers (--max-restarts): go on from the last checkpoint
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0 and os.path.exists(args.checkpoint):
        args.resume = args.checkpoint
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device)
        ...

The gate is an `if` (or `elif`) on an option or a name (`args.resume`, `resume`,
`init_from == "resume"`) around a `torch.load`; the path is the one a `torch.save` in a
training loop writes, when it can be computed before the gate (literals, the gate's own options
object, imported modules, names bound earlier in the gate's function or at module level). A
script whose training saves checkpoints but never loads one gets a note: a restarted worker
trains from the start.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.convert.context import Context
from ddpify.convert.edits import names_read

RESTARTED = 'int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0'
RESUME = (
    "# torchrun restarted the workers (--max-restarts): go on from the last checkpoint\n"
    "if {restarted} and os.path.exists({path}):\n"
    "    {target} = {value}\n"
)
NO_RESUME = (
    "no resume path (loading model, optimizer and epoch before training): a worker torchrun "
    "restarts (--max-restarts) trains from the start; load the latest checkpoint before the "
    "training loop to go on from it"
)


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    saves = [c for c in script.calls if script.is_call_to(c, N.TORCH_SAVE) and len(N.positional(c)) > 1]
    saves = [c for c in saves if _during_training(script, c)]
    if not saves:
        return
    gates = _gates(ctx)
    if not gates:
        if not _resumes_when_saved(ctx):
            edits.note(saves[0], NO_RESUME)
        return
    for head, target, value_of, load in gates:
        if _done(script, head):
            continue
        path = next((p for p in (N.positional(c)[1].value for c in saves) if _computable(ctx, p, head, target)), None)
        if path is None:
            edits.note(head, "a worker torchrun restarts (--max-restarts) trains from the start: the path of the "
                             "checkpoint saved in training is not known here; point this resume option at it")  # fmt: skip
            continue
        path_code = _code(ctx, path)
        if not _assignable(ctx, target, head):
            edits.note(head, f"a worker torchrun restarts (--max-restarts) trains from the start: `{_code(ctx, target)}` "
                             f"is not this function's own name; set it from {path_code} when TORCHELASTIC_RESTART_COUNT > 0")  # fmt: skip
            continue
        value = value_of(path_code, _code(ctx, ctx.script.value_before(load)))  # through `ckpt_path = ...`
        if value is None:
            edits.note(head, f"a worker torchrun restarts (--max-restarts) trains from the start: this resume gate "
                             f"loads {_code(ctx, load)}, not the checkpoint saved in training ({path_code})")  # fmt: skip
            continue
        edits.need_import("os")
        edits.insert_above(head, RESUME.format(restarted=RESTARTED, path=path_code, target=_code(ctx, target), value=value))
        edits.change(head, f"a worker torchrun restarts (--max-restarts) goes on from the last checkpoint ({path_code})")


def _during_training(script, call: cst.Call) -> bool:
    """Is `call` in a training loop, or in a function called from one (`test(epoch)` saving the best)?"""
    scope = script.scope_of(call)
    if script.in_training_loop(call, scope):
        return True
    return isinstance(scope, cst.FunctionDef) and any(
        script.local_function(c) is scope and script.in_training_loop(c, script.scope_of(c)) for c in script.calls
    )


def _gates(ctx: Context):
    """(statement to insert before, the gate's option, how to set it, the load's path) for
    each `if OPTION:` / `if NAME == "literal":` around a torch.load."""
    script = ctx.script
    found, seen = [], set()
    for load in script.calls:
        if not script.is_call_to(load, N.TORCH_LOAD) or not N.positional(load):
            continue
        path = N.positional(load)[0].value
        for node in script.ancestors(load):
            if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
                break
            if not isinstance(node, cst.If) or node in seen:
                continue
            branch = next((b for b in (node.body, node.orelse) if b is not None and script.inside(load, b)), None)
            if branch is None:
                continue  # the load is in the test
            gate = _gate(_when(node.test, branch is node.body), path)
            if gate is not None and _restores_training(ctx, branch):
                seen.add(node)
                found.append((_chain_head(script, node), *gate, path))
    return found


def _when(test: cst.BaseExpression, in_body: bool) -> cst.BaseExpression | None:
    """The test under which the branch holding the load runs, as a plain option where it is one:
    `if args.resume:` (body), `if resume_from is None: ... else:` and `if not args.resume: ... else:`
    (the else), `if resume_from is not None:` (body) all run it when the option is set."""
    subject, truthy = test, True
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        subject, truthy = test.expression, False
    elif isinstance(test, cst.Comparison) and len(test.comparisons) == 1 and N.is_name(test.comparisons[0].comparator, "None"):
        operator = test.comparisons[0].operator
        if isinstance(operator, (cst.Is, cst.IsNot)):
            subject, truthy = test.left, isinstance(operator, cst.IsNot)
    if subject is test:
        return test if in_body else None
    return subject if truthy == in_body and isinstance(subject, (cst.Name, cst.Attribute)) else None


def _resumes_when_saved(ctx: Context) -> bool:
    """`if os.path.exists(CHECKPOINT): state = torch.load(CHECKPOINT) ...`: a gate on the file's
    existence resumes training by itself, after a restart as after a crash."""
    script = ctx.script
    for gate in script.nodes_of(cst.If):
        exists = any(N.call_name(c) in N.EXISTENCE_TESTS for c in script.calls_in(gate.test))
        loads = any(script.is_call_to(c, N.TORCH_LOAD) for c in script.calls_in(gate.body))
        if exists and loads and _restores_training(ctx, gate.body):
            return True
    return False


def _restores_training(ctx: Context, body: cst.CSTNode) -> bool:
    """Does the gate's branch `body` resume training, not only load weights (`--eval-only PATH`)?
    It loads an optimizer's state, or sets a value a later `for` loop counts from (`start_epoch`)."""
    script = ctx.script
    optimizers = set()
    for call in script.calls:
        if N.is_optimizer(script.names(call.func)):
            stmt = script.statement_line(call)
            assign = stmt.body[0] if stmt is not None and stmt.body else None
            if isinstance(assign, cst.Assign) and len(assign.targets) == 1:
                optimizers.add(_code(ctx, assign.targets[0].target))
    for call in script.calls_in(body):
        if N.call_name(call) == "load_state_dict" and N.receiver(call) is not None and _code(ctx, N.receiver(call)) in optimizers:
            return True
    counted = {_code(ctx, t.target) for t in iter_nodes(body) if isinstance(t, cst.AssignTarget)}
    for loop in script.nodes_of(cst.For):
        if script.after(loop, body) and any(_code(ctx, n) in counted for n in iter_nodes(loop.iter) if isinstance(n, (cst.Name, cst.Attribute))):
            return True
    return False


def _gate(test: cst.BaseExpression | None, path: cst.BaseExpression):
    """(the option, how to set it from the checkpoint path's code) for a gate test, else None."""
    if test is None:
        return None
    if isinstance(test, (cst.Name, cst.Attribute)):
        # `if args.resume: torch.load(args.resume)` takes the path; `if resume: torch.load(CKPT)` a flag
        return test, lambda saved, loaded: saved if test.deep_equals(path) else ("True" if saved == loaded else None)
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1 and isinstance(test.left, (cst.Name, cst.Attribute)):
        target = test.comparisons[0]
        if isinstance(target.operator, cst.Equal) and isinstance(target.comparator, cst.SimpleString):
            literal = target.comparator.value
            # `init_from == "resume"` resumes when its load reads the checkpoint saved in training;
            # `model == "NeuMF-pre"` loading pretrained parts from elsewhere is no resume
            return test.left, lambda saved, loaded: literal if saved == loaded else None
    return None


def _chain_head(script, node: cst.If) -> cst.If:
    """The `if` that opens the if/elif chain `node` is part of."""
    parent = script.parent(node)
    while isinstance(parent, cst.If) and parent.orelse is node:
        node, parent = parent, script.parent(parent)
    return node


def _done(script, head: cst.CSTNode) -> bool:
    """A converted script: the restart line sits above the gate already."""
    block = script.parent(head)
    body = list(getattr(block, "body", ()))
    if head not in body:
        return False
    before = body[: body.index(head)]
    return any(
        isinstance(n, cst.SimpleString) and "TORCHELASTIC_RESTART_COUNT" in n.value
        for stmt in before for n in iter_nodes(stmt)
    )  # fmt: skip


def _computable(ctx: Context, path: cst.BaseExpression, head: cst.CSTNode, target: cst.BaseExpression) -> bool:
    """Can `path` be computed right before `head`? Every name in it is the gate's options
    object, a module-level binding, or bound earlier in the gate's own function, and none is
    bound again after the gate (`model_filename = get_weights_file_path(config, epoch)` in the
    loop: the saved path is not the value the name holds at the gate), nor is it the gate's own."""
    if _code(ctx, path) == _code(ctx, target):
        return False
    allowed = {_root(target)} | _module_names(ctx.script.root_of(head)) | _bound_before(ctx, head)
    script = ctx.script
    scope = script.scope_of(head)
    later = {t.value for t in _assigned_names(scope) if script.before(head, t) and script.scope_of(t) is scope}
    return all(name in allowed and name not in later for name in names_read(path))


def _assignable(ctx: Context, target: cst.BaseExpression, head: cst.CSTNode) -> bool:
    """Can the gate's option be set right before `head`? An attribute (`args.resume`) can; a
    name must be the function's own (assigning a module-level name inside a function would
    make it local there, unbound when torchrun did not restart), or one it declares `global`."""
    scope = ctx.script.scope_of(head)
    if not isinstance(target, cst.Name) or not isinstance(scope, cst.FunctionDef):
        return True
    declared = {n.name.value for g in iter_nodes(scope.body) if isinstance(g, cst.Global) for n in g.names}
    return target.value in _bound_before(ctx, head) | declared


def _bound_before(ctx: Context, head: cst.CSTNode) -> set[str]:
    """The parameters of `head`'s function and the names it assigns before `head`."""
    scope = ctx.script.scope_of(head)
    if not isinstance(scope, cst.FunctionDef):
        return set()
    params = scope.params
    names = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
    return names | {t.value for t in _assigned_names(scope) if ctx.script.before(t, head)}


def _root(node: cst.BaseExpression) -> str | None:
    while isinstance(node, cst.Attribute):
        node = node.value
    return node.value if isinstance(node, cst.Name) else None


def _module_names(module: cst.Module) -> set[str]:
    """Names bound at module level: imports, assignments, functions and classes."""
    names = set()
    for stmt in module.body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            names.add(stmt.name.value)
        for small in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
            if isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(small.names, cst.ImportStar):
                for alias in small.names:
                    bound = alias.asname.name if alias.asname else alias.name
                    while isinstance(bound, cst.Attribute):
                        bound = bound.value
                    names.add(bound.value)
            elif isinstance(small, (cst.Assign, cst.AnnAssign)):
                targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
                names |= {t.value for t in targets if isinstance(t, cst.Name)}
    return names


def _assigned_names(scope: cst.FunctionDef | cst.Module) -> list[cst.Name]:
    found = []
    for node in iter_nodes(scope if isinstance(scope, cst.Module) else scope.body):
        if isinstance(node, cst.AssignTarget) and isinstance(node.target, cst.Name):
            found.append(node.target)
        elif isinstance(node, cst.AnnAssign) and isinstance(node.target, cst.Name) and node.value is not None:
            found.append(node.target)
    return found


def _code(ctx: Context, node: cst.CSTNode) -> str:
    return ctx.script.module.code_for_node(node)
