"""`ddpify convert`: an ordered pipeline of small passes over one shared analysis."""

from __future__ import annotations

import dataclasses

import libcst as cst
from libcst.metadata import MetadataWrapper

from ddpify.analysis.options import dead_options
from ddpify.analysis.project import ProjectFacts
from ddpify.analysis.script import AnalysisError, Script, analyze, fully_distributed, run_by_entry
from ddpify.convert import (
    average_gradients,
    average_penalty_gradients,
    average_training_set_metrics,
    agree_on_stop,
    agree_on_training_gate,
    copy_weights_after_wrap,
    drop_model_traces,
    download_once,
    evaluate_distributed,
    gather_full_state,
    keep_model_on_device,
    flag_double_forward,
    flag_unfollowed_code,
    flag_visible_devices,
    guard_output_by_global_rank,
    guard_rank_zero,
    launch_with_spawn,
    legacy_local_rank,
    order_sets_alike,
    place_on_device,
    quiet_library_output,
    quiet_progress_bars,
    read_whole_parameters,
    reduce_train_metrics,
    replace_data_parallel,
    resume_after_restart,
    seed_drawn_items,
    seed_random_split,
    setup_process_group,
    share_rank0_values,
    shard_data,
    shard_hand_batches,
    shard_model,
    shard_split_loaders,
    shard_subset_samplers,
    skip_sync_on_accumulation,
    spread_model_over_gpus,
    teardown,
    unwrap_model,
    wait_for_checkpoints,
    wrap_model,
)
from ddpify.convert.context import Context
from ddpify.convert.edits import (
    Edits,
    add_imports,
    apply,
    bound_name,
    edited_nodes,
    imports_module,
    NameUse,
    names_read,
)
from ddpify.results import ConvertOptions, ConvertResult, Note

# Order matters: later passes read the names and positions earlier ones chose.
PASSES = (
    setup_process_group,
    spread_model_over_gpus,
    place_on_device,
    replace_data_parallel,
    wrap_model,
    unwrap_model,
    copy_weights_after_wrap,
    keep_model_on_device,
    average_gradients,
    average_penalty_gradients,
    skip_sync_on_accumulation,
    flag_double_forward,
    seed_random_split,
    order_sets_alike,
    share_rank0_values,
    download_once,  # before shard_data: its barriers must enclose a dataset shard_data lifts out of a loader
    shard_data,
    shard_split_loaders,
    shard_subset_samplers,
    shard_hand_batches,
    seed_drawn_items,
    evaluate_distributed,
    reduce_train_metrics,
    average_training_set_metrics,
    agree_on_stop,
    agree_on_training_gate,
    guard_rank_zero,
    guard_output_by_global_rank,
    wait_for_checkpoints,
    resume_after_restart,
    quiet_progress_bars,
    quiet_library_output,
    legacy_local_rank,
    teardown,
    launch_with_spawn,
    flag_unfollowed_code,
    flag_visible_devices,
)


# `--to fsdp2`: the model is sharded instead of wrapped; its checkpoints are gathered first.
FSDP2_PASSES = tuple(
    p
    for q in PASSES
    for p in ((shard_model,) if q is wrap_model else (gather_full_state, read_whole_parameters, drop_model_traces, q) if q is guard_rank_zero else (q,))
)


# A project's entry script that hands its model to another module's trainer (`Trainer(model,
# dataset).run()`) keeps its code; what it does once per process becomes once per job.
DRIVER_PASSES = (guard_rank_zero, quiet_progress_bars)


