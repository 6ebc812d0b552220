"""Run a training script unchanged and record what it did (`ddpify verify` and the test suite).

    python tracer.py SCRIPT [ARGS...]
    torchrun --standalone --nproc-per-node=2 tracer.py SCRIPT [ARGS...]
    torchrun ... tracer.py --plan PLAN.json

This file runs in the processes that run the script, so it imports torch; it imports nothing of
ddpify (it is started by path, also with another environment's Python). The script is executed
with ``runpy.run_path(SCRIPT, run_name="__main__")`` and ``sys.argv`` set as if it had been
started directly. Nothing in the script is edited and torch.distributed is real; the tracer only
wraps a few torch entry points to take notes, always calling the original:

* ``DataLoader.__init__``: every loader gets an id (creation order) and its dataset length,
  sampler class, batch size and drop_last are noted.
* ``_BaseDataLoaderIter.__init__`` / ``_next_index``: every ``iter(loader)`` starts a *pass*;
  each index (or batch of indices) the loader's sampler hands out in this process is appended
  to it (None for what is not an int), with the size of each batch; a pass counts the optimizer
  steps taken while it was the last one read (a training pass has some). For samplers whose
  epoch can be listed without side effects (DistributedSampler, SequentialSampler, a
  RandomSampler's set, a SubsetRandomSampler's indices) ``planned`` holds every index this rank
  would read in the pass. A pass is ``complete`` once its sampler is exhausted.
* ``torch.save`` / ``torch.load`` and ``open()``: the files each process writes and reads, with
  the script line and the number of collectives it had passed (a read after the writer's
  barrier is ordered after the write). A state_dict saved is compared with every DDP model's
  unwrapped module: ``loads_into`` names the one it loads into. ``stores`` says what each save
  held: a trained model's state_dict (with or without ``module.`` keys), a whole module, an
  optimizer's state, each with the key of the saved dict it sits under.
* ``torch.optim.Optimizer.__init__`` and a global step post-hook: after every ``optimizer.step()``
  a checksum of that optimizer's parameters (blake2b of their bytes) is appended to
  ``optimizer_steps[<optimizer index>]``; DDP keeps them bitwise identical on every rank.
  The parameters at the end are written to ``params-<tag>.pt``.
* ``Tensor.backward``: the value of every scalar loss (``losses``).
* gradients averaged by hand: at each step of an optimizer that trains parameters no DDP model
  holds, whether ``dist.all_reduce`` went over at least as many elements as their gradients hold
  since the last backward (``hand_averaged[<optimizer index>]``: True when every such step did,
  None when no step had such gradients): a model run with weights passed in (MAML) is not
  wrapped, its gradients are averaged after backward.
* every module's forward (global hooks): the first training forward of a model whose parameters
  an optimizer trains, when no DDP model holds them yet (``unwrapped_forwards``, with the device
  of its parameters and of that forward's tensors, the optimizers that train those parameters,
  and ``cuda_available``); dropout and
  batch statistics in training mode and data loading that draws random numbers (``randomness``).
* ``torch.distributed``: ``init_process_group`` / ``destroy_process_group`` (backend, world
  size, rank), the collectives the script calls, and the ``DistributedDataParallel``
  constructor; a forward pre-hook on every DDP model notes the integer first input of each
  training forward (``trained_tokens``) and a checksum of its parameters (``ddp_forwards``;
  ``ddp_final`` at the end): the replica check for scripts that update parameters by hand.
* FSDP2's ``fully_shard``: the outermost module it shards counts as a wrapped model (entries of
  ``ddp_models`` with ``kind`` "fsdp2"; its blocks, sharded first, are folded into it), and
  ``set_requires_gradient_sync(False)`` as ``no_sync``. Checksums and the parameters at the end
  are of the whole (gathered) parameters: the gathers run where every rank is (after each
  optimizer step, before each training forward, before the process group is destroyed).
* ``torch.multiprocessing.spawn``: a script that starts its own processes has each child
  traced as rank ``i`` (the launcher writes its own files as rank ``launcher``).
* ``os.environ[...] = ...`` and the seeds (``torch.manual_seed``, ``torch.cuda.manual_seed(_all)``,
  ``random.seed``, ``numpy.random.seed``) the script's own code sets (``env_set``, ``seeds``): facts
  for ``ddpify convert --run``.
* ``sys.stdout``: what this process printed, and each line's script line (``lines``).

A plan (a JSON list of runs) runs scripts one after the other in the same processes, to pay for
torchrun's start-up once. A run is ``{"label", "script", "args", "env", "cwd"}`` plus, for
``ddpify verify``: ``limit`` ``{"steps": K, "epochs": E}`` (a training pass ends after K optimizer
steps; the run stops at the start of pass E+1, or after E*K steps without a loader),
``reference`` ``{"seed", "batch_scale", "train_loader_from"}`` (a reproducible run: seeded, no
loader workers, random_split seeded, no shuffling, DistributedSamplers too; the training loader, found in
the earlier run ``train_loader_from``, gets ``batch_scale`` times its batch), ``compare_params``
(a params file of an earlier run: ``reference_diff`` says how far this run ends from it),
``resume`` ``{"after", "args"}`` (run only when rank 0 of the earlier run ``after`` ended well and saved a
state_dict to a file; ``{checkpoint}`` in ``args``, added to the run's, is that file; ``loads`` lists the
files each ``torch.load`` read),
``root`` (the project's folder, when the script runs below it: its modules' lines count as the script's),
``timeout`` (seconds: then every thread's stack goes to ``stacks-<tag>.txt`` and the process
exits), ``only_if_ok`` / ``only_if_failed`` (run only if that earlier run did / did not succeed). ``--keep-going`` runs the rest
of a plan after a failing run. Under torchrun every run of a plan gets its own rendezvous store:
rank 0 picks a free port, publishes it in torchrun's store, and each run sees ``MASTER_PORT`` =
that port with ``TORCHELASTIC_USE_AGENT_STORE=False``. The rendezvous itself stays real.

Output, in ``$DDPIFY_TRACE_DIR`` (default: the working directory), with ``<tag>`` = ``<RANK>`` or
``<label>-<RANK>`` for a plan: ``trace-<tag>.json``, ``params-<tag>.pt`` and ``pid-<tag>``. They
are written even when the script fails; the runner then exits with the script's status.
"""

from __future__ import annotations

import builtins
import faulthandler
import functools
import hashlib
import importlib
import inspect
import io
import json
import os
import random
import runpy
import signal
import socket
import sys
import traceback
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.data.dataloader as dataloader_module
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook
try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5: no FSDP2
    DTensor = None
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
)

_original_save, _original_load, _original_open = torch.save, torch.load, builtins.open
_TRAINED_MODELS: list = []  # the modules of unwrapped_forwards (not in _state, which compiled code reads)
_HERE = os.path.abspath(__file__)
_trace: dict = {}
_optimizers: list = []
_ddp_models: list = []
_state: dict = {}  # per run: config, counters, the current pass
_done: dict = {}  # label -> trace of the earlier runs of a plan
PLANNED_LIMIT = 5_000_000  # indices listed per pass at most


