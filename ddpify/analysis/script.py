"""One analysis of a training script, shared by every conversion pass.

Built on the file's one index (`ddpify.analysis.index`: one traversal for calls, qualified
names, parents and bindings, positions once), which `ddpify check` reads too; passes only read
the facts below and never walk the tree for names themselves.
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

import libcst as cst
from libcst.metadata import MetadataWrapper

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.frozen import frozen
from ddpify.analysis.functional import run_with_weights
from ddpify.analysis.index import FileIndex, dotted_name, iter_nodes, last_name, names_in, remember
from ddpify.analysis.optimizers import OptimizerSummaries, builds_optimizer, parameter_owners
from ddpify.analysis.project import ProjectFacts, names_cuda
from ddpify.analysis.summaries import FunctionSummaries
from ddpify.analysis.training import step_analysis

T = TypeVar("T", bound=cst.CSTNode)

ScopeNode = cst.CSTNode  # a cst.Module or a cst.FunctionDef


class AnalysisError(Exception):
    """The script has no shape ddpify can convert safely."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.message = message


CATCHES_STOP = {"StopIteration", "Exception", "BaseException"}


@dataclass
class Loader:
    """A `name = DataLoader(...)` statement."""

    name: str
    call: cst.Call
    stmt: cst.SimpleStatementLine
    scope: ScopeNode
    shuffle_picks: bool = False  # made by a factory for training and evaluation alike: only shuffled ones train


@dataclass
class EpochLoop:
    """Where `set_epoch` goes: the loop around one pass over a training loader."""

    loop: cst.For
    scope: ScopeNode
    loader_expr: str  # the loader as named in `scope` (a variable or a parameter)
    inner: cst.For | None = None  # the pass over the loader inside it


@dataclass
class PassStart:
    """Where step-based training starts a new pass over a training loader without an epoch
    loop: `iter(loader)` (again after StopIteration), a `for` over it inside a `while`, or the
    `for` of a generator helper that hands out its batches forever."""

    stmt: cst.CSTNode
    scope: ScopeNode
    loader_expr: str  # the loader as named in `scope`
    restarts: bool = True  # False: `next(it)` with no StopIteration handling (a fixed step count)


@dataclass
class SplitLoaders:
    """One DataLoader per split, picked as `loaders[phase]` in a loop over the splits:
    `{x: DataLoader(...) for x in ["train", "val"]}` or `{"train": DataLoader(...), ...}`."""

    name: str
    stmt: cst.SimpleStatementLine
    scope: ScopeNode
    keys: dict[str, str]  # split -> its key as written (`'train'`)
    calls: dict[str, cst.Call]  # split -> its DataLoader call (one call for every split of a comprehension)
    key_var: str | None = None  # the comprehension's variable
    epoch_loops: list[EpochLoop] = field(default_factory=list)

    @property
    def train_key(self) -> str | None:
        """The one split whose name says it trains."""
        found = [key for key in self.keys if "train" in key.lower()]
        return found[0] if len(found) == 1 else None


