"""Values every rank computes differently but must agree on: schedules drawn at random, and
names read from the clock or drawn at random (a per-run folder).

`lr = random.random() * 0.0005` or `epochs = random.choice([100, 150, 200])` in `main()` draw
a different value in every process (Python's and NumPy's generators are seeded from the OS), so
the ranks train with different learning rates and, worse, different step counts: the rank that
stops first leaves the others waiting in a collective forever. A draw matters when the value
(or a name computed from it in the same function) reaches a training decision: an optimizer or
scheduler setting, the bounds of a loop that trains, a DataLoader's batch size, or an argument
of a function or object that trains. Per-step randomness (augmentation, dropout masks) and data
tensors are not schedule draws.

`folder = run_folder()` where the helper names a folder by the time (`datetime.now().strftime(
"%m%d_%H%M%S")`) and makes it (`os.makedirs(path, exist_ok=False)`) gives every rank its own
name, a second apart or not, and the ranks race to make it: rank 0 alone may call it, and its
name must reach the other ranks. A timestamp kept as a number (`start = time.time()`) names
nothing and is each rank's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes
from ddpify.analysis.project import makes_clock_folder
from ddpify.analysis.script import ScopeNode, Script, mentions, ref_of


RANDOM, CLOCK = "drawn at random", "named by the clock"


@dataclass
class ScheduleDraws:
    """Values of one function (or the module) that every rank must take from rank 0: draws
    that decide the schedule, or a name read from the clock."""

    scope: ScopeNode
    refs: list[str]  # the names (or `args.x` attributes) bound to drawn values, in order
    last: cst.BaseStatement  # the statement of the scope's block holding the last draw
    first_use: cst.BaseStatement | None  # the first statement of that block reading one of them
    # (None: other functions or methods read them, a module-level global or a `self.` attribute)
    shared: bool = False  # the script broadcasts them already (a converted script)
    kind: str = RANDOM
    rank0_call: cst.Call | None = None  # a call that makes files: rank 0 alone may run it
    made_at: list[cst.BaseStatement] = field(default_factory=list)  # `os.makedirs(run_dir)` before the first use


def rank0_values(script: Script) -> list[ScheduleDraws]:
    """Every value the ranks must take from rank 0: schedule draws and clock-named folders."""
    return schedule_draws(script) + clock_names(script)


def clock_names(script: Script) -> list[ScheduleDraws]:
    """`folder = run_folder()` (a project function that reads the clock, returns a value and
    makes a folder) or `name = datetime.now().strftime(...)` reaching a path: per statement."""
    found = []
    called = {fn for c in script.calls if (fn := script.local_function(c)) is not None}
    makers = {fn for fn in called if makes_clock_folder(script.calls_in(fn), lambda c: script.names(c.func), fn)}
    for scope, stmts in script.assigns.items():
        if scope in makers:
            continue  # rank 0 alone runs it, once the call is rank 0's
        for assign in stmts:
            stmt = script.parent(assign)
            if not isinstance(stmt, cst.SimpleStatementLine) or not _assigns_one(stmt):
                continue
            if script.top_statement(stmt, scope) is not stmt:
                continue
            maker = _folder_maker(script, assign.value)
            drawn = maker is None and _drawn(script, assign.value) and _names_a_path(script, scope, stmt)
            if maker is None and not drawn and not (_clock_text(script, assign.value) and _names_a_path(script, scope, stmt)):
                continue
            ref = _target(stmt)
            elsewhere = any(where is not scope and _reads(where, ref) for where in script.scopes_for(ref, scope))
            made_at, first_use = _makes_then_uses(script, scope, ref, stmt)
            if elsewhere:
                made_at, first_use = [], None
            elif first_use is None:
                continue
            shared = first_use is not None and _broadcast(script, scope, [ref], first_use)
            found.append(ScheduleDraws(scope, [ref], stmt, first_use, shared, RANDOM if drawn else CLOCK, maker, made_at))
    return found


def _drawn(script: Script, value: cst.BaseExpression) -> bool:
    """A run id drawn at random (`random.randint(1, 100000)`, `uuid.uuid4().hex`, `str()` of one)."""
    calls = [value, *script.calls_in(value)] if isinstance(value, cst.Call) else script.calls_in(value)
    return any(script.is_call_to(c, N.RANDOM_VALUES) and _scalar(script, c) or script.is_call_to(c, N.UUIDS) for c in calls)


def _makes_then_uses(script: Script, scope: ScopeNode, ref: str, stmt: cst.BaseStatement):
    """The statements right after `stmt` that only make the folder `ref` names
    (`os.makedirs(run_dir, exist_ok=False)`, also under an `if` already), and the first
    statement after them that reads `ref`."""
    body = list(script.block_of(scope).body)
    made = []
    for later in body[body.index(stmt) + 1 :]:
        if not _reads(later, ref):
            continue
        inner = later.body.body[0] if isinstance(later, cst.If) and len(later.body.body) == 1 and later.orelse is None else later
        calls = [c for c in script.calls_in(inner) if _reads(c, ref)]
        makes = isinstance(inner, cst.SimpleStatementLine) and len(inner.body) == 1 and isinstance(inner.body[0], cst.Expr)
        if makes and calls and all(script.is_call_to(c, N.MAKEDIRS | N.MKDIR) or N.call_name(c) == "mkdir" for c in calls[:1]):
            made.append(later)
            continue
        return made, later
    return made, None


def _folder_maker(script: Script, value: cst.BaseExpression) -> cst.Call | None:
    """`run_folder(...)`, when that project function reads the clock, makes a folder and
    returns a value (the folder's name)."""
    if not isinstance(value, cst.Call):
        return None
    if script.names(value.func) & script.facts.clock_folder_makers:
        return value  # a function of another module of the project, as its summary tells
    fn = script.local_function(value)
    if fn is None:
        return None
    return value if makes_clock_folder(script.calls_in(fn), lambda c: script.names(c.func), fn) else None


def _clock_text(script: Script, value: cst.BaseExpression) -> bool:
    """A clock read made into text: `datetime.now().strftime(...)`, `time.strftime(...)`, an
    f-string or `str()` around one."""
    calls = [value, *script.calls_in(value)] if isinstance(value, cst.Call) else script.calls_in(value)
    if not any(script.is_call_to(c, N.CLOCK) for c in calls):
        return False
    texts = any(N.call_name(c) in {"strftime", "isoformat", "str", "format"} for c in calls if isinstance(c, cst.Call))
    return texts or any(isinstance(n, cst.FormattedString) for n in iter_nodes(value))


def _names_a_path(script: Script, scope: ScopeNode, stmt: cst.BaseStatement) -> bool:
    """Does the value of `stmt` (or a name computed from it) reach a path: a folder made, a
    file opened or saved, `os.path.join`, `Path(...)`?"""
    refs = _derived(script, scope, _target(stmt), stmt)
    return any(
        script.scope_of(call) is scope and script.after(call, stmt)
        and (script.is_call_to(call, N.PATH_SINKS) or N.call_name(call) == "mkdir")
        and any(_reads(arg.value, r) for arg in call.args for r in refs)
        for call in script.calls_in(scope)
    )  # fmt: skip


def schedule_draws(script: Script) -> list[ScheduleDraws]:
    """Per scope, the names bound to values drawn at random that decide the schedule."""
    by_scope: dict[ScopeNode, list[tuple[str, cst.BaseStatement]]] = {}
    for call in script.calls:
        if not script.is_call_to(call, N.RANDOM_VALUES) or not _scalar(script, call):
            continue
        scope = script.scope_of(call)
        stmt = script.statement_line(call)
        top = script.top_statement(call, scope)
        if stmt is None or top is not stmt or not _assigns_one(stmt):
            continue  # drawn inside a loop or a branch, or not kept in a name: per-step randomness
        by_scope.setdefault(scope, []).append((_target(stmt), stmt))
    found = []
    for scope, draws in by_scope.items():
        deciding = {ref: where for ref, stmt in draws if (where := _decides(script, scope, ref, stmt))}
        if not deciding:
            continue
        refs = list(deciding)
        last = max((stmt for ref, stmt in draws if ref in deciding), key=lambda s: _index(script, scope, s))
        first_use = _first_use(script, scope, refs, last) if set(deciding.values()) == {"here"} else None
        shared = first_use is not None and _broadcast(script, scope, refs, first_use)
        found.append(ScheduleDraws(scope, refs, last, first_use, shared))
    return found


def _scalar(script: Script, call: cst.Call) -> bool:
    """A draw of one value: Python's `random`, NumPy's without `size=`/shape, torch's through
    `.item()` (`torch.rand(1).item()`); a tensor or an array of samples is data."""
    names = script.names(call.func)
    if any(n.startswith("random.") for n in names):
        return True
    parent = script.parent(script.parent(call))  # call -> Attribute -> Call for `.item()`
    if isinstance(script.parent(call), cst.Attribute) and script.parent(call).attr.value == "item":
        return isinstance(parent, cst.Call)
    if any(n.startswith("numpy.random.") for n in names):
        return N.keyword(call, "size") is None and (len(N.positional(call)) <= 2 if _bounded(names) else not call.args)
    return False


def _bounded(names: frozenset[str]) -> bool:
    """NumPy draws whose first two arguments are bounds, not a shape (`uniform(low, high)`)."""
    return any(n.rsplit(".", 1)[-1] in {"uniform", "normal", "randint", "choice", "lognormal"} for n in names)


def _assigns_one(stmt: cst.SimpleStatementLine) -> bool:
    small = stmt.body[0] if len(stmt.body) == 1 else None
    return isinstance(small, cst.Assign) and len(small.targets) == 1 and _ref(small.targets[0].target) is not None


def _target(stmt: cst.SimpleStatementLine) -> str:
    return _ref(stmt.body[0].targets[0].target)


def _ref(node: cst.CSTNode) -> str | None:
    """`lr`, `self.lr` or `args.lr`: what a draw is kept in."""
    if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name):
        return f"{node.value.value}.{node.attr.value}"
    return ref_of(node)


