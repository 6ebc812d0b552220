"""Control flow inside one function, resolved once per file: where a path ends (``return``,
``raise``, ``sys.exit()``, ``break``, ``continue``), which statement can run after which, and
which branches run without a process group (``if not dist.is_initialized():``, ``if
world_size > 1:``'s ``else``, after ``assert not args.distributed``, a flag the script asserts
off under DDP). Loops running again are not considered: "after" is one pass through the code."""

from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from ddpify.analysis.index import FileIndex, dotted_name, iter_nodes
from ddpify.analysis.literals import int_value, string_value
from ddpify.analysis.names import DDP_CLASSES, INIT_PROCESS_GROUP, SPAWN

FUNCTION, LOOP = "function", "loop"  # how far an ending statement sends control
_EXITS = frozenset({"sys.exit", "exit", "quit", "os._exit", "os.abort", "builtins.exit", "builtins.quit"})
_SEQUENCES = (cst.Module, cst.IndentedBlock, cst.SimpleStatementSuite, cst.SimpleStatementLine)
_SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)
DISTRIBUTED_TEST = re.compile(
    r"(distributed|\bddp\b|is_initialized|(world|my|group|comm)_size\s*>\s*1|\bis_dist|num_gpus\s*>\s*1|\bworld_size\s*!=\s*1"
    r"|rank\s*!=\s*-1"  # `local_rank != -1`: the old launcher's "distributed"
    r"|hasattr\(\s*[\w.]+\s*,\s*['\"]module['\"]\s*\)"  # `hasattr(model, "module")`: the model is wrapped
    r"|\[\s*['\"](dist|use_dist|use_ddp)['\"]\s*\])",  # `opt['dist']`: a flag kept in a dict
    re.IGNORECASE,
)
_AVAILABLE = re.compile(r"^[\w.]*is_available\(\)$")  # `dist.is_available()`: true wherever a group can be
_SINGLE_TEST = re.compile(
    r"((world|group|comm)_size\s*((==|<=)\s*1|<\s*2)\b|num_gpus\s*((==|<=)\s*1|<\s*2)\b|local_rank\s*==\s*-1|\brank\s*==\s*-1)",
    re.IGNORECASE,
)


