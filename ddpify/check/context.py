"""What a rule sees of one file: a thin view over the shared analysis in ``ddpify.analysis``.

The file is parsed once and indexed in one traversal (``analysis.index``: calls with their
qualified names, functions, loops, bindings, imports, parents; positions on demand); which
code runs on rank 0 only (``analysis.rank``) and which loop is the step loop
(``analysis.training``) are derived from that index lazily and cached. ``convert`` reads the
same index, so both commands agree on names, rank 0 and the step loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable, Optional

import libcst as cst
from libcst.metadata import CodeRange

from ddpify.analysis.index import (  # re-exported for the rules
    Binding,
    CallInfo,
    FileIndex,
    Func,
    Loop,
    dotted_name,
    index_of,
    iter_nodes,
    last_name,
    main_guard,
)
from ddpify.analysis.literals import (  # re-exported for the rules
    has_star_kwargs,
    int_value,
    is_false,
    is_true,
    kwarg,
    positional,
    string_value,
)
from ddpify.analysis.names import (  # re-exported for the rules
    COLLECTIVES,
    DATALOADER,
    DDP_CLASSES,
    DISTRIBUTED_SAMPLER,
    FRAMEWORKS,
    FULLY_SHARD,
    INIT_PROCESS_GROUP,
    NN_MODULE_API,
    PROCESS_CLASSES,
    SET_DEVICE_CALLS,
    SPAWN,
    START_PROCESSES,
)
from ddpify.analysis.flow import flow
from ddpify.analysis.log_levels import LEVELS, is_handler_setting, is_level_setting, set_level
from ddpify.analysis.multinode import launched_by_torchrun
from ddpify.analysis.options import option_defaults
from ddpify.analysis.project import sibling_launchers
from ddpify.analysis.rank import RANK_TEXT, mentions_rank, one_process_program, rank_analysis
from ddpify.analysis.training import StepAnalysis, step_analysis

__all__ = [
    "Binding", "CallInfo", "FileContext", "Func", "Loop", "COLLECTIVES", "DATALOADER", "DDP_CLASSES",
    "DISTRIBUTED_SAMPLER", "FRAMEWORKS", "dotted_name", "last_name", "has_star_kwargs", "int_value",
    "is_false", "is_true", "kwarg", "positional", "string_value",
]  # fmt: skip


@dataclass(frozen=True)
class ProjectModules:
    """The project modules a checked file imports: dotted name -> module, their files, and which
    of them are packages (a finding in one of them is reported at the call in the checked file)."""

    modules: dict[str, cst.Module]
    paths: dict[str, str]
    packages: frozenset[str] = frozenset()
    importers: tuple[cst.Module, ...] = ()  # the rest of the programs that import the checked file
    truncated: bool = False  # more project modules are imported than were read (a large package)


class FileContext:
    """Everything rules need to know about one file, computed once."""

    def __init__(
        self, path: str, source: str, module: Optional[cst.Module] = None, project: Optional["ProjectModules"] = None
    ) -> None:
        self.path = path
        self.source = source
        self.module = module if module is not None else cst.parse_module(source)
        if project is not None and project.modules:  # the file with the project modules it imports
            self.index: FileIndex = FileIndex(self.module, others=project.modules, packages=project.packages)
        else:
            self.index = index_of(self.module)
        self.project = project
        if project is not None and project.importers:
            self.index.importers = lambda: self._importers
        index = self.index
        self.calls = index.calls
        self.call_info = index.call_info
        self.functions = index.functions
        self.loops = index.loops
        self.loop_func = index.loop_func
        self.assignments = index.assignments
        self.subscripts = index.subscripts
        self._rank = rank_analysis(index)
        self._steps = step_analysis(index)

    # metadata ---------------------------------------------------------------
    def qnames(self, node: cst.CSTNode) -> set[str]:
        return set(self.index.qnames(node))

    def position(self, node: cst.CSTNode) -> CodeRange:
        return self.index.position(node)

    def line(self, node: cst.CSTNode) -> int:
        return self.index.line(node)

    def parent(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self.index.parents.get(node)

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def ancestors(self, node: cst.CSTNode) -> Iterable[cst.CSTNode]:
        return self.index.ancestors(node)

    def enclosing_func(self, node: cst.CSTNode) -> Optional[Func]:
        return self.index.enclosing_func(node)

    # queries over calls -------------------------------------------------------------
    def calls_to(self, *qnames: str) -> list[CallInfo]:
        return self.index.calls_to(*qnames)

    def method_calls(self, name: str) -> list[CallInfo]:
        return [c for c in self.calls if c.receiver is not None and c.name == name]

    @cached_property
    def _importers(self) -> list[FileIndex]:
        return [index_of(m) for m in self.project.importers] if self.project is not None else []

    @property
    def program_indexes(self) -> list[FileIndex]:
        """The indexes of the files of the program around this one (its importers and what they import)."""
        return self._importers

    @property
    def is_script(self) -> bool:
        """Is this file run as a program (`if __name__ == "__main__":`)?"""
        return _is_script(self.index)

    @property
    def has_importers(self) -> bool:
        """Does a file of the project import this one (its callers are in sight)?"""
        return bool(self._importers)

    def program_calls_to(self, *qnames: str) -> bool:
        """Does the program call one of these, here, in a module this file imports, or elsewhere
        in a program that imports this file (a helper module's caller finishes what it starts)?"""
        return bool(self.calls_to(*qnames)) or any(index.calls_to(*qnames) for index in self._importers)

    def program_method_calls(self, name: str) -> bool:
        """Is a method of this name called here, in a module this file imports, or elsewhere in a
        program that imports this file?"""
        return bool(self.method_calls(name)) or any(
            c.receiver is not None and c.name == name for index in self._importers for c in index.calls
        )

    def runs(self, func: Func) -> bool:
        """Is this function called: here, in a project module walked with this file, or by a
        program that imports this file (`main.py` calls `utils.init_distributed_mode()`, whose
        helper replaces `print` for `engine.py` too)?"""
        if self.call_sites(func) or func.name.value in self._passed_functions:
            return True  # called, or handed to a caller (`mp.spawn(main_worker, ...)`, `Process(target=run)`)
        suffixes, through_packages = self._importer_calls
        return any(n in suffixes for n in self.index.qnames(func.name)) or func.name.value in through_packages

    @cached_property
    def _importer_calls(self) -> tuple[set[str], set[str]]:
        """What the importers call: every dotted tail of their calls' qualified names (`a.b.f`
        gives `a.b.f`, `b.f`, `f`), and the names they call through a package of the project
        that re-exports them (`tools.setup_logger(...)`)."""
        suffixes: set[str] = set()
        through_packages: set[str] = set()
        for index in self._importers:
            for ci in index.calls:
                for q in ci.qnames:
                    parts = q.split(".")
                    suffixes.update(".".join(parts[i:]) for i in range(len(parts)))
                    if q.rpartition(".")[0] in self._project_packages:
                        through_packages.add(ci.name)
        return suffixes, through_packages

    @cached_property
    def _passed_functions(self) -> set[str]:
        """Names passed as arguments of a call (`mp.spawn(main_worker, ...)`, `target=run`)."""
        return {a.value.value for ci in self.calls for a in ci.node.args if isinstance(a.value, cst.Name)}

    @cached_property
    def _project_packages(self) -> set[str]:
        """The dotted names of the project's modules this file or its importers import."""
        return set(self.project.modules) if self.project is not None else set()

    def rank0_or_idle(self, node: cst.CSTNode) -> bool:
        """As far as the program in sight shows (files that import this one are read; a script
        nothing imports is its whole program), does the module-level function around `node` run on
        rank 0 only or not at all: nothing calls it (a call left commented out), or
        every call, here or in an importer, is in rank-0-only code (`if rank == 0:
        misc.print_module_summary(net)`), in a branch a one-process run takes (`if world_size <
        2: test(model)`), in a function of this file that is itself rank 0's, idle or the
        launcher's alone (`single_gpu_example()` beside `mp.spawn(worker)`, a trainer's `run()`
        that starts the workers and loads the best model after they end), or in an importer
        that shows no sign of a distributed run (an inference script beside the training one)?
        Not a function whose name is also read as a value (`mp.spawn(main_worker)`): it runs
        wherever that value is called."""
        func = self.enclosing_func(node)
        if func is not None and _own_method(self, func):
            return self._method_rank0_or_idle(func)
        if func is None or not isinstance(self.parent(func), cst.Module):
            return False
        if not self.has_importers and not self.is_script:
            return False  # a library module whose callers are out of sight
        found = self.__dict__.setdefault("_rank0_or_idle", {})
        if func not in found:
            remote = self.remote_call_sites(func)
            local = self.call_sites(func)
            found[func] = False  # (a call from itself, while this is worked out)
            named = self._named_by_importers(func)
            if named and not remote:
                found[func] = False  # an importer names it where no call of it is seen (a re-export, a callback)
                return False
            idle = not local and not remote and not _referenced(self, func) and not named
            if _used_as_value(self, func):
                return False  # handed on too (`mp.spawn(main_worker, ...)`, `fn = validate_sphere`): it runs there
            found[func] = idle or (
                bool(local or remote)
                and all(
                    self.in_rank0(s.node) or flow(self.index).single_process(s.node)
                    or s.func is not None and (self.rank0_or_idle(s.node) or self.launcher_only(s.node))
                    or _in_launching_function(self.index, s.node)
                    for s in local
                )  # fmt: skip
                and all(
                    rank_analysis(index).in_rank0(ci.node) or one_process_program(index) or _in_launching_function(index, ci.node)
                    for index, ci in remote
                )
            )
        return found[func]

    def _method_rank0_or_idle(self, func: Func) -> bool:
        """The same question for a method of a class only the program calls (see `_own_method`):
        every call of a method of its name in the program (`trainer.summary()`,
        `self.log_eval(...)`), here or in the files of the program around this one, is rank 0's,
        a one-process branch's, or in a function that is itself rank 0's or idle; or there is
        none. A read of the name that is not a call (`getattr(self, "summary")`, `fn =
        self.summary`) leaves it unknown."""
        if not self.has_importers and not self.is_script:
            return False
        found = self.__dict__.setdefault("_rank0_or_idle", {})
        if func not in found:
            found[func] = False  # (a call from itself, while this is worked out)
            sites = _method_sites(self, func.name.value)
            found[func] = sites is not None and all(
                _in_launching_function(index, c) or (
                    self.in_rank0(c) or flow(self.index).single_process(c)
                    or self.enclosing_func(c) is not None and self.rank0_or_idle(c)
                    if index is self.index
                    else rank_analysis(index).in_rank0(c) or one_process_program(index)
                )
                for index, c in sites
            )  # fmt: skip
        return found[func]

    def launcher_only(self, node: cst.CSTNode) -> bool:
        """Does the module-level function around `node` run only in the launcher process: every
        call, here or in an importer, is in a script that starts the workers with `mp.spawn`, in
        its top-level code or a function only that code calls (`download_data_if_possible(...)`
        while the configs are read, before `mp.spawn(worker, ...)`), never in a spawned worker?"""
        func = self.enclosing_func(node)
        if func is None:
            return self._in_spawning_main_block(node)
        if not isinstance(self.parent(func), cst.Module):
            return False
        found = self.__dict__.setdefault("_launcher_only", {})
        if func not in found:
            sites = [(self.index, s) for s in self.call_sites(func)] + self.remote_call_sites(func)
            handed_on = func.name.value in self._passed_functions  # `mp.spawn(main_worker, ...)`: the workers run it too
            found[func] = bool(sites) and not handed_on and all(_in_launcher(index, site) for index, site in sites)
        return found[func]

    def _in_spawning_main_block(self, node: cst.CSTNode) -> bool:
        """Is `node` in the `if __name__ == "__main__":` block of a script whose block starts the
        workers with `mp.spawn` (`spawn(...).join(); print("Done!")`)? Spawned workers import the
        script as `__mp_main__` and skip that block: it runs in the launcher alone."""
        guard = main_guard(self.module)
        return guard is not None and any(p is guard for p in self.ancestors(node)) and any(
            any(p is guard for p in self.ancestors(ci.node)) for ci in self.calls_to(*SPAWN)
        )

    def _named_by_importers(self, func: Func) -> bool:
        """Does a file that imports this one name the function other than in its imports
        (`mp.spawn(mpu.run, ...)`, a call through a package that re-exports it, `getattr(utils,
        "init_dist_%s" % launcher)`)? Then "nothing calls it" is not known. A name that resolves to
        another module's function (`thop.profile`) is not it."""
        name = func.name.value
        path = Path(self.path).with_suffix("")
        owners = set(path.parts[-4:])  # the file's stem and the packages above it
        for index in self._importers:
            if any(name.startswith(p) for p in _name_prefixes(index)):
                return True
            for node in _names_used(index).get(name, ()):
                found = index.qnames(node)
                if any(q.rpartition(".")[2] == name and q.rpartition(".")[0].rpartition(".")[2] in owners for q in found):
                    return True  # (not `from .validation import validation_ddp as validation`: another function)
                if not found and isinstance(node, cst.Attribute):
                    return True  # `mpu.run` on a module the analysis did not resolve
        return False

    def remote_call_sites(self, func: Func) -> list[tuple[FileIndex, CallInfo]]:
        """The calls of this file's module-level function in the programs that import it
        (`checkpoint_utils.torch_persistent_save(...)` in trainer.py), with their file's index."""
        path = Path(self.path)
        stem = path.parent.name if path.name == "__init__.py" else path.stem  # a package's own functions
        own = {f"{stem}.{n}" for n in self.index.qnames(func.name)}  # `torch_utils.profile`
        return [
            (index, ci) for index in self._importers for ci in index.calls
            if any(q in own or any(q.endswith("." + n) for n in own) for q in ci.qnames)
        ]  # fmt: skip

    def info(self, call: cst.Call) -> CallInfo:
        return self.call_info[call]

    def local_callees(self, ci: CallInfo) -> list[Func]:
        """The functions of this file a call may reach (``f(...)`` or ``self.f(...)``)."""
        return self.index.local_callees(ci)

    def call_sites(self, func: Func) -> list[CallInfo]:
        return self.index.call_sites(func)

    # what kind of file ----------------------------------------------------------------
    @cached_property
    def uses_framework(self) -> bool:
        """The file uses Lightning, Accelerate, DeepSpeed, ...: they run DDP themselves."""
        return any(name.split(".")[0] in FRAMEWORKS for name in self.index.imported_modules)

    @cached_property
    def is_fsdp2(self) -> bool:
        """The file shards modules with FSDP2's `fully_shard` (it imports it or calls it): what it
        shards stays the module it was (no wrapper, no `.module`), with DTensor shards for
        parameters."""
        return any(name in FULLY_SHARD for name in self.index.own_imports) or bool(self.calls_to(*FULLY_SHARD))

    @cached_property
    def is_distributed(self) -> bool:
        """The file runs several processes: it imports or calls torch.distributed, DDP or
        torch.multiprocessing itself, or it calls a function of a project module that starts the
        group, wraps a model in DDP or spawns the processes. A script that only imports a module
        that uses them (an evaluation script sharing the training's settings module) is not. A
        module whose functions an importer hands its DDP-wrapped model (an `engine.py` with the
        training loop) is part of that distributed program."""
        if self.uses_framework:
            return False
        if self._ddp_params_from_importers:
            return True
        imports = any(  # `import torch.nn.parallel` alone is DataParallel's as much as DDP's
            name.startswith("torch.distributed")
            or name == "torch.multiprocessing"
            or name.endswith(("DistributedSampler", "DistributedDataParallel"))
            for name in self.index.own_imports
        )
        starts = INIT_PROCESS_GROUP | DDP_CLASSES | SPAWN
        return imports or any(
            any(q.startswith(("torch.distributed", "torch.multiprocessing.spawn")) for q in c.qnames) or c.qnames & DDP_CLASSES
            if self.index.root_of(c.node) is self.module
            else c.qnames & starts and self._reached(c)  # a project module's code that starts the group, run from here
            for c in self.calls
        )

    def _reached(self, ci: CallInfo, seen: Optional[set] = None) -> bool:
        """Does the checked file's code run this call (it is here, at a project module's top
        level, or in a function called from code that runs)?"""
        if self.index.root_of(ci.node) is self.module or ci.func is None:
            return True
        seen = set() if seen is None else seen
        if ci.func in seen:
            return False
        seen.add(ci.func)
        return any(self._reached(site, seen) for site in self.call_sites(ci.func))

    @cached_property
    def prints_replaced(self) -> bool:
        """The program replaces `print` (`builtins.print = print_on_master`: the
        `setup_for_distributed(is_master)` helper research code calls from its
        `init_distributed_mode`), in this file or a module it imports, in a function that runs
        (called here or by a program that imports this file): its prints are the master's."""
        return any(
            b.dotted.endswith(".print") and b._node is not None and "builtins.print" in self.index.qnames(b._node)
            and (b.func is None or self.runs(b.func))  # at import, or in a function the program calls
            for b in self.index.assignments
        )  # fmt: skip

    @cached_property
    def output_split_by_launcher(self) -> bool:
        """The script is not started by torchrun or `mp.spawn` but by a launcher of the project
        beside it that gives each process but the first its own output file (`stdout = None if i
        == 0 else open(f"logs/{i}.log", "w")`, then `subprocess.Popen([sys.executable] + args,
        stdout=stdout)`): the console shows one process's prints."""
        if launched_by_torchrun(self.index) or self.program_calls_to(*SPAWN):
            return False
        if _splits_stdout(self.index) or any(_splits_stdout(index) for index in self._importers):
            return True  # a launcher function of the program (`start_ddp_workers(cfg)` in an imported module)
        return not self.path.startswith("<") and any(_splits_stdout(index_of(m)) for m in sibling_launchers(Path(self.path)))

    @cached_property
    def stdout_silenced_off_rank0(self) -> bool:
        """The program points `sys.stdout` elsewhere on the other ranks (`if rank != 0: sys.stdout
        = open(os.devnull, "w")`), here, in a module it imports or in a program that imports it:
        their prints, and logging handlers built on `sys.stdout` afterwards, reach no console."""
        for rank, index in [(self._rank, self.index)] + [(rank_analysis(i), i) for i in self._importers]:
            for b in index.assignments:
                if b.dotted == "sys.stdout" and b._node is not None and not rank.in_rank0(b._node) and rank.under_rank_test(b._node):
                    return True
        return False

    @cached_property
    def group_never_started(self) -> bool:
        """Does every `init_process_group` of the program sit under a flag it binds only to a
        false constant (`is_distributed, world_size = (False, 1)  # get_distrib_config()`, then
        `if is_distributed: dist.init_process_group(...)`)? Then it always runs as one process."""
        inits = [(index, ci) for index in (self.index, *self._importers) for ci in index.calls_to(*INIT_PROCESS_GROUP)]
        return bool(inits) and all(flow(index).dead(ci.node) for index, ci in inits)

    @cached_property
    def stdout_redirected(self) -> bool:
        """The program points `sys.stdout` somewhere itself (`sys.stdout = Logger(path)`, `with
        redirect_stdout(buf):`, `os.dup2(fd, 1)`), here, in a module it imports or in a program
        that imports it: where each rank's prints then go is that code's doing (a tee to the
        console on rank 0 only, `/dev/null` on the others), not known from the prints."""
        return self._redirected("sys.stdout", "contextlib.redirect_stdout")

    @cached_property
    def stderr_redirected(self) -> bool:
        """The same for `sys.stderr`, where progress bars draw (`sys.stderr = open(os.devnull, "w")`)."""
        return self._redirected("sys.stderr", "contextlib.redirect_stderr")

    def _redirected(self, stream: str, redirect: str) -> bool:
        return any(
            any(b.dotted == stream for b in index.assignments) or index.calls_to(redirect, "os.dup2")
            for index in (self.index, *self._importers)
        )

    @cached_property
    def logs_to_stdout(self) -> bool:
        """Does the program's logging write to `sys.stdout` (`basicConfig(stream=sys.stdout)`,
        `StreamHandler(sys.stdout)`)?"""
        return any(
            (ci.is_("logging.basicConfig") or ci.name == "StreamHandler") and "sys.stdout" in index.code(ci.node)
            for index in (self.index, *self._importers) for ci in index.calls
        )

    @cached_property
    def logging_quiet_off_rank0(self) -> bool:
        """The program turns logging down off rank 0: `logger.setLevel(logging.WARN)` under `if
        rank > 0:`, `logging.basicConfig(level=logging.INFO if rank in (-1, 0) else logging.WARN)`
        (a `set_logging(rank)` helper), `logging.disable(...)` on the other ranks; in this file, a
        module it imports, or a program that imports it. Their info and debug messages then go
        nowhere."""
        if any(_quiets_others(self._rank, ci) for ci in self.calls if ci.func is None or self.runs(ci.func)):
            return True  # (a call in a function nothing calls does not count)
        return any(  # the launcher that imports this file turns its other ranks down (`main.py` before `train.main()`)
            _quiets_others(rank_analysis(index), ci) for index in self._importers for ci in index.calls
        )

    @cached_property
    def logs_tagged_with_rank(self) -> bool:
        """The program installs a log filter made from the rank (`tag_logs_with_process_name(
        f"Trainer-{rank}")`, whose filter stamps each record with it): every rank's records say
        which rank wrote them, on purpose."""
        indexes = (self.index, *self._importers)
        adders = {c.func.name.value for index in indexes for c in index.calls if c.name == "addFilter" and c.func is not None}
        return any(
            ci.name in adders and any(RANK_TEXT.search(index.code(a.value)) for a in ci.node.args)
            for index in indexes for ci in index.calls
        )  # fmt: skip

    @cached_property
    def log_level_on_every_rank(self) -> Optional[int]:
        """The lowest logging level every rank surely shows, or None when that is not proven.

        Proven by a handler (`basicConfig`, `addHandler`, a `dictConfig`) and levels the code
        states plainly (`basicConfig(level=logging.INFO)`, `setLevel("DEBUG")`, a helper's
        parameter every caller fills with one, a `--log-level` option's default; Hydra's
        `@hydra.main` sets INFO), set by code every rank runs (here, in a module it imports, or
        in a program that imports it). A level the code does not state (`setLevel(cfg.log_level)`,
        a parameter filled from a config) or set under a test of the rank leaves it unproven."""
        sites = [(self._rank, self.index, ci) for ci in self.calls]
        sites += [(rank_analysis(index), index, ci) for index in self._importers for ci in index.calls]
        hydra = any(ci.is_("hydra.main") for _, _, ci in sites)
        if not hydra and not any(is_handler_setting(ci) for _, _, ci in sites):
            return None  # no handler: Python drops info and debug messages
        levels = [LEVELS["INFO"]] if hydra else []
        options = option_defaults(ci.node for _, _, ci in sites)  # `--log-level` defaults: every rank's command line
        for rank, index in [(self._rank, self.index)] + [(rank_analysis(i), i) for i in self._importers]:
            for b in index.assignments:  # ... unless the program changes it by rank (`if rank: args.log_level = "ERROR"`)
                name = b.dotted.rpartition(".")[2]
                if name in options and b._node is not None and rank.under_rank_test(b._node):
                    del options[name]
        for rank, index, ci in sites:
            if not is_level_setting(ci) or rank.in_rank0(ci.node) or flow(index).single_process(ci.node):
                continue  # rank 0's setting, or a run without a group
            if index is self.index and (self.rank0_or_idle(ci.node) or _module_function(self, ci.func) and not self.runs(ci.func)):
                continue  # a function nothing calls, or only rank 0 (a method's callers are not all in sight: not skipped)
            level = set_level(index, ci, options)
            if level is None or rank.under_rank_test(ci.node):
                return None
            levels.append(level)
        return min(levels, default=None)

    @cached_property
    def log_handlers_on_rank0_only(self) -> bool:
        """The program attaches its log handlers (`logging.basicConfig`, `addHandler`) on rank 0
        only, or on each rank to the rank's own file; here, in a module it imports, or in a program
        that imports this file (dinov2's `setup_logging`: the console on the main process, a
        `log.txt.rank{N}` file on the others). The other ranks' info messages reach no console."""
        sites = [(self._rank, self.index, ci) for ci in self.calls]
        sites += [(rank_analysis(index), index, ci) for index in self._importers for ci in index.calls]
        setup = [
            (rank, index, ci) for rank, index, ci in sites
            if ci.is_("logging.basicConfig") or (ci.name == "addHandler" and not _null_handler(index, ci.node))
        ]  # fmt: skip
        return bool(setup) and all(
            rank.in_rank0(ci.node) or mentions_rank(index, ci.node) or flow(index).single_process(ci.node)
            for rank, index, ci in setup
        )

    @cached_property
    def gpu_per_process_by_launcher(self) -> bool:
        """The program gives each process one GPU of its own before CUDA starts
        (`os.environ["CUDA_VISIBLE_DEVICES"] = str(devices[rank])` in the spawned worker, here or
        in the launcher that imports this file): `cuda:0` is then this process's GPU."""
        for index in (self.index, *self._importers):
            rank = rank_analysis(index)
            for sub in index.subscripts:
                target = index.parents.get(sub)
                assign = index.parents.get(target) if isinstance(target, cst.AssignTarget) else None
                key = sub.slice[0].slice.value if len(sub.slice) == 1 and isinstance(sub.slice[0].slice, cst.Index) else None
                if isinstance(assign, cst.Assign) and key is not None and string_value(key) == "CUDA_VISIBLE_DEVICES":
                    if rank.reads_rank(assign.value):
                        return True
        return False

    @cached_property
    def ddp_state_round_trip(self) -> bool:
        """The program saves the DDP wrapper's state_dict and loads state into the wrapper too
        (`module.` keys on both sides: a resume of its own checkpoints, a best-model copy), here
        or in a program that imports this file: the round trip is consistent, so neither side is
        a bug."""
        saved = any(self.is_ddp(ci.receiver) for ci in self.method_calls("state_dict")) or self._importers_wrapper_calls("state_dict")
        return saved and (
            any(self.is_ddp(ci.receiver) for ci in self.method_calls("load_state_dict"))
            or self._importers_wrapper_calls("load_state_dict")
        )

    def _importers_wrapper_calls(self, method: str) -> bool:
        """Does a program importing this file call `method` on its own DDP wrapper (main.py
        loads the checkpoint that train.py saved, both with `module.` keys)?"""
        return any(
            ci.receiver is not None and ci.name == method and index.is_bound(ci.receiver, index.cached("ddp_bindings", _wrapped_models))
            for index in self._importers for ci in index.calls
        )

    # bindings ----------------------------------------------------------------------
    @cached_property
    def ddp_bindings(self) -> list[Binding]:
        """Names bound to a DDP-wrapped model, including parameters that receive one; not a copy of
        a name made where the code found it unwrapped (`else: netG = self.netG` of `if
        isinstance(self.netG, DDP): netG = self.netG.module`)."""
        seeds = self.index.bindings_of(DDP_CLASSES) + self._ddp_params_from_importers
        return [b for b in self.index.propagate(seeds) if not _found_unwrapped(self.index, b)]

    @cached_property
    def _ddp_params_from_importers(self) -> list[Binding]:
        """The parameters of this file's top-level functions (and its classes' `__init__`) to
        which a program importing the file hands its DDP-wrapped model: `engine.py` checked on
        its own, `train_one_epoch(model, ...)` called in main.py after `model = DDP(model)`. Not a
        call in the importer's one-process branch (nothing wrapped the model there)."""
        found: list[Binding] = []
        for top in self.module.body:
            target = _callee_of(top)
            if target is None:
                continue
            for index, ci in self.remote_call_sites(top):
                if flow(index).single_process(ci.node):
                    continue
                wrapped = index.cached("ddp_bindings", _wrapped_models)
                for i, arg in enumerate(ci.node.args):
                    if arg.star or not index.is_bound(arg.value, wrapped):
                        continue
                    param = self.index.param_for(target, i, arg)
                    if param and not any(b.dotted == param and b.func is target for b in found):
                        found.append(Binding(param, target, None, arg.value, target, self.index))
        return found

    def _is_bound(self, expr: cst.CSTNode, bindings: list[Binding]) -> bool:
        return self.index.is_bound(expr, bindings)

    def is_ddp(self, expr: cst.CSTNode) -> bool:
        """Does this expression hold the DDP-wrapped model (not ``.module``)? Not in a branch that
        runs without a process group (the `else:` of `if args.distributed:`): nothing wrapped it there."""
        return self.index.is_bound(expr, self.ddp_bindings) and not flow(self.index).single_process(expr)

    @cached_property
    def ddp_calls(self) -> list[CallInfo]:
        return self.calls_to(*DDP_CLASSES)

    @cached_property
    def sampler_bindings(self) -> list[Binding]:
        return self.index.bindings_of(DISTRIBUTED_SAMPLER)

    def is_distributed_sampler(self, expr: cst.CSTNode) -> bool:
        if isinstance(expr, cst.Call):
            return bool(self.call_info[expr].qnames & DISTRIBUTED_SAMPLER)
        return self.index.is_bound(expr, self.sampler_bindings)

    # rank-0-only code (analysis.rank) ---------------------------------------------------
    def rank_test(self, e: cst.BaseExpression) -> int:
        """+1: true only on rank 0; -1: true only off rank 0; 0: don't know."""
        return self._rank.rank_test(e)

    @property
    def rank_flags(self) -> list[Binding]:
        return self._rank.rank_flags

    def reads_rank(self, node: cst.BaseExpression) -> bool:
        """Does this expression read the process's rank anywhere in it?"""
        return self._rank.reads_rank(node)

    def in_rank0(self, node: cst.CSTNode) -> bool:
        """Does this code run on rank 0 only (a rank-0 branch, guard, or function only called there)?"""
        return self._rank.in_rank0(node)

    def under_rank_test(self, node: cst.CSTNode) -> bool:
        """Does a test of the rank decide whether this code runs (rank 0's, or `if rank == 0 or
        cfg.all_ranks:`, `if rank in (1, 3):`)?"""
        return self._rank.under_rank_test(node)

    def rank0_function(self, func: Func) -> bool:
        return self._rank.rank0_function(func)

    # the step loop (analysis.training) ---------------------------------------------------
    is_backward = staticmethod(StepAnalysis.is_backward)

    def step_function(self, func: Func) -> bool:
        """A function that runs one backward per call (outside its own loops)."""
        return self._steps.step_function(func)

    def syncs(self, outer: cst.CSTNode) -> bool:
        """Does code under this function or loop run a backward pass or a collective?"""
        return self._steps.syncs(outer)

    @property
    def step_loops(self) -> set[Loop]:
        """Loops whose every iteration runs a backward pass (the innermost such loops)."""
        return self._steps.step_loops

    def in_step(self, node: cst.CSTNode) -> bool:
        """Does this code run once per training step?"""
        return self._steps.in_step(node)

    def enclosing_loop(self, node: cst.CSTNode) -> Optional[Loop]:
        for p in self.ancestors(node):
            if isinstance(p, (cst.For, cst.While)):
                return p
            if isinstance(p, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
                return None
        return None

    @cached_property
    def has_set_device(self) -> bool:
        """Is this process's GPU set, here or elsewhere in the program (an importer included; a
        `set_device` method of whatever namespace holds it, `getattr(torch, kind).set_device(...)`),
        or can the program not be read whole (the walk stopped at its limit: not known, so assumed)?"""
        return (
            self.program_calls_to(*SET_DEVICE_CALLS) or self.program_method_calls("set_device")
            or any(kwarg(c.node, "device_id") for c in self.calls_to(INIT_PROCESS_GROUP))
            or (self.project is not None and self.project.truncated)
        )  # fmt: skip


_WRAPPED_TEST = re.compile(r"isinstance\([^,]+,\s*[\w.]*(DDP|DistributedDataParallel|DataParallel)\b|hasattr\([^,]+,\s*[\"']module[\"']\)")


def _callee_of(top: cst.CSTNode) -> Optional[Func]:
    """The function a call of this top-level statement's name runs: the function itself, or a
    class's `__init__`."""
    if isinstance(top, cst.FunctionDef):
        return top
    if isinstance(top, cst.ClassDef):
        return next((s for s in top.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__"), None)
    return None


def _wrapped_models(index: FileIndex) -> list[Binding]:
    """An importer's names bound to its DDP-wrapped model (its own analysis, without importers)."""
    return [b for b in index.propagate(index.bindings_of(DDP_CLASSES)) if not _found_unwrapped(index, b)]


def _found_unwrapped(index: FileIndex, b: Binding) -> bool:
    """Is the binding `x = y` in the `else:` of `if isinstance(y, ...)`, or of a test whether the
    program's models are wrapped (`isinstance(m, DDP)`, `hasattr(m, "module")`): there `y` holds
    no wrapper?"""
    if b._node is None or not isinstance(b.value, (cst.Name, cst.Attribute)):
        return False
    held, child = index.code(b.value), b._node
    for p in index.ancestors(b._node):
        if isinstance(p, cst.If) and child is p.orelse:
            test = index.code(p.test)
            if f"isinstance({held}," in test or _WRAPPED_TEST.search(test):
                return True  # (`isinstance(self.netG, DDP)` decides for `self.netD` too: both are wrapped together)
        if isinstance(p, (cst.FunctionDef, cst.Module)):
            return False
        child = p
    return False


def _module_function(ctx: "FileContext", func: Optional[Func]) -> bool:
    return func is not None and isinstance(ctx.parent(func), cst.Module)


def _in_launcher(index: FileIndex, site: CallInfo, depth: int = 0) -> bool:
    """A call in a script that spawns its workers, made by its top-level code or by functions
    only that code calls or hands to a runner (`main()` -> `hydra_multirun_main()` ->
    `hydra_main()`, `app.run(main)`), none of them the function handed to `mp.spawn`."""
    if not index.calls_to(*SPAWN) or index.root_of(site.node) is not index.module:
        return False
    if site.func is None:
        return True
    spawned = {a.value.value for ci in index.calls_to(*SPAWN) for a in ci.node.args if isinstance(a.value, cst.Name)}
    name = site.func.name.value
    if name in spawned:
        return False
    if any(  # `app.run(main)`, `fire.Fire(main)` in the top-level code: the launcher's entry
        ci.func is None and any(isinstance(a.value, cst.Name) and a.value.value == name for a in ci.node.args)
        for ci in index.calls
    ):
        return True
    callers = index.call_sites(site.func)
    return bool(callers) and depth < 3 and all(c.func is not site.func and _in_launcher(index, c, depth + 1) for c in callers)


def _uses_of(ctx: "FileContext", func: Func) -> list[Optional[cst.Name]]:
    """The reads of the function's name in this file that may be it (None: its name in a
    string, `__all__`): not its definition, not an import's or an attribute's name, not a name
    that resolves to something else (`from thop import profile` in another function)."""
    used = ctx.__dict__.get("_names_used")
    if used is None:
        skip = {id(f.name) for f in ctx.index.all_functions}
        skip |= {id(n.attr) for n in iter_nodes(ctx.module) if isinstance(n, cst.Attribute)}
        skip |= {id(n) for a in iter_nodes(ctx.module) if isinstance(a, cst.ImportAlias) for n in iter_nodes(a)}
        used = ctx.__dict__["_names_used"] = {}
        for n in iter_nodes(ctx.module):
            if isinstance(n, cst.Name) and id(n) not in skip:
                used.setdefault(n.value, []).append(n)
            elif isinstance(n, cst.SimpleString):
                used.setdefault(n.value.strip("'\""), []).append(None)
    own = ctx.index.qnames(func.name)
    return [n for n in used.get(func.name.value, ()) if n is None or not (q := ctx.index.qnames(n)) or q & own]


_TORCH_MODULE = ("nn.Module", "torch.nn.Module", "Module")


def _own_method(ctx: "FileContext", func: Func) -> bool:
    """Is `func` a method (not a dunder, not a property) of a top-level class of this file whose
    bases are none, `object`, `nn.Module` (for a method outside nn.Module's API), or such classes
    of this file? Only the program's own code calls it then: no framework hook (`training_step`,
    `__getitem__`, a `Module`'s `forward`)."""
    body = ctx.parent(func)
    owner = ctx.parent(body) if isinstance(body, cst.IndentedBlock) else None
    if not isinstance(owner, cst.ClassDef) or not isinstance(ctx.parent(owner), cst.Module):
        return False
    name = func.name.value
    if name.startswith("__") and name.endswith("__") or any(_read_as_attribute(d.decorator) for d in func.decorators):
        return False
    classes = {c.name.value: c for c in ctx.module.body if isinstance(c, cst.ClassDef)}

    def plain(cls: cst.ClassDef, seen: frozenset = frozenset()) -> bool:
        for base in cls.bases:
            base_name = dotted_name(base.value) if not base.keyword else None
            if base_name == "object" or base_name in _TORCH_MODULE and name not in NN_MODULE_API:
                continue  # (nn.Module calls its own API by name, `forward` and `train` among it, nothing else)
            if base_name not in classes or base_name in seen:
                return False
            if not plain(classes[base_name], seen | {base_name}):
                return False
        return True

    return plain(owner)


def _in_launching_function(index: FileIndex, node: cst.CSTNode) -> bool:
    """Is `node` in a function that starts the worker processes (see `launching_functions`): the
    launcher's one process, not a worker?"""
    func = index.enclosing_func(node)
    return func is not None and func in launching_functions(index)


_MP_RECEIVER = re.compile(r"\b(mp|multiprocessing|ctx|context|get_context\(.*\))$")


def launching_functions(index: FileIndex) -> set:
    """The functions of this file that start the worker processes (`mp.spawn(run, ...)`,
    `mp.Process(target=self.train, ...)`, `ctx.Process(...)`), and those that call one of them, a
    few levels up (`Trainer.run()` -> `self.dist_train()` -> `mp.Process(...)`), other than the
    functions handed to the workers: they run in the launcher's one process."""
    found = index.__dict__.get("_launching_functions")
    if found is None:
        starts = SPAWN | START_PROCESSES | PROCESS_CLASSES
        starters = [
            ci for ci in index.calls
            if ci.func is not None and (ci.qnames & starts or ci.name == "Process" and ci.receiver is not None
                                        and _MP_RECEIVER.search(index.module.code_for_node(ci.receiver)))
        ]  # fmt: skip
        handed = {last_name(a.value) for ci in starters for a in ci.node.args} - {None}  # `target=self.train`
        found = {ci.func for ci in starters}
        for _ in range(3):  # callers of callers
            more = {
                c.func for c in index.calls
                if c.func is not None and c.func not in found and c.func.name.value not in handed
                and any(f in found for f in index.local_callees(c))
            }  # fmt: skip
            if not more:
                break
            found |= more
        index.__dict__["_launching_functions"] = found
    return found


def _read_as_attribute(decorator: cst.BaseExpression) -> bool:
    """`@property`, `@cached_property`, `@x.setter`: the method runs when the attribute is read."""
    name = dotted_name(decorator.func if isinstance(decorator, cst.Call) else decorator) or ""
    return name.rpartition(".")[2] in ("property", "cached_property", "setter", "getter", "deleter")


def _method_sites(ctx: "FileContext", name: str) -> Optional[list[tuple[FileIndex, cst.Call]]]:
    """Every call `x.name(...)` in this file and the program's files around it, with its file's
    index; None where the name is also read otherwise (an attribute not called, a string that
    names it: `getattr(obj, "name")`)."""
    sites = []
    for index in [ctx.index, *ctx.program_indexes]:
        for node in _names_used(index).get(name, ()):
            parent = index.parents.get(node)
            if isinstance(parent, cst.Attribute) and parent.attr is node:
                continue  # (the attribute's own name, seen as the attribute)
            if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and index.qnames(node.value) & set(index.imported_modules):
                continue  # `torch.save(...)`: a module's function, not the method
            if isinstance(node, cst.Attribute) and isinstance(parent, cst.Call) and parent.func is node:
                sites.append((index, parent))
            elif isinstance(node, cst.Attribute) or index is ctx.index and not _defines(index, node):
                return None
        if name in _strings(index):
            return None
    return sites


def _defines(index: FileIndex, node: cst.CSTNode) -> bool:
    """Is this name the name of a function's definition?"""
    parent = index.parents.get(node)
    return isinstance(parent, cst.FunctionDef) and parent.name is node


def _strings(index: FileIndex) -> frozenset[str]:
    """The plain strings of the file's main module."""
    return index.cached(
        "plain_strings", lambda i: frozenset(v for n in iter_nodes(i.module) if isinstance(n, cst.SimpleString) and (v := string_value(n)))
    )


def _referenced(ctx: "FileContext", func: Func) -> bool:
    """Is the function's name used other than as its definition (a call, a callback,
    `hooks.append(f)`, `__all__`)? Then "nothing calls it" is not known."""
    return bool(_uses_of(ctx, func))


def _used_as_value(ctx: "FileContext", func: Func) -> bool:
    """Is the function's name read other than as the callee of a call (`validate_fn =
    validate_sphere if sphere else validate`, a callback)? Its call sites are then not all."""
    return any(n is not None and not (isinstance(ctx.parent(n), cst.Call) and ctx.parent(n).func is n) for n in _uses_of(ctx, func))


def _null_handler(index: FileIndex, call: cst.Call) -> bool:
    """`logger.addHandler(logging.NullHandler())`: the dummy logger of the other ranks writes nothing."""
    return any(
        isinstance(a.value, cst.Call) and a.value in index.call_info and index.call_info[a.value].is_("logging.NullHandler")
        for a in call.args
    )


def _names_used(index: FileIndex) -> dict[str, list[cst.CSTNode]]:
    """The names and attribute chains the file's main module reads, by their last name (an import
    alone is no use)."""
    def names(i: FileIndex) -> dict[str, list[cst.CSTNode]]:
        imported = {id(n) for imp in iter_nodes(i.module) if isinstance(imp, (cst.Import, cst.ImportFrom)) for n in iter_nodes(imp)}
        found: dict[str, list[cst.CSTNode]] = {}
        for n in iter_nodes(i.module):
            if isinstance(n, (cst.Name, cst.Attribute)) and id(n) not in imported:
                found.setdefault(n.value if isinstance(n, cst.Name) else n.attr.value, []).append(n)
        return found

    return index.cached("names_used", names)


def _name_prefixes(index: FileIndex) -> frozenset[str]:
    """The fixed start of each formatted string of the file that looks like a name (`"init_dist_%s"`)."""
    def prefixes(i: FileIndex) -> frozenset[str]:
        found = set()
        for n in iter_nodes(i.module):
            value = string_value(n) if isinstance(n, cst.SimpleString) else None
            head = re.split(r"%|\{", value)[0] if value and ("%" in value or "{" in value) else ""
            if isinstance(n, cst.FormattedString) and len(n.parts) > 1 and isinstance(n.parts[0], cst.FormattedStringText):
                head = n.parts[0].value  # f"init_dist_{launcher}"
            if len(head) >= 4 and head.isidentifier():
                found.add(head)
        return frozenset(found)

    return index.cached("name_prefixes", prefixes)


def _is_script(index: FileIndex) -> bool:
    """A file run as a program (an `if __name__ == "__main__":` block at its top level)."""
    return any(isinstance(stmt, cst.If) and "__main__" in index.code(stmt.test) for stmt in index.module.body)


def _splits_stdout(index: FileIndex) -> bool:
    """A `subprocess.Popen`/`run` that starts a worker per process (in a loop, or under a test of
    the rank) whose output goes to a file or to nowhere: `stdout=open(f"logs/{i}.log", "w")`, a
    name bound to `None if i == 0 else open(...)`, `subprocess.DEVNULL`, also through a `**kwargs`
    dict filled beside it (`kwargs["stdout"] = sp.DEVNULL` under `if rank > 0:`)."""
    rank = rank_analysis(index)
    for ci in index.calls:
        if not ci.qnames & {"subprocess.Popen", "subprocess.run", "subprocess.call"}:
            continue
        if not (ci.loops or rank.under_rank_test(ci.node)):
            continue
        values = [a.value for a in ci.node.args if a.keyword is not None and a.keyword.value in ("stdout", "stderr")]
        values += [b.value for v in values if isinstance(v, cst.Name) for b in index.assignments if b.dotted == v.value]
        if any(a.star == "**" for a in ci.node.args) and ci.func is not None:
            values.append(ci.func)  # `kwargs["stdout"] = sp.DEVNULL` in the same function
        if any(_output_file(index, v) for v in values):
            return True
    return False


def _output_file(index: FileIndex, node: cst.CSTNode) -> bool:
    """Does this value (or function) open a file or send output to `DEVNULL`?"""
    return any(
        isinstance(n, cst.Call) and index.code(n.func) == "open" or isinstance(n, (cst.Name, cst.Attribute)) and (last_name(n) or "") == "DEVNULL"
        for n in iter_nodes(node)
    )


def _rank_filter(index: FileIndex, value: cst.BaseExpression, depth: int = 0) -> bool:
    """A log filter that reads the rank (`logger.addFilter(lambda _: rank == 0)`,
    `handler.addFilter(rank0_filter)` with `def rank0_filter(record): return record.global_rank
    == 0`, a `logging.Filter` subclass whose `filter` tests the rank, or a name bound to one of
    them): other ranks' records are dropped."""
    if RANK_TEXT.search(index.code(value)):
        return True  # `addFilter(lambda record: rank == 0)`, `RankFilter(rank)`, `partial(only_rank, 0)`
    if isinstance(value, cst.Call):
        value = value.func  # `RankFilter()`: the class
    name = dotted_name(value) if isinstance(value, (cst.Name, cst.Attribute)) else None
    if name is None or depth > 2:
        return False
    defs = [f for f in index.functions.get(name, [])] + [c for c in index.classes if c.name.value == name]
    if any(RANK_TEXT.search(index.code(d)) for d in defs):
        return True
    return any(b.dotted == name and _rank_filter(index, b.value, depth + 1) for b in index.assignments)


def _quiets_others(rank, ci: CallInfo) -> bool:
    """Does this call turn logging down on the ranks other than 0 (`rank`: its file's rank analysis)?"""
    if ci.name == "addFilter" and ci.node.args:
        return _rank_filter(rank.index, ci.node.args[0].value)
    if not (ci.name == "setLevel" or ci.is_("logging.basicConfig", "logging.disable")):
        return _level_into_helper(rank, ci)
    if not rank.in_rank0(ci.node) and rank.under_rank_test(ci.node):
        return True  # `if rank != 0: logger.setLevel(logging.ERROR)`
    tests = [a.value.test if isinstance(a.value, cst.IfExp) else a.value for a in ci.node.args]
    return any(rank.reads_rank(test) or _chosen_by_rank(rank, test, ci.func) for test in tests)  # `level=logging.INFO if rank == 0 else logging.WARN`


def _chosen_by_rank(rank, value: cst.BaseExpression, func) -> bool:
    """A name given its value under a test of the rank (`level = "WARNING"`, then `if rank == 0:
    level = "INFO"`)."""
    return isinstance(value, cst.Name) and any(
        b.dotted == value.value and b.func is func and b._node is not None and rank.under_rank_test(b._node)
        for b in rank.index.assignments
    )


def _level_into_helper(rank, ci: CallInfo) -> bool:
    """`get_logger(name, path, level)` with a level chosen by the rank, where the project's
    `get_logger` sets the logging level (`basicConfig(level=...)`, `setLevel(...)`) from its
    parameters."""
    if not any(_chosen_by_rank(rank, a.value, ci.func) for a in ci.node.args):
        return False
    helpers = rank.index.local_callees(ci) or rank.index.functions.get(ci.name, [])  # (re-exported by a package)
    return any(c.name == "setLevel" or c.is_("logging.basicConfig") for f in helpers for c in rank.index.calls_under(f))
