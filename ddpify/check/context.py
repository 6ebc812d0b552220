"""The shared per-file analysis every rule reads.

A file is parsed once, its metadata (qualified names, scopes, positions, parents)
resolved once through one ``MetadataWrapper``, and one traversal indexes the calls,
loops, functions and bindings the rules ask about.  Everything else (which branch
runs on rank 0 only, which loop is the step loop, which names hold a DDP model) is
derived lazily from that index and cached.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Optional, Sequence, Union

import libcst as cst
from libcst._metadata_dependent import LazyValue
from libcst.metadata import (
    CodeRange,
    MetadataWrapper,
    ParentNodeProvider,
    PositionProvider,
    QualifiedNameProvider,
    ScopeProvider,
)

Loop = Union[cst.For, cst.While]
Func = cst.FunctionDef

DDP_CLASSES = frozenset(
    {
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
        "torch.nn.DistributedDataParallel",
    }
)
DISTRIBUTED_SAMPLER = frozenset(
    {
        "torch.utils.data.DistributedSampler",
        "torch.utils.data.distributed.DistributedSampler",
    }
)
DATALOADER = frozenset({"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"})
# Collectives: every rank must call them, in the same order.
COLLECTIVES = frozenset(
    "torch.distributed." + n
    for n in (
        "barrier",
        "monitored_barrier",
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "new_group",
        "destroy_process_group",
    )
)
# Libraries that run the distributed machinery themselves: their scripts are not ours to judge.
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "deepspeed", "horovod", "colossalai")

_MAIN_PROCESS_RE = re.compile(
    r"^_?(is_?)?(main|master|primary|chief|leader|rank_?0|rank_?zero|global_?zero|local_?zero)"
    r"(_?(process|proc|rank|worker|node|host))?$",
    re.IGNORECASE,
)
_RANK_NAMES = frozenset({"gpu_id", "gpu", "local_gpu", "device_id", "gpu_idx", "process_index", "proc_id"})
_NOT_MULTI_PROCESS = re.compile(r"(is_initialized|is_available|distributed|ddp|is_dist)", re.IGNORECASE)


@dataclass
class CallInfo:
    """One call site, with what the rules ask about it."""

    node: cst.Call
    qnames: frozenset[str]
    name: str  # last component of the callee: "save" for torch.save, "state_dict" for m.state_dict
    dotted: Optional[str]  # "torch.save", "self.model.state_dict", None for computed callees
    receiver: Optional[cst.BaseExpression]  # the object of a method call
    func: Optional[Func]  # enclosing function
    loops: tuple[Loop, ...]  # enclosing loops inside that function, innermost last
    in_no_grad: bool = False

    def is_(self, *names: str) -> bool:
        return any(n in self.qnames for n in names)

    def qname_startswith(self, prefix: str) -> bool:
        return any(q.startswith(prefix) for q in self.qnames)


@dataclass
class Binding:
    dotted: str
    func: Optional[Func]
    line: int
    value: cst.BaseExpression


def dotted_name(node: cst.CSTNode) -> Optional[str]:
    """``self.model`` for an Attribute chain of Names, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def last_name(node: cst.CSTNode) -> Optional[str]:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return node.attr.value
    if isinstance(node, cst.Call):
        return last_name(node.func)
    return None


def kwarg(call: cst.Call, name: str) -> Optional[cst.Arg]:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg
    return None


def has_star_kwargs(call: cst.Call) -> bool:
    return any(a.star == "**" for a in call.args)


def positional(call: cst.Call) -> list[cst.Arg]:
    return [a for a in call.args if a.keyword is None and not a.star]


def is_true(node: Optional[cst.CSTNode]) -> bool:
    return isinstance(node, cst.Name) and node.value == "True"


def is_false(node: Optional[cst.CSTNode]) -> bool:
    return isinstance(node, cst.Name) and node.value == "False"