def _index(script: Script, scope: ScopeNode, stmt: cst.BaseStatement) -> int:
    return list(script.block_of(scope).body).index(stmt)


def _reads(node: cst.CSTNode, ref: str) -> bool:
    """Does `node` read `ref` (for `args.lr`: also `args` handed on whole)?"""
    if mentions(node, ref) or any(isinstance(n, cst.Attribute) and _ref(n) == ref for n in iter_nodes(node)):
        return True
    owner = ref.partition(".")[0] if "." in ref and not ref.startswith("self.") else None
    return owner is not None and any(
        isinstance(n, cst.Arg) and isinstance(n.value, cst.Name) and n.value.value == owner for n in iter_nodes(node)
    )


def _derived(script: Script, scope: ScopeNode, ref: str, stmt: cst.BaseStatement) -> list[str]:
    """`ref` and the names computed from it after `stmt` in the same block (`steps = epochs * n`)."""
    refs = [ref]
    body = list(script.block_of(scope).body)
    for later in body[body.index(stmt) + 1 :]:
        if isinstance(later, cst.SimpleStatementLine) and _assigns_one(later):
            value = later.body[0].value
            if any(_reads(value, r) for r in refs) and _target(later) not in refs:
                refs.append(_target(later))
    return refs


def _decides(script: Script, scope: ScopeNode, ref: str, stmt: cst.BaseStatement) -> str | None:
    """Where the drawn value reaches a training decision: "here" (after the draw in its own
    scope), "elsewhere" (a function reading the global, a method reading `self.x`), or None."""
    refs = _derived(script, scope, ref, stmt)
    for where in script.scopes_for(ref, scope):
        since = stmt if where is scope else None
        if _decides_in(script, where, refs if where is scope else [ref], since):
            return "here" if where is scope else "elsewhere"
    return None


