"""Side effects that belong to every process, not to rank 0 (read by guard_rank_zero and
wait_for_checkpoints; not a pass).

* a file whose name is built from this process's id or rank (`f"worker{os.getpid()}.log"`,
  `f"log_{rank}.txt"` with `rank = int(os.environ["RANK"])`) or that lies in a temporary
  directory made before the process group exists (or a temporary file): each process has its
  own, so each one writes it (and reads its own back: no barrier). A temporary directory made
  later (`with TemporaryDirectory() as tempdir`, `tempfile.mkdtemp()`) becomes rank 0's on
  every rank instead (shared_temp_dirs): rank 0 saves the best weights there and every rank
  reloads the same ones;
* code that runs in the data pipeline (`Dataset.__getitem__` / `__len__` / `__iter__`, a
  `collate_fn`, a `worker_init_fn`): it runs in every rank's loader (or its workers), per sample;
  guarding it by rank would hide the other ranks' data and can fail in a worker process;
* files a Dataset writes for itself (a `download()` method, a cache its `__init__` saves): they
  are written where the dataset is built, once per node under download_once's guard, and a
  node whose global rank 0 is elsewhere would never get them.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.script import Script, ref_of
from ddpify.convert.context import RANK0, Context

TEMP_DIRS = frozenset(
    {"tempfile.TemporaryDirectory", "tempfile.mkdtemp", "tempfile.NamedTemporaryFile", "tempfile.mkstemp"}
)
TEMPORARY_DIRECTORY = frozenset({"tempfile.TemporaryDirectory"})
MKDTEMP = frozenset({"tempfile.mkdtemp"})
GETPID = frozenset({"os.getpid"})
DATASETS = frozenset(
    {"torch.utils.data.Dataset", "torch.utils.data.dataset.Dataset"} | N.ITERABLE_DATASET
)
PIPELINE_METHODS = frozenset({"__getitem__", "__getitems__", "__len__", "__iter__"})
PIPELINE_KEYWORDS = ("collate_fn", "worker_init_fn")
# A name spelled like this process's rank or id (a parameter or attribute ddpify cannot follow).
_RANK_NAME = re.compile(r"(^|_)(rank|pid|worker_id)$", re.IGNORECASE)


class PerProcess:
    """The facts above, computed once per script. `shared`: temporary directories every rank
    uses rank 0's of (shared_temp_dirs): files there are rank 0's, not each process's."""

    def __init__(self, script: Script, shared: Collection[str] = ()) -> None:
        self.script = script
        self.shared = set(shared)
        self.temp_dirs = self._temp_dirs() - self.shared
        self.pipeline = self._pipeline_functions()
        self.dataset_methods = [fn for cls in self._dataset_classes() for fn in script.methods(cls).values()]
        self.handles: set[str] = set()
        self.handles = self._handles()

    def in_pipeline(self, node: cst.CSTNode) -> bool:
        """Does `node` run in the data pipeline (a Dataset method, a collate_fn, a worker_init_fn)?"""
        return any(self.script.inside(node, fn) for fn in self.pipeline)

    def prepares_data(self, node: cst.CSTNode) -> bool:
        """Does `node` run in a method of a Dataset class (which writes the dataset's own files)?"""
        return any(self.script.inside(node, fn) for fn in self.dataset_methods)

    def path(self, node: cst.CSTNode, depth: int = 0) -> bool:
        """Is `node` (a path, or a value a path is built from) this process's own?"""
        script = self.script
        if D.reads_rank(script, node) or any(script.is_call_to(c, GETPID | TEMP_DIRS) for c in _calls(script, node)):
            return True
        scope = script.scope_of(node) if script.parent(node) is not None else script.module
        for ref in _refs(node):
            if ref in self.shared:
                continue  # rank 0's folder on every rank
            if ref in self.temp_dirs or ref in self.handles:
                return True
            scopes = script.scopes_for(ref, scope) if ref.startswith("self.") else [scope]
            bound = [a.value for where in scopes for a in script.assigns.get(where, []) if ref_of(a.targets[0].target) == ref]
            if bound:
                if depth < 3 and any(self.path(value, depth + 1) for value in bound):
                    return True
            elif _RANK_NAME.search(ref.rsplit(".", 1)[-1]):
                return True  # `args.rank`, a `rank` parameter
            elif depth < 3 and isinstance(scope, cst.FunctionDef):
                passed = self._passed_to(scope, ref)  # `train(..., log_path)`, `Journal(path)`
                if passed and all(self.path(value, depth + 1) for value in passed):
                    return True
        return False

    def _passed_to(self, fn: cst.FunctionDef, param: str) -> list[cst.BaseExpression]:
        """What every call of `fn` (a function, a method, or a class whose `__init__` it is)
        passes for parameter `param`; empty when some call passes nothing for it."""
        script = self.script
        names = [p.name.value for p in fn.params.params]
        if param not in names:
            return []
        cls = script.class_of(fn)
        found = []
        for call in script.calls:
            made = cls is not None and fn.name.value == "__init__" and script.class_called(call) is cls
            if not made and (script.local_function(call) or script.method_of_object(call)) is not fn:
                continue
            params = names[1:] if names[:1] == ["self"] and (made or isinstance(call.func, cst.Attribute)) else names
            value = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == param), None)
            positional = N.positional(call)
            if value is None and param in params and params.index(param) < len(positional):
                value = positional[params.index(param)].value
            if value is None:
                return []
            found.append(value)
        return found

    def _temp_dirs(self) -> set[str]:
        """Names bound to a temporary directory or file: `with TemporaryDirectory() as d`, `d = mkdtemp()`."""
        script = self.script
        found = set()
        for call in script.calls:
            if not script.is_call_to(call, TEMP_DIRS):
                continue
            holder = script.parent(call)
            if isinstance(holder, cst.WithItem) and holder.asname is not None:
                ref = ref_of(holder.asname.name)
            elif isinstance(holder, cst.Assign) and holder.value is call:
                ref = ref_of(holder.targets[0].target)
            else:
                ref = None
            if ref:
                found.add(ref)
        return found

    def _handles(self) -> set[str]:
        """`f` of `with open(<this process's path>, "w") as f`."""
        script = self.script
        found = set()
        for call in script.calls:
            holder = script.parent(call)
            args = N.positional(call)
            if script.is_call_to(call, N.OPEN) and isinstance(holder, cst.WithItem) and holder.asname and args:
                ref = ref_of(holder.asname.name)
                if ref and self.path(args[0].value):
                    found.add(ref)
        return found

    def _dataset_classes(self) -> list[cst.ClassDef]:
        script = self.script
        return [
            cls for cls in script.classes.values()
            if {q for base in cls.bases for q in script.names(base.value)} & DATASETS or cls.name.value.endswith("Dataset")
        ]  # fmt: skip

    def _pipeline_functions(self) -> list[cst.CSTNode]:
        script = self.script
        found: list[cst.CSTNode] = []
        for cls in self._dataset_classes():
            found += [fn for name, fn in script.methods(cls).items() if name in PIPELINE_METHODS]
        for fn in script.all_functions:
            if fn.name.value in PIPELINE_KEYWORDS:
                found.append(fn)
        for call in script.calls:
            for keyword in PIPELINE_KEYWORDS:
                arg = N.keyword(call, keyword)
                if arg is None:
                    continue
                value = arg.value
                if isinstance(value, cst.Lambda):
                    found.append(value)
                elif isinstance(value, cst.Name) and value.value in script.functions:
                    found.append(script.functions[value.value])
        return found