class StopRun(BaseException):
    """Raised into the script when a verification run has seen enough epochs (not an Exception:
    the script's own `except Exception` must not swallow it)."""


def _new_trace(label: str | None, script: str, args: list[str], config: dict | None = None) -> None:
    _optimizers.clear()
    _ddp_models.clear()
    _TRAINED_MODELS.clear()
    _trace.clear()
    _trace.update(
        label=label,
        script=script,
        argv=args,
        env_rank=int(os.environ.get("RANK", 0)),
        env_world_size=int(os.environ.get("WORLD_SIZE", 1)),
        env_local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),  # torchrun's restarts so far
        init_process_group=[],
        destroy_process_group=0,
        ddp_wrapped=0,
        ddp_models=[],
        ddp_forwards=[],
        ddp_final=[],
        trained_tokens=[],
        loaders=[],
        passes=[],
        saves=[],
        loads=[],
        checkpoint=(config or {}).get("checkpoint"),
        files=[],
        collectives=0,
        optimizers=0,
        optimizer_info=[],
        optimizer_steps=[],
        hand_averaged=[],
        final_checksums=[],
        unwrapped_forwards=[],
        cuda_available=None,
        uncovered=[],
        losses=[],
        randomness=[],
        forward_inputs=[],
        env_set=[],
        seeds=[],
        no_sync_steps=0,
        reference_diff=None,
        spawned=0,
        stopped=None,
        dist_initialized_at_exit=None,
        exit_code=None,
        error=None,
        stdout="",
        lines=[],
    )
    _state.clear()
    _state.update(
        active=True,
        config=config or {},
        root=None,
        current_pass=None,
        loaderless_steps=0,
        seen_modules=set(),
        depth=0,
        ddp_params=set(),
        optimizer_params=set(),
        in_no_sync=0,
    )


def _config() -> dict:
    return _state.get("config") or {}


def _user_frame() -> str | None:
    """`file:line` of the innermost frame of the script's own code (under its folder or cwd)."""
    roots = _state.get("roots") or ()
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != _HERE and name.startswith(roots) and "site-packages" not in name:
            return f"{os.path.relpath(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class _Tee:
    """sys.stdout for the run: writes through, keeps a copy, and notes the script line of each line."""

    def __init__(self, stream):
        self._stream, self.parts, self._pending = stream, [], None

    def write(self, text):
        self.parts.append(text)
        if text:
            if self._pending is None:
                self._pending = ["", _user_frame()]
            self._pending[0] += text
            *whole, rest = self._pending[0].split("\n")
            for line in whole:
                _trace["lines"].append([line, self._pending[1]])
            self._pending = [rest, self._pending[1]] if rest else None
        return self._stream.write(text)

    def close_line(self):
        if self._pending is not None:
            _trace["lines"].append(self._pending)
            self._pending = None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _wrap(owner, name, make_wrapper):
    original = getattr(owner, name)
    setattr(owner, name, make_wrapper(original))


# --- DataLoader: loaders, passes and the indices of each pass --------------------------------


def _reference_loader_args(self, args, kwargs, original):
    """A reference run: no workers; the training loader without shuffling, its batch scaled."""
    reference = _config().get("reference")
    if not reference:
        return args, kwargs
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    arguments = bound.arguments
    if arguments.get("num_workers"):
        arguments["num_workers"] = 0
        for key in ("prefetch_factor", "persistent_workers"):
            arguments.pop(key, None)
    if len(_trace["loaders"]) == _state.get("train_loader"):
        scale = int(reference.get("batch_scale", 1))
        batch_sampler = arguments.get("batch_sampler")
        if isinstance(batch_sampler, BatchSampler):
            inner = batch_sampler.sampler
            if isinstance(inner, RandomSampler):
                inner = SequentialSampler(inner.data_source)
            arguments["batch_sampler"] = BatchSampler(inner, batch_sampler.batch_size * scale, batch_sampler.drop_last)
        elif batch_sampler is None:
            if arguments.get("batch_size", 1) is not None:
                arguments["batch_size"] = arguments.get("batch_size", 1) * scale
            if arguments.get("shuffle"):
                arguments["shuffle"] = False
            if isinstance(arguments.get("sampler"), RandomSampler):
                arguments["sampler"] = SequentialSampler(arguments["sampler"].data_source)
    return bound.args[1:], bound.kwargs


def _loader_init(original):
    def __init__(self, *args, **kwargs):
        args, kwargs = _reference_loader_args(self, args, kwargs, original)
        original(self, *args, **kwargs)
        try:
            dataset_len = len(self.dataset)
        except TypeError:
            dataset_len = None
        self._ddpify_trace_id = len(_trace["loaders"])
        _trace["loaders"].append(
            dict(
                id=self._ddpify_trace_id,
                dataset_len=dataset_len,
                dataset_type=type(self.dataset).__name__,
                sampler=type(self.sampler).__name__,
                batch_size=self.batch_size,
                drop_last=self.drop_last,
                where=_user_frame(),
            )
        )

    return __init__


def _index_sampler(loader):
    sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    return sampler.sampler if isinstance(sampler, BatchSampler) else sampler


def _planned(sampler) -> tuple[list | None, bool]:
    """Every index the sampler hands this rank in the pass about to start, when that can be
    known without drawing random numbers; and whether the list is in reading order."""
    try:
        if isinstance(sampler, DistributedSampler):
            return list(iter(sampler)), True  # seeded by its own seed + epoch: no side effect
        if isinstance(sampler, SequentialSampler):
            return list(range(len(sampler.data_source))), True
        if isinstance(sampler, RandomSampler) and not sampler.replacement and sampler.num_samples == len(sampler.data_source):
            return list(range(len(sampler.data_source))), False
        if isinstance(sampler, SubsetRandomSampler):
            return [int(i) for i in sampler.indices], False
    except TypeError:
        pass
    return None, False


def _training_passes(loader_id) -> int:
    return sum(1 for p in _trace["passes"] if p["loader"] == loader_id and p["steps"])


def _iter_init(original):
    def __init__(self, loader, *args, **kwargs):
        loader_id = getattr(loader, "_ddpify_trace_id", None)
        limit = _config().get("limit")
        if limit and loader_id is not None and _training_passes(loader_id) >= limit.get("epochs", 2):
            _trace["stopped"] = f"after {_training_passes(loader_id)} epochs of {limit.get('steps')} steps"
            raise StopRun
        sampler = _index_sampler(loader)
        planned, ordered = _planned(sampler)
        record = dict(
            loader=loader_id,
            indices=[],
            sizes=[],
            complete=False,
            steps=0,
            truncated=False,
            sampler=type(sampler).__name__,
            shuffle=getattr(sampler, "shuffle", isinstance(sampler, (RandomSampler, SubsetRandomSampler))),
            num_replicas=getattr(sampler, "num_replicas", None),
            epoch=getattr(sampler, "epoch", None),
            planned=planned if planned is not None and len(planned) <= PLANNED_LIMIT else None,
            planned_in_order=ordered,
            where=_user_frame(),
        )
        self._ddpify_pass = record
        self._ddpify_part = _part_of(loader.dataset, sampler)
        _trace["passes"].append(record)
        original(self, loader, *args, **kwargs)
        _state.pop("rng", None)  # a new pass draws its base seed: the next step starts a new comparison

    return __init__