class Flow:
    """Path ends, reach and distributed/single-process branches over one file's index."""

    def __init__(self, index: FileIndex) -> None:
        self.index = index
        self._ends: dict[cst.CSTNode, Optional[str]] = {}
        self._off_flags: Optional[frozenset[str]] = None

    # where paths end ------------------------------------------------------------------------------
    def ends(self, stmt: cst.CSTNode) -> Optional[str]:
        """``FUNCTION`` when running `stmt` always leaves its function (return, raise, exit),
        ``LOOP`` when it always leaves the loop's pass (break, continue), else None."""
        if stmt not in self._ends:
            self._ends[stmt] = None  # a statement never ends through itself
            self._ends[stmt] = self._compute_end(stmt)
        return self._ends[stmt]

    def _compute_end(self, stmt: cst.CSTNode) -> Optional[str]:
        if isinstance(stmt, (cst.Return, cst.Raise)):
            return FUNCTION
        if isinstance(stmt, (cst.Break, cst.Continue)):
            return LOOP
        if isinstance(stmt, cst.Expr) and isinstance(stmt.value, cst.Call):
            return FUNCTION if self.index.qnames(stmt.value.func) & _EXITS or dotted_name(stmt.value.func) in _EXITS else None
        if isinstance(stmt, cst.Assert):
            return FUNCTION if isinstance(stmt.test, cst.Name) and stmt.test.value == "False" else None
        if isinstance(stmt, _SEQUENCES) or isinstance(stmt, cst.Else):
            return self.block_ends(stmt)
        if isinstance(stmt, cst.With):
            return self.block_ends(stmt.body)
        if isinstance(stmt, cst.If):
            if stmt.orelse is None:
                return None
            return _weakest(self.block_ends(stmt.body), self.ends(stmt.orelse))
        if isinstance(stmt, cst.Try):
            if stmt.finalbody is not None and self.block_ends(stmt.finalbody.body):
                return self.block_ends(stmt.finalbody.body)
            main = self.block_ends(stmt.body) or (self.block_ends(stmt.orelse.body) if stmt.orelse is not None else None)
            for handler in stmt.handlers:
                main = _weakest(main, self.block_ends(handler.body))
            return main
        return None

    def block_ends(self, block: cst.CSTNode) -> Optional[str]:
        """The end of the first statement of a block (or an `else`) that always ends."""
        if isinstance(block, cst.Else):
            block = block.body
        elif isinstance(block, cst.If):  # `elif`
            return self.ends(block)
        for stmt in getattr(block, "body", ()):
            end = self.ends(stmt)
            if end:
                return end
        return None

    def on_exit_path(self, node: cst.CSTNode, returns: bool = True) -> bool:
        """Is `node` in a branch that then leaves its function: an error or no-work path
        (`if not files: print("nothing to do"); return`, `except E: print(e); sys.exit(1)`)?
        With `returns=False` only a `raise` or an exit counts."""
        child = node
        for p in self.index.ancestors(node):
            if isinstance(p, _SCOPES):
                return False
            if isinstance(p, cst.IndentedBlock) and not isinstance(child, cst.BaseSuite):
                owner = self.index.parent(p)
                if not isinstance(owner, (cst.If, cst.Else, cst.ExceptHandler, cst.FunctionDef)):
                    return False
                returns = returns and not isinstance(owner, cst.FunctionDef)  # a function's own `return` is its end, not a way out
                body = list(p.body)
                for stmt in body[body.index(child) :] if child in body else ():
                    end = self.ends(stmt)
                    if end == LOOP:
                        return False
                    if end == FUNCTION:
                        return returns or not any(isinstance(n, cst.Return) for n in iter_nodes(stmt))
                return False
            child = p
        return False

    def in_error_handler(self, node: cst.CSTNode, _depth: int = 0) -> bool:
        """Is `node` in an `except` handler of its function (`except Exception as e: print(e)`),
        or in a function only such handlers call (`display_and_save_batch(batch)` before `raise`):
        this process's own failure report?"""
        for p in self.index.ancestors(node):
            if isinstance(p, cst.ExceptHandler):
                return True
            if isinstance(p, cst.FunctionDef):
                sites = self.index.call_sites(p) if _depth < 2 else []
                return bool(sites) and all(self.in_error_handler(s.node, _depth + 1) for s in sites)
            if isinstance(p, _SCOPES):
                return False
        return False

    # reach ----------------------------------------------------------------------------------------
    def reaches(self, a: cst.CSTNode, b: cst.CSTNode) -> bool:
        """Can `b` run after `a` in one pass through their function: same function, later in the
        source, not in the other branch of an `if`, and no statement between them that always
        leaves (a `return` after `a` in its branch, a `raise`, `sys.exit()`, a `break` out of the
        loop `b` is in)?"""
        index = self.index
        if index.enclosing_func(a) is not index.enclosing_func(b) or a is b:
            return False
        start = index.source_order()[0]
        if start[a] >= start[b] or index.exclusive(a, b):
            return False
        holders_of_b = set(index.ancestors(b))
        if any(isinstance(p, (cst.Return, cst.Raise)) and p not in holders_of_b for p in index.ancestors(a)):
            return False  # `return helper()`: the path leaves with `a`'s own statement
        leaving_loop: Optional[cst.CSTNode] = None  # a `break`/`continue` sent control past this loop
        in_try = self._in_try(a)
        child = a
        for p in index.ancestors(a):
            if p in holders_of_b:  # the first node holding both: the rest is the way down to `b`
                if leaving_loop is not None:
                    return False
                if isinstance(p, cst.Try) and child is p.body:  # an exception on the way reaches its handler
                    return not (self._lookups_done(p, a, holders_of_b) or self._last_in_try(p, a, holders_of_b))
                if isinstance(p, _SEQUENCES):
                    return self._path_down(p, child, b, in_try)
                return self._enters(p, b, in_try)
            if isinstance(p, _SCOPES):
                return False
            if isinstance(p, (cst.For, cst.While)) and p is leaving_loop:
                leaving_loop = None  # out of the loop: go on after it
            if leaving_loop is None and isinstance(p, _SEQUENCES):
                end = self._first_end_after(p, child, in_try)
                if end == FUNCTION:
                    return False
                if end == LOOP:
                    leaving_loop = next((q for q in index.ancestors(p) if isinstance(q, (cst.For, cst.While))), None)
                    if leaving_loop is None:
                        return False
            child = p
        return False

    def _lookups_done(self, try_: cst.Try, a: cst.CSTNode, holders_of_b: set) -> bool:
        """`try: rank = int(os.environ["RANK"]); init_process_group("nccl") / except KeyError:
        init_process_group(..., world_size=1)`: the handler holding `b` catches only a failed
        lookup, and no lookup (a subscript) is left from `a` to the end of the `try`: once `a`
        runs, that handler cannot. The two are alternatives (launched, or not)."""
        handler = next((h for h in try_.handlers if h in holders_of_b), None)
        if handler is None or try_.finalbody in holders_of_b or handler.type is None:
            return False
        caught = handler.type.elements if isinstance(handler.type, cst.Tuple) else [handler.type]
        names = {self.index.code(c.value if isinstance(c, cst.Element) else c) for c in caught}
        if not names or not names <= {"KeyError", "IndexError", "LookupError"}:
            return False
        body, above = list(try_.body.body), set(self.index.ancestors(a))
        top = next((s for s in body if a is s or s in above), None)
        rest = [a] + body[body.index(top) + 1 :] if top is not None else body
        return not any(isinstance(n, cst.Subscript) for stmt in rest for n in iter_nodes(stmt))

    def _last_in_try(self, try_: cst.Try, a: cst.CSTNode, holders_of_b: set) -> bool:
        """`try: init_process_group(..., device_id=d) / except TypeError: init_process_group(...)`:
        `a` is the whole last statement of the `try`, so its handler (holding `b`) runs only when
        `a` itself failed: `b` never follows a completed `a`."""
        if not any(h in holders_of_b for h in try_.handlers) or try_.finalbody in holders_of_b:
            return False
        last = try_.body.body[-1] if try_.body.body else None
        small = last.body[0] if isinstance(last, cst.SimpleStatementLine) and len(last.body) == 1 else None
        value = small.value if isinstance(small, (cst.Expr, cst.Assign)) else None
        return value is a

    def _in_try(self, node: cst.CSTNode) -> bool:
        """Is `node` in the body of a `try` of its function (a `raise` there may be caught)?"""
        child = node
        for p in self.index.ancestors(node):
            if isinstance(p, _SCOPES):
                return False
            if isinstance(p, cst.Try) and child is p.body:
                return True
            child = p
        return False

    def _first_end_after(self, seq: cst.CSTNode, child: cst.CSTNode, in_try: bool) -> Optional[str]:
        body = list(seq.body)
        rest = body[body.index(child) + 1 :] if child in body else []
        for stmt in rest:
            end = self._end_here(stmt, in_try)
            if end:
                return end
        return None

    def _end_here(self, stmt: cst.CSTNode, in_try: bool) -> Optional[str]:
        """A statement's end, where a `raise` or exit inside a `try` may be caught (so not an end)."""
        end = self.ends(stmt)
        if end == FUNCTION and in_try and any(isinstance(n, (cst.Raise, cst.Call)) for n in iter_nodes(stmt)):
            return None
        return end

    def _path_down(self, seq: cst.CSTNode, child: cst.CSTNode, b: cst.CSTNode, in_try: bool) -> bool:
        """From statement `child` of `seq` down to `b`: no statement in between always ends."""
        body = list(seq.body)
        i = body.index(child) if child in body else -1
        holders = set(self.index.ancestors(b))
        for stmt in body[i + 1 :]:
            if stmt is b:
                return True
            if stmt in holders:
                return self._enters(stmt, b, in_try)
            if self._end_here(stmt, in_try):
                return False
        return False

    def _enters(self, node: cst.CSTNode, b: cst.CSTNode, in_try: bool) -> bool:
        """Does control entering compound `node` get to `b` inside it (no ending statement before
        `b` in any block on the way down)?"""
        path = []
        for p in self.index.ancestors(b):
            if p is node:
                break
            path.append(p)
        child = b
        for p in path:
            if isinstance(p, _SEQUENCES):
                body = list(p.body)
                if child in body and any(self._end_here(s, in_try) for s in body[: body.index(child)]):
                    return False
            child = p
        return True

    def dominates(self, stmt: cst.CSTNode, node: cst.CSTNode) -> bool:
        """Does `stmt` run on every path to `node`: it reaches `node`, from a block that holds
        `node` too (not a branch of its own)?"""
        if not self.reaches(stmt, node):
            return False
        block = next((p for p in self.index.ancestors(stmt) if isinstance(p, (cst.IndentedBlock, cst.Module))), None)
        return block is not None and any(p is block for p in self.index.ancestors(node))

    # single-process branches ----------------------------------------------------------------------
    def single_process(self, node: cst.CSTNode) -> bool:
        """Does `node` run only where no process group is (the branch of `if args.distributed:`
        that runs without one, the code after `assert not dist.is_initialized()` or `assert
        world_size == 1`, a branch on a flag the script asserts off under DDP)?"""
        child = node
        for p in self.index.ancestors(node):
            if isinstance(p, (cst.If, cst.IfExp)):
                side = self._test_side(p.test)
                if side and (child is p.body) == (side > 0):
                    return True
            if isinstance(p, (cst.IndentedBlock, cst.Module)) and not isinstance(child, cst.BaseSuite):
                body = list(p.body)
                if child in body and any(self._asserts_single(s) for s in body[: body.index(child)]):
                    return True
            if isinstance(p, _SCOPES):
                return False
            child = p
        return False

    def _test_side(self, test: cst.BaseExpression) -> int:
        """-1: the test is true only under a group (its `else` runs without); +1: true only
        without a group; 0: neither."""
        if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
            return -self._test_side(test.expression)
        flag, sign = _truth_of(test)
        if flag is not test:
            return self._test_side(flag) * sign  # `if (parallel == True):`
        code = self.index.code(test)
        if _SINGLE_TEST.search(code):
            return 1
        if DISTRIBUTED_TEST.search(code) and not isinstance(test, cst.BooleanOperation):
            return -1
        if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
            parts = [p for p in (test.left, test.right) if not _AVAILABLE.search(self.index.code(p))]
            return self._test_side(parts[0]) if len(parts) == 1 else 0  # `dist.is_available() and dist.is_initialized()`
        if isinstance(test, cst.Comparison):
            return self._equality_side(test)
        name = dotted_name(test)
        if name in self.flags_off_under_ddp:
            return 1
        if name is not None and (name in self.group_switches or any(name.endswith("." + s) for s in self._switch_fields)):
            return -1  # (`self.args.multi_gpu` for the launcher's `args.multi_gpu`)
        return self._flag_side(name) if name is not None else 0

    def _equality_side(self, test: cst.Comparison) -> int:
        """`device == torch.device("cpu")` where the group starts (or the model is wrapped) under
        `device == torch.device("cuda")`: another value of the switch, true only without the
        group (+1); the switch's own value, true only with it (-1); `!=` the other way round."""
        comp = test.comparisons[0] if len(test.comparisons) == 1 else None
        name = dotted_name(test.left)
        if comp is None or name is None or not isinstance(comp.operator, (cst.Equal, cst.NotEqual)):
            return 0
        values = {s.split(" == ", 1)[1] for s in self.group_switches if s.startswith(name + " == ")}
        if not values:
            return 0
        same = self.index.code(comp.comparator) in values
        if isinstance(comp.operator, cst.Equal):
            return -1 if same else 1
        return 1 if same else 0

    @property
    def _switch_fields(self) -> frozenset[str]:
        """The switches' attribute chains without their first name (`args.multi_gpu` -> `multi_gpu`)."""
        found = self.__dict__.get("_fields")
        if found is None:
            found = self.__dict__["_fields"] = frozenset(s.split(".", 1)[1] for s in self.group_switches if "." in s and " == " not in s)
        return found

    @property
    def group_switches(self) -> frozenset[str]:
        """The flags under which the program starts its process group or wraps its model (`if
        cfg.MODEL.DIST_TRAIN: dist.init_process_group(...)`, `if device == torch.device("cuda"):
        model = DDP(...)`): here, in the modules this file imports, and in the
        programs that import it (`index.importers`)."""
        found = self.__dict__.get("_switches")
        if found is None:
            found = set(group_switches(self.index))
            found = found.union(*map(group_switches, self.index.importers()))
            found = self.__dict__["_switches"] = frozenset(found)
        return found

    def _flag_side(self, name: str) -> int:
        """A flag bound to such a test (`self.is_ddp = dist.is_available() and dist.is_initialized()`):
        the test's side, when every binding of the name agrees."""
        sides = self.__dict__.setdefault("_flag_sides", {})
        if name not in sides:
            sides[name] = 0  # (a flag bound from itself: not known)
            found = {self._test_side(b.value) for b in self.index.assignments if b.dotted == name}
            sides[name] = found.pop() if len(found) == 1 else 0
        return sides[name]

    def dead(self, node: cst.CSTNode) -> bool:
        """Is `node` in the body of an `if` whose flag the function binds only to false constants
        (`is_distributed, world_size = (False, 1)  # get_distrib_config()`, then `if is_distributed:`)?"""
        child = node
        for p in self.index.ancestors(node):
            if isinstance(p, cst.If) and child is p.body and isinstance(p.test, cst.Name):
                func = self.index.enclosing_func(p)
                if func is not None and p.test.value in self.index.param_names(func):
                    return False  # the callers decide
                values = _values_bound(func or self.index.root_of(p), p.test.value)
                if values and all(_false_constant(v) for v in values):
                    return True
            if isinstance(p, _SCOPES):
                return False
            child = p
        return False

    def true_without_group(self, test: cst.BaseExpression) -> bool:
        """Is the test true only in a run without a process group (`not args.distributed`, `world_size
        == 1`, `not cfg.multi_gpu` where the program spawns its workers under `if cfg.multi_gpu:`)?"""
        return self._test_side(test) > 0

    def true_with_group_only(self, test: cst.BaseExpression) -> bool:
        """Is the test true only in a run with a process group (`if args.distributed:`)? Its
        `else` (or what follows an `if` without one, for a run that skips it) has no group."""
        return self._test_side(test) < 0

    def mode_test(self, test: cst.BaseExpression) -> bool:
        """Does the test ask about the run's mode, the same answer on every rank (`if
        local_rank != -1:`, `if args.rank is not None:`, `if args.distributed:`)?"""
        if self._test_side(test) or _presence_only(test) or _against_strings(test):
            return True
        return bool(_MODE_COMPARISON.search(self.index.code(test)))

    def _asserts_single(self, stmt: cst.CSTNode) -> bool:
        """`assert not args.distributed`, or `if self.ddp: print(...); exit(0)` (leaving under a group):
        the code after it runs without one."""
        if isinstance(stmt, cst.If) and stmt.orelse is None:
            return self._test_side(stmt.test) < 0 and self.block_ends(stmt.body) == FUNCTION
        if not isinstance(stmt, cst.SimpleStatementLine):
            return False
        return any(isinstance(s, cst.Assert) and self._test_side(s.test) > 0 for s in stmt.body)

    @property
    def flags_off_under_ddp(self) -> frozenset[str]:
        """Flags the script asserts false when distributed: ``if LOCAL_RANK != -1: assert not
        opt.evolve, "--evolve is not compatible with DDP"``."""
        if self._off_flags is None:
            found = set()
            for node in iter_nodes(self.index.module):
                if isinstance(node, cst.If) and _UNDER_GROUP.search(self.index.code(node.test)):
                    for small in _small_statements(node.body):
                        test = small.test if isinstance(small, cst.Assert) else None
                        if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
                            found.add(dotted_name(test.expression))
            self._off_flags = frozenset(found - {None})
        return self._off_flags