def shared_temp_dirs(ctx: Context) -> dict[str, cst.CSTNode]:
    """Temporary directories made once the process group exists, `with TemporaryDirectory() as d:`
    (-> the `with`), or `d = tempfile.mkdtemp()` (-> its line; also just before the setup): a
    different folder on every rank, so every rank takes rank 0's (dist.broadcast_object_list);
    rank 0 writes there, every rank reads."""
    script = ctx.script
    found: dict[str, cst.CSTNode] = {}
    for call in script.calls:
        holder = script.parent(call)
        if script.is_call_to(call, TEMPORARY_DIRECTORY) and isinstance(holder, cst.WithItem):
            stmt = script.parent(holder)
            name = holder.asname.name if holder.asname is not None else None
            if not (isinstance(stmt, cst.With) and isinstance(name, cst.Name) and isinstance(stmt.body, cst.IndentedBlock)):
                continue
        elif script.is_call_to(call, MKDTEMP) and isinstance(holder, cst.Assign) and holder.value is call:
            stmt = script.parent(holder)
            name = holder.targets[0].target
            if not (isinstance(stmt, cst.SimpleStatementLine) and isinstance(name, cst.Name)):
                continue
        else:
            continue
        if D.guarded_by_rank(script, stmt):
            continue  # rank 0's alone already: a broadcast there would wait forever
        if ctx.rank0_condition(stmt) == RANK0 or (isinstance(stmt, cst.SimpleStatementLine) and before_setup(ctx, stmt)):
            found[name.value] = stmt
    return found


def before_setup(ctx: Context, stmt: cst.CSTNode) -> bool:
    """Is `stmt` a statement of the setup scope's block that runs before the process group exists?"""
    script, scope = ctx.script, ctx.setup_scope
    if scope is None or script.scope_of(stmt) is not scope:
        return False
    body = list(script.block_of(scope).body)
    return stmt in body and body.index(stmt) < ctx.init_index < len(body)


def _calls(script: Script, node: cst.CSTNode) -> list[cst.Call]:
    return [node] + script.calls_in(node) if isinstance(node, cst.Call) else script.calls_in(node)


def _refs(node: cst.CSTNode) -> list[str]:
    """The names and `self.` attributes `node` reads (`args.rank` as `args.rank` too)."""
    found: list[str] = []

    class _Refs(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            found.append(n.value)

        def visit_Attribute(self, n: cst.Attribute) -> bool:
            if isinstance(n.value, cst.Name):
                found.append(f"{n.value.value}.{n.attr.value}")
                return False
            return True

    node.visit(_Refs())
    return found