def _decides_in(script: Script, scope: ScopeNode, refs: list[str], since: cst.CSTNode | None) -> bool:
    """Does code of `scope` (after `since`) use one of `refs` to decide how training goes?"""
    def mine(node: cst.CSTNode) -> bool:
        return script.scope_of(node) is scope and (since is None or script.after(node, since))

    if any(mine(call) and _setting_of(script, call, refs) for call in script.calls_in(scope)):
        return True
    for loop in script.nodes_in(scope, (cst.For, cst.While)):
        if mine(loop) and _trains(script, loop.body):
            bounds = loop.iter if isinstance(loop, cst.For) else loop.test
            if any(_reads(bounds, r) for r in refs):
                return True
    return False


def _setting_of(script: Script, call: cst.Call, refs: list[str]) -> bool:
    """Is one of `refs` a setting of `call`: an optimizer's or scheduler's (not its parameters),
    a DataLoader's batch size, or an argument of a function or class that trains?"""
    names = script.names(call.func)
    if N.is_optimizer(names) or any(n.startswith(N.OPTIMIZER_PREFIX) for n in names):
        args = [a for a in call.args if a.keyword is not None] + N.positional(call)[1:]
    elif names & N.DATALOADER:
        args = [a for a in call.args if a.keyword is not None and a.keyword.value == "batch_size"]
    elif script.local_function(call) in script.training_functions or _trains_object(script, call):
        args = list(call.args)
    else:
        return False
    return any(_reads(arg.value, r) for arg in args for r in refs) or any(
        isinstance(arg.value, cst.Name) and any(r.startswith(arg.value.value + ".") for r in refs) for arg in args
    )


def _trains_object(script: Script, call: cst.Call) -> bool:
    """`Trainer(lr=lr, epochs=epochs)`: a class of the project with a method that trains."""
    cls = script.class_called(call)
    return cls is not None and any(fn in script.training_functions for fn in script.methods(cls).values())