def _part_of(dataset, sampler):
    """A Subset a sampler of the script's own draws from (this rank's part of a dataset): its
    indices are noted as the whole dataset's, so the ranks' parts compare. None otherwise."""
    if not isinstance(dataset, Subset) or type(sampler).__module__.startswith("torch."):
        return None
    return dataset


def _whole_index(part, i):
    """The index in the whole dataset of item `i` of a (nested) Subset."""
    while isinstance(part, Subset) and i is not None:
        i, part = _as_index(part.indices[i]), part.dataset
    return i


def _as_index(i):
    """An int, or None for what is not one (an IterableDataset's sampler yields None)."""
    try:
        return int(i)
    except (TypeError, ValueError):
        return None


def _next(original):
    """A verification run ends a training pass after K optimizer steps (exact also with loader
    workers, which ask for indices ahead)."""

    def __next__(self):
        record = getattr(self, "_ddpify_pass", None)
        limit = _config().get("limit")
        if record is not None and limit and record["steps"] >= limit.get("steps", 4):
            record["truncated"] = True
            _state["ended_pass"] = record
            raise StopIteration
        return original(self)

    return __next__


def _next_index(original):
    def _next_index(self):
        record = getattr(self, "_ddpify_pass", None)
        try:
            index = original(self)
        except StopIteration:
            if record is not None:
                record["complete"] = True
            raise
        if record is not None:
            if torch.is_grad_enabled():  # a pass read under no_grad/inference_mode (evaluation mid-epoch) trains nothing
                _state["current_pass"] = record
            part = getattr(self, "_ddpify_part", None)
            if isinstance(index, (list, tuple)):
                record["indices"].extend(_whole_index(part, _as_index(i)) for i in index)
                record["sizes"].append(len(index))
            else:
                record["indices"].append(_whole_index(part, _as_index(index)))
                record["sizes"].append(1)
        return index

    return _next_index


def _next_data(original):
    """Data loading in this process: did fetching a batch draw random numbers (augmentation)?"""

    def _next_data(self):
        if not _config().get("reference"):
            return original(self)
        before = _rng_states()
        data = original(self)
        after = _rng_states()
        if before != after:
            _note_randomness("loading a batch draws random numbers (data augmentation)")
            if "rng" in _state:
                _state["rng"] = after  # reported as augmentation, not as the step's own draws
        return data

    return _next_data


def _rng_states() -> tuple:
    """torch's, Python's and (if loaded) numpy's global random states, comparable with ==."""
    numpy = sys.modules.get("numpy")
    drawn = numpy.random.get_state() if numpy is not None else None
    return (
        torch.random.get_rng_state().numpy().tobytes(),
        random.getstate(),
        (drawn[1].tobytes(), drawn[2]) if drawn is not None else None,
    )


def _note_randomness(reason: str) -> None:
    if reason not in _trace["randomness"]:
        _trace["randomness"].append(reason)


def _dropout(original):
    def dropout(input, p=0.5, training=True, *args, **kwargs):
        if training and p:
            _note_randomness("the model uses dropout in training")
        return original(input, p, training, *args, **kwargs)

    return dropout


def _batch_norm(original):
    def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, *args, **kwargs):
        if training:
            _note_randomness("the model normalises with batch statistics (BatchNorm in training)")
        return original(input, running_mean, running_var, weight, bias, training, *args, **kwargs)

    return batch_norm


def _masked_mean(original):
    """`F.cross_entropy(logits, targets, ignore_index=-1)` over targets that skip some positions:
    the loss is a mean over the positions each rank keeps, and DDP averages the ranks' means with
    equal weight, so one process at N x the batch (one mean over all kept positions) differs."""
    def loss(input, target, *args, **kwargs):
        ignore = kwargs.get("ignore_index", args[2] if len(args) > 2 else -100)
        reduction = kwargs.get("reduction", args[4] if len(args) > 4 else "mean")
        if (
            torch.is_grad_enabled() and reduction == "mean" and isinstance(target, torch.Tensor)
            and not target.is_floating_point() and bool((target == ignore).any())
        ):  # fmt: skip
            _note_randomness("the loss averages over the targets each rank keeps (ignore_index skips some), "
                             "and DDP weighs the ranks' means equally")  # fmt: skip
        return original(input, target, *args, **kwargs)

    return loss


def _random_split(original):
    def random_split(dataset, lengths, *args, **kwargs):
        if _config().get("reference") and not args and "generator" not in kwargs:
            kwargs["generator"] = torch.Generator().manual_seed(0)  # as ddpify's conversion seeds it
        return original(dataset, lengths, *args, **kwargs)

    return random_split


def _distributed_sampler_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if _config().get("reference"):  # a reference run reads in order
            self.shuffle = False

    return __init__


# --- files: torch.save, torch.load, open() ------------------------------------------------------


def _tensor_mapping(obj):
    if isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    if isinstance(obj, Mapping):
        for value in obj.values():
            if isinstance(value, Mapping) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
                return value
    return None


def _shape_map(state) -> dict:
    return {str(k): list(v.shape) for k, v in state.items()}


def _loads_into(state) -> int | None:
    """The index of the DDP model whose unwrapped module would load `state` (same keys and shapes)."""
    shapes = _shape_map(state)
    for i, model in enumerate(_ddp_models):
        plain = model.module if isinstance(model, DistributedDataParallel) else model  # FSDP2: the model itself
        if _shape_map(plain.state_dict()) == shapes:
            return i
    return None


def _stores(obj) -> list[dict]:
    """What a saved object holds, at its top or under a key of the dict saved: a trained model's
    state_dict (``model``: its class, ``prefixed``: its keys start with ``module.``), a module
    (``module``: its class; ``trained``: a model an optimizer trains, or the wrapper around one),
    an optimizer's state_dict."""
    items = [(None, obj)] + ([(str(k), v) for k, v in obj.items()] if isinstance(obj, Mapping) else [])
    found = []
    for key, value in items:
        if isinstance(value, torch.nn.Module):
            plain = getattr(value, "module", value)
            trained = any(plain is m for m in _TRAINED_MODELS)
            found.append(dict(kind="module", key=key, module=type(value).__name__, trained=trained))
        elif isinstance(value, Mapping) and {"state", "param_groups"} <= set(value):
            found.append(dict(kind="optimizer", key=key))
        elif isinstance(value, Mapping) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
            model, prefixed = _trained_model_of(value)
            if model is not None:
                found.append(dict(kind="state_dict", key=key, model=model, prefixed=prefixed))
    return found