def convert_module(
    module: cst.Module,
    options: ConvertOptions = ConvertOptions(),
    *,
    shortcut: bool = True,
    facts: ProjectFacts | None = None,
    driver: bool = False,
) -> ConvertResult:
    """Convert a parsed script; raises AnalysisError when it cannot be done safely.

    A script that already sets up a process group, wraps its model in DDP and shards its data is
    returned as it is (`already_distributed`), with what the passes would still add reported;
    with `shortcut` off every pass runs over it anyway. `facts`: what the rest of its project
    tells; `driver`: the script drives training another module of the project runs (only its
    side effects change)."""
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)  # a freshly parsed tree: no node is shared
    script = analyze(wrapper, full=not shortcut, facts=facts, need_model=not driver)
    if shortcut and fully_distributed(script):
        # Left alone; what the passes would still add (a lost set_epoch, an unguarded save) is
        # reported, not done: a hand-written DDP script may mean it.
        line = script.line(script.distributed_marker)
        try:
            pending = replan(module, options, facts=facts, driver=driver)
        except Exception:  # noqa: BLE001 - only notes: a hand-written DDP script the passes cannot follow stays as it is
            pending = []
        notes = [Note(line, "already distributed: nothing to convert")]
        notes += [Note(at, f"not converted: {what} ({name})") for name, at, what in pending]
        return ConvertResult(module.code, notes, already_distributed=True, pending=pending)
    script, edits = _plan(wrapper, options, script, driver=driver)
    converted = _finish(wrapper.module, edits, script)
    dead = [Note(line, note) for line, note in dead_options(wrapper.module, converted, script.line)]
    return ConvertResult(
        converted.code,
        sorted(dict.fromkeys(edits.changes), key=lambda n: n.line),  # by line, then in the order the passes run
        sorted(dict.fromkeys(edits.todos), key=lambda n: n.line),
        notes=sorted(dict.fromkeys(dead + edits.notes), key=lambda n: n.line),
        # the edits' own list, where a test asks for it (its end lines cost a code generation)
        planned=[] if shortcut else edits.planned,
        per_process_batches=_shards(edits),
    )


def convert_modules(
    entry: cst.Module,
    others: dict[str, cst.Module],
    packages: frozenset[str] = frozenset(),
    options: ConvertOptions = ConvertOptions(),
    facts: ProjectFacts | None = None,
) -> dict[str, ConvertResult] | None:
    """Convert a project's entry script and its other modules (dotted name -> module) as one
    program: the analysis follows calls from module to module, each pass plans its edits wherever
    the code is, and each module gets its own. Returns a result per module that changes ("" is
    the entry), or None when the program is distributed already; raises AnalysisError when it
    cannot be done safely."""
    wrapper = MetadataWrapper(entry, unsafe_skip_copy=True)
    script = analyze(wrapper, full=True, facts=facts, others=others, packages=packages)
    if fully_distributed(script):
        return None  # set up, wrapped and sharded already, somewhere in the program: left alone
    script, edits = _plan(wrapper, options, script)
    edits.forget(lambda node: not run_by_entry(script, node))
    results = {}
    edited = {script.root_of(node) for node in edited_nodes(edits)}
    for module, name in script.index.roots.items():
        if module not in edited:
            continue
        def mine(where: cst.CSTNode | int, module: cst.Module = module) -> bool:
            """Is a note about this module's code? (A bare line number is the entry's.)"""
            return module is entry if isinstance(where, int) else script.root_of(where) is module

        converted = _finish(module, edits, script, prune=True, name=name)
        results[name] = ConvertResult(
            converted.code,
            sorted(dict.fromkeys(edits.changes_where(mine)), key=lambda n: n.line),
            sorted(dict.fromkeys(edits.todos_where(mine)), key=lambda n: n.line),
            notes=sorted(dict.fromkeys(edits.notes_where(mine)), key=lambda n: n.line),
            per_process_batches=_shards(edits),
        )
    return results


def replan_modules(
    entry: cst.Module,
    others: dict[str, cst.Module],
    packages: frozenset[str] = frozenset(),
    options: ConvertOptions = ConvertOptions(),
    facts: ProjectFacts | None = None,
) -> list[tuple[str, int, str]]:
    """`replan` for a project: what every pass would still change in any of its modules."""
    wrapper = MetadataWrapper(entry, unsafe_skip_copy=True)
    script = analyze(wrapper, full=True, facts=facts, others=others, packages=packages)
    script, edits = _plan(wrapper, options, script)
    edits.forget(lambda node: not run_by_entry(script, node))
    planned = edits.planned
    for module, name in script.index.roots.items():
        use = NameUse(module)  # an import the module lacks: a name it reads and never binds
        if not planned and _imports(module, edits, prune=True, read=use.read - use.bound) is not module:
            planned.append(("imports", 1, f"changes the imports of {name or 'the entry'}"))
    return planned