@dataclass
class Script:
    """Facts about one script that the conversion passes read."""

    module: cst.Module
    qnames: N.QualifiedNames
    parents: dict
    calls: list[cst.Call] = field(default_factory=list)
    functions: dict[str, cst.FunctionDef] = field(default_factory=dict)
    all_functions: list[cst.FunctionDef] = field(default_factory=list)
    loops: dict[ScopeNode, list[cst.For]] = field(default_factory=dict)
    assigns: dict[ScopeNode, list[cst.Assign]] = field(default_factory=dict)
    bound: dict[ScopeNode, set[str]] = field(default_factory=dict)  # names a function binds itself
    distributed_marker: cst.CSTNode | None = None
    distributed_apis: dict[str, list[cst.CSTNode]] = field(default_factory=dict)  # qualified name -> its uses
    has_dataloader: bool = False
    model_name: str = ""  # the first trained model (setup goes where it is built)
    model_scope: ScopeNode | None = None
    models: dict[str, ScopeNode] = field(default_factory=dict)  # every trained model -> its scope
    maybe_frozen: set[str] = field(default_factory=set)  # models of `models` frozen on some runs only (analysis/frozen.py)
    frozen_models: dict[str, ScopeNode] = field(default_factory=dict)  # handed to an optimizer, but frozen: never wrapped
    optimizer_stmt: cst.BaseStatement | None = None
    loaders: list[Loader] = field(default_factory=list)
    unplaced_loaders: list[cst.Call] = field(default_factory=list)  # e.g. built in a list comprehension
    split_loaders: list[SplitLoaders] = field(default_factory=list)
    train_loaders: list[Loader] = field(default_factory=list)
    epoch_loops: dict[str, list[EpochLoop]] = field(default_factory=dict)
    pass_starts: dict[str, list[PassStart]] = field(default_factory=dict)  # step-based training
    training_functions: set[cst.FunctionDef] = field(default_factory=set)
    eval_calls: list[cst.Call] = field(default_factory=list)
    eval_loops: dict[str, list[cst.For]] = field(default_factory=dict)  # loader -> loops over it
    ddp_names: dict[ScopeNode, set[str]] = field(default_factory=dict)
    maybe_wrapped: dict[ScopeNode, set[str]] = field(default_factory=dict)  # of ddp_names: held by a model of maybe_frozen
    # models of `models` run with weights handed to them (analysis/functional.py) -> the call that
    # shows it: never wrapped in DDP; rank 0's weights, gradients averaged by hand after backward
    run_with_weights: dict[str, cst.Call] = field(default_factory=dict)
    synced_by_hand: dict[ScopeNode, dict[str, str]] = field(default_factory=dict)  # their names per scope -> the model
    ddp_aliases: dict[cst.Assign, str] = field(default_factory=dict)  # `scorer = model.eval()` -> "model"
    data_parallel: list[cst.CSTNode] = field(default_factory=list)  # references to nn.DataParallel
    data_parallel_imports: list[tuple[str, str, str | None]] = field(default_factory=list)  # from-imports of it
    iterable_datasets: set[str] = field(default_factory=set)  # the script's IterableDataset classes
    # (optimizer call, model, class) of a second trainer class's model of the same name (`self.G` of
    # DCGAN while GAN's is converted): one trainer class per program is converted, the rest get a TODO
    unconverted_models: list[tuple[cst.Call, str, cst.ClassDef | None]] = field(default_factory=list)
    # (model, scope) of a sibling trainer's model named like one of `models` (`net`, a parameter of
    # both `PreTrainer.train` and `MainTrainer.train`): trained in its own function, wrapped there too
    sibling_models: list[tuple[str, ScopeNode]] = field(default_factory=list)
    index: FileIndex | None = None  # the file's one index: calls, qualified names, parents, positions
    _by_type: dict | None = None
    _calls_under: dict = field(default_factory=dict)  # node -> calls_in(node)
    _scopes: dict = field(default_factory=dict)  # node -> scope_of(node)
    _callees: dict = field(default_factory=dict)  # call -> the qualified names of what it calls
    _local_functions: dict = field(default_factory=dict)  # call -> local_function's answer
    _methods_of_objects: dict = field(default_factory=dict)  # call -> method_of_object's answer
    main_block: cst.IndentedBlock | None = None  # `if __name__ == "__main__":` holding the model
    facts: ProjectFacts = field(default_factory=ProjectFacts)  # what the rest of the project tells

    # -- tree navigation -------------------------------------------------
    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.parents.get(node)

    def nodes_of(self, kind: type) -> list[cst.CSTNode]:
        """Every node of a type, in no particular order (from the index: no walk of the tree)."""
        if self._by_type is None:
            self._by_type = {}
            for node in self.parents:
                self._by_type.setdefault(type(node), []).append(node)
        return [n for t, found in self._by_type.items() if issubclass(t, kind) for n in found]

    def nodes_in(self, outer: cst.CSTNode, kind: type[T]) -> list[T]:
        """The nodes of type `kind` under `outer` (itself included), in source order: a walk of
        the fields that hold nodes (a libcst visitor, which `libcst.matchers.findall` runs, rebuilds the tree)."""
        return [n for n in iter_nodes(outer) if isinstance(n, kind)]

    def before(self, a: cst.CSTNode, b: cst.CSTNode) -> bool:
        """Does `a` start before `b` in the source (`a` may contain `b`)?"""
        start, _ = self.index.source_order()
        return start[a] < start[b]

    def value_before(self, node: cst.BaseExpression) -> cst.BaseExpression:
        """What a name holds where it is read: the value of its last plain assignment before it in
        its function (`ckpt_path = os.path.join(out_dir, "ckpt.pt")`, then `torch.load(ckpt_path)`);
        any other node as it is."""
        if not isinstance(node, cst.Name):
            return node
        bound = [a for a in self.assigns.get(self.scope_of(node), [])
                 if N.is_name(a.targets[0].target, node.value) and self.before(a, node)]  # fmt: skip
        return bound[-1].value if bound else node

    def ends_before(self, a: cst.CSTNode, b: cst.CSTNode) -> bool:
        """Is all of `a` before `b` starts?"""
        start, end = self.index.source_order()
        return end[a] < start[b]

    def after(self, a: cst.CSTNode, b: cst.CSTNode) -> bool:
        """Does `a` start after all of `b`?"""
        start, end = self.index.source_order()
        return start[a] > end[b]

    def line(self, node: cst.CSTNode) -> int:
        try:
            return self.index.line(node)
        except KeyError:  # not a node of the script
            return 1

    def ancestors(self, node: cst.CSTNode):
        node = self.parent(node)
        while node is not None:
            yield node
            node = self.parent(node)

    def scope_of(self, node: cst.CSTNode) -> ScopeNode:
        """The function (or the module) whose body holds `node`."""
        found = self._scopes.get(node)
        if found is None:
            found = self._scopes[node] = next(a for a in self.ancestors(node) if isinstance(a, (cst.FunctionDef, cst.Module)))
        return found

    def body_of(self, scope: ScopeNode) -> cst.CSTNode:
        """The node whose `.body` lists the scope's top-level statements."""
        return scope if isinstance(scope, cst.Module) else scope.body

    def block_of(self, scope: ScopeNode) -> cst.CSTNode:
        """The block whose statements run in order in `scope`: a function's body, or for the
        module its `if __name__ == "__main__":` block when the model is built there."""
        if isinstance(scope, cst.Module) and self.main_block is not None:
            return self.main_block
        return self.body_of(scope)

    def top_statement(self, node: cst.CSTNode, scope: ScopeNode) -> cst.BaseStatement | None:
        """The statement of `scope`'s ordered block that contains `node` (None if outside it)."""
        block = self.block_of(scope)
        child = node
        for anc in self.ancestors(node):
            if anc is block:
                return child
            child = anc
        return None

    def statement_line(self, node: cst.CSTNode) -> cst.SimpleStatementLine | None:
        """The simple statement line that holds `node`, if any."""
        for anc in [node, *self.ancestors(node)]:
            if isinstance(anc, cst.SimpleStatementLine):
                return anc
            if isinstance(anc, (cst.BaseCompoundStatement, cst.FunctionDef)):
                return None
        return None

    def enclosing_loop(self, node: cst.CSTNode, scope: ScopeNode) -> cst.For | None:
        """The nearest `for` around `node` inside `scope`."""
        for anc in self.ancestors(node):
            if anc is scope:
                return None
            if isinstance(anc, cst.For):
                return anc
        return None

    def loops_around(self, node: cst.CSTNode, scope: ScopeNode) -> list[cst.For | cst.While]:
        """The `for`/`while` loops around `node` inside `scope`, innermost first."""
        found = []
        for anc in self.ancestors(node):
            if anc is scope:
                break
            if isinstance(anc, (cst.For, cst.While)):
                found.append(anc)
        return found

    def in_training_loop(self, node: cst.CSTNode, scope: ScopeNode) -> bool:
        """Is `node` inside a loop (of `scope`) whose body calls backward, directly or through a helper?"""
        return any(_has_backward(self, loop.body) for loop in self.loops_around(node, scope))

    def inside(self, node: cst.CSTNode, outer: cst.CSTNode) -> bool:
        return node is outer or any(a is outer for a in self.ancestors(node))

    @property
    def positions(self):
        """Every node's position, computed on first use (a walk of its own: lines are for notes)."""
        return self.index.positions

    def calls_in(self, outer: cst.CSTNode) -> list[cst.Call]:
        """Calls inside `outer` (itself included), in source order (the index's lookup)."""
        found = self._calls_under.get(outer)
        if found is None:
            found = self._calls_under[outer] = [ci.node for ci in self.index.calls_under(outer)]
        return found

    def names(self, node: cst.CSTNode) -> frozenset[str]:
        return self.index.qnames(node)

    def is_call_to(self, call: cst.Call, qualified: frozenset[str]) -> bool:
        found = self._callees.get(call)
        if found is None:
            found = self._callees[call] = self.index.qnames(call.func)
        return not found.isdisjoint(qualified)

    def local_function(self, call: cst.Call) -> cst.FunctionDef | None:
        """The script's own function (or `self.method`) a call invokes, if any; in a project, also
        a function of another of its modules (`engine.train_fn(...)`, `from engine import train_fn`)."""
        if call not in self._local_functions:
            self._local_functions[call] = self._local_function(call)
        return self._local_functions[call]

    def _local_function(self, call: cst.Call) -> cst.FunctionDef | None:
        if isinstance(call.func, cst.Name) and call.func.value in self.functions and self.root_of(call) is self.module:
            return self.functions[call.func.value]
        if isinstance(call.func, cst.Attribute) and isinstance(call.func.value, cst.Name) and call.func.value.value == "self":
            cls = self.class_of(call)
            if cls is not None:
                return self.methods(cls).get(call.func.attr.value)
            return None
        if len(self.index.roots) > 1:
            found = self.project_definition(call.func)
            if isinstance(found, cst.FunctionDef):
                return found
        return self._returned_function(call)

    def _returned_function(self, call: cst.Call) -> cst.FunctionDef | None:
        """`update(x, y)` where the call's scope binds `update = make_update(model, optimizer)`
        once, and every `return` of that function hands back the same function it defines
        inside (a closure over the model): that inner function."""
        if not isinstance(call.func, cst.Name):
            return None
        made = [a.value for a in self.assigns.get(self.scope_of(call), []) if ref_of(a.targets[0].target) == call.func.value]
        if len(made) != 1 or not isinstance(made[0], cst.Call) or made[0].func is call.func:
            return None
        maker = self.local_function(made[0])
        if maker is None:
            return None
        inner = {fn.name.value: fn for fn in self.nodes_in(maker.body, cst.FunctionDef)}
        names = {ref_of(r.value) for r in returns(maker)}
        return inner.get(names.pop()) if len(names) == 1 else None

    def method_of_object(self, call: cst.Call) -> cst.FunctionDef | None:
        """`trainer.train(epoch)` where the call's scope binds `trainer = Trainer(...)`, a class of
        the script or its project (or `Trainer(...).train(epoch)`): that class's method (or its
        bases'; of the first class bound when branches bind several)."""
        if call not in self._methods_of_objects:
            self._methods_of_objects[call] = self._method_of_object(call)
        return self._methods_of_objects[call]

    def _method_of_object(self, call: cst.Call) -> cst.FunctionDef | None:
        func = call.func
        if isinstance(func, cst.Name):  # `trainer(loader, epochs=3)`: the object's `__call__`
            obj, name = func, "__call__"
        elif isinstance(func, cst.Attribute) and not N.is_name(func.value, "self"):
            obj, name = func.value, func.attr.value
        else:
            return None
        if isinstance(obj, cst.Call):
            made = [obj]  # `Trainer(model, optimizer).fit(loader)`: made and used at once
        elif isinstance(obj, cst.Name):
            made = [
                a.value for a in self.assigns.get(self.scope_of(call), [])
                if ref_of(a.targets[0].target) == obj.value
            ]  # fmt: skip
            if not made and (declared := self._annotated_class(call, obj.value)) is not None:
                return self._implementation(declared, name)  # `def train(self, dataset: BaseDataset)`
        else:
            return None
        for value in made:  # `trainer = Plain(8)` or, in another branch, `trainer = Momentum(8)`: the first
            cls = self.class_called(value) if isinstance(value, cst.Call) else None
            method = self._inherited(cls, name)
            if method is not None:
                return method
        return None

    def _inherited(self, cls: cst.ClassDef | None, name: str) -> cst.FunctionDef | None:
        """The method `name` of `cls` or of its bases (the project's)."""
        while cls is not None:
            method = self.methods(cls).get(name)
            if method is not None:
                return method
            cls = next((b for b in (self.project_definition(base.value) for base in cls.bases) if isinstance(b, cst.ClassDef)), None)
        return None

    def _annotated_class(self, call: cst.Call, param: str) -> cst.ClassDef | None:
        """The project class a parameter of the call's function is declared as (`dataset: BaseDataset`)."""
        scope = self.scope_of(call)
        if not isinstance(scope, cst.FunctionDef):
            return None
        found = next((p for p in [*scope.params.params, *scope.params.kwonly_params] if p.name.value == param), None)
        if found is None or found.annotation is None:
            return None
        cls = self.project_definition(found.annotation.annotation)
        return cls if isinstance(cls, cst.ClassDef) else None

    def _implementation(self, declared: cst.ClassDef, name: str) -> cst.FunctionDef | None:
        """The method `name` an object declared as `declared` runs: its own (or a base's), or, where
        that one is abstract, the one override the project's subclasses give (None: several)."""
        method = self._inherited(declared, name)
        if method is not None and not _abstract(method):
            return method
        overrides = {
            m for cls in self.index.definitions().values()
            if isinstance(cls, cst.ClassDef) and cls is not declared and self._derives(cls, declared)
            if (m := self._inherited(cls, name)) is not None and not _abstract(m)
        }  # fmt: skip
        return overrides.pop() if len(overrides) == 1 else None

    def _derives(self, cls: cst.ClassDef, base: cst.ClassDef, depth: int = 0) -> bool:
        parents = [b for b in (self.project_definition(a.value) for a in cls.bases) if isinstance(b, cst.ClassDef)]
        return base in parents or (depth < 8 and any(self._derives(p, base, depth + 1) for p in parents))

    def project_definition(self, node: cst.CSTNode) -> cst.FunctionDef | cst.ClassDef | None:
        """The function or class of the project's modules that `node` names (by qualified name)."""
        definitions = self.index.definitions()
        return next((definitions[q] for q in self.names(node) if q in definitions), None)

    def root_of(self, node: cst.CSTNode) -> cst.Module:
        """The module (of the project) that holds `node`."""
        return self.index.root_of(node)

    def class_of(self, node: cst.CSTNode) -> cst.ClassDef | None:
        """The class whose method holds `node`."""
        return next((a for a in self.ancestors(node) if isinstance(a, cst.ClassDef)), None)

    @cached_property
    def summaries(self) -> FunctionSummaries:
        """What the functions this script calls do with their parameters, in its project too."""
        return FunctionSummaries(self.index, outer=self.facts.summaries)

    @cached_property
    def optimizer_summaries(self) -> OptimizerSummaries:
        """Per-function facts: which classes are nn.Modules, which functions build an optimizer
        over which of their parameters (with the rest of the project's, from `facts`)."""
        return OptimizerSummaries(self.index)

    @cached_property
    def classes(self) -> dict[str, cst.ClassDef]:
        """The script's own top-level classes, by name."""
        return {s.name.value: s for s in self.module.body if isinstance(s, cst.ClassDef)}

    def class_called(self, call: cst.Call) -> cst.ClassDef | None:
        """The script's (or its project's) class that `call` instantiates: `Trainer(...)`."""
        if isinstance(call.func, cst.Name) and call.func.value in self.classes and self.root_of(call) is self.module:
            return self.classes[call.func.value]
        if len(self.index.roots) > 1:
            found = self.project_definition(call.func)
            return found if isinstance(found, cst.ClassDef) else None
        return None

    def objects(self, scope: ScopeNode | None = None) -> dict[str, cst.ClassDef]:
        """Names bound to an object of the script's own classes (`meter = AverageMeter()`), in
        `scope` or anywhere."""
        scopes = [scope] if scope is not None else list(self.assigns)
        return {
            ref_of(a.targets[0].target): self.classes[a.value.func.value]
            for where in scopes
            for a in self.assigns.get(where, [])
            if isinstance(a.value, cst.Call) and isinstance(a.value.func, cst.Name) and a.value.func.value in self.classes
        }

    @cached_property
    def uses_gpu(self) -> bool:
        """Does the single-GPU script (or its project) name a GPU: `.cuda()`, `torch.cuda.*`, a
        "cuda" string anywhere (`args.device = "cuda"`, `device: str = "cuda:1"`), or an integer
        device (`.to(0)`, `torch.device(0)`, `.to(gpu_id)` where `gpu_id` is bound to an integer
        or is a parameter annotated `int`)? Only a project that names none trains on the CPU."""
        if self.facts.names_cuda or any(names_cuda(root) for root in self.index.roots):
            return True
        int_names = self._integer_names()
        for call in self.calls:
            if N.call_name(call) == "cuda" or any(q.startswith("torch.cuda.") for q in self.names(call.func)):
                return True
            if any(N.is_cuda_string(a.value) for a in call.args):
                return True
            if (N.call_name(call) == "to" or self.is_call_to(call, N.TORCH_DEVICE)) and N.positional(call):
                value = N.positional(call)[0].value
                if isinstance(value, cst.Integer) or last_name(value) in int_names:
                    return True
        return False

    @cached_property
    def gpu_gate(self) -> str | None:
        """The flag every GPU move of the script waits for (`if args.cuda: model.cuda()`,
        `x.cuda() if use_cuda else x`), as written; None when some move is unconditional or
        the moves wait for different tests. In a project the entry's moves decide when it has
        any (a loss module's `if self.use_gpu:` follows the `args.cuda` the entry hands it).
        Without the flag the script trains on the CPU, so this process's device must be the CPU
        then too (NCCL cannot reduce CPU tensors)."""
        moves = [c for c in self.calls if N.call_name(c) == "cuda" or _names_cuda_device(c)]
        own = [c for c in moves if self.root_of(c) is self.module]
        gates = set()
        for call in own or moves:  # the entry's own moves decide: another module's follow what it is handed
            test = next(
                (a.test for a in self.ancestors(call) if isinstance(a, (cst.If, cst.IfExp)) and not self.inside(call, a.test)),
                None,
            )
            if not isinstance(test, (cst.Name, cst.Attribute)) or ref_of(test) is None and not isinstance(test.value, cst.Name):
                return None
            gates.add(self.module.code_for_node(test))
        return gates.pop() if len(gates) == 1 else None

    def _integer_names(self) -> set[str]:
        """Names (or attribute names) bound to an integer literal, or parameters annotated `int`,
        that name a device: `device = 0`, `gpu_id: int`, `self.gpu_id = gpu_id`."""
        found = set()
        for assigns in self.assigns.values():
            for a in assigns:
                name = last_name(a.targets[0].target)
                if name and isinstance(a.value, cst.Integer) and _DEVICE_NAME.search(name):
                    found.add(name)
        for fn in self.all_functions:
            for p in fn.params.params:
                if p.annotation is not None and N.is_name(p.annotation.annotation, "int") and _DEVICE_NAME.search(p.name.value):
                    found.add(p.name.value)
        return found

    def methods(self, cls: cst.ClassDef) -> dict[str, cst.FunctionDef]:
        return {s.name.value: s for s in cls.body.body if isinstance(s, cst.FunctionDef)}

    def scopes_for(self, ref: str, scope: ScopeNode) -> list[ScopeNode]:
        """Where a reference is visible: its own scope, every method for `self.x`, and every
        function that reads a module-level global without rebinding it."""
        cls = self.class_of(scope) if ref.startswith("self.") else None
        if cls is not None:
            return list(self.methods(cls).values())
        if isinstance(scope, cst.Module):
            return [scope, *(fn for fn in self.all_functions if ref not in self.bound.get(fn, ()))]
        return [scope]