def _trained_model_of(state) -> tuple[str | None, bool]:
    """The class of the trained model whose state_dict `state` is (same keys and shapes, with or
    without ``module.`` before each key), and whether its keys have that prefix."""
    shapes = _shape_map(state)
    prefixed = bool(shapes) and all(k.startswith("module.") for k in shapes)
    if prefixed:
        shapes = {k[len("module."):]: v for k, v in shapes.items()}
    for model in _TRAINED_MODELS:
        if _shape_map(model.state_dict()) == shapes:
            return type(model).__name__, prefixed
    return None, prefixed


def _by_torch() -> bool:
    """Whether torch's own machinery (compile caches, extensions) opens the file, not the script."""
    frame = sys._getframe(3)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_state.get("roots") or ()) and "site-packages" not in name:
            return False
        if any(f"{os.sep}{package}{os.sep}" in name for package in ("torch", "triton")):
            return True
        frame = frame.f_back
    return False


def _note_file(path, mode: str) -> None:
    if not _state.get("active") or _by_torch():
        return
    try:
        name = os.fspath(path)
    except TypeError:
        return
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    if name.startswith(("/dev/", "/proc/", "/sys/")) or "site-packages" in name or os.path.isdir(name):
        return  # a folder a library opens (a cache probing /tmp) is no file the script writes
    _trace["files"].append(
        dict(path=os.path.normpath(os.path.abspath(name)), mode=mode, sync=_trace["collectives"], where=_user_frame())
    )


def _save(original):
    def save(obj, f, *args, **kwargs):
        state = _tensor_mapping(obj)
        prefixed = state is not None and any(str(k).startswith("module.") for k in state)
        stripped = {str(k)[len("module."):]: v for k, v in state.items()} if prefixed else None
        _trace["saves"].append(
            dict(
                path=os.fspath(f) if isinstance(f, (str, os.PathLike)) else _file_name(f) or type(f).__name__,
                file=_absolute(f if isinstance(f, (str, os.PathLike)) else _file_name(f)),
                obj_type=type(obj).__name__,
                keys=list(state) if state is not None else None,
                shapes={k: list(v.shape) for k, v in state.items()} if state is not None else None,
                module_prefix=prefixed if state is not None else None,
                loads_into=_loads_into(state) if state is not None else None,
                unprefixed_loads_into=_loads_into(stripped) if stripped else None,
                stores=_stores(obj),
                where=_user_frame(),
            )
        )
        if isinstance(f, (str, os.PathLike)):
            _note_file(f, "w")
        return original(obj, f, *args, **kwargs)

    return save