def replan(
    module: cst.Module,
    options: ConvertOptions = ConvertOptions(),
    *,
    facts: ProjectFacts | None = None,
    driver: bool = False,
) -> list[tuple[str, int, str]]:
    """Every pass over `module` with the already-distributed shortcut off: the (pass, line, what)
    of each code change they would make. A converted script must give none (engine._verify)."""
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    script = analyze(wrapper, full=True, facts=facts, need_model=not driver)
    script, edits = _plan(wrapper, options, script, driver=driver)
    planned = edits.planned
    if not planned and (_imports(module, edits) is not module):
        planned.append(("imports", 1, "changes the imports"))
    return planned


def _plan(wrapper: MetadataWrapper, options: ConvertOptions, script: Script, driver: bool = False) -> tuple[Script, Edits]:
    """Run every pass over the script; the edits they ask for, not yet applied."""
    edits = Edits(wrapper.module)
    edits.line_of = script.line
    edits.end_line_of = lambda node: script.positions[node].end.line if node in script.positions else script.line(node)
    if options.target == "fsdp2" and (options.eval_on_rank0 or options.sync_batchnorm):
        edits.note(1, "--eval-on-rank0 and --sync-batchnorm do not apply to --to fsdp2: a sharded model evaluates on every rank")
        options = dataclasses.replace(options, eval_on_rank0=False, sync_batchnorm=False)
    ctx = Context(script, edits, options, gpus_per_process=spread_model_over_gpus.width(script), driver=driver)
    for convert_pass in DRIVER_PASSES if driver else FSDP2_PASSES if options.target == "fsdp2" else PASSES:
        edits.current_pass = convert_pass.__name__.rsplit(".", 1)[-1]
        convert_pass.run(ctx)
    return script, edits


SHARDING_PASSES = frozenset({"shard_data", "shard_hand_batches", "shard_split_loaders", "shard_subset_samplers"})


def _shards(edits: Edits) -> bool:
    """Did a pass give the processes batches of their own (a sampler, a slice per rank)? (A TODO
    or a note about data left as it is does not.)"""
    return bool(edits.changed_by & SHARDING_PASSES)


# Modules the code the passes write reads without asking for them (`torch.device(...)`,
# `torch.tensor(...)`, `os.environ`): imported where the converted code reads them anew.
IMPLICIT_IMPORTS = (("torch", None, None), ("os", None, None))


def _finish(original: cst.Module, edits: Edits, script: Script, prune: bool = False, name: str = "") -> cst.Module:
    """`original` with the edits applied and its imports completed: what the new code reads is
    bound in the module (a name of IMPLICIT_IMPORTS is imported; any other unbound one is a bug
    of a pass, an internal error, never output that fails with a NameError)."""
    applied = apply(original, edits, script.parent)
    if applied is original:
        return _imports(applied, edits, prune)
    before, after = NameUse(original), NameUse(applied)
    new = after.read - before.read - after.bound
    extra = [item for item in IMPLICIT_IMPORTS if bound_name(item) in new]
    unbound = after.unbound(before, {bound_name(item) for item in [*edits.imports, *extra]})
    if unbound:
        where = name or "the script"
        raise AnalysisError(1, f"internal error: the converted code of {where} reads {', '.join(unbound)}, which it never binds")
    return _imports(applied, edits, prune, read=after.read, extra=extra)


def _imports(
    module: cst.Module, edits: Edits, prune: bool = False, read: set[str] | None = None, extra: list | None = None
) -> cst.Module:
    """`module` with the imports the passes need added and the ones they made unused removed
    (the same object when nothing changes). `prune`: a module of a project, which gets only the
    added imports its own code reads (`read`, when known; the passes ask for them for the whole
    program). `extra`: imports its new code needs besides (`_finish`)."""
    needed = [*edits.imports, *(extra or ())]
    if prune:
        read = names_read(module) if read is None else read
        needed = [item for item in needed if bound_name(item) in read]
    converted = add_imports(module, needed)
    # libcst's RemoveImportsVisitor resolves scopes over the whole module: only where one is there
    unused = [item for item in edits.unused_imports if imports_module(converted, item[0])]
    if unused:
        from libcst.codemod import CodemodContext  # libcst.codemod costs as much to import as libcst
        from libcst.codemod.visitors import RemoveImportsVisitor

        imports = CodemodContext()
        for module_name, obj, asname in unused:
            RemoveImportsVisitor.remove_unused_import(imports, module_name, obj, asname)
        removed = RemoveImportsVisitor(imports).transform_module(converted)
        if not removed.deep_equals(converted):
            converted = removed
    if prune and converted is not module and converted.deep_equals(module):
        return module
    return converted

