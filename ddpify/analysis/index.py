"""One index of a file, built in one traversal, shared by `convert` and `check`.

The traversal walks the syntax tree's own fields (no node is rebuilt, unlike a libcst
visitor, and whitespace is skipped) in libcst's visiting order, and records what both
analyses ask about: every call with its enclosing function, loops and scope; functions,
loops, bindings, imports and parents. Analyses that need their own facts plug a visitor
into the same traversal (``extra``: an object with ``visit_<Node>``/``leave_<Node>``
methods, called like a ``cst.CSTVisitor``'s).

Qualified names follow libcst's ``QualifiedNameProvider`` (same strings for imports and
builtins: ``dist.all_reduce`` -> ``torch.distributed.all_reduce``, ``print`` ->
``builtins.print``, a local ``model.parameters`` -> ``main.<locals>.model.parameters``)
but come from the bindings the traversal records, resolved on demand and cached: libcst's
scope analysis alone costs three times the parse. ``tests/test_check_index.py`` compares the
two on every bundled script. Positions (line, column) are those of libcst's
``PositionProvider``, computed by ``analysis/positions.py`` once per file, only when something
asks for one. ``index_of(module)`` shares one index between every analysis of a module.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections import OrderedDict
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import libcst as cst

from ddpify.analysis import names as N

Loop = Union[cst.For, cst.While]
Func = cst.FunctionDef
Scope = Union[cst.Module, cst.FunctionDef, cst.ClassDef, cst.Lambda]

_BUILTINS = frozenset(dir(builtins))
# Fields that hold only tokens and whitespace: never walked.
_SKIP = frozenset(
    {"asynchronous", "colon", "comma", "dot", "equal", "first_colon", "second_colon", "footer", "header",
     "lbrace", "lbracket", "rbrace", "rbracket", "leading_lines", "lines_after_decorators", "lpar", "rpar",
     "newline", "operator", "semicolon", "trailing_whitespace", "empty_lines", "last_line", "first_line",
     "comment", "indent", "posonly_ind", "separator", "relative", "star"}
)  # fmt: skip
_FIELDS: dict[type, tuple[str, ...]] = {}


def visit_order(cls: type) -> tuple[str, ...]:
    """Every field of a node class, in the order libcst visits (and writes) them: the order the
    field names first appear as constants of its `_visit_and_replace_children`, each a
    `visit_*(self, "name", ...)` call (reading the code object, not the source, which costs
    tens of milliseconds of tokenizing on a run's first walk)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    consts = cls._visit_and_replace_children.__code__.co_consts
    return tuple(dict.fromkeys(c for c in consts if isinstance(c, str) and c in fields))


def _fields(cls: type) -> tuple[str, ...]:
    """The fields of a node class that may hold nodes, in libcst's visiting order."""
    found = _FIELDS.get(cls)
    if found is None:
        found = _FIELDS[cls] = tuple(f for f in visit_order(cls) if f not in _SKIP and not f.startswith("whitespace"))
    return found


_NODE_CLASSES: dict[type, bool] = {}


def is_node_class(cls: type) -> bool:
    """Is `cls` a libcst node class? (Cached: ``isinstance`` against libcst's abstract base
    class costs more than the rest of a walk's step.)"""
    found = _NODE_CLASSES.get(cls)
    if found is None:
        found = _NODE_CLASSES[cls] = issubclass(cls, cst.CSTNode)
    return found


def iter_nodes(node: cst.CSTNode, prune=None) -> Iterator[cst.CSTNode]:
    """``node`` and every node under it, in libcst's visiting order, without rebuilding any
    (a libcst visitor rebuilds the tree it walks); tokens and whitespace are left out. Below a
    node for which ``prune(node)`` is true, nothing is visited."""
    stack = [node]
    node_classes = _NODE_CLASSES
    while stack:
        n = stack.pop()
        yield n
        if prune is not None and n is not node and prune(n):
            continue
        children = []
        for name in _FIELDS.get(n.__class__) or _fields(n.__class__):
            value = getattr(n, name)
            cls = value.__class__
            if cls is tuple or cls is list:
                children.extend(value)  # libcst's sequences hold nodes only
            elif node_classes.get(cls) or (cls not in node_classes and is_node_class(cls)):
                children.append(value)
        stack.extend(reversed(children))


def names_in(node: cst.CSTNode) -> set[str]:
    """The value of every Name in `node` (itself included): `{"x", "i", "shape"}` for `x[i].shape`."""
    return {n.value for n in iter_nodes(node) if isinstance(n, cst.Name)}


def dotted_name(node: cst.CSTNode) -> Optional[str]:
    """``self.model`` for an Attribute chain of Names, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


_LIBRARY_BASES = ("torch.", "builtins.", "abc.", "typing.", "collections.")  # bases no class of the project derives through


def last_name(node: cst.CSTNode) -> Optional[str]:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return node.attr.value
    if isinstance(node, cst.Call):
        return last_name(node.func)
    return None


def full_name(node: cst.CSTNode) -> Optional[str]:
    """libcst's ``get_full_name_for_node`` for the nodes a qualified name is asked of:
    ``a.b`` for ``a.b``, ``a().b`` and ``a[0].b``."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{full_name(node.value)}.{node.attr.value}"  # "None.format" for "".format, as libcst
    if isinstance(node, cst.Call):
        return full_name(node.func)
    if isinstance(node, cst.Subscript):
        return full_name(node.value)
    return None


class CallInfo:
    """One call site, with what the analyses ask about it."""

    __slots__ = ("node", "name", "dotted", "receiver", "func", "loops", "scope", "_withs", "_index", "_qnames", "_no_grad")

    def __init__(self, node: cst.Call, func, loops, scope, withs, index: "FileIndex") -> None:
        f = node.func
        self.node = node
        self.name = last_name(f) or ""  # last component: "save" for torch.save, "state_dict" for m.state_dict
        self.dotted = dotted_name(f)  # "torch.save", "self.model.state_dict", None for computed callees
        self.receiver = f.value if isinstance(f, cst.Attribute) else None  # the object of a method call
        self.func: Optional[Func] = func  # enclosing function
        self.loops: tuple[Loop, ...] = loops  # enclosing loops inside that function, innermost last
        self.scope: Scope = scope  # the scope whose names the callee reads
        self._withs = withs
        self._index = index
        self._qnames: Optional[frozenset[str]] = None
        self._no_grad: Optional[bool] = None

    @property
    def qnames(self) -> frozenset[str]:
        if self._qnames is None:
            self._qnames = self._index.qnames_in(self.node.func, self.scope)
        return self._qnames

    @property
    def in_no_grad(self) -> bool:
        if self._no_grad is None:
            self._no_grad = any(self._index.is_no_grad(w) for w in self._withs)
        return self._no_grad

    def is_(self, *names: str) -> bool:
        q = self.qnames
        return any(n in q for n in names)

    def qname_startswith(self, prefix: str) -> bool:
        return any(q.startswith(prefix) for q in self.qnames)

    def __repr__(self) -> str:  # pragma: no cover - debugging
        return f"CallInfo({self.dotted or self.name!r})"


class Binding:
    """A name (or ``self.attr`` chain) bound to a value, in a function (None: module level)."""

    __slots__ = ("dotted", "func", "value", "_line", "_node", "_index")

    def __init__(self, dotted: str, func: Optional[Func], line: Optional[int], value: cst.BaseExpression,
                 node: Optional[cst.CSTNode] = None, index: Optional["FileIndex"] = None) -> None:  # fmt: skip
        self.dotted = dotted
        self.func = func
        self.value = value
        self._line = line
        self._node = node
        self._index = index

    @property
    def line(self) -> int:
        if self._line is None:
            self._line = self._index.line(self._node)
        return self._line

    def __repr__(self) -> str:  # pragma: no cover - debugging
        return f"Binding({self.dotted!r})"


_IMPORT, _LOCAL = 0, 1
# parents under which a Name is not a read of a variable
_NOT_ACCESS = (cst.ImportAlias, cst.ImportFrom, cst.FunctionDef, cst.ClassDef, cst.NameItem)
_SCOPE_TYPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)  # their body is their own scope
_COMP_TYPES = (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)  # all of them is