_DEVICE_NAME = re.compile(r"(^|_)(gpu|gpus|device|dev|cuda)(_|$)|^gpu|gpu_?id|device_?id", re.IGNORECASE)


def _abstract(method: cst.FunctionDef) -> bool:
    """A method with no body of its own: `@abstractmethod`, or only a docstring, `pass`, `...` or
    `raise NotImplementedError`."""
    if any(ref_of(d.decorator) in ("abstractmethod", "abc.abstractmethod") for d in method.decorators):
        return True
    for stmt in method.body.body:
        small = N.sole_statement(stmt)
        if isinstance(small, cst.Pass) or isinstance(small, cst.Expr) and isinstance(small.value, (cst.SimpleString, cst.Ellipsis)):
            continue
        if isinstance(small, cst.Raise) and small.exc is not None and "NotImplementedError" in cst.Module([]).code_for_node(small.exc):
            continue
        return False
    return True


def is_device_name(ref: str) -> bool:
    """Does a name (`device`, `self.gpu_id`) say it holds a device?"""
    return bool(_DEVICE_NAME.search(ref.rpartition(".")[2]))


def ref_of(node: cst.CSTNode) -> str | None:
    """`name` or `self.attr` as a string: the references ddpify follows."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == "self":
        return f"self.{node.attr.value}"
    return None


_MARKER_TAILS = {name.rsplit(".", 1)[-1] for name in N.DISTRIBUTED_MARKERS | N.DATA_PARALLEL | N.DATALOADER}


class _CallCollector(cst.CSTVisitor):
    """What the conversion indexes by scope (loops, assignments, bound names) and the references
    to distributed APIs, gathered in the file index's one traversal (`FileIndex(extra=...)`);
    what needs qualified names is decided in `finish`, once every binding is known."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.scopes: list[ScopeNode] = [script.module]
        self.aliases: set[str] = set()
        self.classes: list[cst.ClassDef] = []
        self.references: list[cst.CSTNode] = []

    def visit_Module(self, node: cst.Module) -> None:
        self.scopes = [node]  # each module of a project has its own top level

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.append(node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.script.all_functions.append(node)
        self.script.bound[node] = {p.name.value for p in node.params.params}
        self.scopes.append(node)

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.scopes.pop()

    def visit_For(self, node: cst.For) -> None:
        self.script.loops.setdefault(self.scopes[-1], []).append(node)

    def visit_Assign(self, node: cst.Assign) -> None:
        if len(node.targets) == 1:
            self.script.assigns.setdefault(self.scopes[-1], []).append(node)

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        if isinstance(node.target, cst.Name):
            self.script.bound.setdefault(self.scopes[-1], set()).add(node.target.value)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self._reference(node)

    def visit_Name(self, node: cst.Name) -> None:
        self._reference(node)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if isinstance(node.names, cst.ImportStar) or node.module is None or node.relative:
            return
        module = cst.Module([]).code_for_node(node.module)
        for alias in node.names:
            if isinstance(alias.name, cst.Name) and f"{module}.{alias.name.value}" in N.DATA_PARALLEL:
                asname = alias.asname.name.value if alias.asname and isinstance(alias.asname.name, cst.Name) else None
                self.script.data_parallel_imports.append((module, alias.name.value, asname))

    def visit_ImportAlias(self, node: cst.ImportAlias) -> None:
        imported = node.name.value if isinstance(node.name, cst.Name) else node.name.attr.value
        if imported in _MARKER_TAILS and node.asname is not None and isinstance(node.asname.name, cst.Name):
            self.aliases.add(node.asname.name.value)

    def _reference(self, node: cst.CSTNode) -> None:
        # Only names spelled like a marker or its alias are resolved (in `finish`).
        spelled = node.value if isinstance(node, cst.Name) else node.attr.value
        if spelled in _MARKER_TAILS or spelled in self.aliases:
            self.references.append(node)

    def finish(self) -> None:
        for node in self.classes:
            if any(self.script.names(base.value) & N.ITERABLE_DATASET for base in node.bases):
                self.script.iterable_datasets.add(node.name.value)
        for node in self.references:
            self._resolved(node)

    def _resolved(self, node: cst.CSTNode) -> None:
        names = self.script.names(node)
        if self.script.distributed_marker is None and names & N.DISTRIBUTED_MARKERS:
            self.script.distributed_marker = node
        for name in names & N.DISTRIBUTED_MARKERS:
            self.script.distributed_apis.setdefault(name, []).append(node)
        if names & N.DATALOADER:
            self.script.has_dataloader = True
        if names & N.DATA_PARALLEL and not isinstance(self.script.parent(node), (cst.Attribute, cst.ImportAlias)):
            self.script.data_parallel.append(node)


def _names_cuda_device(call: cst.Call) -> bool:
    """`x.to("cuda")`, `torch.zeros(3, device="cuda:0")`: a "cuda" string given as a device (not
    `parser.add_argument("--cuda", dest="cuda")` or `choices=["cpu", "cuda"]`)."""
    if N.call_name(call) == "add_argument":
        return False
    return any(N.is_cuda_string(a.value) and (a.keyword is None or a.keyword.value in ("device", "map_location")) for a in call.args)


def run_by_entry(script: Script, node: cst.CSTNode) -> bool:
    """Does the program run `node`? All of the entry's module does, and so does the code other
    modules run on import; a function of another module runs when the program names it (calls
    it, or hands it on as a collate_fn), and a class's methods when it names the class. A module
    imported for one function may hold others that nothing calls (`init_distributed_mode()`)."""
    if len(script.index.roots) == 1 or script.root_of(node) is script.module:
        return True
    functions = [a for a in (node, *script.ancestors(node)) if isinstance(a, cst.FunctionDef)]
    return not functions or any(fn in _run_functions(script) for fn in functions)


def _run_functions(script: Script) -> set[cst.FunctionDef]:
    """The functions of the project's other modules that the program names, transitively."""
    return script.index.cached("run_functions", lambda index: _named_from(script))


def _named_from(script: Script) -> set[cst.FunctionDef]:
    definitions = script.index.definitions()
    spelled = {q.rpartition(".")[2] for q in definitions}
    run: set[cst.FunctionDef] = set()
    classes: set[cst.ClassDef] = set()
    todo: list[cst.CSTNode] = [script.module]
    for other in list(script.index.roots)[1:]:  # what another module runs on import
        todo += [s for s in other.body if not isinstance(s, (cst.FunctionDef, cst.ClassDef))]
    while todo:
        for node in iter_nodes(todo.pop()):
            if not (isinstance(node, cst.Name) and node.value in spelled or isinstance(node, cst.Attribute) and node.attr.value in spelled):
                continue
            found = script.project_definition(node)
            if isinstance(found, cst.FunctionDef) and found not in run:
                run.add(found)
                todo.append(found)
                cls = script.class_of(found)
                found = cls if cls is not None and cls not in classes else None
            if isinstance(found, cst.ClassDef) and found not in classes:
                classes.add(found)
                todo.append(found)  # its methods, its bases, its decorators
                for method in found.body.body:
                    if isinstance(method, cst.FunctionDef):
                        run.add(method)
    return run


def fully_distributed(script: Script) -> bool:
    """Does the script already do what a conversion would: set up a process group, wrap a model
    in DDP (or shard it with FSDP2's fully_shard), and read its data through a DistributedSampler
    (or through no DataLoader at all)? Only what the program runs counts: a helper module's
    setup that nothing calls does not make the entry distributed."""
    apis = {name for name, uses in script.distributed_apis.items() if any(run_by_entry(script, n) for n in uses)}
    wrapped = apis & (D.DDP | D.FULLY_SHARD | D.REPLICATE)
    return bool(
        apis & D.INIT_PROCESS_GROUP and wrapped and (apis & D.DISTRIBUTED_SAMPLER or not script.has_dataloader)
    )


def analyze(
    wrapper: MetadataWrapper,
    full: bool = False,
    facts: ProjectFacts | None = None,
    need_model: bool = True,
    others: dict[str, cst.Module] | None = None,
    packages: frozenset[str] = frozenset(),
) -> Script:
    """Resolve metadata once and find the model, loaders, loops and helpers of a script
    (all of it, or with `full` off, only what says it is fully distributed already); `facts`:
    what the project's other modules tell about this one; `others`: the project's other modules
    (dotted name -> module), analysed with this one as one program."""
    module = wrapper.module if isinstance(wrapper, MetadataWrapper) else wrapper
    script = Script(module=module, qnames={}, parents={}, facts=facts or ProjectFacts())
    collector = _CallCollector(script)
    index = FileIndex(module, extra=[collector], others=others, packages=packages)  # the one traversal
    script.index = index if others else remember(module, index)  # shared with `check` (a single file)
    script.parents = index.parents
    script.calls = [c.node for c in index.calls]
    script.functions = {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef)}
    collector.finish()
    if not full and fully_distributed(script):
        return script
    steps = step_analysis(index)  # a function that calls a training helper (`self._run_batch(...)`) trains too
    script.training_functions = {fn for fn in script.all_functions if steps.trains(fn)}
    try:
        _find_model(script)
    except AnalysisError:
        if need_model:
            raise
    _find_loaders(script)
    _find_ddp_names_and_eval_calls(script)
    _find_eval_loops(script)
    return script


