"""`ddpify convert`: an ordered pipeline of small passes over one shared analysis."""

from __future__ import annotations

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor
from libcst.metadata import MetadataWrapper

from ddpify.analysis.script import analyze
from ddpify.convert import (
    download_once,
    evaluate_distributed,
    guard_rank_zero,
    launch_with_spawn,
    legacy_local_rank,
    place_on_device,
    quiet_progress_bars,
    reduce_train_metrics,
    replace_data_parallel,
    seed_random_split,
    setup_process_group,
    shard_data,
    shard_hand_batches,
    shard_split_loaders,
    skip_sync_on_accumulation,
    spread_model_over_gpus,
    teardown,
    unwrap_model,
    wait_for_checkpoints,
    wrap_model,
)
from ddpify.convert.context import Context
from ddpify.convert.edits import Edits, apply
from ddpify.results import ConvertOptions, ConvertResult, Note

# Order matters: later passes read the names and positions earlier ones chose.
PASSES = (
    setup_process_group,
    spread_model_over_gpus,
    place_on_device,
    replace_data_parallel,
    wrap_model,
    unwrap_model,
    skip_sync_on_accumulation,
    seed_random_split,
    shard_data,
    shard_split_loaders,
    shard_hand_batches,
    evaluate_distributed,
    reduce_train_metrics,
    download_once,
    guard_rank_zero,
    wait_for_checkpoints,
    quiet_progress_bars,
    legacy_local_rank,
    teardown,
    launch_with_spawn,
)


def convert_module(module: cst.Module, options: ConvertOptions = ConvertOptions()) -> ConvertResult:
    """Convert a parsed script; raises AnalysisError when it cannot be done safely."""
    wrapper = MetadataWrapper(module)
    script = analyze(wrapper)
    if script.distributed_marker is not None:
        line = script.line(script.distributed_marker)
        return ConvertResult(
            module.code,
            [Note(line, "already distributed: nothing to convert")],
            already_distributed=True,
        )
    edits = Edits(wrapper.module)
    ctx = Context(script, edits, options, gpus_per_process=spread_model_over_gpus.width(script))
    for convert_pass in PASSES:
        convert_pass.run(ctx)
    converted = apply(wrapper.module, edits)
    imports = CodemodContext()
    for module_name, obj, asname in edits.imports:
        AddImportsVisitor.add_needed_import(imports, module_name, obj, asname)
    for module_name, obj, asname in edits.unused_imports:
        RemoveImportsVisitor.remove_unused_import(imports, module_name, obj, asname)
    converted = AddImportsVisitor(imports).transform_module(converted)
    if edits.unused_imports:
        converted = RemoveImportsVisitor(imports).transform_module(converted)
    return ConvertResult(
        converted.code,
        sorted(set(edits.changes), key=lambda n: n.line),
        sorted(set(edits.todos), key=lambda n: n.line),
    )