def _load(original):
    def load(f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            _note_file(f, "r")
            if _state.get("active"):
                _trace["loads"].append(dict(file=_absolute(f), where=_user_frame()))
        return original(f, *args, **kwargs)

    return load


def _file_name(f) -> str | None:
    """The path of a file object the script opened (`with open(path, "wb") as f`), else None."""
    name = getattr(f, "name", None)
    return name if isinstance(name, str) and name else None


def _absolute(f) -> str | None:
    """A path the script named, absolute and normalised (None for a file object)."""
    if not isinstance(f, (str, os.PathLike)):
        return None
    name = os.fspath(f)
    name = name.decode(errors="replace") if isinstance(name, bytes) else name
    return os.path.normpath(os.path.abspath(name))


def _open(original):
    def open(file, mode="r", *args, **kwargs):
        noted = isinstance(file, (str, bytes, os.PathLike)) and _state.get("active")
        if noted:
            _note_file(file, "w" if any(c in mode for c in "wax+") else "r")
        handle = original(file, mode, *args, **kwargs)
        if noted and "a" in mode and _trace["files"] and _trace["files"][-1]["mode"] == "w":
            try:  # an append-mode handle (a log file) that never writes is not a second writer
                _state.setdefault("appends", []).append((_trace["files"][-1], handle, handle.tell()))
            except (OSError, ValueError):
                pass
        return handle

    return open


def _unwritten_appends() -> None:
    """Mark the append-mode files this process opened and, still open, never wrote to."""
    for record, handle, start in _state.get("appends", []):
        try:
            if not handle.closed and handle.tell() == start:
                record["mode"] = "a-unused"
        except (OSError, ValueError):
            continue


# --- optimizers, models and torch.distributed ------------------------------------------------


def _optimizer_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._ddpify_trace_index = len(_optimizers)
        _optimizers.append(self)
        params = _optimizer_params(self)
        _state["optimizer_params"].update(id(p) for p in params)
        _trace["optimizers"] += 1
        _trace["optimizer_steps"].append([])
        _trace["hand_averaged"].append(None)
        _trace["optimizer_info"].append(dict(type=type(self).__name__, params=len(params), where=_user_frame()))

    return __init__


def _optimizer_params(optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _whole(p):
    """A parameter's whole value: FSDP2's DTensors are gathered (a collective: every rank calls it)."""
    return p.full_tensor() if DTensor is not None and isinstance(p, DTensor) else p


def _sharded(params) -> bool:
    return DTensor is not None and any(isinstance(p, DTensor) for p in params)


def params_checksum(params) -> str:
    """blake2b of the parameters' bytes: equal on two ranks iff their parameters are bitwise equal."""
    digest = hashlib.blake2b(digest_size=8)
    for p in params:
        t = _whole(p).detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.reshape(-1).clone()  # a copy: numpy must not pin the storage (FSDP2 frees it after forward)
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _note_hand_averaged(optimizer, index: int) -> None:
    """Did `dist.all_reduce` cover the gradients no DDP model averages, since the last backward?"""
    need = sum(
        p.grad.numel() for p in _optimizer_params(optimizer)
        if p.requires_grad and p.grad is not None and id(p) not in _state["ddp_params"]
    )  # fmt: skip
    if not need:
        return
    done = _state.get("reduced_since_backward", 0) >= need
    before = _trace["hand_averaged"][index]
    _trace["hand_averaged"][index] = done if before is None else before and done


def _after_step(optimizer, args, kwargs):
    """Global optimizer step post-hook: the checksum of this optimizer's parameters after the step."""
    index = getattr(optimizer, "_ddpify_trace_index", None)
    if index is None or index >= len(_optimizers) or _optimizers[index] is not optimizer:
        return  # an optimizer of an earlier run of the plan
    _trace["optimizer_steps"][index].append(params_checksum(_optimizer_params(optimizer)))
    _note_hand_averaged(optimizer, index)
    if _config().get("reference") and index == _state.get("step_optimizer", index):
        rng = _rng_states()
        if "rng" in _state and _state["rng"] != rng:
            _note_randomness("the training step draws random numbers (noise, random batches or masks)")
        _state["rng"] = rng
    if _state.get("backward_in_no_sync"):
        _trace["no_sync_steps"] += 1  # the gradients of this step were never averaged
    current, limit = _state["current_pass"], _config().get("limit")
    if _state.setdefault("step_optimizer", index) != index:
        return  # steps are counted on the first optimizer that steps (a GAN steps two per batch)
    if current is not None:
        current["steps"] += 1
    elif limit:
        _state["loaderless_steps"] += 1
        if _state["loaderless_steps"] >= limit.get("steps", 4) * limit.get("epochs", 2):
            _trace["stopped"] = f"after {_state['loaderless_steps']} optimizer steps (no DataLoader)"
            raise StopRun


def _init_process_group(original):
    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        _trace["init_process_group"].append(
            dict(backend=str(dist.get_backend()), world_size=dist.get_world_size(), rank=dist.get_rank(), where=_user_frame())
        )
        return result

    return init_process_group


def _destroy_process_group(original):
    def destroy_process_group(*args, **kwargs):
        _trace["destroy_process_group"] += 1
        _gather_final()
        return original(*args, **kwargs)

    return destroy_process_group


def _collective(original):
    reduces = original.__name__ == "all_reduce"

    def collective(*args, **kwargs):
        result = original(*args, **kwargs)
        _trace["collectives"] += 1
        tensor = args[0] if args else kwargs.get("tensor")
        if reduces and isinstance(tensor, torch.Tensor):
            _state["reduced_since_backward"] = _state.get("reduced_since_backward", 0) + tensor.numel()
        return result

    return collective


COLLECTIVES = (
    "barrier", "all_reduce", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object",
    "all_gather_into_tensor", "reduce", "gather", "gather_object", "scatter", "reduce_scatter", "all_to_all",
)  # fmt: skip


def _ddp_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        replicated = _state.get("replicated_params", ())
        if replicated and all(id(p) in replicated for p in self.parameters()):
            return  # the DDP a `replicate(module)` builds at its first forward: traced as that module
        _trace["ddp_wrapped"] += 1
        self._ddpify_trace_index = len(_ddp_models)
        _ddp_models.append(self)
        _state["ddp_params"].update(id(p) for p in self.parameters())
        _trace["ddp_models"].append(
            dict(module=type(self.module).__name__, params=sum(1 for _ in self.parameters()), where=_user_frame(), event=_event())
        )
        _trace["ddp_forwards"].append([])
        self.register_forward_pre_hook(_record_tokens)
        self.register_forward_pre_hook(_record_forward_params)

    return __init__


def _install_fsdp2_hooks() -> None:
    try:
        import torch.distributed.fsdp as fsdp
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    _wrap(fsdp, "fully_shard", _fully_shard)
    _wrap(FSDPModule, "set_requires_gradient_sync", _set_requires_gradient_sync)
    composable = sys.modules.get("torch.distributed._composable.fsdp")
    if composable is not None and hasattr(composable, "fully_shard"):
        composable.fully_shard = fsdp.fully_shard
    try:
        importlib.import_module("torch.distributed._composable.replicate")
    except ImportError:
        return
    _wrap(sys.modules["torch.distributed._composable.replicate"], "replicate", _replicate)


def _replicate(original):
    """`replicate(module)`: DDP in place (a model FSDP2 cannot shard), traced as this module, of
    kind "replicate" (the DDP it builds at the first forward is not traced again)."""
    @functools.wraps(original)  # (with its `state` attribute, which `replicate` reads through its own global name)
    def replicate(module, *args, **kwargs):
        name = type(module).__name__  # (replicate changes the class to DDP<name>)
        result = original(module, *args, **kwargs)
        _state.setdefault("replicated_params", set()).update(id(p) for p in module.parameters())
        _trace_in_place(module, name, "replicate")
        return result

    return replicate


def _fully_shard(original):
    def fully_shard(module, *args, **kwargs):
        name = type(module).__name__  # (FSDP2 changes the class to FSDP<name>)
        result = original(module, *args, **kwargs)
        inner = {id(m) for m in module.modules()}
        for model in [m for m in _ddp_models if id(m) in inner]:  # its blocks, sharded before it
            at = _ddp_models.index(model)
            del _ddp_models[at], _trace["ddp_models"][at], _trace["ddp_forwards"][at]
            _trace["ddp_wrapped"] -= 1
        for i, model in enumerate(_ddp_models):
            model._ddpify_trace_index = i
        _trace_in_place(module, name, "fsdp2")
        return result

    return fully_shard


def _trace_in_place(module, name: str, kind: str) -> None:
    """Trace a module made distributed in place (no wrapper: `fully_shard`, `replicate`) as one
    more model of the run, with its forwards."""
    _trace["ddp_wrapped"] += 1
    module._ddpify_trace_index = len(_ddp_models)
    _ddp_models.append(module)
    _state["ddp_params"].update(id(p) for p in module.parameters())
    _trace["ddp_models"].append(
        dict(module=name, kind=kind, params=sum(1 for _ in module.parameters()), where=_user_frame(), event=_event())
    )
    _trace["ddp_forwards"].append([])
    module.register_forward_pre_hook(_record_tokens)
    module.register_forward_pre_hook(_record_forward_params)


def _set_requires_gradient_sync(original):
    def set_requires_gradient_sync(self, requires_gradient_sync, *args, **kwargs):
        if getattr(self, "_ddpify_trace_index", None) is not None:
            _state["fsdp_no_sync"] = not requires_gradient_sync
        return original(self, requires_gradient_sync, *args, **kwargs)

    return set_requires_gradient_sync


def _gather_final() -> None:
    """The whole parameters of sharded models, while the process group is still up."""
    if "final_ddp" in _state or not dist.is_initialized():
        return
    if any(_sharded(_optimizer_params(opt)) for opt in _optimizers):
        _state["final_params"] = [[_whole(p).detach().cpu().clone() for p in _optimizer_params(opt)] for opt in _optimizers]
    elif not any(_sharded(model.parameters()) for model in _ddp_models):
        return  # (a sharded model updated by hand, with no optimizer, is gathered too)
    _state["final_ddp"] = [params_checksum(model.parameters()) for model in _ddp_models]


def _no_sync(original):
    def no_sync(self):
        inner = original(self)

        class _Counted:
            def __enter__(self_):
                _state["in_no_sync"] += 1
                return inner.__enter__()

            def __exit__(self_, *exc):
                _state["in_no_sync"] -= 1
                return inner.__exit__(*exc)

        return _Counted()

    return no_sync


INPUTS_NOTED = 4  # training forwards whose input is noted


def _event() -> int:
    _state["events"] = _state.get("events", 0) + 1
    return _state["events"]


def _record_forward_params(module, inputs):
    """Checksum of a DDP model's parameters before each training forward (also for scripts that
    update parameters by hand, without a torch optimizer): DDP keeps them identical on every rank."""
    if not (module.training and torch.is_grad_enabled()):
        return
    index = getattr(module, "_ddpify_trace_index", None)
    if index is not None and index < len(_ddp_models) and _ddp_models[index] is module:
        _trace["ddp_forwards"][index].append(params_checksum(module.parameters()))


def _record_tokens(module, inputs):
    """Integer inputs of training forwards (token ids): which data this rank trained on."""
    first = inputs[0] if inputs else None
    if not (module.training and torch.is_grad_enabled() and isinstance(first, torch.Tensor)):
        return
    if first.is_floating_point() or first.is_complex() or first.numel() > 100_000:
        return
    _trace["trained_tokens"].append(first.detach().flatten().tolist())


def _note_input(module, inputs) -> None:
    """A checksum of the first tensor given to each of the first few training forwards of a
    model an optimizer trains (``forward_inputs``): ranks that replay one run feed the same ones."""
    if len(_trace["forward_inputs"]) >= INPUTS_NOTED or not (module.training and torch.is_grad_enabled()):
        return
    first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    if first is None or not ({id(p) for p in module.parameters()} & _state["optimizer_params"]):
        return
    try:
        data = _local(first).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError):  # a tensor subclass or layout with no plain bytes
        return
    _trace["forward_inputs"].append(hashlib.blake2b(data, digest_size=8).hexdigest())


def _any_forward_pre(module, inputs):
    """Every module's forward: the first training forward of a top-level model an optimizer
    trains, when no DDP model holds its parameters yet."""
    _state["depth"] = _state.get("depth", 0) + 1
    if _state["depth"] == 1:
        _note_input(module, inputs)
    if _state["depth"] != 1 or isinstance(module, DistributedDataParallel) or not module.training:
        return
    if id(module) in _state["seen_modules"] or not torch.is_grad_enabled():
        return
    _state["seen_modules"].add(id(module))
    params = {id(p) for p in module.parameters() if p.requires_grad}
    trained = params & _state["optimizer_params"]
    if not trained:
        _state["seen_modules"].discard(id(module))  # no optimizer trains it (yet)
    elif not trained <= _state["ddp_params"]:
        _remember_trained(module)
        if _trace["cuda_available"] is None:
            _trace["cuda_available"] = torch.cuda.is_available()
        outside = trained - _state["ddp_params"]
        optimizers = [i for i, opt in enumerate(_optimizers) if any(id(p) in outside for p in _optimizer_params(opt))]
        _trace["unwrapped_forwards"].append(
            dict(module=type(module).__name__, where=_user_frame(), event=_event(), optimizers=optimizers,
                 device=_device_of(module.parameters()), batch_device=_device_of(_tensors(inputs)))
        )  # fmt: skip


@torch.compiler.disable
def _remember_trained(module) -> None:
    """Keep the model for what a later torch.save stores (outside a compiled forward's graph:
    dynamo must not track the module through the tracer's state)."""
    _TRAINED_MODELS.append(module)


def _tensors(inputs):
    """The tensors a forward was given: its arguments, and those in a list, tuple or dict among them."""
    for x in inputs:
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple, Mapping)):
            yield from (v for v in (x.values() if isinstance(x, Mapping) else x) if isinstance(v, torch.Tensor))