def _has_backward(script: Script, outer: cst.CSTNode) -> bool:
    """Does `outer` call backward, directly or through one of the script's training functions?"""
    return any(
        (N.call_name(c) == "backward" and N.receiver(c) is not None)
        or (script.local_function(c) in script.training_functions and not script.inside(script.local_function(c), outer))
        for c in script.calls_in(outer)
    )


def _find_model(script: Script) -> None:
    """The model is what the (first) optimizer trains: `torch.optim.X(model.parameters(), ...)`,
    also through names, parameter groups, the model's own parameter methods and the project's
    optimizer factories (`analysis/optimizers.py`). Without an optimizer, it is the model whose
    `.parameters()` a training function updates by hand. Never `self`, nor an object of a class
    that is no nn.Module."""
    summaries = script.optimizer_summaries
    for call in script.calls:
        # `optim.optim4GPU(cfg, model)`, `model.configure_optimizers()` (`model.module.` in a converted trainer)
        passed = summaries.passed(call)
        by_name = any("torch.optim" in script.names(a.value) for a in call.args)  # `init_obj(cfg, "optimizer", torch.optim, params)`
        if passed is None and not by_name and not summaries.builds(script.names(call.func)):
            continue
        optimizer_scope = script.scope_of(call)
        owners = [passed] if passed else parameter_owners(
            optimizer_scope, call, summaries.parameter_methods, summaries.passed
        )
        for owner in owners:  # itertools.chain(G.parameters(), F.parameters())
            if not _may_be_model(script, owner, optimizer_scope):
                continue
            scope, built_here = optimizer_scope, True
            if (taken := _taken_out(script, owner, scope)) is not None:
                (owner, scope), built_here = taken, False  # `dataset, model, optimizer = load_train_objs()`
            if (outer := _wrapper_module(script, owner, scope)) is not None:
                owner = outer  # `net = LossWrapper(backbone)`: the training runs `net`
            if (state := frozen(script, owner, _binding_scope(script, owner, scope))) is True:
                script.frozen_models[owner] = _binding_scope(script, owner, scope)
                continue  # nothing in it trains: DDP refuses it (a frozen backbone handed over with its head)
            if state is None:
                script.maybe_frozen.add(owner)
            if owner in script.models:
                first = script.models[owner]
                if owner.startswith("self.") and script.class_of(first) is not script.class_of(scope):
                    script.unconverted_models.append((call, owner, script.class_of(scope)))  # said, never guessed
                elif _sibling(script, first, (here := _binding_scope(script, owner, scope))) and (owner, here) not in script.sibling_models:
                    script.sibling_models.append((owner, here))
                continue
            if not script.models:
                script.model_name = owner
                script.model_scope = _binding_scope(script, owner, scope)
                if isinstance(scope, cst.Module) and built_here:
                    script.main_block = _main_block(script, call)
                elif script.model_scope is script.module:  # an optimizer another module builds: where the model is
                    script.main_block = next(
                        (b for a in script.assigns.get(script.module, []) if ref_of(a.targets[0].target) == owner
                         if (b := _main_block(script, a)) is not None), None,
                    )  # fmt: skip
                script.optimizer_stmt = (
                    script.top_statement(call, scope) if built_here and script.model_scope is scope else None
                )
            script.models[owner] = _binding_scope(script, owner, scope)
    if script.models:
        return
    for call in script.calls:
        owner = N.receiver(call)
        scope = script.scope_of(call)
        if (
            N.call_name(call) == "parameters"
            and owner is not None
            and ref_of(owner)
            and _may_be_model(script, ref_of(owner), scope)
            and _updates_by_hand(script, call, scope)
            and frozen(script, ref_of(owner), _binding_scope(script, ref_of(owner), scope)) is not True  # an EMA copy
        ):
            script.model_name = ref_of(owner)
            script.model_scope = _binding_scope(script, script.model_name, scope)
            script.models[script.model_name] = script.model_scope
            return
    picked = _picked_at_run_time(script)
    if picked is not None:
        raise AnalysisError(
            script.line(picked),
            f"no model to convert: what trains is picked at run time (`{script.module.code_for_node(picked)}`), "
            "which ddpify cannot follow; convert the module whose code builds the model and its optimizer",
        )
    raise AnalysisError(1, "no model to convert: found no `torch.optim` optimizer over `model.parameters()`")


def _sibling(script: Script, first: ScopeNode, scope: ScopeNode) -> bool:
    """Is `scope` a function of another trainer than `first` (another class, or another function
    outside any class), where a model of the same name trains on its own?"""
    if not isinstance(scope, cst.FunctionDef) or not isinstance(first, cst.FunctionDef) or scope is first:
        return False
    return (script.class_of(scope) or scope) is not (script.class_of(first) or first)


def _picked_at_run_time(script: Script) -> cst.CSTNode | None:
    """A class or function looked up by a name known only at run time in the entry's own code
    (`globals()[config.agent]`, `vars(models)[name]`, `getattr(agents, args.agent)(config)`)."""
    for node in iter_nodes(script.module):
        if isinstance(node, cst.Subscript) and isinstance(node.value, cst.Call):
            if any(N.is_name(node.value.func, f) for f in ("globals", "locals", "vars")):
                return node
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Call) and N.is_name(node.func.func, "getattr"):
            if len(node.func.args) >= 2 and not isinstance(node.func.args[1].value, cst.SimpleString):
                return node.func
    return None


def _may_be_model(script: Script, owner: str, scope: ScopeNode) -> bool:
    """Can `owner` be wrapped? Not `self` (the object whose method builds the optimizer), not a
    parameter of a factory whose callers say which model it is (`optim4GPU(cfg, model)`), and
    not an object of the project's classes that is certainly no nn.Module (`Solver(...)`)."""
    if owner == "self":
        return False
    if scope in script.optimizer_summaries.trains and owner in {p.name.value for p in scope.params.params}:
        return False  # the callers' argument is the model
    for assign in _assignments_in(script, _binding_scope(script, owner, scope)):
        if ref_of(assign.targets[0].target) == owner and isinstance(assign.value, cst.Call):
            cls = script.class_called(assign.value)
            if cls is not None and script.optimizer_summaries.is_module(cls) is False:
                return False
    return True


def _wrapper_module(script: Script, model: str, scope: ScopeNode) -> str | None:
    """`net = LossWrapper(backbone)`: an nn.Module of the project built around the trained
    network under another name, whose forward the training calls (and never the network's own):
    DDP wraps the module the training step runs."""
    called = {ref_of(c.func) for c in script.calls if script.class_of(c) is None}
    if model in called:
        return None
    for assign in _assignments_in(script, _binding_scope(script, model, scope)):
        target, value = ref_of(assign.targets[0].target), assign.value
        if target in (None, model) or target not in called or not isinstance(value, cst.Call):
            continue
        cls = script.class_called(value)
        if cls is not None and any(ref_of(a.value) == model for a in value.args) and script.optimizer_summaries.is_module(cls):
            return target
    return None


def _taken_out(script: Script, model: str, scope: ScopeNode) -> tuple[str, ScopeNode] | None:
    """A factory that builds the model (and its optimizer) without training it and returns it,
    called once: the name the caller unpacks it into, in the caller's scope."""
    if not isinstance(scope, cst.FunctionDef) or scope in script.training_functions:
        return None
    index = None
    for ret in returns(scope):
        items = [e.value for e in ret.value.elements] if isinstance(ret.value, cst.Tuple) else [ret.value]
        where = [i for i, item in enumerate(items) if ref_of(item) == model]
        if len(where) != 1 or index not in (None, where[0]):
            return None
        index = where[0]
    if index is None:
        return None
    callers = [c for c in script.calls if isinstance(c.func, cst.Name) and script.local_function(c) is scope]
    if len(callers) != 1:
        return None
    assign = script.parent(callers[0])
    if not isinstance(assign, cst.Assign) or len(assign.targets) != 1:
        return None
    target = assign.targets[0].target
    items = [e.value for e in target.elements] if isinstance(target, (cst.Tuple, cst.List)) else [target]
    name = ref_of(items[index]) if index < len(items) else None
    return (name, script.scope_of(assign)) if name else None


def _updates_by_hand(script: Script, call: cst.Call, scope: ScopeNode) -> bool:
    """Is `model.parameters()` walked where training happens: in a training function, or in a
    loop of the module that calls backward (`p.data.add_(-lr * p.grad)` without an optimizer)?"""
    if scope in script.training_functions:
        return True
    return script.in_training_loop(call, scope)


def _main_block(script: Script, node: cst.CSTNode) -> cst.IndentedBlock | None:
    """The top-level `if __name__ == "__main__":` block around `node`, if any."""
    for stmt in script.module.body:
        if isinstance(stmt, cst.If) and N.tests_module_name(stmt.test) and script.inside(node, stmt.body):
            return stmt.body
    return None


def _assignments_in(script: Script, scope: ScopeNode) -> list[cst.Assign]:
    return script.assigns.get(scope, [])


def _binding_scope(script: Script, ref: str, scope: ScopeNode) -> ScopeNode:
    """The scope that assigns `ref`: `scope` itself, a method of its class, or the module."""
    candidates = [scope, *script.scopes_for(ref, scope), script.module]
    for candidate in candidates:
        if any(ref_of(a.targets[0].target) == ref for a in _assignments_in(script, candidate)):
            return candidate
    return scope


