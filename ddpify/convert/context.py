"""State the conversion passes share: the script's analysis, the edit plan, chosen names."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from ddpify.analysis.script import Script, ScopeNode, mentions, param_receiving, ref_of, returns
from ddpify.convert.edits import Edits
from ddpify.results import ConvertOptions

RANK0 = "dist.get_rank() == 0"
RANK0_BEFORE_INIT = 'int(os.environ.get("RANK", 0)) == 0'
LOCAL_RANK_ENV = 'int(os.environ.get("LOCAL_RANK", 0))'
UNWRAP = '''

def unwrap(model):
    """The network itself: inside the DDP wrapper once the model is wrapped, the model before."""
    return model.module if isinstance(model, DDP) else model
'''


@dataclass
class Context:
    """Analysis + edits + the names the setup pass chose for later passes."""

    script: Script
    edits: Edits
    options: ConvertOptions = field(default_factory=ConvertOptions)
    setup_scope: ScopeNode | None = None
    init_index: int = 0  # index in the setup scope's body of the first statement after setup
    device_stmt: cst.CSTNode | None = None  # the script's own device line, if it has one
    gpus_per_process: int = 1  # > 1 when the model itself spans several GPUs
    device_fixup: bool = False  # the device comes from a run-time value (e.g. --device)
    wrap_after: dict[str, cst.CSTNode] = field(default_factory=dict)  # model -> statement wrapping it
    sibling_wraps: dict[tuple[str, ScopeNode], cst.CSTNode] = field(default_factory=dict)  # of script.sibling_models
    reloads: set[cst.CSTNode] = field(default_factory=set)
    _before_init: set[cst.FunctionDef] | None = None  # `model = torch.load(...)` turned into loads
    _after_setup: set[cst.FunctionDef] | None = None  # the functions the setting-up function calls
    device: str = "device"
    device_type: str = "device.type"  # expression giving "cuda" or "cpu"
    local_rank: str = "local_rank"
    helpers: set[tuple[cst.Module, str]] = field(default_factory=set)  # module-level helpers already added
    driver: bool = False  # the module only drives training another module runs (and sets up)
    collective_lines: set[cst.CSTNode] = field(default_factory=set)  # statements with a collective now run before them
    every_rank: set[cst.Call] = field(default_factory=set)  # saves every rank makes (sharded checkpoints): never guarded
    forward_methods: set[tuple[str, str]] = field(default_factory=set)  # (model, method) registered with FSDP2
    shard_units: dict[str, list[str]] = field(default_factory=dict)  # model -> attribute paths sharded as units of their own
    replicated: dict[str, str] = field(default_factory=dict)  # model FSDP2 cannot shard -> why (it is replicated)

    def ran(self, what: str, node: cst.CSTNode) -> bool:
        """Did the brief run of `convert --run` see `what` (RunFacts.lines) at `node`'s line?"""
        run = self.options.run
        if run is None:
            return False
        script = self.script
        first, last = self.lines_of(node)
        return any(first <= line <= last for line in run.lines(what, script.index.roots.get(script.root_of(node), "")))

    def saved_in_run(self, call: cst.Call, what: str = "save") -> bool:
        """Did the brief run see a torch.save (`what`: "save", or "model_save" for a trained
        model's) at `call`, the call its statement is (`write(state, path)` with `write=torch.save`,
        a library's save)?"""
        run = self.options.run
        if run is None or not run.saves:
            return False
        stmt = self.script.statement_line(call)
        if stmt is None or len(stmt.body) != 1 or getattr(stmt.body[0], "value", None) is not call:
            return False
        return self.ran(what, call)

    def lines_of(self, node: cst.CSTNode) -> tuple[int, int]:
        """The first and last line of the statement that holds `node` (a run names any of them)."""
        script = self.script
        stmt = script.statement_line(node) or node
        first = script.line(stmt)
        return first, first + script.root_of(stmt).code_for_node(stmt).strip("\n").count("\n")

    def run_sites(self, what: str, module: cst.Module) -> set[int]:
        """The lines of `module` where the brief run of `convert --run` saw `what`."""
        run = self.options.run
        return set() if run is None else run.lines(what, self.script.index.roots.get(module, ""))

    @property
    def fsdp2(self) -> bool:
        """Is the model sharded with FSDP2 (`--to fsdp2`): no wrapper, no `.module`?"""
        return self.options.target == "fsdp2"

    def rank_and_world(self, stmt: cst.CSTNode) -> tuple[str, str]:
        """This process's rank and the world size as code that works where `stmt` runs."""
        if self.rank0_condition(stmt) == RANK0:
            return "dist.get_rank()", "dist.get_world_size()"
        return 'int(os.environ.get("RANK", 0))', 'int(os.environ.get("WORLD_SIZE", 1))'

    def device_visible(self, scope: ScopeNode) -> bool:
        """Can code in `scope` name this process's device? (Not in another module of the
        project: the entry's globals are not its globals.)"""
        if scope is self.setup_scope or self._global_here(scope):
            return True
        if self.device.startswith("self."):
            return scope in self.script.scopes_for(self.device, self.setup_scope)
        return isinstance(scope, cst.FunctionDef) and any(
            p.name.value == self.device for p in scope.params.params
        )

    def local_rank_visible(self, scope: ScopeNode) -> bool:
        return scope is self.setup_scope or self._global_here(scope)

    def _global_here(self, scope: ScopeNode) -> bool:
        """Is the setup at the top level of the module that holds `scope`?"""
        setup = self.setup_scope
        return isinstance(setup, cst.Module) and (scope is setup or self.script.root_of(scope) is setup)

    def local_rank_at(self, stmt: cst.CSTNode) -> str:
        """This process's rank on its node as code that works where `stmt` runs: the setup's
        `local_rank` where `stmt` sees it (the setup's own function, after it), else torchrun's
        LOCAL_RANK from the environment."""
        setup = self.setup_scope
        if setup is not None and self.rank0_condition(stmt) == RANK0:
            if self._global_here(self.script.scope_of(stmt)) or self.script.scope_of(stmt) is setup:
                return self.local_rank
        self.edits.need_import("os")
        return LOCAL_RANK_ENV

    def rank0_condition(self, stmt: cst.CSTNode) -> str:
        """`dist.get_rank() == 0`, or the environment's RANK before the group exists."""
        script = self.script
        scope = script.scope_of(stmt)
        if self.driver:
            return RANK0_BEFORE_INIT  # the group is another module's: it may not exist yet here
        if self.setup_scope is not None and script.root_of(stmt) is not script.root_of(self.setup_scope):
            return RANK0_BEFORE_INIT  # a project's other module: its other callers may have no group
        if isinstance(scope, cst.Module) and scope is not self.setup_scope:
            return RANK0_BEFORE_INIT  # module code runs at import, before setup
        if scope in self.called_before_init() or self.off_the_setup_path(scope):
            return RANK0_BEFORE_INIT
        if scope is not self.setup_scope and self._before_the_call_that_sets_up(stmt, scope):
            return RANK0_BEFORE_INIT
        if scope is self.setup_scope:
            body = list(script.block_of(scope).body)
            top = script.top_statement(stmt, scope)
            if top is None or body.index(top) < self.init_index:
                return RANK0_BEFORE_INIT
        return RANK0

    def after_wrap(self, node: cst.CSTNode, model: str | None = None) -> bool:
        """Does `node` see the wrapped `model`: after the wrap, and not after `model` was
        bound to something else (e.g. a reloaded checkpoint)?"""
        script = self.script
        model = model or script.model_name
        scope = script.scope_of(node)
        wrapped = self.wrap_after.get(model) if scope is script.models.get(model) else self.sibling_wraps.get((model, scope))
        if wrapped is None:
            return True
        if script.top_statement(node, scope) is None or not self._past_wrap(node, wrapped):
            return False
        return not any(
            ref_of(a.targets[0].target) == model
            and script.after(a, wrapped)
            and script.ends_before(a, node)
            and a not in self.reloads
            and not self._hands_back(a.value, model)
            for a in script.assigns.get(scope, [])
        )

    def _past_wrap(self, node: cst.CSTNode, wrapped: cst.CSTNode) -> bool:
        """Does `node` run after the statement the wrap follows: after it in the source, and not
        in another branch of an if/try around it (a wrap inside `if not eval_only:`)?"""
        script = self.script
        if not script.ends_before(wrapped, node):
            return False
        for block, outer in zip(script.ancestors(wrapped), list(script.ancestors(wrapped))[1:]):
            if isinstance(block, cst.IndentedBlock) and isinstance(outer, (cst.If, cst.Else, cst.Try, cst.With)):
                statement = next(a for a in [outer, *script.ancestors(outer)] if isinstance(a, cst.BaseCompoundStatement))
                if script.inside(node, statement) and not script.inside(node, block):
                    return False
        return True

    def plain(self, node: cst.CSTNode, model: str) -> str | None:
        """How `node` reads the network inside `model`: `model.module` where every path to it
        has wrapped the model, `unwrap(model)` where some path has not (a method of a trainer
        that may run before the method that wraps its model, or without it, or a model frozen on
        some runs, which is wrapped only where it trains), None where the model
        is still plain (or sharded with FSDP2, which keeps the model itself). `unwrap` is the
        module's helper (defined where it is used)."""
        if self.fsdp2 or model in self.script.run_with_weights:
            return None  # the model itself: sharded in place, or never wrapped (run with weights passed in)
        if not self.after_wrap(node, model) or not self._alias_of_wrapped(node, model):
            return None
        frozen_on_some_runs = model in self.script.maybe_wrapped.get(self.script.scope_of(node), ())
        if not frozen_on_some_runs and self._wrapped_on_every_path(node, model):
            return f"{model}.module"
        from ddpify.convert.emit import define_function

        define_function(self, "unwrap", UNWRAP, node)
        return f"unwrap({model})"

    def _alias_of_wrapped(self, node: cst.CSTNode, name: str) -> bool:
        """Where `name` was last bound before `node` to `model.eval()` (or another method that
        returns the module itself), was `model` wrapped there already? True for any other name."""
        script = self.script
        bound = [a for a in script.assigns.get(script.scope_of(node), [])
                 if ref_of(a.targets[0].target) == name and script.ends_before(a, node)]  # fmt: skip
        if not bound or bound[-1] not in script.ddp_aliases:
            return not any(a in script.ddp_aliases for a in bound)  # rebound to something else since
        model = script.ddp_aliases[bound[-1]]
        return not self.fsdp2 and self.after_wrap(bound[-1], model) and self._alias_of_wrapped(bound[-1], model)

    def _wrapped_on_every_path(self, node: cst.CSTNode, model: str) -> bool:
        """A `self.` model wrapped in a method other than `__init__` is wrapped only once that
        method ran: other methods see it wrapped only when the wrap's method (after the wrap), or
        a method only it calls, is their only caller."""
        script = self.script
        wrap_scope = script.models.get(model)
        if not model.startswith("self.") or not isinstance(wrap_scope, cst.FunctionDef) or self._constructs(wrap_scope):
            return True
        return self._runs_after_wrap(script.scope_of(node), node, model, wrap_scope, depth=0)

    def _constructs(self, method: cst.FunctionDef, depth: int = 0) -> bool:
        """Does `method` run whenever its object is made: `__init__`, or a method `__init__` (or
        such a method) calls in its own body, not under a condition (`self.build_model()`)?"""
        script = self.script
        if method.name.value == "__init__":
            return True
        if depth > 3:
            return False
        for call in script.calls:
            caller = script.scope_of(call)
            if script.local_function(call) is method and isinstance(caller, cst.FunctionDef) and script.class_of(caller) is script.class_of(method):
                top = script.top_statement(call, caller)
                if isinstance(top, cst.SimpleStatementLine) and self._constructs(caller, depth + 1):
                    return True
        return False

    def _runs_after_wrap(self, scope, node, model: str, wrap_scope, depth: int) -> bool:
        if scope is wrap_scope:
            return self.after_wrap(node, model)
        if depth > 3 or not isinstance(scope, cst.FunctionDef):
            return False
        script = self.script
        sites = [c for c in script.calls if script.local_function(c) is scope]
        return bool(sites) and all(
            self._runs_after_wrap(script.scope_of(site), site, model, wrap_scope, depth + 1) for site in sites
        )

    def _hands_back(self, value: cst.BaseExpression, model: str) -> bool:
        """`model = train_model(model, ...)`: the script's helper returns the model it was given."""
        script = self.script
        fn = script.local_function(value) if isinstance(value, cst.Call) else None
        if fn is None:
            return False
        param = param_receiving(fn, value, model)
        return param is not None and any(ref_of(r.value) == param for r in returns(fn))

    def model_class(self, model: str, scope: ScopeNode | None = None) -> cst.ClassDef | None:
        """The nn.Module class of the script (or its project) `model` is built from in `scope`
        (default: where the analysis found it): `model = GPT(cfg)`, or the class a factory of the
        script returns (`model = build_model(cfg)`); None when a flag picks among several."""
        script = self.script
        scope = scope if scope is not None else script.models.get(model)
        built = [
            a for a in script.assigns.get(scope, [])
            if ref_of(a.targets[0].target) == model and isinstance(a.value, cst.Call) and not mentions(a.value, model)
        ]  # fmt: skip  (`model = model.to(device)` moves it: not what builds it)
        wrapping = [  # `model = AutoregressiveWrapper(model)`: the last one is the class it is
            a for a in script.assigns.get(scope, [])
            if ref_of(a.targets[0].target) == model and isinstance(a.value, cst.Call) and not mentions(a.value.func, model)
            and mentions(a.value, model) and script.class_called(a.value) is not None
        ]  # fmt: skip
        if wrapping:
            built = wrapping[-1:]
        if len({script.module.code_for_node(a.value.func) for a in built}) > 1:
            return None  # `model = GPT(cfg)` or `model = MLP(cfg)` by a flag: known at run time only
        for assign in built:
            for call in script.calls_in(assign.value):
                cls = script.class_called(call)
                if cls is not None and script.optimizer_summaries.is_module(cls):
                    return cls
                fn = script.local_function(call) or script.project_definition(call.func)
                if not isinstance(fn, cst.FunctionDef):
                    continue
                for ret in returns(fn):
                    made = [ret] + [a.value for a in script.assigns.get(fn, []) if ret.value is not None and ref_of(ret.value) and
                                    ref_of(a.targets[0].target) == ref_of(ret.value)]  # fmt: skip  (`model = GPT(...)`, `return model`)
                    for value in made:
                        found = next((c for c in map(script.class_called, script.calls_in(value)) if c is not None), None)
                        if found is not None and script.optimizer_summaries.is_module(found):
                            return found
        return None

    def children(self, cls: cst.ClassDef) -> set[str]:
        """The submodules a model class builds in `__init__` (`self.encoder = Encoder(...)`)."""
        init = self.script.methods(cls).get("__init__")
        if init is None:
            return set()
        given = {p.name.value for p in init.params.params}
        found = set()
        for assign in self.script.assigns.get(init, []):
            target, value = assign.targets[0].target, assign.value
            pairs = [(target, value)]
            if isinstance(target, cst.Tuple) and isinstance(value, cst.Tuple):  # `self.enc, self.dec = enc, dec`
                pairs = [(t.value, v.value) for t, v in zip(target.elements, value.elements)]
            for t, v in pairs:
                built = isinstance(v, cst.Call) or isinstance(v, cst.Name) and v.value in given  # made here, or handed in
                if built and isinstance(t, cst.Attribute) and ref_of(t.value) == "self":
                    found.add(t.attr.value)
        return found

    def _before_the_call_that_sets_up(self, stmt: cst.CSTNode, scope: ScopeNode) -> bool:
        """Does `stmt` run before its function calls, directly or down a few calls, the one that
        sets up the group (`main()` drawing values before `Runner(settings).run()`, whose
        constructor makes it)?"""
        if not isinstance(scope, cst.FunctionDef) or self.setup_scope is None:
            return False
        script = self.script
        top = script.top_statement(stmt, scope)
        body = list(script.block_of(scope).body)
        if top not in body:
            return False
        first = next((i for i, later in enumerate(body) if self._sets_up(later)), None)
        return first is not None and body.index(top) < first

    def _sets_up(self, node: cst.CSTNode, depth: int = 0) -> bool:
        """Does running `node` reach the setup: a call of its function, or of a class whose
        constructor holds it, followed a few calls deep."""
        script = self.script
        if depth > 3:
            return False
        for call in script.calls_in(node):
            fn = script.local_function(call) or self._constructor(call)
            if fn is self.setup_scope or (fn is not None and fn is not node and self._sets_up(fn, depth + 1)):
                return True
        return False

    def _constructor(self, call: cst.Call) -> cst.FunctionDef | None:
        """The `__init__` of the script's own class a call makes an object of."""
        names = self.script.names(call.func)
        for cls in self.script.index.classes:
            if names and self.script.index.qnames(cls.name) & names:
                return self.script.methods(cls).get("__init__")
        return None

    def off_the_setup_path(self, scope) -> bool:
        """Is `scope` a function the function that sets up never calls, itself or through the
        functions it calls (`test()` where only `train()` sets up: a mode with no group)?"""
        setup = self.setup_scope
        if not (isinstance(scope, cst.FunctionDef) and isinstance(setup, cst.FunctionDef)) or scope is setup:
            return False
        if self.script.class_of(setup) is not None or self.script.root_of(scope) is not self.script.root_of(setup):
            return False  # a trainer's constructor sets up: its object's other methods run after it
        if self._after_setup is None:
            script, found, todo = self.script, set(), [setup]
            while todo:
                fn = todo.pop()
                for call in script.calls_in(fn):
                    callee = script.local_function(call) or script.method_of_object(call)
                    if callee is not None and callee not in found:
                        found.add(callee)
                        todo.append(callee)
            self._after_setup = found
        return scope not in self._after_setup and self.script.class_of(scope) is None

    def called_before_init(self) -> set[cst.FunctionDef]:
        """The script's functions that may run before the process group exists."""
        if self._before_init is None:
            script = self.script
            body = list(script.block_of(self.setup_scope).body)[: self.init_index]
            todo = [fn for stmt in body for c in script.calls_in(stmt) if (fn := script.local_function(c))]
            found: set[cst.FunctionDef] = set()
            while todo:
                fn = todo.pop()
                if fn not in found and fn is not self.setup_scope:
                    found.add(fn)
                    todo += [g for c in script.calls_in(fn) if (g := script.local_function(c))]
            self._before_init = found
        return self._before_init