def _device_of(tensors) -> str | None:
    """The device the tensors are on ("cpu", "cuda:0"; several joined by "+"), None for none."""
    devices = sorted({str(t.device) for t in tensors})
    return "+".join(devices) if devices else None


def _any_forward(module, inputs, output):
    _state["depth"] = max(_state.get("depth", 1) - 1, 0)


def _backward(original):
    def backward(self, *args, **kwargs):
        _state["reduced_since_backward"] = 0  # what is all-reduced from here on averages these gradients
        if self.numel() == 1 and self.requires_grad and _state.get("active"):
            try:
                _trace["losses"].append(float(self.detach().float().item()))
            except RuntimeError:
                pass
            _state["backward_in_no_sync"] = bool(_state["in_no_sync"] or _state.get("fsdp_no_sync"))
        return original(self, *args, **kwargs)

    return backward


# --- mp.spawn: trace the processes a script starts itself ---------------------------------------


def _start_processes(original):
    def start_processes(fn, args=(), nprocs=1, *rest, **kwargs):
        _trace["spawned"] += nprocs
        child = functools.partial(_spawned_entry, fn, _trace["label"], _trace["script"], _trace["argv"], _state["config"])
        return original(child, args, nprocs, *rest, **kwargs)

    return start_processes


def _spawned_entry(fn, label, script, argv, config, index, *args):
    """What a child of mp.spawn runs (pickled by reference to this module): fn, traced as rank `index`."""
    install_hooks()
    _traced(label, script, argv, lambda: fn(index, *args), rank=index, reraise=True, config=config)


_installed = False


# --- what the script sets: environment variables, seeds (facts for `convert --run`) -----------