def _find_loaders(script: Script) -> None:
    for call in script.calls:
        if not script.is_call_to(call, N.DATALOADER):
            continue
        if _add_to_split(script, call):
            continue
        assign = script.parent(call)
        line = script.parent(assign) if assign is not None else None
        if (
            isinstance(assign, cst.Assign)
            and len(assign.targets) == 1
            and ref_of(assign.targets[0].target)
            and isinstance(line, cst.SimpleStatementLine)
        ):
            script.loaders.append(Loader(ref_of(assign.targets[0].target), call, line, script.scope_of(call)))
        elif (returned := _returned_loader(script, call)) is not None:
            script.loaders.append(returned)
        elif (handed := _handed_to_generator(script, call)) is not None:
            script.loaders.append(handed)
        elif (iterated := _iterated_inline(script, call)) is not None:
            script.loaders.append(iterated)
        else:
            script.unplaced_loaders.append(call)
    _named_splits(script)
    for split in script.split_loaders:
        split.epoch_loops = _epoch_loops(script, split.name, split.scope, depth=0) or []
    if not script.loaders:
        return  # batches made by hand, or loaders ddpify cannot follow: shard_data leaves a TODO
    for loader in script.loaders:
        loops = _epoch_loops(script, loader.name, loader.scope, depth=0)
        starts = _pass_starts(script, loader.name, loader.scope)
        for name, scope in _returned_to(script, loader) + _held_by_objects(script, loader):
            more = _epoch_loops(script, name, scope, depth=0)
            if more is not None:
                loops = (loops or []) + more
            starts += _pass_starts(script, name, scope)
        starts += _generator_pass_starts(script, loader)
        if isinstance(loader.stmt, cst.For):  # `for x, y in DataLoader(...)`: its epoch loop, if any
            loops = [] if loader.stmt is _for_of(script, loader.call) else [EpochLoop(loader.stmt, loader.scope, loader.name)]
        if loops is not None or starts:
            script.train_loaders.append(loader)
            script.epoch_loops[loader.name] = loops or []
            script.pass_starts[loader.name] = starts


def _returned_loader(script: Script, call: cst.Call) -> Loader | None:
    """`def prepare_dataloader(...): return DataLoader(...)` called from one place as
    `train_data = prepare_dataloader(...)`: a loader named as its caller names it, whose sampler
    is made in the factory (the caller reaches it as `train_data.sampler`)."""
    ret, line = script.parent(call), script.parent(script.parent(call))
    fn = script.scope_of(call)
    if not (isinstance(ret, cst.Return) and ret.value is call and isinstance(line, cst.SimpleStatementLine)):
        return None
    if not isinstance(fn, cst.FunctionDef):
        return None
    callers = [c for c in script.calls if script.local_function(c) is fn]
    assign = script.parent(callers[0]) if len(callers) == 1 else None
    if isinstance(assign, cst.Assign) and assign.value is callers[0] and isinstance(assign.targets[0].target, cst.Name):
        return Loader(assign.targets[0].target.value, call, line, fn)
    return _factory_of_splits(script, call, line, fn, callers)


def _factory_of_splits(script: Script, call: cst.Call, line, fn: cst.FunctionDef, callers: list[cst.Call]) -> Loader | None:
    """`def get_loader(name, shuffle=True): return DataLoader(..., shuffle=shuffle)`, called for
    the training loader and for others (`get_loader(name, shuffle=False)` to evaluate): one caller's
    loader trains, and the factory's shuffle parameter tells it apart. The loaders it makes that
    shuffle get the sampler; named as the training caller names it."""
    shuffle = N.keyword(call, "shuffle")
    params = {p.name.value for p in fn.params.params}
    if shuffle is None or not (isinstance(shuffle.value, cst.Name) and shuffle.value.value in params):
        return None
    training = []
    for caller in callers:
        assign = script.parent(caller)
        if isinstance(assign, cst.Assign) and assign.value is caller and isinstance(assign.targets[0].target, cst.Name):
            name, where = assign.targets[0].target.value, script.scope_of(caller)
            if _epoch_loops(script, name, where, depth=0) is not None or _pass_starts(script, name, where):
                training.append(name)
    if len(training) != 1:
        return None
    return Loader(training[0], call, line, fn, shuffle_picks=True)


def _handed_to_generator(script: Script, call: cst.Call) -> Loader | None:
    """`batches = endless(DataLoader(...))`: a loader made inline as the first argument of a
    generator of the script, named as the statement names the generator (its sampler is
    `batches_sampler`); each pass of the generator's own loop is a new pass over it."""
    arg = script.parent(call)
    outer = script.parent(arg) if isinstance(arg, cst.Arg) else None
    assign = script.parent(outer) if isinstance(outer, cst.Call) else None
    line = script.parent(assign) if assign is not None else None
    if not (
        isinstance(assign, cst.Assign)
        and assign.value is outer
        and len(assign.targets) == 1
        and ref_of(assign.targets[0].target)
        and isinstance(line, cst.SimpleStatementLine)
        and outer.args[0] is arg
    ):
        return None
    fn = script.local_function(outer)
    if fn is None or not script.nodes_in(fn, cst.Yield) or not fn.params.params:
        return None
    return Loader(ref_of(assign.targets[0].target), call, line, script.scope_of(call))


def _iterated_inline(script: Script, call: cst.Call) -> Loader | None:
    """`for x, y in DataLoader(data, shuffle=True):` (or in `enumerate(...)`/`tqdm(...)` of one)
    in a loop that trains: a loader made anew each pass. Its sampler is made once, before the
    epoch loop around it (`Loader.stmt`, a `for`, where `set_epoch` goes), or before the pass
    itself when nothing loops around it."""
    loop = _for_of(script, call)
    if loop is None or not _has_backward(script, loop.body):
        return None
    scope = script.scope_of(call)
    outer = script.enclosing_loop(loop, scope)
    where = outer if isinstance(outer, cst.For) else loop if outer is None else None
    if where is None or script.top_statement(where, scope) is not where and script.enclosing_loop(where, scope) is not None:
        return None
    return Loader("loader", call, where, scope)


def _for_of(script: Script, call: cst.Call) -> cst.For | None:
    """The `for` whose iterable is `call`, itself or wrapped first in `enumerate(...)`/`tqdm(...)`."""
    node, parent = call, script.parent(call)
    while isinstance(parent, cst.Arg) and isinstance(script.parent(parent), cst.Call) and script.parent(parent).args[0] is parent:
        node, parent = script.parent(parent), script.parent(script.parent(parent))
    return parent if isinstance(parent, cst.For) and parent.iter is node else None


def _generator_pass_starts(script: Script, loader: Loader) -> list[PassStart]:
    """The passes of the generator a loader made inline is handed to (`_handed_to_generator`),
    when the training loop draws from it with `next(...)`."""
    outer = script.parent(script.parent(loader.call))
    fn = script.local_function(outer) if isinstance(outer, cst.Call) else None
    if fn is None or script.parent(outer) is not loader.stmt.body[0] or not _drawn_in_training(script, outer, loader.scope):
        return []
    param = fn.params.params[0].name.value
    return [PassStart(loop, fn, param) for loop in _loops_in(script, fn) if mentions(loop.iter, param)]


def _picks(script: Script, fn: cst.FunctionDef, call: cst.Call, name: str, aliases: set[str]) -> bool:
    """Does this call of `fn` get the loader `name`: its constant arguments (`fetch("train")`)
    decide every `if` above an assignment of `name` to one of `aliases` (`if kind == "train":
    chosen = train_loader`)? False where a test cannot be decided."""
    params = [p.name.value for p in fn.params.params]
    given = {params[i]: a.value for i, a in enumerate(N.positional(call)) if i < len(params)}
    given |= {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    for assign in script.assigns.get(fn, []):
        if ref_of(assign.targets[0].target) not in aliases or not N.is_name(assign.value, name):
            continue
        child, decided = assign, True
        for anc in script.ancestors(assign):
            if anc is fn:
                break
            if isinstance(anc, cst.If):
                holds = _constant_test(anc.test, given)
                taken = holds if script.inside(child, anc.body) else (None if holds is None else not holds)
                decided = decided and bool(taken)
            child = anc
        if decided:
            return True
    return False


def _constant_test(test: cst.BaseExpression, given: dict) -> bool | None:
    """`kind == "train"` (or `!=`) with `kind` given a constant: its value; None otherwise."""
    if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1 and isinstance(test.left, cst.Name)):
        return None
    op, right = test.comparisons[0].operator, test.comparisons[0].comparator
    value = given.get(test.left.value)
    if not (isinstance(value, cst.SimpleString) and isinstance(right, cst.SimpleString)):
        return None
    same = value.evaluated_value == right.evaluated_value
    return same if isinstance(op, cst.Equal) else (not same if isinstance(op, cst.NotEqual) else None)


def _aliases_of(script: Script, fn: ScopeNode, name: str) -> set[str]:
    """The names `fn` binds to the loader `name` (`dl = trainloader`, or one side of an `if` expression)."""
    return {
        ref_of(a.targets[0].target) for a in script.assigns.get(fn, [])
        if N.is_name(a.value, name) or isinstance(a.value, cst.IfExp) and name in (ref_of(a.value.body), ref_of(a.value.orelse))
    }  # fmt: skip


def _kept_from_argument(script: Script, arg: cst.Arg) -> list[tuple[str, cst.FunctionDef]]:
    """The `self.` attributes in which the constructor of the script's class that `arg` is given
    to keeps it (`Trainer(data.loader(), config)` keeps `self.data_loader`)."""
    ctor = script.parent(arg)
    cls = script.class_called(ctor) if isinstance(ctor, cst.Call) else None
    init = script.methods(cls).get("__init__") if cls is not None else None
    if init is None:
        return []
    params = [p.name.value for p in init.params.params][1:]
    if arg.keyword is not None:
        param = arg.keyword.value if arg.keyword.value in params else None
    else:
        index = N.positional(ctor).index(arg)
        param = params[index] if index < len(params) else None
    return _kept_by_init(script, init, param) if param is not None else []


def _add_to_split(script: Script, call: cst.Call) -> bool:
    """Record a DataLoader built per split in a dict (comprehension or literal)."""
    holder = script.parent(call)
    if isinstance(holder, cst.DictComp) and holder.value is call:
        comp = holder.for_in
        if not (isinstance(comp.target, cst.Name) and not comp.ifs and comp.inner_for_in is None):
            return False
        keys = _string_keys(getattr(comp.iter, "elements", None), lambda e: e.value)
        if keys is None or not isinstance(holder.key, cst.Name) or holder.key.value != comp.target.value:
            return False
        dict_node, key_var, calls = holder, comp.target.value, {key: call for key in keys}
    elif isinstance(holder, cst.DictElement) and holder.value is call:
        dict_node = script.parent(holder)
        keys = _string_keys(dict_node.elements, lambda e: e.key)
        if keys is None:
            return False
        key_var, calls = None, {}
        for element, key in zip(dict_node.elements, keys):
            if isinstance(element.value, cst.Call) and script.is_call_to(element.value, N.DATALOADER):
                calls[key] = element.value
    else:
        return False
    assign = script.parent(dict_node)
    line = script.parent(assign)
    if not (isinstance(assign, cst.Assign) and len(assign.targets) == 1 and ref_of(assign.targets[0].target)):
        return False
    if not isinstance(line, cst.SimpleStatementLine):
        return False
    name = ref_of(assign.targets[0].target)
    if any(split.name == name and split.stmt is line for split in script.split_loaders):
        return True
    script.split_loaders.append(SplitLoaders(name, line, script.scope_of(call), keys, calls, key_var))
    return True