def string_value(node: Optional[cst.CSTNode]) -> Optional[str]:
    if isinstance(node, cst.SimpleString):
        return node.evaluated_value if isinstance(node.evaluated_value, str) else None
    return None


def int_value(node: Optional[cst.CSTNode]) -> Optional[int]:
    if isinstance(node, cst.Integer):
        return int(node.value, 0)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        inner = int_value(node.expression)
        return -inner if inner is not None else None
    return None


class _Indexer(cst.CSTVisitor):
    """The one traversal: calls, loops, functions, assignments, imports, comments."""

    def __init__(self, ctx: "FileContext") -> None:
        self.ctx = ctx
        self.funcs: list[Func] = []
        self.loops: list[list[Loop]] = [[]]
        self.no_grad = 0

    # scopes -----------------------------------------------------------------
    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.ctx.functions.setdefault(node.name.value, []).append(node)
        self.funcs.append(node)
        self.loops.append([])

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.funcs.pop()
        self.loops.pop()

    def visit_For(self, node: cst.For) -> None:
        self.ctx.loops.append(node)
        self.ctx.loop_func[node] = self.funcs[-1] if self.funcs else None
        self.loops[-1].append(node)

    def leave_For(self, node: cst.For) -> None:
        self.loops[-1].pop()

    def visit_While(self, node: cst.While) -> None:
        self.ctx.loops.append(node)
        self.ctx.loop_func[node] = self.funcs[-1] if self.funcs else None
        self.loops[-1].append(node)

    def leave_While(self, node: cst.While) -> None:
        self.loops[-1].pop()

    def visit_With(self, node: cst.With) -> None:
        for item in node.items:
            call = item.item
            if isinstance(call, cst.Call):
                q = self.ctx.qnames(call.func)
                if {"torch.no_grad", "torch.inference_mode"} & q:
                    self.no_grad += 1
                    self.ctx._no_grad_withs.add(node)
                    return

    def leave_With(self, node: cst.With) -> None:
        if node in self.ctx._no_grad_withs:
            self.no_grad -= 1

    # imports ----------------------------------------------------------------
    def _module_used(self, name: str) -> None:
        if (
            name.startswith(("torch.distributed", "torch.nn.parallel"))
            or name == "torch.multiprocessing"
            or name.endswith(("DistributedSampler", "DistributedDataParallel"))
        ):
            self.ctx._imports_distributed = True
        if name.split(".")[0] in FRAMEWORKS:
            self.ctx.uses_framework = True

    def visit_Import(self, node: cst.Import) -> None:
        for alias in node.names:
            self._module_used(cst.helpers.get_full_name_for_node(alias.name) or "")

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.module is None or node.relative:
            return
        base = cst.helpers.get_full_name_for_node(node.module) or ""
        self._module_used(base)
        if isinstance(node.names, Sequence):
            for alias in node.names:
                self._module_used(f"{base}.{cst.helpers.get_full_name_for_node(alias.name)}")

    # calls and bindings ---------------------------------------------------------
    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        qn = frozenset(self.ctx.qnames(func))
        receiver = func.value if isinstance(func, cst.Attribute) else None
        info = CallInfo(
            node=node,
            qnames=qn,
            name=last_name(func) or "",
            dotted=dotted_name(func),
            receiver=receiver,
            func=self.funcs[-1] if self.funcs else None,
            loops=tuple(self.loops[-1]),
            in_no_grad=self.no_grad > 0,
        )
        self.ctx.calls.append(info)
        self.ctx.call_info[node] = info
        if any(q.startswith(("torch.distributed", "torch.multiprocessing.spawn")) for q in qn) or (
            qn & DDP_CLASSES
        ):
            self.ctx._calls_distributed = True

    def _bind(self, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        name = dotted_name(target)
        if name is None:
            return
        line = self.ctx.line(target)
        self.ctx.assignments.append(
            Binding(name, self.funcs[-1] if self.funcs else None, line, value)
        )

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._bind(t.target, node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:
            self._bind(node.target, node.value)

    def visit_Subscript(self, node: cst.Subscript) -> None:
        self.ctx.subscripts.append(node)

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        if "LOCAL_RANK" in node.value or "WORLD_SIZE" in node.value:
            self.ctx._reads_rank_env = True


class FileContext:
    """Everything rules need to know about one file, computed once."""

    PROVIDERS = (QualifiedNameProvider, ScopeProvider, PositionProvider, ParentNodeProvider)

    def __init__(self, path: str, source: str, module: Optional[cst.Module] = None) -> None:
        self.path = path
        self.source = source
        # the module was parsed for this context alone: no defensive deep copy needed
        self.wrapper = MetadataWrapper(
            module if module is not None else cst.parse_module(source), unsafe_skip_copy=True
        )
        self.module = self.wrapper.module
        resolved = self.wrapper.resolve_many(self.PROVIDERS)
        self._qn = resolved[QualifiedNameProvider]
        self._pos = resolved[PositionProvider]
        self._parent = resolved[ParentNodeProvider]
        self.scopes = resolved[ScopeProvider]

        self.calls: list[CallInfo] = []
        self.call_info: dict[cst.Call, CallInfo] = {}
        self.functions: dict[str, list[Func]] = {}
        self.loops: list[Loop] = []
        self.loop_func: dict[Loop, Optional[Func]] = {}
        self.assignments: list[Binding] = []
        self.subscripts: list[cst.Subscript] = []
        self.uses_framework = False
        self._imports_distributed = False
        self._calls_distributed = False
        self._reads_rank_env = False
        self._no_grad_withs: set[cst.With] = set()
        self._rank0_cache: dict[cst.CSTNode, bool] = {}
        self._rank0_func: dict[Func, bool] = {}
        self._step_func: dict[Func, bool] = {}
        self._guard_index: dict[cst.CSTNode, int] = {}
        self.module.visit(_Indexer(self))

    # metadata ---------------------------------------------------------------
    def qnames(self, node: cst.CSTNode) -> set[str]:
        value = self._qn.get(node, ())
        if isinstance(value, LazyValue):  # qualified names are computed on demand, once
            value = value()
        return {q.name for q in value}

    def position(self, node: cst.CSTNode) -> CodeRange:
        return self._pos[node]

    def line(self, node: cst.CSTNode) -> int:
        return self._pos[node].start.line

    def parent(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self._parent.get(node)

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def ancestors(self, node: cst.CSTNode) -> Iterable[cst.CSTNode]:
        p = self.parent(node)
        while p is not None:
            yield p
            p = self.parent(p)

    def enclosing_func(self, node: cst.CSTNode) -> Optional[Func]:
        for a in self.ancestors(node):
            if isinstance(a, cst.FunctionDef):
                return a
        return None

    # queries over calls -------------------------------------------------------------
    def calls_to(self, *qnames: str) -> list[CallInfo]:
        wanted = set(qnames)
        return [c for c in self.calls if c.qnames & wanted]

    def method_calls(self, name: str) -> list[CallInfo]:
        return [c for c in self.calls if c.receiver is not None and c.name == name]

    def info(self, call: cst.Call) -> CallInfo:
        return self.call_info[call]

    def local_callees(self, ci: CallInfo) -> list[Func]:
        """The functions of this file a call may reach (``f(...)`` or ``self.f(...)``)."""
        f = ci.node.func
        if isinstance(f, cst.Name) or (
            isinstance(f, cst.Attribute) and isinstance(f.value, cst.Name) and f.value.value in ("self", "cls")
        ):
            return self.functions.get(ci.name, [])
        return []

    def call_sites(self, func: Func) -> list[CallInfo]:
        return [c for c in self.calls if func in self.local_callees(c)]

    # what kind of file ----------------------------------------------------------------
    @cached_property
    def is_distributed(self) -> bool:
        """The file runs several processes itself (torch.distributed, DDP, mp.spawn)."""
        if self.uses_framework:
            return False
        return self._imports_distributed or self._calls_distributed

    # bindings ----------------------------------------------------------------------
    def _bindings_of(self, qnames: frozenset[str]) -> list[Binding]:
        out = []
        for b in self.assignments:
            v = b.value
            if isinstance(v, cst.Call) and self.call_info[v].qnames & qnames:
                out.append(b)
        return out

    @cached_property
    def ddp_bindings(self) -> list[Binding]:
        """Names bound to a DDP-wrapped model, including parameters that receive one."""
        bindings = self._bindings_of(DDP_CLASSES)
        for _ in range(3):  # propagate into parameters of local functions
            added = False
            for ci in self.calls:
                callees = self.local_callees(ci)
                if not callees:
                    continue
                for i, arg in enumerate(ci.node.args):
                    if arg.star or not self._is_bound(arg.value, bindings):
                        continue
                    for fn in callees:
                        param = self._param_for(fn, i, arg)
                        if param and not any(b.dotted == param and b.func is fn for b in bindings):
                            bindings.append(Binding(param, fn, self.line(fn), arg.value))
                            added = True
            if not added:
                break
        return bindings

    @staticmethod
    def _param_for(fn: Func, index: int, arg: cst.Arg) -> Optional[str]:
        params = list(fn.params.posonly_params) + list(fn.params.params)
        if arg.keyword is not None:
            names = {p.name.value for p in params} | {p.name.value for p in fn.params.kwonly_params}
            return arg.keyword.value if arg.keyword.value in names else None
        if params and params[0].name.value in ("self", "cls"):
            params = params[1:]
        return params[index].name.value if index < len(params) else None

    def _is_bound(self, expr: cst.CSTNode, bindings: list[Binding]) -> bool:
        name = dotted_name(expr)
        if name is None:
            return False
        func = None
        line = None
        for b in bindings:
            if b.dotted != name:
                continue
            if func is None and line is None:
                func = self.enclosing_func(expr)
                line = self.line(expr)
            if b.func is func:
                if line > b.line or (b.func is not None and b.line == self.line(b.func)):
                    return True
            elif b.func is None:
                if func is not None and name in self._param_names(func):
                    continue  # a parameter shadows the global: bound only through its call sites
                return True
            elif name.startswith("self."):
                # a method only called before the wrapping (e.g. loading a snapshot in __init__)
                sites = self.call_sites(func) if func is not None else []
                if not (sites and all(s.func is b.func and self.line(s.node) < b.line for s in sites)):
                    return True
        return False

    @staticmethod
    def _param_names(fn: Func) -> set[str]:
        params = fn.params
        return {p.name.value for p in [*params.posonly_params, *params.params, *params.kwonly_params]}

    def is_ddp(self, expr: cst.CSTNode) -> bool:
        """Does this expression hold the DDP-wrapped model (not ``.module``)?"""
        return self._is_bound(expr, self.ddp_bindings)

    @cached_property
    def ddp_calls(self) -> list[CallInfo]:
        return self.calls_to(*DDP_CLASSES)

    @cached_property
    def sampler_bindings(self) -> list[Binding]:
        return self._bindings_of(DISTRIBUTED_SAMPLER)

    def is_distributed_sampler(self, expr: cst.CSTNode) -> bool:
        if isinstance(expr, cst.Call):
            return bool(self.call_info[expr].qnames & DISTRIBUTED_SAMPLER)
        return self._is_bound(expr, self.sampler_bindings)

    # rank-0-only code -------------------------------------------------------------------
    def _is_rank_expr(self, e: cst.BaseExpression) -> bool:
        if isinstance(e, cst.Call):
            if self.call_info[e].is_("torch.distributed.get_rank", "torch.distributed.get_node_local_rank"):
                return True
            if last_name(e.func) == "int" and e.args:
                return self._is_rank_expr(e.args[0].value)
            if last_name(e.func) in ("get", "getenv") and e.args:  # os.environ.get("RANK", 0)
                key = string_value(e.args[0].value)
                return key is not None and key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
            return "rank" in (last_name(e.func) or "").lower()
        if isinstance(e, cst.Subscript):  # os.environ["RANK"]
            if len(e.slice) == 1 and isinstance(e.slice[0].slice, cst.Index):
                s = string_value(e.slice[0].slice.value)
                return s is not None and "RANK" in s
            return False
        if isinstance(e, cst.BinaryOperation) and isinstance(e.operator, cst.Modulo):
            return self._is_rank_expr(e.left)
        n = last_name(e) if isinstance(e, (cst.Name, cst.Attribute)) else None
        return n is not None and ("rank" in n.lower() or n.lower() in _RANK_NAMES)

    def _is_single_process(self, e: cst.BaseExpression) -> bool:
        """Operands of ``or`` that are false whenever several processes run."""
        if isinstance(e, cst.UnaryOperation) and isinstance(e.operator, cst.Not):
            inner = e.expression
            target = inner.func if isinstance(inner, cst.Call) else inner
            return bool(_NOT_MULTI_PROCESS.search(self.code(target)))
        if isinstance(e, cst.Comparison) and len(e.comparisons) == 1:
            n = last_name(e.left) or ""
            v = int_value(e.comparisons[0].comparator)
            op = e.comparisons[0].operator
            return "world_size" in n.lower() and (
                (isinstance(op, cst.Equal) and v == 1) or (isinstance(op, cst.LessThanEqual) and v == 1)
            )
        return False

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
        if isinstance(e, cst.Comparison) and len(e.comparisons) == 1:
            comp = e.comparisons[0]
            op, right, left = comp.operator, comp.comparator, e.left
            if int_value(left) is not None and isinstance(op, (cst.Equal, cst.NotEqual)):
                left, right = right, left
            if not self._is_rank_expr(left):
                return 0
            v = int_value(right)
            if isinstance(op, (cst.In, cst.NotIn)) and isinstance(right, (cst.Tuple, cst.List, cst.Set)):
                values = {int_value(el.value) for el in right.elements}
                if values and values <= {0, -1} and 0 in values:
                    return 1 if isinstance(op, cst.In) else -1
                return 0
            if v is None:
                return 0
            if isinstance(op, cst.Equal) and v == 0 or isinstance(op, cst.LessThan) and v == 1:
                return 1
            if isinstance(op, cst.NotEqual) and v == 0 or isinstance(op, cst.GreaterThan) and v == 0:
                return -1
            if isinstance(op, cst.GreaterThanEqual) and v == 1:
                return -1
            return 0
        if isinstance(e, cst.Call):
            n = last_name(e.func) or ""
            return 1 if _MAIN_PROCESS_RE.match(n) else 0
        if isinstance(e, (cst.Name, cst.Attribute)):
            n = last_name(e) or ""
            if _MAIN_PROCESS_RE.match(n):
                return 1
            name = dotted_name(e)
            for b in self.rank_flags:
                if b.dotted == name:
                    return self.rank_test(b.value)
        return 0

    @cached_property
    def rank_flags(self) -> list[Binding]:
        """``is_main = rank == 0``-style flags."""
        return [
            b
            for b in self.assignments
            if isinstance(b.value, (cst.Comparison, cst.BooleanOperation, cst.UnaryOperation))
        ]

    def _guard_start(self, block: cst.CSTNode) -> int:
        """Index of the first statement after an ``if rank != 0: return`` guard in a block."""
        if block in self._guard_index:
            return self._guard_index[block]
        idx = 1 << 30
        for i, stmt in enumerate(getattr(block, "body", ())):
            if isinstance(stmt, cst.If) and stmt.orelse is None and self.rank_test(stmt.test) == -1:
                body = stmt.body.body
                last = body[-1] if body else None
                if isinstance(last, cst.SimpleStatementLine):
                    last = last.body[-1] if last.body else None
                if isinstance(last, (cst.Return, cst.Continue, cst.Raise)) or (
                    isinstance(last, cst.Expr)
                    and isinstance(last.value, cst.Call)
                    and (last_name(last.value.func) in ("exit", "_exit"))
                ):
                    idx = i
                    break
        self._guard_index[block] = idx
        return idx

    def in_rank0(self, node: cst.CSTNode) -> bool:
        """Does this code run on rank 0 only (a rank-0 branch, guard, or function only called there)?"""
        if node in self._rank0_cache:
            return self._rank0_cache[node]
        result = False
        child = node
        for p in self.ancestors(node):
            if isinstance(p, cst.If):
                sign = self.rank_test(p.test)
                if (child is p.body and sign == 1) or (child is p.orelse and sign == -1):
                    result = True
                    break
            elif isinstance(p, cst.IfExp):
                sign = self.rank_test(p.test)
                if (child is p.body and sign == 1) or (child is p.orelse and sign == -1):
                    result = True
                    break
            elif isinstance(p, (cst.IndentedBlock, cst.Module)) and not isinstance(child, cst.BaseSuite):
                try:
                    index = list(p.body).index(child)
                except ValueError:
                    index = -1
                if index > self._guard_start(p):
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

    def rank0_function(self, func: Func) -> bool:
        if func in self._rank0_func:
            return self._rank0_func[func]
        self._rank0_func[func] = False  # cycles: assume not
        sites = self.call_sites(func)
        result = bool(sites) and all(self.in_rank0(s.node) for s in sites)
        self._rank0_func[func] = result
        # cached answers computed under the provisional False may be stale
        if result:
            self._rank0_cache.clear()
        return result

    # the step loop ----------------------------------------------------------------------
    def is_backward(self, ci: CallInfo) -> bool:
        return (ci.receiver is not None and ci.name == "backward") or ci.is_("torch.autograd.backward")

    def _steps(self, ci: CallInfo) -> bool:
        return self.is_backward(ci) or any(self.step_function(f) for f in self.local_callees(ci))

    def step_function(self, func: Func) -> bool:
        """A function that runs one backward per call (outside its own loops)."""
        if func in self._step_func:
            return self._step_func[func]
        self._step_func[func] = False
        result = any(self._steps(c) for c in self.calls if c.func is func and not c.loops)
        self._step_func[func] = result
        return result

    @cached_property
    def step_loops(self) -> set[Loop]:
        """Loops whose every iteration runs a backward pass (the innermost such loops)."""
        return {c.loops[-1] for c in self.calls if c.loops and self._steps(c)}

    def in_step(self, node: cst.CSTNode, _seen: Optional[set] = None) -> bool:
        """Does this code run once per training step?"""
        for p in self.ancestors(node):
            if isinstance(p, (cst.For, cst.While)) and p in self.step_loops:
                return True
            if isinstance(p, cst.FunctionDef):
                if not self.step_function(p):
                    return False
                seen = _seen or set()
                if p in seen:
                    return False
                seen.add(p)
                return any(self.in_step(s.node, seen) for s in self.call_sites(p))
        return False

    def enclosing_loop(self, node: cst.CSTNode) -> Optional[Loop]:
        for p in self.ancestors(node):
            if isinstance(p, (cst.For, cst.While)):
                return p
            if isinstance(p, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
                return None
        return None

    @cached_property
    def has_set_device(self) -> bool:
        return bool(
            self.calls_to("torch.cuda.set_device", "torch.accelerator.set_device_index", "torch.cuda.device")
        ) or any(kwarg(c.node, "device_id") for c in self.calls_to("torch.distributed.init_process_group"))