def _false_constant(value: cst.BaseExpression) -> bool:
    return isinstance(value, cst.Name) and value.value in ("False", "None") or isinstance(value, cst.Integer) and int_value(value) == 0


def _values_bound(scope: cst.CSTNode, name: str) -> list[cst.BaseExpression]:
    """The values `name` is given in this scope (not in nested ones): `name = v`, and `a, name =
    (x, v)` element by element; a value that cannot be read (`a, name = f()`) is the call itself."""
    found: list[cst.BaseExpression] = []

    class _Bindings(cst.CSTVisitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is scope

        def visit_Assign(self, node: cst.Assign) -> None:
            for t in node.targets:
                if isinstance(t.target, cst.Name) and t.target.value == name:
                    found.append(node.value)
                elif isinstance(t.target, (cst.Tuple, cst.List)):
                    names = [e.value for e in t.target.elements]
                    for i, target in enumerate(names):
                        if isinstance(target, cst.Name) and target.value == name:
                            value = node.value
                            same = isinstance(value, (cst.Tuple, cst.List)) and len(value.elements) == len(names)
                            found.append(value.elements[i].value if same else value)

        def visit_AugAssign(self, node: cst.AugAssign) -> None:
            if isinstance(node.target, cst.Name) and node.target.value == name:
                found.append(node.value)

    scope.visit(_Bindings())
    return found


def group_switches(index: FileIndex) -> frozenset[str]:
    """The flags (a name or attribute chain, or a name's comparison with one value) whose `if`
    starts the file's process group, spawns its workers or wraps the model in DDP (`if
    args.multi_gpu: mp.spawn(...)`, `if device == torch.device("cuda"): model = DDP(model)`)."""
    def switches(i: FileIndex) -> frozenset[str]:
        found = set()
        for ci in i.calls_to(*INIT_PROCESS_GROUP, *SPAWN, *DDP_CLASSES):
            child = ci.node
            for p in i.ancestors(ci.node):
                if isinstance(p, cst.If) and child is p.body:
                    flag, sign = _truth_of(p.test)
                    name = (dotted_name(flag) or _equality(i, flag)) if sign > 0 else None
                    if name is not None:
                        found.add(name)
                    break
                if isinstance(p, _SCOPES):
                    break
                child = p
        return frozenset(found)

    return index.cached("group_switches", switches)


def _equality(index: FileIndex, test: cst.BaseExpression) -> Optional[str]:
    """`device == torch.device("cuda")` as the switch "device == torch.device("cuda")": a name
    compared with one value (the group starts, or the model is wrapped, only for that value)."""
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1 and isinstance(test.comparisons[0].operator, cst.Equal):
        name = dotted_name(test.left)
        if name is not None:
            return f"{name} == {index.code(test.comparisons[0].comparator)}"
    return None


def _truth_of(test: cst.BaseExpression) -> tuple[cst.BaseExpression, int]:
    """(flag, +1) for `flag == True` or `flag is True`, (flag, -1) for `flag == False` or `flag is
    not True`; (the test itself, +1) otherwise."""
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        comp = test.comparisons[0]
        truth = comp.comparator.value if isinstance(comp.comparator, cst.Name) else None
        if truth in ("True", "False") and isinstance(comp.operator, (cst.Equal, cst.Is, cst.NotEqual, cst.IsNot)):
            same = isinstance(comp.operator, (cst.Equal, cst.Is)) == (truth == "True")
            return test.left, 1 if same else -1
    return test, 1


def _small_statements(block: cst.BaseSuite) -> list[cst.BaseSmallStatement]:
    """The simple statements directly in a block (`x = 1; assert y` lines, or a one-line suite)."""
    if isinstance(block, cst.SimpleStatementSuite):
        return list(block.body)
    return [small for stmt in block.body if isinstance(stmt, cst.SimpleStatementLine) for small in stmt.body]


_MODE_COMPARISON = re.compile(r"(!=|==|>=|<|>)\s*-1\b|\bis\s+(not\s+)?None\b|>=\s*0\b")
_UNDER_GROUP = re.compile(r"(rank\s*!=\s*-1|^\s*(args\.|opt\.|self\.)?(distributed|ddp|is_distributed)\s*$|world_size\s*>\s*1)", re.IGNORECASE)


def _weakest(x: Optional[str], y: Optional[str]) -> Optional[str]:
    """Both branches end: control leaves as far as the nearer of the two sends it."""
    if not x or not y:
        return None
    return LOOP if LOOP in (x, y) else FUNCTION


def flow(index: FileIndex) -> Flow:
    """The file's control-flow facts, made once per index."""
    return index.cached("flow", Flow)


def env_presence(node: cst.CSTNode) -> bool:
    """`"RANK" in os.environ`: whether a launcher set the variable, the same answer on every rank
    (a test of the run's mode, not of the rank's value)."""
    return (
        isinstance(node, cst.Comparison) and len(node.comparisons) == 1
        and isinstance(node.comparisons[0].operator, (cst.In, cst.NotIn))
        and string_value(node.left) is not None and dotted_name(node.comparisons[0].comparator) in ("os.environ", "environ")
    )  # fmt: skip


def _against_strings(test: cst.BaseExpression) -> bool:
    """`rank not in ("cpu", "cuda")`, `device == "cpu"`: a rank is a number; a value compared with
    strings only is the run's mode (one process on "cpu"/"cuda", or a spawned worker), the same on
    every rank."""
    if not isinstance(test, cst.Comparison):
        return False
    for comp in test.comparisons:
        right = comp.comparator
        items = [el.value for el in right.elements] if isinstance(right, (cst.Tuple, cst.List, cst.Set)) else [right]
        if not items or not all(isinstance(i, (cst.SimpleString, cst.ConcatenatedString)) for i in items):
            return False
    return True


def _presence_only(test: cst.BaseExpression) -> bool:
    """A test made only of `"X" in os.environ` parts (with `and`, `or`, `not`)."""
    if isinstance(test, cst.BooleanOperation):
        return _presence_only(test.left) and _presence_only(test.right)
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return _presence_only(test.expression)
    return env_presence(test)