def _string_keys(elements, key_of) -> dict[str, str] | None:
    """{split: key as written} when every element's key is a plain string literal."""
    if not elements:
        return None
    keys = {}
    for element in elements:
        key = key_of(element) if isinstance(element, (cst.Element, cst.DictElement)) else None
        if not isinstance(key, cst.SimpleString):
            return None
        keys[key.evaluated_value] = cst.Module([]).code_for_node(key)
    return keys


def _named_splits(script: Script) -> None:
    """`loaders = {"train": train_loader, "val": val_loader}` over loaders built above."""
    for loader in list(script.loaders):
        for assign in script.assigns.get(loader.scope, []):
            if not isinstance(assign.value, cst.Dict):
                continue
            elements = assign.value.elements
            keys = _string_keys(elements, lambda e: e.key)
            values = [ref_of(e.value) if isinstance(e, cst.DictElement) else None for e in elements]
            name = ref_of(assign.targets[0].target)
            if keys is None or loader.name not in values or name is None:
                continue
            if not _epoch_loops(script, name, loader.scope, depth=0):
                continue  # the dict is not what the training loop walks: the loader stays on its own
            line = script.parent(assign)
            split = next((s for s in script.split_loaders if s.stmt is line), None)
            if split is None:
                split = SplitLoaders(name, line, loader.scope, keys, {})
                script.split_loaders.append(split)
            split.calls[list(keys)[values.index(loader.name)]] = loader.call
            script.loaders.remove(loader)


def _held_by_objects(script: Script, loader: Loader) -> list[tuple[str, ScopeNode]]:
    """Where a loader a class keeps (`self.train_loader = DataLoader(...)` in a data holder's
    method) is read through an object of that class: `self.data = Batches(cfg)` makes it
    `self.data.train_loader` in the methods of the class that holds `self.data`."""
    cls = script.class_of(loader.scope) if isinstance(loader.scope, cst.FunctionDef) else None
    if cls is None or not loader.name.startswith("self.") or loader.name.count(".") != 1:
        return []
    found = []
    for scope, assigns in script.assigns.items():
        for assign in assigns:
            holder = ref_of(assign.targets[0].target) if len(assign.targets) == 1 else None
            if holder and isinstance(assign.value, cst.Call) and script.class_called(assign.value) is cls:
                found.append((f"{holder}.{loader.name[5:]}", scope))
    return found


def _returned_to(script: Script, loader: Loader) -> list[tuple[str, ScopeNode]]:
    """Where a loader built by a helper (`return train_loader, test_loader`) lands in callers."""
    fn = loader.scope
    if not isinstance(fn, cst.FunctionDef):
        return []
    position = None
    aliases = {loader.name} | _aliases_of(script, fn, loader.name)  # `dl = trainloader`, then `return dl`
    others = [o for o in script.loaders if o.scope is fn and o.name != loader.name]
    chosen = any(_aliases_of(script, fn, o.name) & aliases for o in others)  # `if split == "train": dl = trainloader`
    for ret in returns(fn):
        values = ret.value.elements if isinstance(ret.value, cst.Tuple) else [ret.value]
        for index, element in enumerate(values):
            value = element.value if isinstance(element, cst.Element) else element
            if (isinstance(value, cst.Name) and value.value in aliases) or value is loader.call:
                position = (index, len(values))
    if position is None:
        return []
    found = []
    for call in script.calls:
        if (script.local_function(call) or script.method_of_object(call)) is not fn:
            continue
        if chosen and not _picks(script, fn, call, loader.name, aliases - {loader.name}):
            continue  # this caller's argument picks another loader (or ddpify cannot tell which)
        assign = script.parent(call)
        if position[1] == 1 and isinstance(assign, cst.Arg):  # `Trainer(data.loader(), config)`: kept by the object
            found += _kept_from_argument(script, assign)
            continue
        if not isinstance(assign, cst.Assign) or len(assign.targets) != 1:
            continue
        target = assign.targets[0].target
        index, count = position
        if count == 1 and isinstance(target, cst.Name):
            found.append((target.value, script.scope_of(call)))
        elif isinstance(target, (cst.Tuple, cst.List)) and len(target.elements) == count:
            name = target.elements[index].value
            if isinstance(name, cst.Name):
                found.append((name.value, script.scope_of(call)))
    return found


def returns(fn: cst.FunctionDef) -> list[cst.Return]:
    """The `return <value>` statements of `fn` itself (not of functions defined inside it)."""
    return [
        n
        for n in iter_nodes(fn, prune=lambda n: isinstance(n, cst.FunctionDef))
        if isinstance(n, cst.Return) and n.value is not None
    ]


def data_parallel_loads(script: Script) -> list[cst.Call]:
    """`model.load_state_dict(state)` where `model` holds an `nn.DataParallel` model: what it
    loads has `module.` keys (an earlier run saved the wrapper's state dict), which the plain
    model a conversion loads into does not have."""
    bound = _data_parallel_bindings(script)
    return [
        call for call in script.calls
        if N.call_name(call) == "load_state_dict" and (N.positional(call) or N.keyword(call, "state_dict"))
        and (_holds_data_parallel(script, bound, N.receiver(call), call) or _handed_data_parallel(script, bound, call))
    ]  # fmt: skip


def _handed_data_parallel(script: Script, bound: dict, call: cst.Call) -> bool:
    """`def load_checkpoint(path, model): model.load_state_dict(...)`, which a caller hands an
    `nn.DataParallel` model (`load_checkpoint("teacher.pt", teacher)`)."""
    receiver, fn = N.receiver(call), script.scope_of(call)
    if not (isinstance(receiver, cst.Name) and isinstance(fn, cst.FunctionDef)):
        return False
    if receiver.value not in {p.name.value for p in fn.params.params}:
        return False
    for caller in script.calls:
        if script.local_function(caller) is fn:
            given = argument_for(fn, caller, receiver.value)
            if given is not None and _holds_data_parallel(script, bound, given, caller):
                return True
    return False


def data_parallel_modules(script: Script) -> list[cst.Attribute]:
    """`model.module` where `model` holds an `nn.DataParallel` model: the network inside it."""
    bound = _data_parallel_bindings(script)
    return [
        node for node in script.nodes_of(cst.Attribute)
        if bound and node.attr.value == "module" and _holds_data_parallel(script, bound, node.value, node)
    ]  # fmt: skip


def _holds_data_parallel(script: Script, bound: dict, expr: cst.CSTNode | None, node: cst.CSTNode) -> bool:
    """Does `expr` (a name or `self.x`) hold an `nn.DataParallel` model where `node` runs: bound
    to `nn.DataParallel(net)` (or `.to(device)`/`.cuda()` of it) before, in its scope, or in
    another method for `self.x`?"""
    ref = ref_of(expr) if expr is not None else None
    if ref is None:
        return False
    scope = script.scope_of(node)
    return any(
        (scope in script.scopes_for(ref, where) or _closure_of(script, scope, where, ref))
        and (scope is not where or script.before(assign, node))
        for assign, where in bound.get(ref, ())
    )


def _closure_of(script: Script, scope: ScopeNode, where: ScopeNode, ref: str) -> bool:
    """Is `scope` a function nested in `where` that reads `ref` from it (`def save_ckpt(path):`
    inside `main`, called after `model = nn.DataParallel(model)`)?"""
    if not isinstance(scope, cst.FunctionDef) or not isinstance(where, cst.FunctionDef) or ref in script.bound.get(scope, ()):
        return False
    return any(a is where for a in script.ancestors(scope))


def _data_parallel_bindings(script: Script) -> dict[str, list[tuple[cst.Assign, ScopeNode]]]:
    """Each name bound to an `nn.DataParallel` model -> (the assignment, its scope)."""
    found: dict[str, list[tuple[cst.Assign, ScopeNode]]] = {}
    for node in script.data_parallel:
        call = script.parent(node)
        if not (isinstance(call, cst.Call) and call.func is node):
            continue
        outer = _chained(script, call)
        assign = script.parent(outer)
        if isinstance(assign, cst.Assign) and assign.value is outer and ref_of(assign.targets[0].target):
            found.setdefault(ref_of(assign.targets[0].target), []).append((assign, script.scope_of(assign)))
    return found


def _chained(script: Script, call: cst.Call) -> cst.Call:
    """`nn.DataParallel(net).to(device).cuda()`: the outermost call of the chain."""
    while True:
        attr = script.parent(call)
        outer = script.parent(attr) if isinstance(attr, cst.Attribute) and attr.value is call else None
        if not (isinstance(outer, cst.Call) and outer.func is attr and attr.attr.value in ("to", "cuda", "float", "half")):
            return call
        call = outer


def mentions(node: cst.CSTNode, ref: str) -> bool:
    """Does `node` use the variable or `self.` attribute `ref` (or a longer chain, the loader a
    held object keeps: `self.data.train_loader`)? (`self.loader` and `x.loader` do not use the
    variable `loader`.)"""
    attributes = set()  # the `.attr` names of attributes: no variable
    deep = ref.count(".") > 1
    for n in iter_nodes(node):
        if isinstance(n, cst.Attribute):
            attributes.add(n.attr)
            if ref_of(n) == ref or deep and dotted_name(n) == ref:
                return True
        elif isinstance(n, cst.Name) and n.value == ref and n not in attributes:
            return True
    return False


def _epoch_loops(script: Script, ref: str, scope: ScopeNode, depth: int) -> list[EpochLoop] | None:
    """Epoch loops around training passes over loader `ref`; None if it never trains."""
    if depth > 3:
        return None
    found: list[EpochLoop] | None = None
    for where in script.scopes_for(ref, scope):
        aliases = {ref} | {  # batches = tqdm(loader) ...: iterating `batches` iterates the loader
            ref_of(a.targets[0].target) for a in _assignments_in(script, where) if mentions(a.value, ref)
        }
        for loop in _loops_in(script, where):
            if any(mentions(loop.iter, r) for r in aliases - _untrained_picks(script, where, ref, loop) if r) and _has_backward(script, loop.body):
                outer = script.enclosing_loop(loop, where)
                if outer is not None and _picks_split(loop, outer):
                    outer = script.enclosing_loop(outer, where)
                found = found or []
                if outer is not None:
                    found.append(EpochLoop(outer, where, ref, loop))
                elif isinstance(where, cst.FunctionDef):
                    found += _loops_around_calls(script, where, ref, loop)
        for call in script.calls_in(where):
            fn = script.local_function(call) or script.method_of_object(call)  # `trainer.train(loader, epochs)`
            if fn is None or script.scope_of(call) is not where or fn not in script.training_functions:
                continue
            param = param_receiving(fn, call, ref)
            if param is None:
                continue
            outer = script.enclosing_loop(call, where)
            inner = _epoch_loops(script, param, fn, depth + 1)
            if outer is not None:
                passes = [loop.inner for loop in inner or [] if loop.inner is not None]
                found = (found or []) + [EpochLoop(outer, where, ref, passes[0] if passes else None)]
            elif inner is not None:
                found = (found or []) + inner
        for attr, init in kept_by_objects(script, ref, where):  # `Trainer(model, train_loader)`
            kept = _epoch_loops(script, attr, init, depth + 1)
            if kept is not None:
                found = (found or []) + kept
    return found