def _script_call() -> str | None:
    """`file:line` of the script's line that called the wrapper calling this, when the script
    itself made the call: not torch on its way (torch.manual_seed seeds CUDA too; inductor sets
    its cache folder), nor a library the script imports (cv2 sets LD_LIBRARY_PATH)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in _PASSED_THROUGH:
        frame = frame.f_back  # `os.environ.setdefault`, `random.seed` reach the wrapper through these
    if frame is None:
        return None
    name = frame.f_code.co_filename
    if name != _HERE and name.startswith(_state.get("roots") or ()) and "site-packages" not in name:
        return f"{os.path.relpath(name)}:{frame.f_lineno}"
    return None


_PASSED_THROUGH = {os.path.join(os.path.dirname(os.__file__), name) for name in ("os.py", "_collections_abc.py", "random.py")}


def _environ_setitem(original):
    def __setitem__(self, key, value):
        if _state.get("active") and self is os.environ:
            where = _script_call()
            if where:
                _trace["env_set"].append(dict(name=str(key), value=str(value)[:200], where=where))
        return original(self, key, value)

    return __setitem__


def _seed(kind):
    def wrapper(original):
        def seed(*args, **kwargs):
            if _state.get("active"):
                where = _script_call()
                if where:
                    value = args[0] if args else kwargs.get("seed")
                    _trace["seeds"].append(dict(kind=kind, value=repr(value)[:80], where=where))
            return original(*args, **kwargs)

        return seed

    return wrapper


def _install_seed_hooks() -> None:
    _wrap(type(os.environ), "__setitem__", _environ_setitem)
    _wrap(torch, "manual_seed", _seed("torch"))
    torch.random.manual_seed = torch.manual_seed
    for name in ("manual_seed", "manual_seed_all"):
        _wrap(torch.cuda, name, _seed("torch.cuda"))
    _wrap(random, "seed", _seed("random"))
    try:
        import numpy
    except ImportError:
        return
    _wrap(numpy.random, "seed", _seed("numpy"))


def install_hooks() -> None:
    global _installed
    if _installed:  # a forked child inherits its parent's hooks
        return
    _installed = True
    _wrap(DataLoader, "__init__", _loader_init)
    _wrap(dataloader_module._BaseDataLoaderIter, "__init__", _iter_init)
    _wrap(dataloader_module._BaseDataLoaderIter, "_next_index", _next_index)
    _wrap(dataloader_module._BaseDataLoaderIter, "__next__", _next)
    _wrap(dataloader_module._SingleProcessDataLoaderIter, "_next_data", _next_data)
    _wrap(DistributedSampler, "__init__", _distributed_sampler_init)
    _wrap(torch, "save", _save)
    _wrap(torch, "load", _load)
    torch.serialization.save, torch.serialization.load = torch.save, torch.load  # `from torch.serialization import save`
    _wrap(builtins, "open", _open)
    io.open = builtins.open
    _wrap(torch.Tensor, "backward", _backward)
    _wrap(torch.optim.Optimizer, "__init__", _optimizer_init)
    _wrap(dist, "init_process_group", _init_process_group)
    _wrap(dist, "destroy_process_group", _destroy_process_group)
    for name in COLLECTIVES:
        if hasattr(dist, name):
            _wrap(dist, name, _collective)
    _wrap(DistributedDataParallel, "__init__", _ddp_init)
    _wrap(DistributedDataParallel, "no_sync", _no_sync)
    _install_fsdp2_hooks()
    _install_seed_hooks()
    for name in ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"):
        if hasattr(F, name):
            _wrap(F, name, _dropout)
    _wrap(F, "batch_norm", _batch_norm)
    for name in ("cross_entropy", "nll_loss"):
        _wrap(F, name, _masked_mean)
    import torch.utils.data as data_module
    import torch.utils.data.dataset as dataset_module

    _wrap(dataset_module, "random_split", _random_split)
    data_module.random_split = dataset_module.random_split
    register_optimizer_step_post_hook(_after_step)
    register_module_forward_pre_hook(_any_forward_pre)
    register_module_forward_hook(_any_forward, always_call=True)
    import torch.multiprocessing as mp

    spawn_module = sys.modules["torch.multiprocessing.spawn"]  # the name `spawn` is the function there
    _wrap(spawn_module, "start_processes", _start_processes)  # mp.spawn calls it from this module
    mp.start_processes = spawn_module.start_processes


# --- running ----------------------------------------------------------------------------------


def run_one(script: str, args: list[str], label: str | None = None, env: dict | None = None, cwd: str | None = None,
            config: dict | None = None) -> int:  # fmt: skip
    """Run one script in this process and write its trace; return its exit status."""
    folder = os.path.dirname(os.path.abspath(script))

    def body():
        sys.argv = [script, *args]
        sys.path[0] = folder  # as `python SCRIPT` would have it
        extra = [p for p in (env or {}).get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = extra  # a project's root, as `PYTHONPATH=ROOT python SCRIPT` would have it
        runpy.run_path(script, run_name="__main__")

    try:
        return _traced(label, script, args, body, env=env, cwd=cwd, config=config)
    finally:
        _forget_modules(folder, cwd)


def _forget_modules(*folders) -> None:
    """Drop the modules a run imported from its folders: the next run of a plan imports its own."""
    roots = tuple(os.path.abspath(f) + os.sep for f in folders if f)
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if path.startswith(roots) and path != _HERE:
            del sys.modules[name]


def _traced(label, script, args, body, env=None, cwd=None, rank=None, reraise=False, config=None) -> int:
    """Run body() with a fresh trace, write the trace and parameters; return its exit status.

    rank: the tag's rank (a child of mp.spawn), else RANK from the environment. reraise: raise
    the body's exception after writing the trace (mp.spawn reports it to the parent).
    """
    config = dict(config or {})
    _new_trace(label, script, args, config)
    if rank is not None:
        _trace["env_rank"] = rank
    out_dir = os.environ.get("DDPIFY_TRACE_DIR", os.getcwd())
    tag = _tag(label, _trace["env_rank"])
    with _original_open(os.path.join(out_dir, f"pid-{tag}"), "w") as fh:
        fh.write(str(os.getpid()))
    stacks = _watch(config.get("timeout"), os.path.join(out_dir, f"stacks-{tag}.txt"))
    reference = config.get("reference") or {}
    if reference:
        _state["train_loader"] = _train_loader_of(_done.get(reference.get("train_loader_from")))
        seed = int(reference.get("seed", 0))
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            import numpy

            numpy.random.seed(seed)
        except ImportError:
            pass
    saved_argv, saved_env, saved_cwd, saved_stdout = sys.argv, dict(os.environ), os.getcwd(), sys.stdout
    sys.stdout = tee = _Tee(sys.stdout)
    os.environ.update(env or {})
    if cwd:
        os.makedirs(cwd, exist_ok=True)
        os.chdir(cwd)
    _trace["cwd"] = os.getcwd()
    _state["roots"] = tuple(
        os.path.abspath(p) + os.sep
        for p in {os.getcwd(), os.path.dirname(os.path.abspath(script)), *filter(None, [config.get("root")])}
    )
    code, failure = 0, None
    try:
        body()
    except StopRun:
        pass
    except (StopIteration, RuntimeError) as exc:
        if not _ended_by_us(exc):
            traceback.print_exc()
            _trace["error"] = traceback.format_exc()
            code, failure = 1, exc
        else:  # `while i < len(loader): next(it)`: the pass this run cut short ended the script's loop
            _trace["stopped"] = _trace.get("stopped") or "after a training pass cut short (the script asked for more batches)"
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            _trace["error"] = f"SystemExit({exc.code!r})"
            failure = exc
    except BaseException as exc:  # noqa: BLE001 - reported in the trace and on stderr, status 1
        traceback.print_exc()
        _trace["error"] = traceback.format_exc()
        code, failure = 1, exc
    finally:
        tee.close_line()
        sys.stdout = saved_stdout
        _trace["stdout"] = "".join(tee.parts)
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        sys.stdout.flush()
        sys.stderr.flush()
        if stacks is not None:
            faulthandler.cancel_dump_traceback_later()

    _trace["exit_code"] = code
    _trace["dist_initialized_at_exit"] = dist.is_initialized()
    if code == 0:
        _gather_final()  # a run cut short (StopRun) has its group up still
    if dist.is_initialized():
        dist.destroy_process_group()  # cut short before the script's teardown, or left up: the next run makes its own
    params = _state.get("final_params") or [
        [_local(p).detach().cpu().clone() for p in _optimizer_params(opt)] for opt in _optimizers
    ]
    _trace["final_checksums"] = [params_checksum(group) for group in params]
    _trace["ddp_final"] = _state.get("final_ddp") or [
        params_checksum(_local(p) for p in model.parameters()) for model in _ddp_models
    ]
    _trace["uncovered"] = _uncovered()
    _unwritten_appends()
    if config.get("compare_params"):
        _trace["reference_diff"] = _compare(params, config["compare_params"])
    tag = _tag(label, "launcher" if _trace["spawned"] else _trace["env_rank"])  # mp.spawn's children wrote the ranks'
    _original_save(params, os.path.join(out_dir, f"params-{tag}.pt"))
    with _original_open(os.path.join(out_dir, f"trace-{tag}.json"), "w") as fh:
        json.dump(_trace, fh)
    if label:
        _done[label] = json.loads(json.dumps(_trace))
    _optimizers.clear()
    _ddp_models.clear()
    _state["active"] = False
    if reraise and failure is not None:
        raise failure
    return code


def _ended_by_us(exc: BaseException) -> bool:
    """Is this the StopIteration the run raised to cut a training pass short, escaping a script
    that counts its batches (`while i < len(loader): next(it)`), or a generator's wrapping of it?"""
    ended = _state.get("ended_pass")
    if ended is None:
        return False
    if isinstance(exc, RuntimeError):
        exc = exc.__cause__ if "StopIteration" in str(exc) else None
    return isinstance(exc, StopIteration)