class FileIndex:
    """Everything one traversal learns about a module; derived facts are computed on demand."""

    def __init__(
        self,
        module: cst.Module,
        extra: Iterable[object] = (),
        others: Optional[dict[str, cst.Module]] = None,
        packages: frozenset[str] = frozenset(),
    ) -> None:
        """`others`: the other modules of a project (dotted name -> module), walked into the same
        index: a name imported from one of them resolves to the qualified name of its definition
        there (`engine.train_fn`), so calls follow it from module to module; `packages`: which of
        them are a package's `__init__`."""
        self.module = module
        self.roots: dict[cst.Module, str] = {module: ""}  # every module walked -> its dotted name
        self._project = bool(others)  # a file alone keeps libcst's names for relative imports (`.x.Y`)
        self.parents: dict[cst.CSTNode, cst.CSTNode] = {}
        self.calls: list[CallInfo] = []
        self.call_info: dict[cst.Call, CallInfo] = {}
        self.functions: dict[str, list[Func]] = {}  # every function and method, by name
        self.all_functions: list[Func] = []
        self.classes: list[cst.ClassDef] = []
        self.loops: list[Loop] = []
        self.loop_func: dict[Loop, Optional[Func]] = {}
        self.assignments: list[Binding] = []
        self.subscripts: list[cst.Subscript] = []
        self.imported_modules: list[str] = []  # every module and name imported, dotted
        self.own_imports: list[str] = []  # those the module itself imports (not the project modules walked with it)
        self.reads_rank_env = False  # a "LOCAL_RANK"/"WORLD_SIZE" string
        # the indexes of the files that import this one (their programs call its functions and build
        # its classes), found lazily by whoever knows the project (the checker); none by default
        self.importers: Callable[[], Sequence["FileIndex"]] = tuple
        # scope -> name -> bindings ((_IMPORT, real name) or (_LOCAL, None))
        self._bindings: dict[cst.CSTNode, dict[str, list[tuple[int, Optional[str]]]]] = {module: {}}
        self._globals: dict[cst.CSTNode, set[str]] = {}
        self._locals_of: Optional[dict[Func, set[str]]] = None  # built on first use
        self._nonlocals: dict[cst.CSTNode, set[str]] = {}
        self._scope_parent: dict[cst.CSTNode, cst.CSTNode] = {}
        self._qualname: dict[cst.CSTNode, str] = {module: ""}
        self._qn_cache: dict[tuple[int, str], frozenset[str]] = {}
        self._no_grad: dict[cst.With, bool] = {}
        self._positions = None
        self._lines: dict[cst.CSTNode, int] | None = None
        self._order: Optional[tuple[dict, dict]] = None
        self._extra = tuple(extra)
        self._handlers: dict[type, tuple] = {}
        # traversal state
        self._funcs: list[Func] = []
        self._loop_stack: list[list[Loop]] = [[]]
        self._scopes: list[cst.CSTNode] = [module]
        self._withs: list[cst.With] = []
        self._root = module
        self._packages = packages
        self._stars: dict[cst.Module, list[str]] = {}
        self._walk(module)
        for name, other in (others or {}).items():
            self.roots[other] = name
            self._root = other
            self._bindings[other] = {}
            self._qualname[other] = name
            self._scopes = [other]
            self._walk_imported(other)
        del self._funcs, self._loop_stack, self._scopes, self._withs, self._handlers, self._root, self._packages

    # the traversal --------------------------------------------------------------------------------
    def _walk_imported(self, module: cst.Module) -> None:
        """A module the program imports: walked without its `if __name__ == "__main__":` block
        (its self-test), which never runs on import, so no analysis sees it and no pass edits it."""
        test = main_guard(module)
        if test is None:
            self._walk(module)
            return
        visit, leave, _ = self._handlers.get(cst.Module) or self._handlers_for(cst.Module)
        for fn in visit:
            fn(module)
        for stmt in module.body:  # a Module's one field that holds nodes
            self.parents[stmt] = module
            if stmt is not test:
                self._walk(stmt)
        for fn in leave:
            fn(module)

    def _handlers_for(self, cls: type) -> tuple:
        name = cls.__name__
        visit, leave = [], []
        own = getattr(self, "_enter_" + name, None)
        if own is not None:
            visit.append(own)
        for v in self._extra:
            for prefix, found in (("visit_", visit), ("leave_", leave)):
                fn = getattr(v, prefix + name, None)
                if fn is not None and getattr(type(v), prefix + name) is not getattr(cst.CSTVisitor, prefix + name, None):
                    found.append(fn)  # the visitor's own method, not libcst's no-op default
        own = getattr(self, "_leave_" + name, None)
        if own is not None:
            leave.append(own)
        found = self._handlers[cls] = (tuple(visit), tuple(leave), _fields(cls))
        return found

    def _walk(self, node: cst.CSTNode) -> None:
        handlers = self._handlers
        parents = self.parents
        scopes = self._scopes
        node_classes = _NODE_CLASSES
        scope_types = _SCOPE_TYPES
        comp_types = _COMP_TYPES

        def walk(node: cst.CSTNode) -> None:
            cls = node.__class__
            h = handlers.get(cls)
            if h is None:
                h = self._handlers_for(cls)
            visit, leave, fields = h
            for fn in visit:
                fn(node)
            is_scope = cls in scope_types
            if cls in comp_types:
                scopes.append(node)
            for name in fields:
                value = getattr(node, name)
                vcls = value.__class__
                if vcls is tuple or vcls is list:
                    for child in value:  # libcst's sequences hold nodes only
                        parents[child] = node
                        walk(child)
                elif node_classes.get(vcls) or (vcls not in node_classes and is_node_class(vcls)):
                    parents[value] = node
                    if is_scope and name == "body":
                        scopes.append(node)
                        walk(value)
                        scopes.pop()
                    else:
                        walk(value)
            if cls in comp_types:
                scopes.pop()
            for fn in leave:
                fn(node)

        walk(node)

    def _bind(self, name: str, kind: int = _LOCAL, real: Optional[str] = None) -> None:
        scope = self._scopes[-1]
        if name in self._globals.get(scope, ()):
            scope = self._root
        while name in self._nonlocals.get(scope, ()):  # bound in the enclosing function
            scope = self._enclosing(scope)
        self._bindings.setdefault(scope, {}).setdefault(name, []).append((kind, real))

    def _bind_target(self, target: cst.CSTNode) -> None:
        if isinstance(target, cst.Name):
            self._bind(target.value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            for el in target.elements:
                self._bind_target(el.value)
        elif isinstance(target, cst.StarredElement):
            self._bind_target(target.value)

    def _enter_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.functions.setdefault(node.name.value, []).append(node)
        self.all_functions.append(node)
        self._bind(node.name.value)
        self._new_scope(node, node.name.value)
        params = node.params
        for p in (*params.posonly_params, *params.params, *params.kwonly_params):
            self._bindings[node].setdefault(p.name.value, []).append((_LOCAL, None))
        for p in (params.star_arg, params.star_kwarg):
            if isinstance(p, cst.Param):
                self._bindings[node].setdefault(p.name.value, []).append((_LOCAL, None))
        self._funcs.append(node)
        self._loop_stack.append([])

    def _leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._funcs.pop()
        self._loop_stack.pop()

    def _new_scope(self, node: cst.CSTNode, name: str) -> None:
        outer = self._scopes[-1]
        self._scope_parent[node] = outer
        prefix = self._qualname[outer]
        if isinstance(outer, (cst.FunctionDef, cst.Lambda)):
            prefix += ".<locals>."
        elif prefix:
            prefix += "."
        # a lambda's names read `f.<locals>.<locals>.x`, as libcst has them
        self._qualname[node] = prefix[:-1] if isinstance(node, cst.Lambda) else prefix + name
        self._bindings[node] = {}

    def _enter_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.append(node)
        self._bind(node.name.value)
        self._new_scope(node, node.name.value)

    def _enter_Lambda(self, node: cst.Lambda) -> None:
        self._new_scope(node, "<lambda>")
        params = node.params
        for p in (*params.posonly_params, *params.params, *params.kwonly_params):
            self._bindings[node].setdefault(p.name.value, []).append((_LOCAL, None))

    def _comprehension(self, node: cst.CSTNode) -> None:
        self._new_scope(node, "<comprehension>")

    _enter_ListComp = _enter_SetComp = _enter_GeneratorExp = _enter_DictComp = _comprehension

    def _enter_CompFor(self, node: cst.CompFor) -> None:
        self._bind_target(node.target)

    def _enclosing(self, scope: cst.CSTNode) -> cst.CSTNode:
        """The scope a nested scope's free names come from (class bodies are skipped)."""
        outer = self._scope_parent.get(scope, self.module)
        while isinstance(outer, cst.ClassDef):
            outer = self._scope_parent[outer]
        return outer

    def _enter_Nonlocal(self, node: cst.Nonlocal) -> None:
        names = self._nonlocals.setdefault(self._scopes[-1], set())
        names.update(item.name.value for item in node.names)

    def _enter_Global(self, node: cst.Global) -> None:
        names = self._globals.setdefault(self._scopes[-1], set())
        names.update(item.name.value for item in node.names)

    def _enter_For(self, node: cst.For) -> None:
        self.loops.append(node)
        self.loop_func[node] = self._funcs[-1] if self._funcs else None
        self._loop_stack[-1].append(node)
        self._bind_target(node.target)

    def _leave_For(self, node: cst.For) -> None:
        self._loop_stack[-1].pop()

    def _enter_While(self, node: cst.While) -> None:
        self.loops.append(node)
        self.loop_func[node] = self._funcs[-1] if self._funcs else None
        self._loop_stack[-1].append(node)

    _leave_While = _leave_For

    def _enter_With(self, node: cst.With) -> None:
        if any(isinstance(item.item, cst.Call) for item in node.items):
            self._withs.append(node)
            self._no_grad[node] = None
        for item in node.items:
            if item.asname is not None:
                self._bind_target(item.asname.name)

    def _leave_With(self, node: cst.With) -> None:
        if self._withs and self._withs[-1] is node:
            self._withs.pop()

    def _enter_ExceptHandler(self, node: cst.ExceptHandler) -> None:
        if node.name is not None:
            self._bind_target(node.name.name)

    def _enter_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._bind_target(node.target)

    def _enter_Import(self, node: cst.Import) -> None:
        for alias in node.names:
            full = dotted_name(alias.name) or ""
            self.imported_modules.append(full)
            if self._root is self.module:
                self.own_imports.append(full)
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                self._bind(alias.asname.name.value, _IMPORT, full)
            else:
                first = full.split(".")[0]
                self._bind(first, _IMPORT, first)

    def _enter_ImportFrom(self, node: cst.ImportFrom) -> None:
        base = "." * len(node.relative) + (dotted_name(node.module) or "" if node.module is not None else "")
        if node.relative and self._root is not self.module:  # `from .base import X` in package `a`: `a.base.X`
            package = self.roots[self._root].split(".")
            if self.roots[self._root] not in self._packages:
                package = package[:-1]
            up = len(node.relative) - 1
            package = package[: len(package) - up] if len(package) >= up else []
            base = ".".join(p for p in (*package, dotted_name(node.module) if node.module is not None else "") if p) + (
                "" if node.module is not None else "."
            )
        elif node.relative and len(node.relative) == 1 and self._project:  # the entry of a project (`pkg/__main__.py`):
            base = dotted_name(node.module) or "" if node.module is not None else ""  # its folder's modules, as found
        if node.module is not None and not node.relative:
            self.imported_modules.append(base)
            if self._root is self.module:
                self.own_imports.append(base)
        if isinstance(node.names, cst.ImportStar):
            self._stars.setdefault(self._root, []).append(base)  # `from .trainer import *` re-exports
            return
        for alias in node.names:
            name = dotted_name(alias.name) or ""
            real = f"{base}.{name}" if base and not base.endswith(".") else f"{base}{name}"
            if node.module is not None and not node.relative:
                self.imported_modules.append(real)
                if self._root is self.module:
                    self.own_imports.append(real)
            local = alias.asname.name.value if alias.asname is not None and isinstance(alias.asname.name, cst.Name) else name
            self._bind(local, _IMPORT, real)

    def _enter_Call(self, node: cst.Call) -> None:
        info = CallInfo(
            node,
            self._funcs[-1] if self._funcs else None,
            tuple(self._loop_stack[-1]),
            self._scopes[-1],
            tuple(self._withs),
            self,
        )
        self.calls.append(info)
        self.call_info[node] = info

    def _assignment(self, target: cst.CSTNode, value: cst.BaseExpression) -> None:
        name = dotted_name(target)
        if name is not None:
            self.assignments.append(Binding(name, self._funcs[-1] if self._funcs else None, None, value, target, self))

    def _enter_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._assignment(t.target, node.value)
            self._bind_target(t.target)

    def _enter_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:
            self._assignment(node.target, node.value)
        self._bind_target(node.target)

    def _enter_AugAssign(self, node: cst.AugAssign) -> None:
        self._bind_target(node.target)

    def _enter_Subscript(self, node: cst.Subscript) -> None:
        self.subscripts.append(node)

    def _enter_SimpleString(self, node: cst.SimpleString) -> None:
        if "LOCAL_RANK" in node.value or "WORLD_SIZE" in node.value:
            self.reads_rank_env = True

    # metadata -------------------------------------------------------------------------------------
    def parent(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self.parents.get(node)

    def ancestors(self, node: cst.CSTNode) -> Iterable[cst.CSTNode]:
        p = self.parents.get(node)
        while p is not None:
            yield p
            p = self.parents.get(p)

    def exclusive(self, a: cst.CSTNode, b: cst.CSTNode) -> bool:
        """Are `a` and `b` in different branches of one `if` (or conditional expression): no run
        goes through both (write a file, else read it)?"""
        branch_of_a: dict[cst.CSTNode, cst.CSTNode] = {}
        child = a
        for p in self.ancestors(a):
            if isinstance(p, (cst.If, cst.IfExp)):
                branch_of_a[p] = child
            child = p
        child = b
        for p in self.ancestors(b):
            if p in branch_of_a:
                mine, theirs = branch_of_a[p], child
                return mine is not theirs and {mine, theirs} <= {p.body, p.orelse}
            child = p
        return False

    @property
    def positions(self):
        """Every node's ``CodeRange`` (libcst's PositionProvider's): computed on first use, once."""
        if self._positions is None:
            from ddpify.analysis.positions import Positions

            self._positions = Positions(self.module)
            for other in list(self.roots)[1:]:
                self._positions._raw.update(Positions(other)._raw)
        return self._positions

    def source_order(self) -> tuple[dict[cst.CSTNode, int], dict[cst.CSTNode, int]]:
        """Where each node starts and ends in source order (numbers, not lines): the traversal
        files every node in ``parents`` just before its subtree, so that order is the source's.
        Comparing these needs no positions (a conversion compares order far more often than it
        needs a line)."""
        if self._order is None:
            parents = self.parents
            start = dict.fromkeys(self.roots, 0)
            for i, node in enumerate(parents, 1):
                start[node] = i
            end = dict(start)
            for node in reversed(list(parents)):  # children before their parents
                parent = parents[node]
                if end[node] > end[parent]:
                    end[parent] = end[node]
            self._order = (start, end)
        return self._order

    def position(self, node: cst.CSTNode):
        return self.positions[node]

    def line(self, node: cst.CSTNode) -> int:
        """The line `node` starts on (counted without generating code: ``positions.start_lines``)."""
        if self._lines is None:
            from ddpify.analysis.positions import start_lines

            self._lines = start_lines(self.module)
            for other in list(self.roots)[1:]:
                self._lines.update(start_lines(other))
        return self._lines[node]

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def scope_of(self, node: cst.CSTNode) -> cst.CSTNode:
        """The scope whose names ``node`` reads (a function's, class's or lambda's body; else the module)."""
        child = node
        for p in self.ancestors(node):
            if p.__class__ in _SCOPE_TYPES and child is p.body or p.__class__ in _COMP_TYPES:
                return p
            child = p
        return child if child.__class__ is cst.Module else self.module

    # qualified names ------------------------------------------------------------------------------
    def qnames(self, node: cst.CSTNode) -> frozenset[str]:
        """The qualified names ``node`` may refer to (libcst's QualifiedNameProvider's strings)."""
        info = self.call_info.get(self.parents.get(node)) if node.__class__ is not cst.Call else None
        if info is not None and info.node.func is node:
            return info.qnames
        return self.qnames_in(node, None)

    def qnames_in(self, node: cst.CSTNode, scope: Optional[cst.CSTNode]) -> frozenset[str]:
        parent = self.parents.get(node)
        if isinstance(node, cst.Name):
            if parent is None or isinstance(parent, _NOT_ACCESS) or getattr(parent, "keyword", None) is node:
                if isinstance(parent, (cst.FunctionDef, cst.ClassDef)) and parent.name is node:
                    return frozenset({self._qualname[parent]})
                return frozenset()
            if isinstance(parent, cst.Attribute) and (parent.attr is node or self._in_import(parent)):
                return frozenset()
            if isinstance(parent, cst.AsName) and isinstance(self.parents.get(parent), cst.ImportAlias):
                return frozenset()
            if isinstance(parent, cst.Param):
                scope = self.scope_of(self.parents.get(self.parents.get(parent)))  # the function's own
                scope = next((a for a in self.ancestors(parent) if isinstance(a, (cst.FunctionDef, cst.Lambda))), scope)
            dotted = node.value
        elif isinstance(node, cst.Attribute):
            dotted = full_name(node)
            if dotted is None or isinstance(parent, _NOT_ACCESS) or self._in_import(node):
                return frozenset()
        else:
            return frozenset()
        if scope is None:
            scope = self.scope_of(node)
        if isinstance(parent, cst.AssignTarget) and parent.target is node and node.__class__ is cst.Name:  # its own name
            return frozenset({self._local(dotted, scope)})
        key = (id(scope), dotted)
        found = self._qn_cache.get(key)
        if found is None:
            found = self._qn_cache[key] = self._resolve(dotted, scope)
        return found

    def _in_import(self, node: cst.CSTNode) -> bool:
        for p in self.ancestors(node):
            if isinstance(p, (cst.Import, cst.ImportFrom)):
                return True
            if not isinstance(p, (cst.Attribute, cst.ImportAlias)):
                return False
        return False

    def is_import(self, node: cst.Name) -> bool:
        """Is this name bound by an import where it is read (`Image` of `from PIL import Image`,
        `tarfile`), not by an assignment, a parameter or a definition?"""
        found, _ = self._bindings_for(node.value, self.scope_of(node))
        return bool(found) and all(kind == _IMPORT for kind, _ in found)

    def _bindings_for(self, base: str, scope: cst.CSTNode) -> tuple[list, cst.CSTNode]:
        """The bindings of `base` seen from `scope` (Python's scoping: globals, nonlocals, class
        bodies invisible to their methods), and the scope that holds them; ([], the module) if none."""
        start = scope
        while True:
            if base in self._globals.get(scope, ()):
                scope = self._root_of(scope)
            while base in self._nonlocals.get(scope, ()):
                scope = self._enclosing(scope)
            found = self._bindings.get(scope, {}).get(base)
            if found:
                return found, scope
            if scope.__class__ is cst.Module:
                return [], scope
            scope = self._scope_parent[scope]
            while isinstance(scope, cst.ClassDef) and scope is not start:  # methods do not see class names
                scope = self._scope_parent[scope]

    def _resolve(self, dotted: str, scope: cst.CSTNode) -> frozenset[str]:
        base, _, rest = dotted.partition(".")
        rest = "." + rest if rest else ""
        found, scope = self._bindings_for(base, scope)
        if found:
            out = set()
            for kind, real in found:
                if kind == _IMPORT:
                    out.add(real + rest)
                else:
                    out.add(self._local(dotted, scope))
            loaders = self._loader_classes()
            return frozenset(out | N.DATALOADER) if loaders and not loaders.isdisjoint(out) else frozenset(out)
        starred = self._from_stars(base, dotted, scope) if scope in self._stars else frozenset()
        if starred:
            return starred
        if base in _BUILTINS:
            return frozenset({"builtins." + base})
        return frozenset()

    def _from_stars(self, base: str, dotted: str, module: cst.CSTNode) -> frozenset[str]:
        """A name no statement of `module` binds, from its `from X import *`: what X binds it to
        when X is a module of the project (followed through X's own star imports), else `X.name`
        (a library's star import: `from torch.nn import *` makes `Linear` `torch.nn.Linear`)."""
        by_name = {name: root for root, name in self.roots.items()}
        found: set[str] = set()
        visiting = self.__dict__.setdefault("_star_visits", set())
        if module in visiting:
            return frozenset()
        visiting.add(module)
        try:
            for star in self._stars[module]:
                other = by_name.get(star)
                if other is not None and other is not module:
                    found |= self._resolve(dotted, other) - {"builtins." + base}
                elif other is None and not star.startswith(".") and base not in _BUILTINS:
                    found.add(f"{star}.{dotted}")
        finally:
            visiting.discard(module)
        return frozenset(found)

    def root_of(self, node: cst.CSTNode) -> cst.Module:
        """The module (of a project's) that holds `node`."""
        if len(self.roots) == 1:
            return self.module
        for node in self.ancestors(node):
            pass
        return node if node.__class__ is cst.Module else self.module

    def _root_of(self, scope: cst.CSTNode) -> cst.CSTNode:
        """The module a scope is in."""
        while scope.__class__ is not cst.Module:
            scope = self._scope_parent[scope]
        return scope

    def _local(self, dotted: str, scope: cst.CSTNode) -> str:
        if dotted.partition(".")[0] in self._globals.get(scope, ()):
            scope = self._root_of(scope)
        prefix = self._qualname[scope]
        if isinstance(scope, (cst.FunctionDef, cst.Lambda)):
            prefix += ".<locals>." if prefix else "<locals>."  # a lambda of the module: `<locals>.p`, as libcst has it
        elif prefix:
            prefix += "."
        return prefix + dotted

    def is_no_grad(self, node: cst.With) -> bool:
        found = self._no_grad.get(node)
        if found is None:
            found = any(
                isinstance(item.item, cst.Call)
                and N.NO_GRAD & self.qnames(item.item.func)
                for item in node.items
            )
            self._no_grad[node] = found
        return found

    # the call graph ---------------------------------------------------------------------------------
    def calls_to(self, *qnames: str) -> list[CallInfo]:
        wanted = set(qnames)
        return [c for c in self.calls if c.qnames & wanted]

    def calls_under(self, outer: cst.CSTNode) -> list[CallInfo]:
        """The calls inside `outer` (itself included), in source order: each call is filed once
        under every node above it, so this is a lookup."""
        under = self.__dict__.get("_calls_under")
        if under is None:
            under = self.__dict__["_calls_under"] = {}
            parents = self.parents
            for ci in self.calls:
                node = ci.node
                while node is not None:
                    under.setdefault(node, []).append(ci)
                    node = parents.get(node)
        return under.get(outer, [])

    def local_callees(self, ci: CallInfo) -> list[Func]:
        """The functions of this file a call may reach (``f(...)`` or ``self.f(...)``)."""
        f = ci.node.func
        if isinstance(f, cst.Name) and ci.qnames:  # not one the name is bound to something else at the call (`from thop import profile`)
            return [fn for fn in self.functions.get(ci.name, []) if not (q := self.qnames(fn.name)) or q & ci.qnames]
        if isinstance(f, cst.Name) or (
            isinstance(f, cst.Attribute) and isinstance(f.value, cst.Name) and f.value.value in ("self", "cls")
        ):
            return self.functions.get(ci.name, [])
        if len(self.roots) > 1:  # a project: `utils.report(...)` reaches utils.py's function
            definitions = self.definitions()
            return [d for q in ci.qnames if isinstance(d := definitions.get(q), cst.FunctionDef)]
        return []

    def _constructors(self, ci: CallInfo) -> list[Func]:
        """The `__init__` of a class of this file's top level that the call builds (`Engine(...)`)."""
        if not isinstance(ci.node.func, cst.Name) or ci.name in self.functions:
            return []
        return [
            stmt for cls in self.classes if cls.name.value == ci.name and isinstance(self.parent(cls), cst.Module)
            and (not (q := self.qnames(cls.name)) or not ci.qnames or q & ci.qnames)
            for stmt in cls.body.body if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__"
        ]  # fmt: skip

    def call_sites(self, func: Func) -> list[CallInfo]:
        sites = self._call_sites
        if sites is None:
            sites = self._call_sites = {}
            for c in self.calls:
                for fn in self.local_callees(c):
                    sites.setdefault(fn, []).append(c)
        return sites.get(func, [])

    _call_sites: Optional[dict] = None

    # bindings ---------------------------------------------------------------------------------------
    def bindings_of(self, qnames: frozenset[str]) -> list[Binding]:
        """Names bound to a call of one of ``qnames``."""
        out = []
        for b in self.assignments:
            v = b.value
            if isinstance(v, cst.Call) and self.call_info[v].qnames & qnames:
                out.append(b)
        return out

    def enclosing_func(self, node: cst.CSTNode) -> Optional[Func]:
        for a in self.ancestors(node):
            if isinstance(a, cst.FunctionDef):
                return a
        return None

    @staticmethod
    def param_names(fn: Func) -> set[str]:
        params = fn.params
        return {p.name.value for p in [*params.posonly_params, *params.params, *params.kwonly_params]}

    @staticmethod
    def param_for(fn: Func, index: int, arg: cst.Arg) -> Optional[str]:
        params = list(fn.params.posonly_params) + list(fn.params.params)
        if arg.keyword is not None:
            names = {p.name.value for p in params} | {p.name.value for p in fn.params.kwonly_params}
            return arg.keyword.value if arg.keyword.value in names else None
        if params and params[0].name.value in ("self", "cls"):
            params = params[1:]
        return params[index].name.value if index < len(params) else None

    def argument_for(self, func: Func, site: CallInfo, name: str) -> Optional[tuple[cst.BaseExpression, Optional[Func]]]:
        """What a call of `func` gives its parameter `name`, with the function whose names that
        expression reads: the argument (read in the caller) or the default (module level); None
        when the call passes `*args`/`**kwargs` or the parameter has no default."""
        for i, arg in enumerate(site.node.args):
            if not arg.star and self.param_for(func, i, arg) == name:
                return arg.value, site.func
        if any(arg.star for arg in site.node.args):
            return None
        params = (*func.params.posonly_params, *func.params.params, *func.params.kwonly_params)
        default = next((p.default for p in params if p.name.value == name), None)
        return (default, None) if default is not None else None

    def is_bound(self, expr: cst.CSTNode, bindings: list[Binding]) -> bool:
        """Does ``expr`` (a name or ``self.attr``) hold a value of ``bindings`` where it is read?"""
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
                param = b.func is not None and b.line == self.line(b.func)
                if (line > b.line or param) and not self._unwrapped_between(name, func, b.line, line):
                    return True
            elif b.func is None:
                if func is not None and name in self.param_names(func):
                    continue  # a parameter shadows the global: bound only through its call sites
                if func is not None and name in self._assigned_in(func):
                    continue  # `model = GPT(config)` in a function: its own local, not the global
                return True
            elif func is not None and b.func is not None and self._nested_in(func, b.func):
                if name not in self.param_names(func) and name not in self._assigned_in(func):
                    return True  # a closure reads the enclosing function's binding
            elif name.startswith("self."):
                if func is not None and b.func is not None and not self._same_object(func, b.func):
                    continue  # `self.model` of another class in the file (`MultiTrainer` beside `BaseTrainer`)
                if func is not None and func.name.value == "__init__" and not any(
                    s.func is func and self.line(s.node) < line for s in self.call_sites(b.func)
                ):
                    continue  # the constructor runs before the other methods (unless it calls this one first)
                # a method only called before the wrapping (e.g. loading a snapshot in __init__)
                sites = self.call_sites(func) if func is not None else []
                if not (sites and all(self._before_wrap(s, b) for s in sites)):
                    return True
        return False

    def _same_object(self, a: Func, b: Func) -> bool:
        """May methods `a` and `b` see the same `self`: methods of one class, of a class and its
        base or subclass here, or not both methods of classes of this file?"""
        ca, cb = (p if isinstance(p := self.parent(self.parent(f)), cst.ClassDef) else None for f in (a, b))
        if ca is None or cb is None or ca is cb:
            return True
        return self._inherits(ca, cb) or self._inherits(cb, ca)

    def _inherits(self, cls: cst.ClassDef, base: cst.ClassDef, depth: int = 0) -> bool:
        """Does `cls` derive from `base` through bases named in this file (or from one it cannot see)?"""
        for arg in cls.bases:
            name = last_name(arg.value)
            if name == base.name.value:
                return True
            known = [c for c in self.classes if c.name.value == name]
            if not known and not (name == "object" or any(q.startswith(_LIBRARY_BASES) for q in self.qnames(arg.value))):
                return True  # a project base from elsewhere may be the other's subclass: assume related
            if depth < 5 and any(self._inherits(c, base, depth + 1) for c in known):
                return True
        return False

    def _before_wrap(self, site: "CallInfo", wrap: Binding, depth: int = 0) -> bool:
        """Does this call of a method run before the binding: earlier in the binding's own method,
        or in the constructor before its call of that method (`self.load_checkpoint()` then
        `self._setup_ddp()` in `__init__`), or in a method whose every call does (`load()` called
        by `load_from_checkpoint()`, which the constructor calls before it wraps)?"""
        if site.func is wrap.func:
            return self.line(site.node) < wrap.line
        if site.func is not None and site.func.name.value == "__init__":
            return any(w.func is site.func and self.line(w.node) > self.line(site.node) for w in self.call_sites(wrap.func))
        callers = self.call_sites(site.func) if site.func is not None and depth < 3 else []
        return bool(callers) and all(c.func is not site.func and self._before_wrap(c, wrap, depth + 1) for c in callers)

    def _unwrapped_between(self, name: str, func: Optional[Func], after: int, before: int) -> bool:
        """Is `name` bound to its own wrapped module (`model = model.module`, often under `if
        args.distributed:`, or `model = model.module if hasattr(model, "module") else model`)
        between two lines of its function: from there it holds the plain model."""
        return any(
            a.dotted == name and a.func is func and after < a.line < before and _module_of(a.value)
            for a in self.assignments
        )

    def _nested_in(self, inner: Func, outer: Func) -> bool:
        """Is `inner` defined inside `outer` (a closure of it)?"""
        return any(p is outer for p in self.ancestors(inner))

    def own_names(self, func: Func) -> set[str]:
        """The names a function binds itself: its parameters and the locals it assigns."""
        return set(self.param_names(func)) | self._assigned_in(func)

    def _assigned_in(self, func: Func) -> set[str]:
        """The plain names a function assigns (its locals, unless declared `global`)."""
        if self._locals_of is None:
            self._locals_of = {}
            for b in self.assignments:
                if b.func is not None and "." not in b.dotted:
                    self._locals_of.setdefault(b.func, set()).add(b.dotted)
        return self._locals_of.get(func, set()) - self._globals.get(func, set())

    def propagate(self, bindings: list[Binding], rounds: int = 3) -> list[Binding]:
        """``bindings`` plus the parameters of local functions that receive one of them, and the
        names bound to one of them (`model = self.model`)."""
        bindings = list(bindings)
        for _ in range(rounds):
            added = False
            for b in self.assignments:
                if isinstance(b.value, (cst.Name, cst.Attribute)) and b._node is not None and b not in bindings:
                    if not any(o.dotted == b.dotted and o.func is b.func for o in bindings) and self.is_bound(b.value, bindings):
                        if not self._one_process_branch(b._node):  # `else: g_module = generator` (no wrapper there)
                            bindings.append(b)
                            added = True
            for ci in self.calls:
                callees = self.local_callees(ci) or self._constructors(ci)  # `Engine(model=model)`: its `__init__` gets it
                if not callees or self._one_process_branch(ci.node):
                    continue  # `if args.local_rank == -1: evaluate(args, model)`: nothing wrapped it there
                for i, arg in enumerate(ci.node.args):
                    if arg.star or not self.is_bound(arg.value, bindings):
                        continue
                    for fn in callees:
                        param = self.param_for(fn, i, arg)
                        if param and not any(b.dotted == param and b.func is fn for b in bindings):
                            bindings.append(Binding(param, fn, None, arg.value, fn, self))
                            added = True
            if not added:
                break
        return bindings

    def _one_process_branch(self, node: cst.CSTNode) -> bool:
        from ddpify.analysis.flow import flow  # (flow reads this index)

        return flow(self).single_process(node)

    def _loader_classes(self) -> frozenset[str]:
        """The project's DataLoader subclasses that take the loader's own arguments (no `__init__`,
        or one with `**kwargs`): a call to one is a DataLoader call (`AudioLoader(ds, shuffle=True)`)."""
        store = self.__dict__.setdefault("_derived", {})
        if "loader_classes" not in store:
            store["loader_classes"] = frozenset()  # while it is worked out, names resolve as they are
            store["loader_classes"] = _loader_classes(self)
        return store["loader_classes"]

    # derived facts, cached ------------------------------------------------------------------------------
    def definitions(self) -> dict[str, cst.CSTNode]:
        """The functions and classes of a project's other modules, by qualified name
        (`engine.train_fn`, `trainer.trainer.Trainer`, `trainer.trainer.Trainer.run`)."""
        return self.cached("definitions", _definitions)

    def cached(self, key: str, compute):
        """A fact derived from the index, computed once (``compute(index)``)."""
        store = self.__dict__.setdefault("_derived", {})
        if key not in store:
            store[key] = compute(self)
        return store[key]


def main_guard(module: cst.Module) -> Optional[cst.If]:
    """The module's top-level `if __name__ == "__main__":` (what runs only as a script)."""
    for stmt in module.body:
        if isinstance(stmt, cst.If) and isinstance(stmt.test, cst.Comparison):
            test = stmt.test
            names = [test.left, *(c.comparator for c in test.comparisons)]
            if len(test.comparisons) == 1 and isinstance(test.comparisons[0].operator, cst.Equal) and any(
                isinstance(n, cst.Name) and n.value == "__name__" for n in names
            ) and any(isinstance(n, cst.SimpleString) and n.evaluated_value == "__main__" for n in names):
                return stmt
    return None


def _definitions(index: FileIndex) -> dict[str, cst.CSTNode]:
    """Qualified name -> function or class of a project's other modules, re-exports included
    (`trainer/__init__.py`: `from .trainer import *` makes `trainer.Trainer` the class of
    `trainer.trainer`; `from .util import prepare_device` makes `utils.prepare_device`)."""
    found = {
        index._qualname[node]: node
        for node in (*index.all_functions, *index.classes)
        if index._root_of(node) is not index.module and "<locals>" not in index._qualname[node]
    }
    for _ in range(3):  # re-exports of re-exports
        for root, name in list(index.roots.items())[1:]:
            for local, bound in index._bindings.get(root, {}).items():
                for kind, real in bound:
                    if kind == _IMPORT and real in found:
                        found.setdefault(f"{name}.{local}", found[real])
            for base in index._stars.get(root, ()):
                for qualified, node in list(found.items()):
                    head, _, tail = qualified.rpartition(".")
                    if head == base and not tail.startswith("_"):
                        found.setdefault(f"{name}.{tail}", node)
    return found


def _loader_classes(index: FileIndex) -> frozenset[str]:
    found: set[str] = set()
    for _ in range(3):  # subclasses of subclasses
        for cls in index.classes:
            name = index._qualname.get(cls)
            if name is None or name in found or not _takes_loader_arguments(cls):
                continue
            bases = set().union(*(index.qnames_in(b.value, index._scope_parent.get(cls)) for b in cls.bases)) if cls.bases else set()
            if bases & (N.DATALOADER | found):
                found.add(name)
    return frozenset(found)


def _takes_loader_arguments(cls: cst.ClassDef) -> bool:
    init = next((s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__"), None)
    return init is None or isinstance(init.params.star_kwarg, cst.Param)


_RECENT: "OrderedDict[int, tuple[cst.Module, FileIndex]]" = OrderedDict()  # nodes take no weak references


def index_of(module: cst.Module) -> FileIndex:
    """The module's index, built once and shared by every analysis of the same module."""
    found = _RECENT.get(id(module))
    if found is not None and found[0] is module:
        _RECENT.move_to_end(id(module))
        return found[1]
    return remember(module, FileIndex(module))


def remember(module: cst.Module, index: FileIndex) -> FileIndex:
    """Share an index built elsewhere (e.g. with the converter's visitor plugged in)."""
    _RECENT[id(module)] = (module, index)
    while len(_RECENT) > 4:
        _RECENT.popitem(last=False)
    return index


def _module_of(value: cst.BaseExpression) -> bool:
    """`m.module`, or `m.module if ... else m`: the network inside a wrapper."""
    if isinstance(value, cst.IfExp):
        return _module_of(value.body) and not _module_of(value.orelse)
    return isinstance(value, cst.Attribute) and value.attr.value == "module"