def _untrained_picks(script: Script, where: ScopeNode, ref: str, loop: cst.For | cst.While) -> set[str]:
    """Names bound to `ref` by `x = A if test else B` on the side the loop's training steps never
    see: `data_loader = self.tr_loader if not cross_valid else self.cv_loader`, with every backward
    of the loop under `if not cross_valid:`, never trains on `self.cv_loader`."""
    found = set()
    for assign in _assignments_in(script, where):
        pick = assign.value
        if not isinstance(pick, cst.IfExp) or ref not in (ref_of(pick.body), ref_of(pick.orelse)):
            continue
        guard = pick_training_test(script, loop, pick)
        if guard is not None:
            untrained = pick.orelse if guard == script.root_of(loop).code_for_node(pick.test) else pick.body
            if ref_of(untrained) == ref:
                found.add(ref_of(assign.targets[0].target))
    return found


def pick_training_test(script: Script, loop: cst.For | cst.While, pick: cst.IfExp) -> str | None:
    """For `x = A if test else B` read by `loop`: the test every backward of the loop runs under,
    when it is the pick's (`test`: A trains) or its negation (`not test`: B trains)."""
    code = script.root_of(loop).code_for_node
    guards = [
        {code(a.test) for a in script.ancestors(c) if isinstance(a, cst.If) and script.inside(a, loop)}
        for c in script.calls_in(loop.body) if N.call_name(c) == "backward" and N.receiver(c) is not None
    ]  # fmt: skip
    if not guards:
        return None
    test = code(pick.test)
    negated = test[len("not ") :] if test.startswith("not ") else f"not {test}"
    return test if all(test in g for g in guards) else negated if all(negated in g for g in guards) else None


def _pass_starts(script: Script, ref: str, scope: ScopeNode, depth: int = 0, holders: frozenset[str] = frozenset()) -> list[PassStart]:
    """Step-based training over loader `ref`: the statements that start each new pass."""
    found: list[PassStart] = []
    if depth > 3:
        return found
    for where in script.scopes_for(ref, scope):
        for loop in _loops_in(script, where):  # `while step < max_steps: for batch in loader:`
            if (
                mentions(loop.iter, ref)
                and _has_backward(script, loop.body)
                and script.enclosing_loop(loop, where) is None
                and any(isinstance(a, cst.While) for a in _ancestors_in(script, loop, where))
            ):
                found.append(PassStart(loop, where, ref))
        for call in script.calls_in(where):
            if script.scope_of(call) is not where:
                continue
            fn = script.local_function(call) or script.method_of_object(call)
            param = param_receiving(fn, call, ref) if fn is not None else None
            if N.is_name(call.func, "iter") and call.args and mentions(call.args[0].value, ref):
                if _drawn_in_training(script, call, where, holders):  # `it = iter(loader)`
                    stmt = script.statement_line(call) or call
                    found.append(PassStart(stmt, where, ref, _restarts(script, call, where)))
            elif param and script.nodes_in(fn, cst.Yield) and _drawn_in_training(script, call, where):
                # `batches = infinite_loader(loader)`: each pass of the generator's own loop
                found += [PassStart(loop, fn, param) for loop in _loops_in(script, fn) if mentions(loop.iter, param)]
            elif param and fn in script.training_functions:  # `train(model, loader, max_steps)`
                found += _pass_starts(script, param, fn, depth + 1)
        kept = kept_by_objects(script, ref, where)
        held = _holders(script, ref, where) if kept else frozenset()
        for attr, init in kept:  # `Solver(loader, config)`: `iter(self.loader)`
            found += [s for s in _pass_starts(script, attr, init, depth + 1, held) if s not in found]
    return found


def _restarts(script: Script, call: cst.Call, scope: ScopeNode) -> bool:
    """Does every `next(it)` on this iterator survive its end (`except StopIteration`, or a
    default: `next(it, None)`)? Otherwise the script counts on a number of batches per pass."""
    name = ref_of(script.parent(call).targets[0].target)
    for where in script.scopes_for(name, scope) if name and name.startswith("self.") else [scope]:
        for draw in script.calls_in(where):
            if not (N.is_name(draw.func, "next") and draw.args and ref_of(draw.args[0].value) == name):
                continue
            caught = any(  # `except StopIteration:`, or a handler that catches it too (`except:`, `except Exception:`)
                isinstance(a, cst.Try) and any(h.type is None or CATCHES_STOP & set(names_in(h.type)) for h in a.handlers)
                for a in _ancestors_in(script, draw, where)
            )
            if len(draw.args) == 1 and not caught:
                return False
    return True


def _ancestors_in(script: Script, node: cst.CSTNode, scope: ScopeNode) -> list[cst.CSTNode]:
    found = []
    for anc in script.ancestors(node):
        if anc is scope:
            break
        found.append(anc)
    return found


def _holders(script: Script, ref: str, scope: ScopeNode) -> frozenset[str]:
    """The names bound to the objects that keep `ref` (`fetcher = Prefetcher(loader, device)`):
    where their methods draw from it is training only where the training loop calls them on these."""
    found = set()
    for call in script.calls_in(scope):
        assign = script.parent(call)
        cls = script.class_called(call)
        init = script.methods(cls).get("__init__") if cls is not None else None
        if init is not None and isinstance(assign, cst.Assign) and assign.value is call and param_receiving(init, call, ref):
            found.add(ref_of(assign.targets[0].target))
    return frozenset(n for n in found if n)


def _drawn_in_training(script: Script, call: cst.Call, scope: ScopeNode, holders: frozenset[str] = frozenset()) -> bool:
    """`it = <call>` and `next(it)` inside a loop that calls backward: in `scope`, or, for an
    iterator kept on `self`, in a method that a training loop calls on an object of the class
    (`batch = batch_loader.next()`, an endless-loader class)."""
    assign = script.parent(call)
    if not isinstance(assign, cst.Assign) or not (name := ref_of(assign.targets[0].target)):
        return False
    for where in script.scopes_for(name, scope) if name.startswith("self.") else [scope]:
        for draw in script.calls_in(where):
            if not (N.is_name(draw.func, "next") and draw.args and ref_of(draw.args[0].value) == name):
                continue
            if any(isinstance(a, cst.With) and script.index.is_no_grad(a) for a in _ancestors_in(script, draw, where)):
                continue  # an evaluation batch drawn mid-training
            if script.in_training_loop(draw, where):
                return True
            if isinstance(where, cst.FunctionDef) and _method_called_in_training(script, where, holders):
                return True
    return False


def _method_called_in_training(script: Script, method: cst.FunctionDef, holders: frozenset[str] = frozenset(), depth: int = 0) -> bool:
    """Is `obj.method()` called, on an object of the method's class (`holders`: on one of these
    names, the objects that hold the loader), in a loop that calls backward; or `self.method()`
    from a method of the class that is (`next()` calling `self.preload()`)?"""
    cls = script.class_of(method)
    if cls is None or depth > 2:
        return False
    owners = holders or {name for name, kind in script.objects().items() if kind is cls}
    for call in script.calls:
        if not (isinstance(call.func, cst.Attribute) and call.func.attr.value == method.name.value):
            continue
        caller = script.scope_of(call)
        if N.is_name(call.func.value, "self") and isinstance(caller, cst.FunctionDef) and script.class_of(caller) is cls:
            if caller is not method and _method_called_in_training(script, caller, holders, depth + 1):
                return True
            continue
        if ref_of(call.func.value) not in owners:
            continue
        if script.in_training_loop(call, caller):
            return True
    return False


def _loops_around_calls(script: Script, fn: cst.FunctionDef, ref: str, inner: cst.For, depth: int = 0) -> list[EpochLoop]:
    """`def train(epoch): for x in loader: ...` called as `for epoch in ...: train(epoch)`."""
    found = []
    for call in script.calls:
        if (script.local_function(call) or script.method_of_object(call)) is fn:
            caller = script.scope_of(call)
            outer = script.enclosing_loop(call, caller)
            if outer is not None:
                found.append(EpochLoop(outer, caller, ref, inner))
            elif isinstance(caller, cst.FunctionDef) and caller is not fn and depth < 3:
                # `def train(self, epoch): self.iteration(epoch, self.train_data)`, called in the epoch loop
                found += _loops_around_calls(script, caller, ref, inner, depth + 1)
    return found


def _picks_split(loop: cst.For, outer: cst.For) -> bool:
    """`for phase in splits: for batch in loaders[phase]`: the outer loop is not the epoch."""
    if not isinstance(outer.target, cst.Name):
        return False
    return any(N.is_name(N.sole_index(n), outer.target.value) for n in iter_nodes(loop.iter))


def _loops_in(script: Script, scope: ScopeNode) -> list[cst.For]:
    return script.loops.get(scope, [])


def argument_for(fn: cst.FunctionDef, call: cst.Call, param: str) -> cst.BaseExpression | None:
    """What this call of `fn` hands its parameter `param` (by keyword or by position)."""
    given = N.keyword(call, param)
    if given is not None:
        return given.value
    params = [p.name.value for p in fn.params.params]
    if params[:1] == ["self"] and (isinstance(call.func, cst.Attribute) or fn.name.value in ("__init__", "__call__")):
        params = params[1:]
    positional = N.positional(call)
    index = params.index(param) if param in params else len(positional)
    return positional[index].value if index < len(positional) else None


def param_receiving(fn: cst.FunctionDef, call: cst.Call, ref: str) -> str | None:
    """The parameter of `fn` that receives `ref` at this call."""
    params = [p.name.value for p in fn.params.params]
    if params[:1] == ["self"] and (isinstance(call.func, cst.Attribute) or fn.name.value in ("__init__", "__call__")):
        params = params[1:]
    for index, arg in enumerate(N.positional(call)):
        if _passes(arg.value, ref) and index < len(params):
            return params[index]
    for arg in call.args:
        if arg.keyword is not None and _passes(arg.value, ref):
            return arg.keyword.value
    return None


