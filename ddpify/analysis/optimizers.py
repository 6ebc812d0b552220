"""Which model an optimizer trains, wherever the optimizer is built.

`torch.optim.SGD(model.parameters())` names its model; real projects hide it behind a few
steps, and each step is a fact about a function that holds in every module of the project:

- parameter groups and lists built first: `[{"params": model.backbone.parameters()}, ...]`,
  `params = [...]; SGD(params)`, `decay.append(p)` in a loop over `model.named_parameters()`:
  the values that flow into the optimizer's arguments inside its function are followed
  (assignments, `append`/`extend`, the loops that bind them);
- a method of a model class that hands out its own parameters (`model.get_1x_lr_params()`,
  `model.get_parameters(initial_lr=lr)`): its receiver is the model;
- a function that builds an optimizer over the parameters of one of its parameters
  (`optim.optim4GPU(cfg, model)`, another module's factory): the argument is the model;
  a method that builds one over `self.parameters()` (`model.configure_optimizers()`): the
  receiver is the model.

Only `nn.Module`s are models: a method of a class whose bases are known and none of them is
an `nn.Module` (`class Solver(object)`, followed across the project's modules) never makes its
object a model, whatever optimizers it builds over the models it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import FileIndex, iter_nodes

PARAMETER_CALLS = frozenset({"parameters", "named_parameters"})
COLLECTS = frozenset({"append", "extend", "insert", "add", "update", "__setitem__"})  # `groups.append(...)`
# Bases that say "not an nn.Module" for certain (a class with only these bases is a plain object).
PLAIN_BASES = frozenset({"builtins.object", "object", "abc.ABC", "typing.Generic", "typing.Protocol"})
PLAIN_PREFIXES = ("builtins.", "abc.", "typing.", "enum.", "dataclasses.", "torch.utils.data.")
MODULE_PREFIXES = ("torch.nn.",)  # torch.nn.Module and its subclasses (Sequential, ModuleList, ...)
MODULE_NAMES = ("LightningModule",)  # lightning's modules are nn.Modules


@dataclass(frozen=True)
class Trains:
    """What the optimizer a function builds trains: the parameters of its parameter `param`
    (`index`: its position among the call's arguments, `self` left out; None if keyword-only),
    or, with `param == "self"`, of the object the method is called on."""

    param: str
    index: Optional[int] = None
    given: bool = False  # the parameter holds the parameters themselves (`make_optimizer(model.parameters(), cfg)`)


def builds_optimizer(qnames: frozenset[str]) -> bool:
    """Is this an optimizer class (torch.optim's or a library's; not a scheduler)?"""
    return N.is_optimizer(qnames)


def model_ref(node: Optional[cst.CSTNode]) -> Optional[str]:
    """The model a `.parameters()` receiver belongs to, as `name` or `self.attr`:
    `model.backbone` and `net[2]` are parts of `model` and `net`; `self.backbone` of `self`'s
    attribute `self.backbone`, `self.model.head` of `self.model`."""
    while node is not None:
        if isinstance(node, cst.Name):
            return node.value
        if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == "self":
            return f"self.{node.attr.value}"
        node = node.value if isinstance(node, (cst.Attribute, cst.Subscript)) else None
    return None


def own_nodes(scope: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """The nodes of a function (or module) itself, not of the functions and classes defined in it."""
    return iter_nodes(scope, prune=lambda n: n is not scope and isinstance(n, (cst.FunctionDef, cst.ClassDef)))


def parameter_owners(
    scope: cst.CSTNode,
    node: cst.CSTNode,
    methods: frozenset[str],
    passed: Callable[[cst.Call], Optional[str]] = lambda call: None,
    reached: Optional[set[str]] = None,
) -> list[str]:
    """The models whose parameters reach `node` (an optimizer's call) inside `scope`, in order:
    receivers of `.parameters()`/`.named_parameters()` and of `methods` (the model classes'
    own methods that hand out parameters), and what `passed(call)` says a factory call trains;
    followed through the names `node` reads, back to what they are built from in `scope`
    (`reached`, if given, gets every name followed)."""
    flows = _flows(scope)
    found: list[str] = []
    seen: set[str] = set() if reached is None else reached
    todo = [node]
    while todo:
        claimed: set[cst.CSTNode] = set()  # a call that names its model: its receiver is not followed
        for inner in iter_nodes(todo.pop(0), prune=claimed.__contains__):
            if isinstance(inner, cst.Call):
                name = N.call_name(inner)
                owner = model_ref(N.receiver(inner)) if name in PARAMETER_CALLS or name in methods else None
                owner = owner or passed(inner)
                if owner is not None:
                    claimed.add(inner.func)
                    found += [owner] if owner not in found else []
            elif isinstance(inner, cst.Name) and inner.value not in seen:
                seen.add(inner.value)
                todo += flows.get(inner.value, [])
    return found


def _flows(scope: cst.CSTNode) -> dict[str, list[cst.CSTNode]]:
    """What flows into each name of a scope: the values assigned to it, what is appended to it
    (`name.append(p)`, `(a if c else name).append(p)`), the iterables of the loops that bind it."""
    found: dict[str, list[cst.CSTNode]] = {}

    def into(target: cst.CSTNode, value: cst.CSTNode, bound_only: bool = True) -> None:
        for n in _bound(target) if bound_only else [n for n in iter_nodes(target) if isinstance(n, cst.Name)]:
            found.setdefault(n.value, []).append(value)

    for node in own_nodes(scope):
        if isinstance(node, cst.Assign):
            for target in node.targets:
                into(target.target, node.value)
        elif isinstance(node, (cst.AugAssign, cst.AnnAssign)) and node.value is not None:
            into(node.target, node.value)
        elif isinstance(node, (cst.For, cst.CompFor)):
            into(node.target, node.iter)
        elif isinstance(node, cst.Call) and N.call_name(node) in COLLECTS and (owner := N.receiver(node)) is not None:
            for arg in node.args:
                into(owner, arg.value, bound_only=False)
    return found


def _bound(target: cst.CSTNode) -> list[cst.Name]:
    """The names an assignment target binds (`a`, `a, (b, c)`; not `x.a` nor `x[a]`)."""
    if isinstance(target, cst.Name):
        return [target]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for e in target.elements for n in _bound(e.value)]
    return []


def _returned(index: FileIndex, fn: cst.FunctionDef, call: cst.Call) -> bool:
    """Does `fn` return what `call` builds: `return SGD(...)`, or `opt = SGD(...)` ... `return opt`?"""
    returns = [n.value for n in own_nodes(fn) if isinstance(n, cst.Return) and n.value is not None]
    names = set()
    for node in index.ancestors(call):
        if node is fn:
            break
        if isinstance(node, cst.Return):
            return True
        if isinstance(node, cst.Assign):
            names |= {n.value for t in node.targets for n in iter_nodes(t.target) if isinstance(n, cst.Name)}
    return any(isinstance(n, cst.Name) and n.value in names for value in returns for n in iter_nodes(value))


class OptimizerSummaries:
    """Per-function facts of one index (a module, or a project walked as one): which classes are
    `nn.Module`s, which methods hand out their object's parameters, and what each function's
    optimizer trains."""

    def __init__(self, index: FileIndex) -> None:
        self.index = index
        self._module: dict[cst.ClassDef, Optional[bool]] = {}
        self.optimizer_classes = self._optimizer_classes()
        self.parameter_methods = frozenset(self._parameter_methods())
        self.trains: dict[cst.FunctionDef, Trains] = {}
        # `model.configure_optimizers()`: the receiver's class is not known, the method's name is
        self.optimizer_methods: frozenset[str] = frozenset()
        for _ in range(3):  # a factory that calls a factory
            before = len(self.trains)
            for fn in index.all_functions:
                if fn not in self.trains and (found := self._trained_by(fn)) is not None:
                    self.trains[fn] = found
            self.optimizer_methods = frozenset(fn.name.value for fn, t in self.trains.items() if t.param == "self")
            if len(self.trains) == before:
                break

    # classes ------------------------------------------------------------------------------------
    def builds(self, qnames: frozenset[str]) -> bool:
        """Does a call to this callee build an optimizer: torch.optim's, a library's, or one of the
        project's own classes derived from them (`class BertAdam(Optimizer)`)?"""
        return builds_optimizer(qnames) or not qnames.isdisjoint(self.optimizer_classes)

    def _optimizer_classes(self) -> frozenset[str]:
        """The qualified names of the project's optimizer classes, through bases of bases, and of
        its optimizer wrappers (`Optim(model.parameters(), "adam", lr)`, whose method builds a
        torch optimizer over the parameters its constructor kept)."""
        found: set[str] = set()
        for _ in range(3):
            for cls in self.index.classes:
                bases = [self.index.qnames(b.value) for b in cls.bases if b.keyword is None]
                if any(builds_optimizer(q) or not q.isdisjoint(found) for q in bases) or self._wraps_optimizer(cls):
                    found |= self.index.qnames(cls.name)
        return frozenset(found)

    def _wraps_optimizer(self, cls: cst.ClassDef) -> bool:
        """Does a method build a torch optimizer over `self.x`, which `__init__` binds from one of
        its parameters (`self.params = list(params)`)?"""
        methods = [s for s in cls.body.body if isinstance(s, cst.FunctionDef)]
        init = next((m for m in methods if m.name.value == "__init__"), None)
        if init is None:
            return False
        params = {p.name.value for p in init.params.params[1:]}
        kept = set()
        for node in iter_nodes(init):
            if isinstance(node, cst.Assign) and len(node.targets) == 1:
                target = node.targets[0].target
                if isinstance(target, cst.Attribute) and N.is_name(target.value, "self") and any(
                    isinstance(n, cst.Name) and n.value in params for n in iter_nodes(node.value)
                ):
                    kept.add(target.attr.value)
        for method in methods:
            for ci in self.index.calls_under(method):
                first = next(iter(N.positional(ci.node)), None)
                if builds_optimizer(ci.qnames) and first is not None and any(
                    isinstance(n, cst.Attribute) and N.is_name(n.value, "self") and n.attr.value in kept
                    for n in iter_nodes(first.value)
                ):
                    return True
        return False

    def is_module(self, cls: cst.ClassDef) -> Optional[bool]:
        """True: an `nn.Module` (a base is one, here or in another module of the project);
        False: certainly not (no base, `object`, or plain classes of the project only);
        None: a base ddpify cannot see (a library's)."""
        if cls in self._module:
            return self._module[cls]
        self._module[cls] = None  # a cycle of bases: unknown
        verdicts = [self._base_is_module(base.value) for base in cls.bases if base.keyword is None]
        found = True if True in verdicts else (None if None in verdicts else False)
        self._module[cls] = found
        return found

    def _base_is_module(self, base: cst.BaseExpression) -> Optional[bool]:
        names = self.index.qnames(base)
        if any(q.startswith(MODULE_PREFIXES) or q.endswith(MODULE_NAMES) for q in names):
            return True
        local = next((c for c in self.index.classes if self.index.qnames(c.name) & names), None)
        if local is None and len(self.index.roots) > 1:
            definitions = self.index.definitions()
            local = next((definitions[q] for q in names if isinstance(definitions.get(q), cst.ClassDef)), None)
        if local is not None:
            return self.is_module(local)
        if names and all(q in PLAIN_BASES or q.startswith(PLAIN_PREFIXES) for q in names):
            return False
        return None

    def class_of(self, fn: cst.FunctionDef) -> Optional[cst.ClassDef]:
        """The class `fn` is a method of (directly in its body)."""
        parent = self.index.parent(self.index.parent(fn))
        return parent if isinstance(parent, cst.ClassDef) else None

    # methods and functions ----------------------------------------------------------------------
    def _parameter_methods(self) -> Iterator[str]:
        """Methods of model classes that return or yield parameters (`get_1x_lr_params`,
        `get_parameters(initial_lr)`): in a model's own method, those are its own."""
        calling = {self.index.enclosing_func(ci.node) for ci in self.index.calls if ci.name in PARAMETER_CALLS}
        for fn in calling - {None}:
            cls = self.class_of(fn)
            if cls is None or self.is_module(cls) is False or fn.name.value in PARAMETER_CALLS:
                continue
            if any(self.builds(ci.qnames) for ci in self.index.calls_under(fn)):
                continue  # it hands out an optimizer (`configure_optimizers`), not parameters
            if any(isinstance(n, (cst.Return, cst.Yield)) and n.value is not None for n in own_nodes(fn)):
                yield fn.name.value

    def _trained_by(self, fn: cst.FunctionDef) -> Optional[Trains]:
        """What the optimizer `fn` builds (itself, or through a factory it calls) trains: one of
        its parameters, or `self` for a method of a model class."""
        cls = self.class_of(fn)
        params = [p.name.value for p in (*fn.params.posonly_params, *fn.params.params)]
        if cls is not None and params[:1] in (["self"], ["cls"]):
            params = params[1:]
        keyword_only = {p.name.value for p in fn.params.kwonly_params}
        for ci in self.index.calls_under(fn):
            if self.index.enclosing_func(ci.node) is not fn:
                continue  # a function defined inside it
            if not self.builds(ci.qnames) and self.passed(ci.node) is None:
                continue
            if not _returned(self.index, fn, ci.node):
                continue  # built and used here (a training function): not a factory
            owners = parameter_owners(fn, ci.node, self.parameter_methods, self.passed)
            if not owners and (given := self._given(fn, ci.node, params)) is not None:
                return given
            for owner in owners:
                if owner in params:
                    return Trains(owner, params.index(owner))
                if owner in keyword_only:
                    return Trains(owner)
                if cls is not None and owner == "self" and self.is_module(cls) is not False:
                    return Trains("self")
                if cls is not None and owner.startswith("self.") and self.is_module(cls):
                    return Trains("self")  # `self.backbone.parameters()` in the model's own method
        return None

    def _given(self, fn: cst.FunctionDef, call: cst.Call, params: list[str]) -> Optional[Trains]:
        """`def make(params, lr): return SGD(params, lr=lr)`: the optimizer's own parameters (its
        first argument, or `params=`) come from one parameter of `fn`."""
        first = N.keyword(call, "params") or next(iter(N.positional(call)), None)
        if first is None:
            return None
        reached: set[str] = set()
        parameter_owners(fn, first.value, self.parameter_methods, self.passed, reached)
        given = [p for p in params if p in reached]
        return Trains(given[0], params.index(given[0]), given=True) if len(given) == 1 else None

    def passed(self, call: cst.Call) -> Optional[str]:
        """The model a call of a factory (or of an optimizer-building method) trains, as the caller
        names it: the argument for the factory's parameter, or the method's receiver."""
        trains = self.of_call(call)
        if trains is None:
            return None
        if trains.param == "self":
            return model_ref(N.receiver(call)) if isinstance(call.func, cst.Attribute) else None
        value = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == trains.param), None)
        positional = N.positional(call)
        if value is None and trains.index is not None and trains.index < len(positional) and not positional[trains.index].star:
            value = positional[trains.index].value
        if value is None:
            return None
        if trains.given:  # the caller's `model.parameters()` (or a name it built from them)
            scope = self.index.enclosing_func(call) or self.index.root_of(call)
            owners = parameter_owners(scope, value, self.parameter_methods, self.passed)
            return owners[0] if len(owners) == 1 else None
        return model_ref(value) if isinstance(value, (cst.Name, cst.Attribute)) else None

    def of_call(self, call: cst.Call) -> Optional[Trains]:
        """What the optimizer built by the function a call reaches trains (None: no such function)."""
        info = self.index.call_info.get(call)
        if info is None:
            return None
        for fn in self.index.local_callees(info):
            if fn in self.trains:
                trains = self.trains[fn]
                method_call = isinstance(call.func, cst.Attribute) and self.class_of(fn) is not None
                return trains if trains.param != "self" or method_call else None
        if isinstance(call.func, cst.Attribute) and N.call_name(call) in self.optimizer_methods:
            return Trains("self")
        return None