def _trains(script: Script, body: cst.CSTNode) -> bool:
    """Does `body` call backward or a function that trains?"""
    return any(
        (N.call_name(c) == "backward" and N.receiver(c) is not None)
        or script.local_function(c) in script.training_functions
        or _trains_object(script, c)
        for c in script.calls_in(body)
    )


def _first_use(script: Script, scope: ScopeNode, refs: list[str], last: cst.BaseStatement) -> cst.BaseStatement | None:
    """The first statement of the scope's block after `last` that reads one of `refs`."""
    body = list(script.block_of(scope).body)
    return next((s for s in body[body.index(last) + 1 :] if any(_reads(s, r) for r in refs)), None)


def _broadcast(script: Script, scope: ScopeNode, refs: list[str], first_use: cst.BaseStatement) -> bool:
    """Is the first use `shared = [lr, epochs]`, followed by `dist.broadcast_object_list(shared)`?"""
    if not (isinstance(first_use, cst.SimpleStatementLine) and _assigns_one(first_use)):
        return False
    if not isinstance(first_use.body[0].value, cst.List):
        return False
    body = list(script.block_of(scope).body)
    at = body.index(first_use)
    following = body[at + 1] if at + 1 < len(body) else None
    shared = _target(first_use)
    return following is not None and any(
        script.is_call_to(c, N.BROADCAST_OBJECTS) and any(ref_of(a.value) == shared for a in c.args)
        for c in script.calls_in(following)
    )


@dataclass
class ClockInPlace:
    """`run_id = datetime.now().strftime(...)` in a function that then makes folders named by it
    and keeps them on an object (a config class's `__init__`) instead of returning the name: the
    name is shared where it is read, and rank 0 alone makes the folders."""

    scope: cst.FunctionDef
    ref: str
    stmt: cst.SimpleStatementLine  # the clock read, at any depth of the function
    makes: list[cst.SimpleStatementLine]  # `path.mkdir(...)` / `os.makedirs(...)` lines after it
    shared: bool = False  # broadcast already (a converted script)


def clock_names_in_place(script: Script) -> list[ClockInPlace]:
    """Per function of the program that reads the clock as text into a name and makes folders,
    but hands no name back (`makes_clock_folder` covers those: its callers share the name).
    Computed once per analysis (setup_process_group and share_rank0_values both ask)."""
    return script.index.cached("clock_names_in_place", lambda _index: _clock_names_in_place(script))


def _clock_names_in_place(script: Script) -> list[ClockInPlace]:
    found = []
    at_callers = {values.last for values in clock_names(script)}  # shared where they are used
    for scope, assigns in script.assigns.items():
        if not isinstance(scope, cst.FunctionDef):
            continue
        calls = script.calls_in(scope)
        if makes_clock_folder(calls, lambda c: script.names(c.func), scope):
            continue
        for assign in assigns:
            stmt = script.parent(assign)
            if stmt in at_callers or not (
                isinstance(stmt, cst.SimpleStatementLine) and _assigns_one(stmt) and _clock_text(script, assign.value)
            ):
                continue
            makes = [
                line for c in calls
                if script.scope_of(c) is scope and script.after(c, stmt)
                and (script.is_call_to(c, N.MAKEDIRS | N.MKDIR) or N.call_name(c) == "mkdir")
                and not N.is_name(getattr(N.keyword(c, "exist_ok"), "value", None), "True")
                and (line := script.statement_line(c)) is not None and len(line.body) == 1
                and isinstance(line.body[0], cst.Expr) and line.body[0].value is c
            ]  # fmt: skip
            if makes:
                shared = any(script.is_call_to(c, N.BROADCAST_OBJECTS) and script.after(c, stmt) for c in calls)
                found.append(ClockInPlace(scope, _target(stmt), stmt, makes, shared))
    return found


def reaches(script: Script, stmt: cst.CSTNode, scopes: set[cst.FunctionDef], depth: int = 0) -> bool:
    """Does running `stmt` run one of `scopes`: a call of it, of its class (its `__init__`), of
    another method of that class (`Config.from_args(...)`, which builds one), or of a function of
    the program that does, three calls deep at most?"""
    classes = {script.class_of(fn) for fn in scopes} - {None}
    for call in script.calls_in(stmt):
        callee = script.local_function(call) or script.method_of_object(call) or script.project_definition(call.func)
        if callee in scopes or (isinstance(callee, cst.ClassDef) and callee in classes):
            return True
        if isinstance(callee, cst.FunctionDef) and script.class_of(callee) in classes:
            return True
        if isinstance(callee, cst.FunctionDef) and depth < 3 and reaches(script, callee, scopes, depth + 1):
            return True
    return False