def _passes(value: cst.BaseExpression, ref: str) -> bool:
    """Does an argument hand over `ref`, or one item of it by a constant key (`loaders["train"]`:
    a dict of loaders per split, each used by name)?"""
    if isinstance(N.sole_index(value), cst.SimpleString):
        value = value.value
    return ref_of(value) == ref


def kept_by_objects(script: Script, ref: str, scope: ScopeNode, rebound: bool = True) -> list[tuple[str, cst.FunctionDef]]:
    """`Trainer(model, optimizer, train_loader)` keeps `train_loader` as `self.train_loader`:
    each `self.` attribute an `__init__` of the script's own classes stores `ref` in.
    `rebound=False`: not in an object `ref` itself is rebound to (`model = LossWrapper(model)`:
    the object is the model from then on, and what it keeps is never wrapped on its own)."""
    found = []
    for call in script.calls_in(scope):
        assign = script.parent(call)
        if not rebound and isinstance(assign, cst.Assign) and assign.value is call and ref_of(assign.targets[0].target) == ref:
            continue
        cls = script.class_called(call)
        init = script.methods(cls).get("__init__") if cls is not None else None
        param = param_receiving(init, call, ref) if init is not None and script.scope_of(call) is scope else None
        if param is not None:
            found += _kept_by_init(script, init, param)
        elif init is not None and script.scope_of(call) is scope:
            for key, held in _handed_in_dicts(script, init, call, ref, scope):  # `Solver({"train": loader}, ...)`
                found += _kept_by_init(script, init, held, key=key)
    return found


def _handed_in_dicts(script: Script, init: cst.FunctionDef, call: cst.Call, ref: str, scope: ScopeNode) -> list[tuple[str, str]]:
    """`data = {"tr_loader": tr_loader, ...}; Solver(data, ...)`: (key, parameter) for each dict
    the call hands the constructor that holds `ref` under a string key."""
    found = []
    for arg in call.args:
        value, name = arg.value, ref_of(arg.value)
        if name is not None and not isinstance(value, cst.Dict):
            bound = [a.value for a in script.assigns.get(scope, []) if ref_of(a.targets[0].target) == name]
            value = bound[-1] if bound else value
        if not isinstance(value, cst.Dict):
            continue
        param = param_receiving(init, call, name) if name is not None else None
        if param is None and not arg.keyword and arg in call.args:
            positional = [p.name.value for p in init.params.params][1:]
            index = [a for a in call.args if not a.keyword].index(arg)
            param = positional[index] if index < len(positional) else None
        for element in value.elements:
            if isinstance(element, cst.DictElement) and isinstance(element.key, cst.SimpleString) and ref_of(element.value) == ref:
                if param is not None:
                    found.append((element.key.evaluated_value, param))
    return found


def _kept_by_init(script: Script, init: cst.FunctionDef, param: str, depth: int = 0, key: str | None = None) -> list[tuple[str, cst.FunctionDef]]:
    """The `self.` attributes a constructor stores its parameter `param` in (`key`: the item of
    the dict it is, `param["tr_loader"]`), its base classes' constructors included
    (`super().__init__(model, ...)`, pytorch-template's BaseTrainer)."""
    found = []
    star = init.params.star_kwarg
    kwargs = star.name.value if isinstance(star, cst.Param) and param not in {p.name.value for p in init.params.params} else None

    def given(node: cst.CSTNode) -> bool:
        """`param`; or, passed in `**kwargs` (the keyword `model=` of the call), `kwargs["model"]`
        or `kwargs.get("model", ...)`."""
        if key is not None:
            return (isinstance(node, cst.Subscript) and N.is_name(node.value, param) and N.is_string(N.sole_index(node), key)) or (
                N.is_method_call(node, "get") and N.is_name(N.receiver(node), param) and bool(node.args) and N.is_string(node.args[0].value, key)
            )  # fmt: skip
        if kwargs is None:
            return N.is_name(node, param)
        if isinstance(node, cst.Subscript):
            return N.is_name(node.value, kwargs) and N.is_string(N.sole_index(node), param)
        return (
            N.is_method_call(node, "get") and N.is_name(N.receiver(node), kwargs)
            and bool(node.args) and N.is_string(node.args[0].value, param)
        )  # fmt: skip

    def kept(node: cst.CSTNode) -> bool:
        """`given`, or `given.to(...)` / `given.cuda(...)`."""
        return given(node) or (N.is_method_call(node, "to", "cuda") and given(N.receiver(node)))

    for assign in script.assigns.get(init, []):
        for target, value in _pairs(assign.targets[0].target, assign.value):
            target = ref_of(target)
            if isinstance(value, cst.Call) and value.args and script.is_call_to(value, D.DDP):
                value = value.args[0].value  # `self.model = DDP(model.to(gpu), ...)`: kept, wrapped
            if kept(value) and target and target.startswith("self."):
                found.append((target, init))  # `self.model = model` or `self.model = model.to(gpu_id)`
    cls = script.class_of(init)
    if cls is None or depth > 3:
        return found
    for call in script.calls_in(init):
        if not (N.is_method_call(call, "__init__") and N.is_call_of(N.receiver(call), "super")):
            continue
        for base in cls.bases:
            parent = script.classes.get(base.value.value) if isinstance(base.value, cst.Name) else None
            parent = parent or script.project_definition(base.value)
            base_init = script.methods(parent).get("__init__") if isinstance(parent, cst.ClassDef) else None
            passed = param_receiving(base_init, call, param) if base_init is not None else None
            if passed is not None:
                for target, where in _kept_by_init(script, base_init, passed, depth + 1):
                    found += [(target, where), (target, init)]  # the subclass's methods read it too
    return found


def _pairs(target: cst.BaseExpression, value: cst.BaseExpression) -> list[tuple[cst.BaseExpression, cst.BaseExpression]]:
    """`self.loader, self.opt = loader, opt`: each target with its value (one pair when not unpacked)."""
    if isinstance(target, (cst.Tuple, cst.List)) and isinstance(value, (cst.Tuple, cst.List)):
        if len(target.elements) == len(value.elements):
            return [(t.value, v.value) for t, v in zip(target.elements, value.elements)]
    return [(target, value)]


def _find_ddp_names_and_eval_calls(script: Script) -> None:
    """Which names hold a DDP model in which function (and which of them only on some runs: a
    model frozen on others is not wrapped there), and which helper calls only evaluate. A model
    its training runs with weights handed to it (analysis/functional.py) is never wrapped: its
    names go to `synced_by_hand` instead (a sibling trainer's model of the same name is wrapped
    as ever)."""
    own = len(script.models)  # (the sibling trainers' models come after)
    for index, (model, model_scope) in enumerate([*script.models.items(), *script.sibling_models]):
        held: list[tuple[ScopeNode, str]] = []
        aliases: list[cst.Assign] = []

        def hold(scope: ScopeNode, name: str) -> None:
            if (scope, name) not in held:
                held.append((scope, name))

        holders = [(model, model_scope)]
        for _ in range(3):  # an object that hands the model on to another's constructor (a visualizer's plotter)
            found = []
            for name, where in holders:
                for attr, init in kept_by_objects(script, name, where, rebound=False):
                    for method in script.scopes_for(attr, init):
                        hold(method, attr)
                for param, init in _given_to_constructors(script, name, where):  # `model.latent_dim` in the constructor
                    if (init, param) not in held:
                        hold(init, param)
                        found.append((param, init))
            holders = found
        for scope in script.scopes_for(model, model_scope):
            hold(scope, model)
            for assign in script.assigns.get(scope, []):  # `scorer = model.eval()`: the same object
                alias = ref_of(assign.targets[0].target)
                value = N.module_itself(assign.value)
                if alias not in (None, model) and value is not assign.value and ref_of(value) == model:
                    hold(scope, alias)
                    aliases.append(assign)
            for call in script.calls_in(scope):
                fn = script.local_function(call)
                if fn is None or script.scope_of(call) is not scope:
                    continue
                param = param_receiving(fn, call, model)
                if param is None:
                    continue
                if fn in script.training_functions:
                    hold(fn, param)
                elif isinstance(script.parent(call), cst.Expr) and model == script.model_name and not D.all_reduces(script, fn):
                    script.eval_calls.append(call)  # (a helper that all-reduces, e.g. its gradients, does not evaluate)
        evidence = run_with_weights(script, held) if index < own else None
        if evidence is not None:
            script.run_with_weights[model] = evidence
        for scope, name in held:
            if evidence is not None:
                script.synced_by_hand.setdefault(scope, {})[name] = model
                continue
            script.ddp_names.setdefault(scope, set()).add(name)
            if model in script.maybe_frozen:
                script.maybe_wrapped.setdefault(scope, set()).add(name)
        if evidence is None:
            script.ddp_aliases.update((assign, model) for assign in aliases)


def _given_to_constructors(script: Script, ref: str, scope: ScopeNode) -> list[tuple[str, cst.FunctionDef]]:
    """(parameter, `__init__`) of each constructor of the project's classes that `scope` calls
    with `ref` (`Visualizer(model, ...)`), except where `ref` is rebound to the object."""
    found = []
    for call in script.calls_in(scope):
        assign = script.parent(call)
        if isinstance(assign, cst.Assign) and assign.value is call and ref_of(assign.targets[0].target) == ref:
            continue  # `model = Wrapper(model)`: the object is the model from then on
        cls = script.class_called(call)
        init = script.methods(cls).get("__init__") if cls is not None else None
        param = param_receiving(init, call, ref) if init is not None and script.scope_of(call) is scope else None
        if param is not None and param != "self":
            found.append((param, init))
    return found


def _find_eval_loops(script: Script) -> None:
    """Loops over the loaders that do not train (directly, through aliases or helpers)."""
    for loader in script.loaders:
        if loader in script.train_loaders:
            continue
        script.eval_loops[loader.name] = _passes_over(script, loader.name, loader.scope, depth=0)


def _passes_over(script: Script, ref: str, scope: ScopeNode, depth: int) -> list[cst.For]:
    found: list[cst.For] = []
    if depth > 2:
        return found
    for where in script.scopes_for(ref, scope):
        aliases = {ref} | {ref_of(a.targets[0].target) for a in _assignments_in(script, where) if mentions(a.value, ref)}
        for loop in _loops_in(script, where):
            if any(mentions(loop.iter, r) for r in aliases if r) and not _has_backward(script, loop.body):
                found.append(loop)
        for call in script.calls_in(where):
            fn = script.local_function(call)
            if fn is None or fn in script.training_functions or script.scope_of(call) is not where:
                continue
            param = param_receiving(fn, call, ref)
            if param is not None:
                found += [loop for loop in _passes_over(script, param, fn, depth + 1) if loop not in found]
        for attr, init in kept_by_objects(script, ref, where):
            found += [loop for loop in _passes_over(script, attr, init, depth + 1) if loop not in found]
    return found
