"""Which code runs on rank 0 only: ``if rank == 0``, ``if dist.get_rank() == 0``, ``if local_rank
in (-1, 0)``, ``if is_main_process():``, ``is_main = rank == 0; if is_main:``, ``if rank != 0:
return`` guards, and functions only called from such code."""

from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.flow import env_presence, flow
from ddpify.analysis.index import Binding, FileIndex, Func, dotted_name, iter_nodes, last_name
from ddpify.analysis.literals import int_value, is_false, string_value

MAIN_PROCESS_RE = re.compile(
    r"^_?(is_?)?(main|master|primary|chief|leader|rank_?0|rank_?zero|global_?zero|local_?zero|local_?(main|master))"
    r"(_?(process|proc|rank|worker|node|host))?$",
    re.IGNORECASE,
)
_MAIN = r"(master|main|rank_?0|rank_?zero|leader|primary|global_?zero)(_?process)?"
_RANK0_DECORATOR = re.compile(rf"^(on_{_MAIN}|{_MAIN}_?only)$", re.IGNORECASE)
# `@master_only`, `@rank_zero_only`, `@main_process_only`, `@on_main_process` (`@main`, `@hydra.main`: entry points)
RANK_NAMES = frozenset({"gpu_id", "gpu", "local_gpu", "device_id", "gpu_idx", "process_index", "proc_id"})
RANK_ENV = frozenset({"RANK", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"})
# "rank", not "ranks" or "ranking" (`load_on_all_ranks`, `num_ranks`, `ranking_loss`: a flag, a count, a metric)
RANK_WORD = re.compile(r"rank(?!s|ing)", re.IGNORECASE)
RANK_TEXT = re.compile(r"rank(?!s|ing)|gpu_id|\bgpu\b|device_id|local_gpu|process_index|getpid", re.IGNORECASE)
_RANK_KEY = re.compile(r"^(local_|global_|node_|dist_)?rank$", re.IGNORECASE)
_NOT_MULTI_PROCESS = re.compile(r"(is_initialized|is_available|distributed|ddp|is_dist)", re.IGNORECASE)


class RankAnalysis:
    """Rank-0 reasoning over one file's index; answers are cached."""

    def __init__(self, index: FileIndex) -> None:
        self.index = index
        self._rank0_cache: dict[cst.CSTNode, bool] = {}
        self._rank0_func: dict[Func, bool] = {}
        self._guard_index: dict[cst.CSTNode, int] = {}
        self._exit_index: dict[cst.CSTNode, int] = {}
        self._flags: Optional[list[Binding]] = None
        self._resolving: set = set()  # flags being resolved (a flag bound from itself)
        self._reads_rank: dict[cst.CSTNode, bool] = {}
        self._rank_names: Optional[set[str]] = None
        self._per_rank_names: Optional[set[tuple[Optional[Func], str]]] = None
        self._rank0_names: Optional[frozenset[tuple[Optional[Func], str]]] = None

    def is_rank_expr(self, e: cst.BaseExpression) -> bool:
        """``rank``, ``dist.get_rank()``, ``int(os.environ["RANK"])``, ``args.rank % ngpus``..."""
        if isinstance(e, cst.Call):
            info = self.index.call_info.get(e)
            if info is not None and info.qnames & N.RANK_CALLS:
                return True
            if last_name(e.func) == "int" and e.args:
                return self.is_rank_expr(e.args[0].value)
            if last_name(e.func) in ("get", "getenv") and e.args:  # os.environ.get("RANK", 0)
                key = string_value(e.args[0].value)
                return key is not None and key in RANK_ENV
            return bool(RANK_WORD.search(last_name(e.func) or ""))
        if isinstance(e, cst.Subscript):  # os.environ["RANK"], opt["rank"] (a rank kept in a dict)
            if len(e.slice) == 1 and isinstance(e.slice[0].slice, cst.Index):
                s = string_value(e.slice[0].slice.value)
                return s is not None and ("RANK" in s or bool(_RANK_KEY.match(s)))
            return False
        if isinstance(e, cst.BinaryOperation) and isinstance(e.operator, cst.Modulo):
            return self.is_rank_expr(e.left)
        n = last_name(e) if isinstance(e, (cst.Name, cst.Attribute)) else None
        if n is not None and (RANK_WORD.search(n) or n.lower() in RANK_NAMES):
            return not (isinstance(e, cst.Name) and self._presence_flag(e.value))
        return isinstance(e, cst.Name) and self._bound_to_rank(e.value)

    def _presence_flag(self, name: str) -> bool:
        """`has_local_rank = hasattr(params, "local_rank")`: a name the file binds only to whether
        something exists (`hasattr`, `isinstance`, `"LOCAL_RANK" in os.environ`, a bool), the same
        on every rank, whatever its name says."""
        values = [b.value for b in self.index.assignments if b.dotted == name]
        return bool(values) and all(_presence_value(v) for v in values)

    def _bound_to_rank(self, name: str) -> bool:
        """`me = dist.get_rank()` (or `me, world = dist.get_rank(), ...`): a name the file binds to
        the rank, whatever it is called."""
        if self._rank_names is None:
            self._rank_names = set()
            for b in self.index.assignments:
                if "." not in b.dotted and isinstance(b.value, cst.Call) and not isinstance(b._node, (cst.Tuple, cst.List)):
                    info = self.index.call_info.get(b.value)
                    if info is not None and info.qnames & N.RANK_CALLS:
                        self._rank_names.add(b.dotted)
        return name in self._rank_names

    def per_rank(self, expr: cst.BaseExpression, func: Optional[Func] = None) -> bool:
        """Does this value differ by rank: it reads the rank, the local rank or the process
        (``f"[rank {rank}]"``, ``os.getpid()``), or a name bound to such a value, however
        far back (``device = torch.device(f"cuda:{local_rank}")``, ``out = f"run/{device}"``)?
        `func` is the function whose local names `expr` reads."""
        if RANK_TEXT.search(self.index.code(expr)):
            return True
        names = self.per_rank_names
        return any((func, n) in names or (None, n) in names for n in _dotted_names_in(expr))

    @property
    def per_rank_names(self) -> set[tuple[Optional[Func], str]]:
        """(function, name) pairs bound to a per-rank identifier (a string, number, path or
        device built from the rank); module names and attribute chains (``self.device``,
        ``args.gpu``) with function None. Found once, to a fixed point. A model moved to a
        per-rank device is not one: its contents are the same on every rank."""
        if self._per_rank_names is None:
            found: set[tuple[Optional[Func], str]] = set()
            pending = [b for b in self.index.assignments if _identifier_like(b.value) or self._local_call(b.value)]
            returns = [r for r in iter_nodes(self.index.module) if isinstance(r, cst.Return) and r.value is not None]

            def per_rank(e: cst.BaseExpression, f: Optional[Func]) -> bool:
                return bool(RANK_TEXT.search(self.index.code(e))) or any(
                    (f, n) in found or (None, n) in found for n in _dotted_names_in(e)
                )

            for _ in range(6):
                more = set()
                giving = {f for r in returns if (f := self.index.enclosing_func(r)) is not None and per_rank(r.value, f)}
                for b in pending:
                    key = (None if b.func is None or "." in b.dotted else b.func, b.dotted)
                    if key in found:
                        continue
                    callees = self._local_call(b.value)
                    if callees and any(f in giving for f in callees) or (
                        not callees and (RANK_TEXT.search(b.dotted) or per_rank(b.value, b.func))
                    ):
                        more.add(key)
                if not more:
                    break
                found |= more
            self._per_rank_names = found
        return self._per_rank_names

    def _local_call(self, value: cst.CSTNode) -> list[Func]:
        """The file's functions a call runs (``device = start_group()``), if it is one."""
        info = self.index.call_info.get(value) if isinstance(value, cst.Call) else None
        return self.index.local_callees(info) if info is not None else []

    def _is_single_process(self, e: cst.BaseExpression) -> bool:
        """Operands of ``or`` that are false whenever several processes run (also such operands
        joined by ``or``: `not dist.is_available() or not dist.is_initialized()`)."""
        if isinstance(e, cst.BooleanOperation) and isinstance(e.operator, cst.Or):
            return self._is_single_process(e.left) and self._is_single_process(e.right)
        if isinstance(e, cst.UnaryOperation) and isinstance(e.operator, cst.Not):
            inner = e.expression
            target = inner.func if isinstance(inner, cst.Call) else inner
            if _NOT_MULTI_PROCESS.search(self.index.code(target)):
                return True
        if isinstance(e, cst.Comparison) and len(e.comparisons) == 1:
            n = last_name(e.left) or ""
            v = int_value(e.comparisons[0].comparator)
            op = e.comparisons[0].operator
            if isinstance(op, cst.Equal) and v == -1 and self.is_rank_expr(e.left):
                return True  # `local_rank == -1`: the old launcher's "not distributed"
            if "world_size" in n.lower() and (
                (isinstance(op, cst.Equal) and v == 1) or (isinstance(op, cst.LessThanEqual) and v == 1)
            ):
                return True
        return flow(self.index).true_without_group(e)  # `not self.args.multi_gpu`: the launcher's switch off

    def rank_test(self, e: cst.BaseExpression) -> int:
        """+1: true only on rank 0; -1: true only off rank 0; 0: don't know."""
        if isinstance(e, cst.UnaryOperation) and isinstance(e.operator, cst.Not):
            return -self.rank_test(e.expression)
        if isinstance(e, cst.BooleanOperation):
            left, right = self.rank_test(e.left), self.rank_test(e.right)
            if isinstance(e.operator, cst.And):
                return 1 if 1 in (left, right) else (-1 if -1 in (left, right) else 0)
            # or
            ok_l = left == 1 or self._is_single_process(e.left)
            ok_r = right == 1 or self._is_single_process(e.right)
            return 1 if (ok_l and ok_r and 1 in (left, right)) else 0
        if isinstance(e, cst.Comparison) and len(e.comparisons) == 1 and _is_none(e.comparisons[0].comparator):
            field = isinstance(e.left, cst.Attribute) and e.left.attr.value in self.rank0_fields  # `cfg.ckpt_dir is not None`
            if isinstance(e.comparisons[0].operator, (cst.Is, cst.IsNot)) and (self._rank0_only(e.left) or field):
                return 1 if isinstance(e.comparisons[0].operator, cst.IsNot) else -1  # `if saver is not None:`
        if isinstance(e, cst.Comparison) and len(e.comparisons) == 1:
            comp = e.comparisons[0]
            op, right, left = comp.operator, comp.comparator, e.left
            if int_value(left) is not None and isinstance(op, (cst.Equal, cst.NotEqual, cst.Is, cst.IsNot)):
                left, right = right, left
            if not self.is_rank_expr(left):
                return 1 if isinstance(op, cst.Equal) and self._field_equals_value(left, right) else 0
            v = int_value(right)
            if isinstance(op, (cst.In, cst.NotIn)) and isinstance(right, (cst.Tuple, cst.List, cst.Set)):
                values = {int_value(el.value) for el in right.elements}
                if values and values <= {0, -1} and 0 in values:
                    return 1 if isinstance(op, cst.In) else -1
                return 0
            if v is None:
                return 0
            if isinstance(op, cst.Is):
                op = cst.Equal()  # `self.rank is 0`: CPython's small ints make it `==`
            elif isinstance(op, cst.IsNot):
                op = cst.NotEqual()
            if isinstance(op, cst.Equal) and v == 0 or isinstance(op, cst.LessThan) and v == 1:
                return 1
            if isinstance(op, cst.LessThanEqual) and v == 0:  # `local_rank <= 0`: -1 when not distributed
                return 1
            if isinstance(op, cst.NotEqual) and v == 0 or isinstance(op, cst.GreaterThan) and v == 0:
                return -1
            if isinstance(op, cst.GreaterThanEqual) and v == 1:
                return -1
            return 0
        if isinstance(e, cst.Call) and _is_bool_of_one(e):
            return self.rank_test(e.args[0].value)  # `bool(is_main_process and is_logging_enabled)`
        if isinstance(e, cst.Call):
            n = last_name(e.func) or ""
            return 1 if MAIN_PROCESS_RE.match(n) or self._false_off_rank0(e) or self._returns_rank0_test(e) else 0
        if isinstance(e, cst.Subscript) and len(e.slice) == 1 and isinstance(e.slice[0].slice, cst.Index):
            key = string_value(e.slice[0].slice.value)
            return 1 if key is not None and key in self.rank0_fields else 0
        if isinstance(e, (cst.Name, cst.Attribute)):
            n = last_name(e) or ""
            if MAIN_PROCESS_RE.match(n) or self._rank0_only(e):
                return 1
            if isinstance(e, cst.Attribute) and n in self.rank0_fields:
                return 1  # `params.log_to_screen` after `params["log_to_screen"] = rank == 0 and ...`
            if isinstance(e, cst.Attribute) and self._rank0_attribute(e):
                return 1
            name = dotted_name(e)
            key = (self.index.enclosing_func(e), name)  # (a parameter passed on under its own name is another)
            known = self.__dict__.setdefault("_name_tests", {})
            if key in known:  # (once per name and function: callers of callers are asked again and again)
                return known[key]
            if key in self._resolving:  # `flag = flag and x`: a flag bound from itself
                return 0
            self._resolving.add(key)
            try:
                known[key] = self._name_test(e, name)
            finally:
                self._resolving.discard(key)
            return known[key]
        return 0

    def _name_test(self, e: cst.BaseExpression, name: Optional[str]) -> int:
        for b in self.rank_flags:
            if b.dotted == name:
                return self.rank_test(b.value)
        if isinstance(e, cst.Name):
            return self._passed_test(e) or self._returned_test(e) or self._set_true_on_rank0(e)
        return 0

    def _false_off_rank0(self, call: cst.Call) -> bool:
        """A call of the project's predicate that first returns False off rank 0 (`def
        do_save(epoch): if not is_master: return False; ...`, then `if do_save(epoch):`)."""

        def decide(fn: cst.FunctionDef) -> bool:
            for stmt in fn.body.body:
                if isinstance(stmt, cst.If) and stmt.orelse is None and _returns_false(stmt.body) and self.rank_test(stmt.test) == -1:
                    return True
                if any(isinstance(n, cst.Return) for n in iter_nodes(stmt)):
                    return False  # a return before the guard
            return False

        return self._sole_callee(call, decide)

    def _returns_rank0_test(self, call: cst.Call) -> bool:
        """A call of the project's predicate whose every `return` gives a rank-0 test (`def
        is_first_worker(): return not dist.is_initialized() or dist.get_rank() == 0`)."""
        if call.args:
            return False  # (a predicate of nothing but the process: its answer does not depend on a caller's values)
        known = self.__dict__.setdefault("_rank0_predicates", {})

        def decide(fn: cst.FunctionDef) -> bool:
            if [p for p in fn.params.params if p.name.value not in ("self", "cls")] or fn.params.star_arg not in (None, cst.MaybeSentinel.DEFAULT):
                return False
            if fn not in known:  # (once per function: rank tests are asked of the same calls again and again)
                own = lambda n: isinstance(n, (cst.FunctionDef, cst.Lambda, cst.ClassDef))  # noqa: E731 - (nested code's returns are not its)
                returns = [r for r in iter_nodes(fn.body, prune=own) if isinstance(r, cst.Return)]
                known[fn] = bool(returns) and all(r.value is not None and self.rank_test(r.value) == 1 for r in returns)
            return known[fn]

        return self._sole_callee(call, decide)

    def _sole_callee(self, call: cst.Call, decide) -> bool:
        """`decide(fn)` for the one function of the project the call reaches (False when it reaches
        none, several, or one being decided already)."""
        info = self.index.call_info.get(call)
        callees = self.index.local_callees(info) if info is not None else []
        if len(callees) != 1 or callees[0] in self._resolving:
            return False
        self._resolving.add(callees[0])
        try:
            return decide(callees[0])
        finally:
            self._resolving.discard(callees[0])

    def _set_true_on_rank0(self, e: cst.Name) -> int:
        """`flag = False`, then `flag = True` only under a rank-0 test or where no group runs (the
        `else:` of `if args.local_rank != -1:`): true on rank 0 alone (`default_gpu`)."""
        func = self.index.enclosing_func(e)
        bindings = [b for b in self.index.assignments if b.dotted == e.value and b.func is func]
        truthy = [b for b in bindings if not is_false(b.value)]
        if not truthy or not all(isinstance(b.value, cst.Name) and b.value.value == "True" for b in truthy):
            return 0
        paths = flow(self.index)
        return 1 if all(b._node is not None and (self.in_rank0(b._node) or paths.single_process(b._node)) for b in truthy) else 0

    def _passed_test(self, e: cst.Name) -> int:
        """A parameter every caller fills with the same kind of rank test (`print_variables(model,
        log=dist.get_rank() == 0)`, then `if log:`), here or in a file that imports this one; a
        caller that leaves it False never takes the branch."""
        func = self.index.enclosing_func(e)
        if func is None or e.value not in self.index.param_names(func):
            return 0
        sites = [(self, site) for site in self.index.call_sites(func)]
        if isinstance(self.index.parent(func), cst.Module):  # `clip_grads(model, verbose=self.log_to_screen)` in an importer
            sites += [
                (rank_analysis(index), site) for index in self.index.importers() for site in index.calls
                if site.name == func.name.value and any(q.rpartition(".")[2] == site.name for q in site.qnames)
            ]  # fmt: skip
        tests = set()
        for ranks, site in sites:
            given = ranks.index.argument_for(func, site, e.value)
            if given is not None and is_false(given[0]):
                continue  # `clip_grads(model, max_norm)`: the default False, the branch never runs there
            tests.add(self._program_test(ranks, given[0]) if given is not None else 0)
        return tests.pop() if len(tests) == 1 else 0

    def _program_test(self, ranks: "RankAnalysis", value: cst.BaseExpression) -> int:
        """A value's rank test where it is written, with the fields the whole program sets to a
        rank-0 test (`verbose=self.log_to_screen` in one trainer, the field set in the launcher)."""
        return ranks.rank_test(value) or (1 if isinstance(value, cst.Attribute) and value.attr.value in self.rank0_fields else 0)

    def _field_equals_value(self, field: cst.BaseExpression, value: cst.BaseExpression) -> bool:
        """`config["lr_schedule"] == "linear"`, where the field is cleared off rank 0 (`if rank != 0:
        config["lr_schedule"] = None`): true on rank 0 alone."""
        if isinstance(field, cst.Subscript) and len(field.slice) == 1 and isinstance(field.slice[0].slice, cst.Index):
            key = string_value(field.slice[0].slice.value)
        else:
            key = field.attr.value if isinstance(field, cst.Attribute) else None
        truthy = string_value(value) or int_value(value)
        return bool(key and truthy) and key in self.rank0_fields

    def _returned_test(self, e: cst.Name) -> int:
        """`device, is_logger = setup(config)`, where every `return` of the project's `setup` gives
        a rank test in that place (`return device, comm.get_local_rank() == 0`)."""
        tests = set()
        for call, place in self._unpacked.get(e.value, ()):
            info = self.index.call_info.get(call)
            for func in self.index.local_callees(info) if info is not None else ():
                for r in iter_nodes(func.body):
                    if isinstance(r, cst.Return) and isinstance(r.value, cst.Tuple) and place < len(r.value.elements):
                        tests.add(self.rank_test(r.value.elements[place].value))
                    elif isinstance(r, cst.Return):
                        tests.add(0)
        return tests.pop() if len(tests) == 1 else 0

    @property
    def _unpacked(self) -> dict[str, list[tuple[cst.Call, int]]]:
        """Names bound by unpacking a call's result (`a, b = f(x)`), with the call and the place."""
        found = self.__dict__.get("_unpacked_names")
        if found is None:
            found = self.__dict__["_unpacked_names"] = {}
            for node in (n for root in self.index.roots for n in iter_nodes(root)):
                if isinstance(node, cst.Assign) and isinstance(node.value, cst.Call):
                    for t in node.targets:
                        for place, el in enumerate(getattr(t.target, "elements", ())):
                            if isinstance(el.value, cst.Name):
                                found.setdefault(el.value.value, []).append((node.value, place))
        return found

    def _rank0_attribute(self, e: cst.Attribute) -> bool:
        """`self.verbose`, where the constructor stores a parameter every construction of the
        class fills with a rank-0 test (`Trainer(..., verbose=config.verbose and is_logger)`, here
        or in a file that imports this one)."""
        if not (isinstance(e.value, cst.Name) and e.value.value == "self"):
            return False
        cls = next((a for a in self.index.ancestors(e) if isinstance(a, cst.ClassDef)), None)
        init = cls and next((f for f in cls.body.body if isinstance(f, cst.FunctionDef) and f.name.value == "__init__"), None)
        if init is None:
            return False
        stored = {b.value.value for b in self.index.assignments if b.func is init and b.dotted == dotted_name(e)
                  and isinstance(b.value, cst.Name)}  # fmt: skip
        param = stored.pop() if len(stored) == 1 and stored <= self.index.param_names(init) else None
        if param is None or dotted_name(e) in self._resolving:
            return False
        self._resolving.add(dotted_name(e))
        try:
            tests = [
                rank_analysis(index).rank_test(given[0]) if (given := index.argument_for(init, site, param)) else 0
                for index in (self.index, *(i for i in self.index.importers() if not one_process_program(i)))
                for site in index.calls if _builds(site, cls.name.value)
            ]  # fmt: skip
        finally:
            self._resolving.discard(dotted_name(e))
        return bool(tests) and all(t == 1 for t in tests)

    def false_only_on_rank0(self, e: cst.BaseExpression) -> bool:
        """Is the test false on rank 0 only, so its `else` is rank 0's? `rank != 0`, and an `or`
        with such a part (`use_dummy = args.run == "dummy" or not master_process`, then
        `DummyWandb() if use_dummy else wandb.init()`): both parts false means rank 0. Not `if
        num_gpus == 1 and rank != 0: raise`: it is false on every rank when several GPUs run."""
        if isinstance(e, cst.BooleanOperation):
            if isinstance(e.operator, cst.And):  # false when either part is: both must be false on rank 0 only
                return self.false_only_on_rank0(e.left) and self.false_only_on_rank0(e.right)
            return self.false_only_on_rank0(e.left) or self.false_only_on_rank0(e.right)
        if self.rank_test(e) == -1:
            return True
        name = dotted_name(e) if isinstance(e, (cst.Name, cst.Attribute)) else None
        if name is None or name in self._resolving:
            return False
        self._resolving.add(name)
        try:
            return any(b.dotted == name and self.false_only_on_rank0(b.value) for b in self.rank_flags)
        finally:
            self._resolving.discard(name)

    def _rank0_only(self, e: cst.BaseExpression) -> bool:
        name = dotted_name(e)
        return name is not None and (self.index.enclosing_func(e), name) in self.rank0_only_names

    @property
    def rank0_only_names(self) -> frozenset[tuple[Optional[Func], str]]:
        """Names that hold a value on rank 0 and None on the other ranks: every binding but
        `x = None` is in rank-0 code (`saver = None`, `if rank == 0: saver = CheckpointSaver(...)`;
        then `best = saver.save(...)` under `if saver is not None:`, with `best = None` before).
        Found to a fixed point (a test of one such name makes the next one's binding rank 0's)."""
        if self._rank0_names is None:
            self._rank0_names = frozenset()
            nones: set[tuple[Optional[Func], str]] = set()
            values: dict[tuple[Optional[Func], str], list[cst.CSTNode]] = {}  # where each name gets a value
            for b in self.index.assignments:
                if "." not in b.dotted and b._node is not None:
                    if _is_none(b.value):
                        nones.add((b.func, b.dotted))
                    else:
                        values.setdefault((b.func, b.dotted), []).append(b._node)
            for node in iter_nodes(self.index.module):  # `best, epoch = saver.save(...)`
                if isinstance(node, cst.Assign):
                    for target in node.targets:
                        for element in getattr(target.target, "elements", ()):
                            if isinstance(element.value, cst.Name):
                                key = (self.index.enclosing_func(element.value), element.value.value)
                                values.setdefault(key, []).append(element.value)
            candidates = {key: nodes for key, nodes in values.items() if key in nones}
            for _ in range(4):
                found = frozenset(key for key, nodes in candidates.items() if all(self.in_rank0(n) for n in nodes))
                if found == self._rank0_names:
                    break
                self._rank0_names = found
                self._rank0_cache.clear()
        return self._rank0_names

    @property
    def rank0_fields(self) -> frozenset[str]:
        """Fields of a config object or dict set to a rank-0 test (`params["log_to_wandb"] =
        (world_rank == 0) and params["log_to_wandb"]`, `cfg.is_main = rank == 0`), or cleared on
        the other ranks (`if rank not in [0, -1]: self._use_wandb = False; cfg.ckpt_dir = None`):
        read anywhere in the program (`self.params.log_to_wandb`, `if self._use_wandb:`, `if
        cfg.ckpt_dir is not None:`), they are rank-0 flags."""
        found = self.__dict__.get("_rank0_fields")
        if found is None:
            self.__dict__["_rank0_fields"] = frozenset()  # (recursion: none yet)
            found = self.__dict__["_rank0_fields"] = self._fields_set_here().union(
                *(rank_analysis(index)._fields_set_here() for index in self.index.importers())
            )  # a launcher that imports this module sets them too: `params["log_to_screen"] = rank == 0`
        return found

    def _fields_set_here(self) -> frozenset[str]:
        """The rank-0 fields this file and the modules it imports set."""
        found = self.__dict__.get("_fields_here")
        if found is None:
            found = self.__dict__["_fields_here"] = frozenset()  # (recursion: none yet)
            fields = set()
            for node in (n for root in self.index.roots for n in iter_nodes(root)):
                if isinstance(node, cst.Assign) and len(node.targets) == 1:
                    target = node.targets[0].target
                    key = None
                    if isinstance(target, cst.Attribute):
                        key = target.attr.value
                    elif isinstance(target, cst.Subscript) and len(target.slice) == 1 and isinstance(target.slice[0].slice, cst.Index):
                        key = string_value(target.slice[0].slice.value)
                    if key and isinstance(node.value, (cst.Comparison, cst.BooleanOperation)) and self.rank_test(node.value) == 1:
                        fields.add(key)
                    elif key and (is_false(node.value) or _is_none(node.value) or int_value(node.value) == 0):
                        if self._off_rank0(node):
                            fields.add(key)  # cleared off rank 0
            found = self.__dict__["_fields_here"] = frozenset(fields)
        return found

    def _off_rank0(self, node: cst.CSTNode) -> bool:
        """In a branch only the other ranks take (`if rank != 0:`, the `else` of `if rank == 0:`),
        not one a test of the run's mode picks (`if local_rank != -1: ... else:`)."""
        child = node
        for p in self.index.ancestors(node):
            if isinstance(p, cst.If):
                if child is p.body and self.rank_test(p.test) == -1 or child is p.orelse and self.rank_test(p.test) == 1:
                    return True
            elif isinstance(p, (cst.FunctionDef, cst.Lambda)):
                return False
            child = p
        return False

    @property
    def rank_flags(self) -> list[Binding]:
        """``is_main = rank == 0``-style flags."""
        if self._flags is None:
            self._flags = [
                b
                for b in self.index.assignments
                if isinstance(b.value, (cst.Comparison, cst.BooleanOperation, cst.UnaryOperation)) or _is_bool_of_one(b.value)
            ]
        return self._flags

    def guard_start(self, block: cst.CSTNode) -> int:
        """Index of the first statement after an ``if rank != 0: return`` guard in a block (or
        ``if rank == 0: ... else: return``)."""
        if block in self._guard_index:
            return self._guard_index[block]
        idx = 1 << 30
        paths = flow(self.index)
        for i, stmt in enumerate(getattr(block, "body", ())):
            if isinstance(stmt, cst.If) and stmt.orelse is None and self.false_only_on_rank0(stmt.test):
                if paths.block_ends(stmt.body):  # `return`, `continue`, `raise`, `sys.exit()`, or both branches of an `if` inside
                    idx = i
                    break
            if isinstance(stmt, cst.If) and isinstance(stmt.orelse, cst.Else) and self.rank_test(stmt.test) == 1:
                if paths.block_ends(stmt.orelse.body) and not paths.block_ends(stmt.body):  # `if rank == 0: ... else: return`
                    idx = i
                    break
            if isinstance(stmt, cst.If) and stmt.orelse is None and paths.true_with_group_only(stmt.test):
                if self.guard_start(stmt.body) < len(stmt.body.body):  # `if distributed: ...; if rank != 0: return`
                    idx = i  # (after it: rank 0 of the group, or the one process of a run without one)
                    break
        self._guard_index[block] = idx
        return idx

    def in_rank0(self, node: cst.CSTNode) -> bool:
        """Does this code run on rank 0 only (a rank-0 branch, guard, or function only called there)?"""
        if node in self._rank0_cache:
            return self._rank0_cache[node]
        result = False
        child = node
        for p in self.index.ancestors(node):
            if isinstance(p, (cst.If, cst.IfExp)):
                if child is p.body and self.rank_test(p.test) == 1 or child is p.orelse and self.false_only_on_rank0(p.test):
                    result = True
                    break
            elif isinstance(p, (cst.IndentedBlock, cst.Module)) and not isinstance(child, cst.BaseSuite):
                try:
                    index = list(p.body).index(child)
                except ValueError:
                    index = -1
                if index > self.guard_start(p):
                    result = True
                    break
            elif isinstance(p, cst.FunctionDef):
                result = self.rank0_function(p)
                break
            elif isinstance(p, cst.Lambda):
                break
            child = p
        self._rank0_cache[node] = result
        return result

    def under_rank_test(self, node: cst.CSTNode) -> bool:
        """Does this code run only where a test of the rank decided it (any rank: `if rank == 1:`
        too), or on rank 0 only? Code there must not get another rank guard."""
        if self.in_rank0(node):
            return True
        child = node
        for p in self.index.ancestors(node):
            if isinstance(p, (cst.If, cst.IfExp, cst.While)) and self.reads_rank(p.test):
                return True
            if isinstance(p, (cst.IndentedBlock, cst.Module)) and not isinstance(child, cst.BaseSuite):
                body = list(p.body)
                if child in body and body.index(child) > self._rank_exit(p):
                    return True  # after `if self.rank == 0: return`: the other ranks' code
            if isinstance(p, (cst.FunctionDef, cst.ClassDef)):
                return False
            child = p
        return False

    def _rank_exit(self, block: cst.CSTNode) -> int:
        """Index of the first `if <test true only on or only off rank 0>: return` (or `raise`,
        `continue`, ...) in a block (not `if args.gpu and not cuda: raise`: a GPU flag, no rank test)."""
        found = self._exit_index.get(block)
        if found is None:
            paths = flow(self.index)
            found = next(
                (i for i, stmt in enumerate(block.body)
                 if isinstance(stmt, cst.If) and stmt.orelse is None and self.rank_test(stmt.test) and paths.block_ends(stmt.body)),
                1 << 30,
            )  # fmt: skip
            self._exit_index[block] = found
        return found

    def reads_rank(self, test: cst.BaseExpression) -> bool:
        """Does the test compare or read this process's rank anywhere in it?"""
        found = self._reads_rank.get(test)
        if found is None:
            presence = {id(x) for n in iter_nodes(test) if env_presence(n) for x in iter_nodes(n)}
            found = self._reads_rank[test] = self.rank_test(test) != 0 or any(
                isinstance(n, cst.BaseExpression) and id(n) not in presence and self.is_rank_expr(n) for n in iter_nodes(test)
            )
        return found

    def rank0_function(self, func: Func) -> bool:
        """A function only called from rank-0-only code (or from a branch that runs without a
        process group: `if opt['dist']: self.dist_eval() else: self.eval()`)."""
        if func in self._rank0_func:
            return self._rank0_func[func]
        if any(self._rank0_decorator(d.decorator) for d in func.decorators):
            self._rank0_func[func] = True  # `@master_only`, `@rank_zero_only`: the body runs on rank 0
            return True
        self._rank0_func[func] = False  # cycles: assume not
        sites = self.index.call_sites(func) + self._wrapped_module_calls(func)
        result = bool(sites) and all(self.in_rank0(s.node) or flow(self.index).single_process(s.node) for s in sites)
        result = result and any(self.in_rank0(s.node) for s in sites)  # rank 0's, or one process's, and rank 0's once
        self._rank0_func[func] = result
        # cached answers computed under the provisional False may be stale
        if result:
            self._rank0_cache.clear()
        return result

    def _rank0_decorator(self, decorator: cst.BaseExpression) -> bool:
        """A decorator that runs the function on rank 0 only: named so (`@master_only`,
        `@rank_zero_only`, `@main_process_only`), or a project decorator whose wrapper calls the
        function only in a rank-0 branch (`if get_rank() == 0: return func(*args, **kwargs)`)."""
        name = last_name(decorator.func if isinstance(decorator, cst.Call) else decorator) or ""
        if _RANK0_DECORATOR.match(name):
            return True
        for d in self.index.functions.get(name, []):
            inner = [c for c in self.index.calls_under(d) if isinstance(c.node.func, cst.Name) and c.node.func.value in self.index.param_names(d)]
            if inner and all(self.in_rank0(c.node) for c in inner):
                return True
        return False

    def _wrapped_module_calls(self, func: Func) -> list:
        """Calls of a model class's method through the wrapper (`model.module.inference(...)`):
        `module` is the wrapped model, so a method of the file's classes by that name is reached."""
        if not isinstance(self.index.parents.get(self.index.parents.get(func)), cst.ClassDef):
            return []
        name = func.name.value
        return [
            c for c in self.index.calls
            if c.name == name and isinstance(c.node.func, cst.Attribute)
            and isinstance(c.node.func.value, cst.Attribute) and c.node.func.value.attr.value == "module"
        ]


def mentions_rank(index: FileIndex, call: cst.Call) -> bool:
    """Output tagged with the rank or the process (``print(f"[rank {rank}] ...")``,
    ``print(os.getpid(), ...)``), or naming a per-rank value (``print(f"on {device}")`` with
    ``device`` built from the local rank; ``path = f"queue{rank}.pth"; torch.save(q, path)``),
    is per-rank on purpose."""
    ranks = rank_analysis(index)
    func = index.enclosing_func(call)
    if any(ranks.per_rank(a.value, func) for a in call.args):
        return True
    names = {a.value.value for a in call.args if isinstance(a.value, cst.Name)}  # `own = FileHandler(f"{rank}.log")`
    return bool(names) and any(
        b.dotted in names and b.func is func and (RANK_TEXT.search(index.code(b.value)) or ranks.per_rank(b.value, func))
        for b in index.assignments
    )  # `handler = StreamHandler(open(log_path))` with a per-rank `log_path`


def _is_bool_of_one(e: cst.BaseExpression) -> bool:
    """`bool(x)`: the truth of `x`."""
    return isinstance(e, cst.Call) and isinstance(e.func, cst.Name) and e.func.value == "bool" and len(e.args) == 1 and not e.args[0].star


def _builds(site, class_name: str) -> bool:
    """Is this call a construction of the class (`Trainer(...)`, `trainer.Trainer(...)`)?"""
    return site.name == class_name and (not site.qnames or any(q.rpartition(".")[2] == class_name for q in site.qnames))


def _presence_value(value: cst.BaseExpression) -> bool:
    if isinstance(value, cst.Name) and value.value in ("True", "False"):
        return True
    if isinstance(value, cst.Call) and last_name(value.func) in ("hasattr", "isinstance", "callable"):
        return True
    return env_presence(value)


def _returns_false(block: cst.BaseSuite) -> bool:
    """A block that is only `return False` (or `return`, `return None`)."""
    body = list(block.body)
    small = body[0].body[0] if len(body) == 1 and isinstance(body[0], cst.SimpleStatementLine) and len(body[0].body) == 1 else None
    if isinstance(block, cst.SimpleStatementSuite) and len(block.body) == 1:
        small = block.body[0]
    return isinstance(small, cst.Return) and (small.value is None or is_false(small.value) or _is_none(small.value))


def _is_none(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.Name) and expr.value == "None"


def _dotted_names_in(expr: cst.BaseExpression) -> set[str]:
    """The names and attribute chains whose values an expression uses (``device`` in
    ``f"on {device}"`` or ``str(device)``), not the receivers of its calls (``model`` in
    ``model.module.state_dict()``)."""
    found: set[str] = set()

    def walk(node: cst.CSTNode) -> None:
        if isinstance(node, (cst.Name, cst.Attribute)):
            name = dotted_name(node)
            if name:
                found.add(name)
                return
        for child in node.children:
            if isinstance(node, cst.Call) and child is node.func:
                continue
            walk(child)

    walk(expr)
    return found


_IDENTIFIER_CALLS = frozenset({
    "device", "str", "int", "format", "join", "Path", "get", "getenv", "get_rank", "get_local_rank",
    "get_node_local_rank", "getpid", "abspath", "expanduser", "current_device",
})  # fmt: skip


def _identifier_like(value: cst.CSTNode) -> bool:
    """A value that names something (a string, number, path, device), not an object with contents."""
    if isinstance(value, cst.IfExp):
        return _identifier_like(value.body) and _identifier_like(value.orelse)
    if isinstance(value, cst.Call):
        return last_name(value.func) in _IDENTIFIER_CALLS
    return isinstance(
        value, (cst.BaseString, cst.BinaryOperation, cst.Name, cst.Attribute, cst.Subscript, cst.Integer, cst.Comparison,
                cst.BooleanOperation, cst.UnaryOperation),
    )  # fmt: skip


_DISTRIBUTED_HINT = re.compile(
    r"distributed|ddp|process_group|local_rank|world_size|accelerat|fabric|deepspeed|horovod|\bspawn\(|start_processes", re.I
)  # (`set_start_method("spawn")` is how data workers start, not a sign of several ranks)


def one_process_program(index: FileIndex) -> bool:
    """A file with no sign of a distributed run anywhere in its text (an importer that is an
    inference or export script): what it calls runs in one process."""
    return index.cached("one_process", lambda i: not _DISTRIBUTED_HINT.search(i.module.code))


def rank_analysis(index: FileIndex) -> RankAnalysis:
    """The file's rank-0 reasoning, made once per index."""
    return index.cached("rank", RankAnalysis)