def _local(p):
    """This rank's own part of a parameter (a failed FSDP2 run cannot gather the whole)."""
    return p.to_local() if DTensor is not None and isinstance(p, DTensor) else p


def _tag(label, rank) -> str:
    return f"{label}-{rank}" if label else str(rank)


def _watch(timeout, path):
    """After `timeout` seconds, or on SIGTERM (torchrun stopping a rank, or ddpify verify), write
    every thread's stack to `path`; at the timeout the process then exits."""
    if not timeout:
        return None
    fh = _original_open(path, "w")
    faulthandler.dump_traceback_later(float(timeout), exit=True, file=fh)
    if hasattr(signal, "SIGTERM") and hasattr(faulthandler, "register"):
        faulthandler.register(signal.SIGTERM, file=fh, all_threads=True, chain=True)
    return fh


def _train_loader_of(trace: dict | None) -> int | None:
    """The loader (creation index) whose passes the optimizer steps happened in."""
    if not trace:
        return None
    counts: dict = {}
    for p in trace["passes"]:
        if p["steps"] and p["loader"] is not None:
            counts[p["loader"]] = counts.get(p["loader"], 0) + p["steps"]
    return max(counts, key=counts.get) if counts else None


def _uncovered() -> list[dict]:
    """Optimizers whose trained parameters no DDP model holds (the run had a process group)."""
    found = []
    for i, optimizer in enumerate(_optimizers):
        params = [p for p in _optimizer_params(optimizer) if p.requires_grad]
        missing = [p for p in params if id(p) not in _state["ddp_params"]]
        if missing and params:
            found.append(dict(optimizer=i, missing=len(missing), of=len(params)))
    return found


def _compare(params: list, path: str) -> dict:
    """How far these parameters are from those in `path` (a params file of an earlier run)."""
    try:
        other = _original_load(path)
    except (OSError, RuntimeError) as exc:
        return dict(error=f"cannot read {path}: {exc}")
    if [len(g) for g in params] != [len(g) for g in other]:
        return dict(error=f"{[len(g) for g in params]} vs {[len(g) for g in other]} parameters per optimizer")
    worst, where, close = 0.0, None, True
    for i, (mine, theirs) in enumerate(zip(params, other)):
        for j, (a, b) in enumerate(zip(mine, theirs)):
            if a.shape != b.shape:
                return dict(error=f"optimizer {i} parameter {j}: shape {list(a.shape)} vs {list(b.shape)}")
            if not a.numel():
                continue
            diff = (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max().item()
            close = close and torch.allclose(a.double(), b.double(), rtol=1e-3, atol=1e-4)
            if diff > worst or where is None:
                worst, where = max(diff, worst), f"optimizer {i} parameter {j} (shape {list(a.shape)})"
    return dict(max_abs=worst, where=where, allclose=close)


def fresh_rendezvous(run_index: int) -> dict:
    """Under torchrun: environment that gives one plan run a store of its own (see the docstring)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return {}
    addr, agent_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = dist.TCPStore(addr, agent_port, is_master=False, timeout=timedelta(seconds=120))
    # the agent's store outlives a restart (--max-restarts): each attempt publishes its own port
    key = f"ddpify_trace_run/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{run_index}/master_port"
    if int(os.environ["RANK"]) == 0:
        with socket.socket() as probe:
            probe.bind((addr, 0))
            agent_store.set(key, str(probe.getsockname()[1]))
    port = agent_store.get(key).decode()
    return {"MASTER_PORT": port, "TORCHELASTIC_USE_AGENT_STORE": "False"}


def _saved_checkpoint(label: str) -> str | None:
    """The file of the last state_dict rank 0 saved in the run `label` of this plan, if it ran
    to its end (read from its trace file, so every rank finds the same)."""
    path = os.path.join(os.environ.get("DDPIFY_TRACE_DIR", os.getcwd()), f"trace-{label}-0.json")
    try:
        with _original_open(path) as fh:
            trace = json.load(fh)
    except (OSError, ValueError):
        return None
    saved = [s["file"] for s in trace.get("saves", []) if s.get("keys") and s.get("file")]
    return saved[-1] if trace.get("exit_code") == 0 and saved and os.path.exists(saved[-1]) else None


CONFIG_KEYS = ("limit", "reference", "compare_params", "timeout", "root")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    install_hooks()
    keep_going = "--keep-going" in argv
    argv = [a for a in argv if a != "--keep-going"]
    if argv[0] == "--plan":
        with _original_open(argv[1]) as fh:
            plan = json.load(fh)
        status = 0
        for index, run in enumerate(plan):
            ok = {label: trace.get("exit_code") == 0 for label, trace in _done.items()}
            if run.get("only_if_failed") and ok.get(run["only_if_failed"], False):
                continue
            if run.get("only_if_ok") and not ok.get(run["only_if_ok"], False):
                continue
            env = {**run.get("env", {}), **fresh_rendezvous(index)}  # rank 0 has finished the runs before
            config = {k: run[k] for k in CONFIG_KEYS if k in run}
            args = run.get("args", [])
            if run.get("resume"):
                config["checkpoint"] = _saved_checkpoint(run["resume"]["after"])
                if config["checkpoint"] is None:
                    continue  # every rank reads the same trace: every rank skips
                args = [*args, *(a.replace("{checkpoint}", config["checkpoint"]) for a in run["resume"].get("args", []))]
            code = run_one(run["script"], args, run["label"], env, run.get("cwd"), config)
            status = status or code
            if code and not keep_going:
                return code
        return status
    return run_one(argv[0], argv[1:])


if __name__ == "__main__":
    # Run as the module `tracer`, not `__main__`: the children of mp.spawn unpickle
    # _spawned_entry by reference, and their `__main__` is the training script.
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
    import tracer

    sys.exit(tracer.main(sys.argv[1:]))
