"""Run a training script unchanged and record what it did, for the integration tests.

    python tests/harness/trace_run.py SCRIPT [ARGS...]
    torchrun --standalone --nproc-per-node=2 tests/harness/trace_run.py SCRIPT [ARGS...]
    torchrun ... tests/harness/trace_run.py --plan PLAN.json

The script is executed with ``runpy.run_path(SCRIPT, run_name="__main__")`` and ``sys.argv``
set as if it had been started directly. Nothing in the script is edited and torch.distributed
is real; the runner only wraps a few torch entry points to take notes, always calling the
original:

* ``DataLoader.__init__``: every loader gets an id (creation order) and its dataset length,
  sampler class, batch size and drop_last are noted.
* ``_BaseDataLoaderIter.__init__`` / ``_next_index``: every ``iter(loader)`` starts a *pass*;
  each index (or batch of indices) the loader's sampler hands out in this process is appended
  to it (None for what is not an int: an IterableDataset's sampler yields None). The hook sits
  in the main process, so it sees the indices with worker processes too.
  A pass is ``complete`` once its sampler is exhausted.
* ``torch.save``: the path, and the keys / shapes of the state_dict saved (a mapping of tensors,
  or the first such mapping nested one level down, e.g. ``{"model": sd, "epoch": 3}``).
* ``torch.optim.Optimizer.__init__``: every optimizer; their parameters at the end of the run
  are written to ``params-<tag>.pt`` as ``[[tensor, ...] per optimizer]``.
* a global optimizer step post-hook: after every ``optimizer.step()`` a checksum of that
  optimizer's parameters (blake2b of their bytes, in ``param_groups`` order) is appended to
  ``optimizer_steps[<optimizer index>]``. DDP keeps every rank's parameters bitwise identical
  after each step, so comparing these lists across ranks names the first step at which they
  part (tests/conftest.py ``assert_replicas_identical``).
* ``torch.multiprocessing.spawn`` / ``start_processes``: a script that starts its own processes
  (``mp.spawn(fn, ...)``) has every child traced too: child ``i`` writes the files of rank ``i``
  and the launching process writes its own as rank ``launcher``.
* ``torch.distributed.init_process_group`` / ``destroy_process_group`` and the
  ``DistributedDataParallel`` constructor: calls, backend, world size and rank; a forward
  pre-hook on every DDP model notes the integer first input (token ids) of each training
  forward, as ``trained_tokens`` (one flat list per forward), and a checksum of the model's
  parameters before each training forward, as ``ddp_forwards[<DDP model index>]`` (and at the end
  of the run, ``ddp_final``): the replica check for scripts that update parameters by hand.
* ``sys.stdout``: what this process printed during the run (still written through).

Output, in ``$DDPIFY_TRACE_DIR`` (default: the working directory), with ``<tag>`` = ``<RANK>``
(``RANK`` from torchrun's environment, 0 without it) or ``<label>-<RANK>`` for a plan:
``trace-<tag>.json`` and ``params-<tag>.pt``. They are written even when the script fails;
the runner then exits with the script's status.

A plan (a JSON list of ``{"label", "script", "args", "env", "cwd"}``) runs several scripts one
after the other in the same processes, to pay for torchrun's start-up once. ``env`` and ``cwd``
apply to that run only. A failing run stops the plan. Under torchrun every run of a plan gets
its own rendezvous store: ``destroy_process_group`` resets torch's group counter, so a second
``init_process_group`` on torchrun's store would reuse the first run's keys and can hang. Rank 0
picks a free port, publishes it in torchrun's store, and each run sees ``MASTER_PORT`` = that
port with ``TORCHELASTIC_USE_AGENT_STORE=False`` (rank 0 hosts the run's store, as with
``torch.distributed.launch``). The rendezvous itself stays real.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import runpy
import socket
import sys
import traceback
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.utils.data.dataloader as dataloader_module
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader

_original_save = torch.save
_trace: dict = {}
_optimizers: list = []
_ddp_models: list = []


def _new_trace(label: str | None, script: str, args: list[str]) -> None:
    _optimizers.clear()
    _ddp_models.clear()
    _trace.clear()
    _trace.update(
        label=label,
        script=script,
        argv=args,
        env_rank=int(os.environ.get("RANK", 0)),
        env_world_size=int(os.environ.get("WORLD_SIZE", 1)),
        init_process_group=[],
        destroy_process_group=0,
        ddp_wrapped=0,
        ddp_forwards=[],
        ddp_final=[],
        trained_tokens=[],
        loaders=[],
        passes=[],
        saves=[],
        optimizers=0,
        optimizer_steps=[],
        spawned=0,
        dist_initialized_at_exit=None,
        exit_code=None,
        error=None,
        stdout="",
    )


class _Tee:
    """sys.stdout for the run: writes through and keeps a copy for the trace."""

    def __init__(self, stream):
        self._stream, self.parts = stream, []

    def write(self, text):
        self.parts.append(text)
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _wrap(owner, name, make_wrapper):
    original = getattr(owner, name)
    setattr(owner, name, make_wrapper(original))


# --- DataLoader: loaders, passes and the indices of each pass --------------------------------


def _loader_init(original):
    def __init__(self, *args, **kwargs):
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
            )
        )

    return __init__


def _iter_init(original):
    def __init__(self, loader, *args, **kwargs):
        self._ddpify_pass = dict(loader=getattr(loader, "_ddpify_trace_id", None), indices=[], complete=False)
        _trace["passes"].append(self._ddpify_pass)
        original(self, loader, *args, **kwargs)

    return __init__


def _as_index(i):
    """An int, or None for what is not one (an IterableDataset's sampler yields None)."""
    try:
        return int(i)
    except (TypeError, ValueError):
        return None


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
            if isinstance(index, (list, tuple)):
                record["indices"].extend(_as_index(i) for i in index)
            else:
                record["indices"].append(_as_index(index))
        return index

    return _next_index


# --- torch.save -------------------------------------------------------------------------------


def _tensor_mapping(obj):
    if isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    if isinstance(obj, Mapping):
        for value in obj.values():
            if isinstance(value, Mapping) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
                return value
    return None


def _save(original):
    def save(obj, f, *args, **kwargs):
        state = _tensor_mapping(obj)
        _trace["saves"].append(
            dict(
                path=os.fspath(f) if isinstance(f, (str, os.PathLike)) else type(f).__name__,
                obj_type=type(obj).__name__,
                keys=list(state) if state is not None else None,
                shapes={k: list(v.shape) for k, v in state.items()} if state is not None else None,
                module_prefix=any(str(k).startswith("module.") for k in state) if state is not None else None,
            )
        )
        return original(obj, f, *args, **kwargs)

    return save


# --- optimizers and torch.distributed -----------------------------------------------------


def _optimizer_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._ddpify_trace_index = len(_optimizers)
        _optimizers.append(self)
        _trace["optimizers"] += 1
        _trace["optimizer_steps"].append([])

    return __init__


def _optimizer_params(optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def params_checksum(params) -> str:
    """blake2b of the parameters' bytes: equal on two ranks iff their parameters are bitwise equal."""
    digest = hashlib.blake2b(digest_size=8)
    for p in params:
        t = p.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous().reshape(-1)
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _after_step(optimizer, args, kwargs):
    """Global optimizer step post-hook: the checksum of this optimizer's parameters after the step."""
    index = getattr(optimizer, "_ddpify_trace_index", None)
    if index is None or index >= len(_optimizers) or _optimizers[index] is not optimizer:
        return  # an optimizer of an earlier run of the plan
    _trace["optimizer_steps"][index].append(params_checksum(_optimizer_params(optimizer)))


def _init_process_group(original):
    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        _trace["init_process_group"].append(
            dict(backend=str(dist.get_backend()), world_size=dist.get_world_size(), rank=dist.get_rank())
        )
        return result

    return init_process_group


def _destroy_process_group(original):
    def destroy_process_group(*args, **kwargs):
        _trace["destroy_process_group"] += 1
        return original(*args, **kwargs)

    return destroy_process_group


def _ddp_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _trace["ddp_wrapped"] += 1
        self._ddpify_trace_index = len(_ddp_models)
        _ddp_models.append(self)
        _trace["ddp_forwards"].append([])
        self.register_forward_pre_hook(_record_tokens)
        self.register_forward_pre_hook(_record_forward_params)

    return __init__


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


# --- mp.spawn: trace the processes a script starts itself ---------------------------------------


def _start_processes(original):
    def start_processes(fn, args=(), nprocs=1, *rest, **kwargs):
        _trace["spawned"] += nprocs
        child = functools.partial(_spawned_entry, fn, _trace["label"], _trace["script"], _trace["argv"])
        return original(child, args, nprocs, *rest, **kwargs)

    return start_processes


def _spawned_entry(fn, label, script, argv, index, *args):
    """What a child of mp.spawn runs (pickled by reference to this module): fn, traced as rank `index`."""
    install_hooks()
    _traced(label, script, argv, lambda: fn(index, *args), rank=index, reraise=True)


_installed = False


def install_hooks() -> None:
    global _installed
    if _installed:  # a forked child inherits its parent's hooks
        return
    _installed = True
    _wrap(DataLoader, "__init__", _loader_init)
    _wrap(dataloader_module._BaseDataLoaderIter, "__init__", _iter_init)
    _wrap(dataloader_module._BaseDataLoaderIter, "_next_index", _next_index)
    _wrap(torch, "save", _save)
    _wrap(torch.optim.Optimizer, "__init__", _optimizer_init)
    _wrap(dist, "init_process_group", _init_process_group)
    _wrap(dist, "destroy_process_group", _destroy_process_group)
    _wrap(DistributedDataParallel, "__init__", _ddp_init)
    register_optimizer_step_post_hook(_after_step)
    import torch.multiprocessing as mp

    spawn_module = sys.modules["torch.multiprocessing.spawn"]  # the name `spawn` is the function there
    _wrap(spawn_module, "start_processes", _start_processes)  # mp.spawn calls it from this module
    mp.start_processes = spawn_module.start_processes


# --- running ----------------------------------------------------------------------------------


def run_one(script: str, args: list[str], label: str | None = None, env: dict | None = None, cwd: str | None = None) -> int:
    """Run one script in this process and write its trace; return its exit status."""

    def body():
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would have it
        extra = [p for p in (env or {}).get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = extra  # a project's root, as `PYTHONPATH=ROOT python SCRIPT` would have it
        runpy.run_path(script, run_name="__main__")

    return _traced(label, script, args, body, env=env, cwd=cwd)


def _traced(label, script, args, body, env=None, cwd=None, rank=None, reraise=False) -> int:
    """Run body() with a fresh trace, write the trace and parameters; return its exit status.

    rank: the tag's rank (a child of mp.spawn), else RANK from the environment. reraise: raise
    the body's exception after writing the trace (mp.spawn reports it to the parent).
    """
    _new_trace(label, script, args)
    if rank is not None:
        _trace["env_rank"] = rank
    saved_argv, saved_env, saved_cwd, saved_stdout = sys.argv, dict(os.environ), os.getcwd(), sys.stdout
    sys.stdout = tee = _Tee(sys.stdout)
    os.environ.update(env or {})
    if cwd:
        os.makedirs(cwd, exist_ok=True)
        os.chdir(cwd)
    code, failure = 0, None
    try:
        body()
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
        sys.stdout = saved_stdout
        _trace["stdout"] = "".join(tee.parts)
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        sys.stdout.flush()
        sys.stderr.flush()

    _trace["exit_code"] = code
    _trace["dist_initialized_at_exit"] = dist.is_initialized()
    out_dir = os.environ.get("DDPIFY_TRACE_DIR", os.getcwd())
    rank = "launcher" if _trace["spawned"] else _trace["env_rank"]  # its children write the ranks' files
    tag = f"{label}-{rank}" if label else str(rank)
    params = [[p.detach().cpu().clone() for p in _optimizer_params(opt)] for opt in _optimizers]
    _trace["ddp_final"] = [params_checksum(model.parameters()) for model in _ddp_models]
    _original_save(params, os.path.join(out_dir, f"params-{tag}.pt"))
    with open(os.path.join(out_dir, f"trace-{tag}.json"), "w") as fh:
        json.dump(_trace, fh)
    _optimizers.clear()
    _ddp_models.clear()
    if reraise and failure is not None:
        raise failure
    return code


def fresh_rendezvous(run_index: int) -> dict:
    """Under torchrun: environment that gives one plan run a store of its own (see the docstring)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return {}
    addr, agent_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = dist.TCPStore(addr, agent_port, is_master=False, timeout=timedelta(seconds=120))
    key = f"ddpify_trace_run/{run_index}/master_port"
    if int(os.environ["RANK"]) == 0:
        with socket.socket() as probe:
            probe.bind((addr, 0))
            agent_store.set(key, str(probe.getsockname()[1]))
    port = agent_store.get(key).decode()
    return {"MASTER_PORT": port, "TORCHELASTIC_USE_AGENT_STORE": "False"}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    install_hooks()
    if argv[0] == "--plan":
        with open(argv[1]) as fh:
            plan = json.load(fh)
        for index, run in enumerate(plan):
            env = {**run.get("env", {}), **fresh_rendezvous(index)}
            code = run_one(run["script"], run.get("args", []), run["label"], env, run.get("cwd"))
            if code:
                return code
        return 0
    return run_one(argv[0], argv[1:])


if __name__ == "__main__":
    # Run as the module `trace_run`, not `__main__`: the children of mp.spawn unpickle
    # _spawned_entry by reference, and their `__main__` is the training script.
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
    import trace_run

    sys.exit(trace_run.main(sys.argv[1:]))
