"""What the run's mode, the callers and the constructors of a helper say about where its code runs.

Each case is a shape met in public DDP codebases, written in our own words: a flag that tells
whether an option exists, a rank compared with device names, a construction that hands a rank-0
test to a trainer, a helper only a one-process script calls. Each is checked both ways: the
shape that proves the rule's premise wrong is silent, the nearest shape where it holds is flagged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from check_projects import codes, write_files
from ddpify.check.rule import select_rules
from ddpify.check.runner import check_source


def _codes(source: str, code: str) -> list[str]:
    result = check_source(source, "train.py", select_rules(code))
    return [f"{f.line} {f.code}" for f in result.findings if f.code == code]


PRESENCE = """\
import torch.distributed as dist


def init(params):
    has_local_rank = {test}
    if has_local_rank and params.local_rank != -1:
        params.is_distributed = True
    else:
        params.is_distributed = False
    if params.is_distributed:
        dist.init_process_group(backend="gloo")
        group = dist.new_group([0, 1], backend="gloo")
        dist.destroy_process_group()
"""


@pytest.mark.parametrize("test, flagged", [('hasattr(params, "local_rank")', False), ("params.local_rank == 0", True)])
def test_a_flag_named_after_the_rank_that_holds_whether_an_option_exists_is_the_mode(test, flagged):
    """`has_local_rank = hasattr(params, "local_rank")` is the same on every rank, and so is
    `is_distributed` set in its `else`: the collective under `if params.is_distributed:` runs on
    every rank (DDP116 silent). Bound to `local_rank == 0`, the flag is rank 0's."""
    assert _codes(PRESENCE.format(test=test), "DDP116") == (["12 DDP116"] if flagged else [])


SENTINEL = """\
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    if rank {test}:
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2,), nprocs=2)
"""


@pytest.mark.parametrize("test, flagged", [('not in ("cpu", "cuda")', False), ("== 0", True)])
def test_a_rank_compared_with_device_names_is_the_mode(test, flagged):
    """`rank` is "cpu"/"cuda" in a one-process run and a number in a spawned worker: `if rank not
    in ("cpu", "cuda"):` is the same on every worker, not a rank test (DDP116 silent)."""
    assert _codes(SENTINEL.format(test=test), "DDP116") == (["8 DDP116"] if flagged else [])


TRAINER = """\
import torch
import torch.distributed as dist


class Trainer:
    def __init__(self, model, verbose=False):
        self.model = model
        self.verbose = verbose

    def fit(self, loader):
        for x in loader:
            loss = self.model(x).sum()
            loss.backward()
            if self.verbose:
                print(f"loss {loss.item()} over {dist.get_world_size()} ranks")
"""

TRAIN = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer import Trainer


def setup():
    dist.init_process_group("gloo")
    return "cpu", dist.get_rank() == 0


def main():
    device, is_logger = setup()
    model = DDP(torch.nn.Linear(2, 1))
    Trainer(model, verbose={verbose}).fit([torch.ones(2)])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("verbose, flagged", [("True and is_logger", False), ("True", True)])
def test_a_constructor_argument_that_is_a_rank0_test_guards_the_trainers_prints(tmp_path: Path, verbose, flagged):
    """`Trainer(model, verbose=... and is_logger)` where `is_logger` is the rank-0 test a setup
    helper returns: `if self.verbose:` in the trainer is rank 0's (DDP302 silent); `verbose=True`
    prints on every rank."""
    write_files(tmp_path, {"trainer.py": TRAINER, "train.py": TRAIN.format(verbose=verbose)})
    assert codes(tmp_path / "trainer.py", "DDP302") == (["15 DDP302"] if flagged else [])


VALIDATION = """\
import torch
import torch.distributed as dist
from tqdm import tqdm


def validation(model, loader):
    return [model(x) for x in tqdm(loader)]


def validation_ddp(model, loader, rank):
    return [model(x) for x in (tqdm(loader) if rank == 0 else loader)]
"""

ONE_GPU = """\
import torch
import torch.multiprocessing

from validation import validation

if __name__ == "__main__":
    torch.multiprocessing.set_start_method("spawn")
    print(validation(torch.nn.Linear(2, 1), [torch.ones(2)]))
"""

DDP_SCRIPT = """\
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from validation import {imported}


def worker(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    validation(torch.nn.Linear(2, 1), [torch.ones(2)]{extra})
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2,), nprocs=2)
"""


@pytest.mark.parametrize(
    "imported, extra, flagged",
    [("validation_ddp as validation", ", rank", False), ("validation", "", True)],
)
def test_a_function_imported_under_another_name_is_that_function(tmp_path: Path, imported, extra, flagged):
    """`from validation import validation_ddp as validation`: the DDP script calls
    `validation_ddp`; `validation` is called only by the one-GPU script (whose
    `set_start_method("spawn")` starts data workers, not ranks), so its bar is one process's
    (DDP304 silent). Imported by its own name, it draws on every rank."""
    write_files(tmp_path, {
        "validation.py": VALIDATION, "train.py": ONE_GPU,
        "train_ddp.py": DDP_SCRIPT.format(imported=imported, extra=extra),
    })  # fmt: skip
    assert codes(tmp_path / "validation.py", "DDP304") == (["7 DDP304"] if flagged else [])


MODES = """\
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def predict(model):
    device = torch.device("cuda")
    return model.to(device)


def evaluate(model):
    print("evaluating", model)


def train(rank, world_size):
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    if world_size {test}:
        evaluate(torch.nn.Linear(2, 1))
    dist.destroy_process_group()


def main(mode, world_size):
    if mode == "train":
        mp.spawn(train, args=(world_size,), nprocs=world_size)
    elif mode == "predict":
        predict(torch.nn.Linear(2, 1))


if __name__ == "__main__":
    main("train", 2)
"""


def test_code_of_the_other_run_modes_runs_in_one_process():
    """`predict` runs in the launcher (instead of `mp.spawn`): its `cuda` is the one process's GPU
    (DDP108 silent); `evaluate`, called under `if world_size < 2:`, runs in a one-process run only
    (DDP302 silent), and on every rank under `if world_size > 0:`."""
    assert _codes(MODES.format(test="< 2"), "DDP108") == []
    assert _codes(MODES.format(test="< 2"), "DDP302") == []
    assert _codes(MODES.format(test="> 0"), "DDP302") == ["12 DDP302"]


WRAP_AFTER_LOAD = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, model, path):
        self.model = model
        self.path = path
        {first}
        {second}

    def load_checkpoint(self):
        self.model.load_state_dict(torch.load(self.path, map_location="cpu")["model"])

    def setup_ddp(self):
        dist.init_process_group("gloo")
        self.model = DDP(self.model)
"""


@pytest.mark.parametrize("first, second, flagged", [
    ("self.load_checkpoint()", "self.setup_ddp()", False),
    ("self.setup_ddp()", "self.load_checkpoint()", True),
])  # fmt: skip
def test_a_method_the_constructor_calls_before_the_wrap_loads_into_the_plain_model(first, second, flagged):
    """The constructor calls `load_checkpoint()` before `setup_ddp()` wraps the model: the load
    goes into the plain model (DDP121 silent); called after the wrap, it loads into the wrapper."""
    source = WRAP_AFTER_LOAD.format(first=first, second=second)
    assert _codes(source, "DDP121") == (["14 DDP121"] if flagged else [])


CLEARED_FIELD = """\
import torch.distributed as dist


class Agent:
    def __init__(self, config):
        dist.init_process_group("gloo")
        if dist.get_rank() {op} 0:
            config["schedule"] = None
        self.linear = config["schedule"] == "linear"
        if self.linear:
            print("linear schedule")
        dist.destroy_process_group()
"""


@pytest.mark.parametrize("op, flagged", [("!=", False), ("==", True)])
def test_a_field_cleared_off_rank0_compared_with_a_value_is_rank0s(op, flagged):
    """`config["schedule"] = None` on every rank but 0: `config["schedule"] == "linear"` can
    only be true on rank 0 (DDP302 silent). Cleared on rank 0, the other ranks print."""
    assert _codes(CLEARED_FIELD.format(op=op), "DDP302") == (["11 DDP302"] if flagged else [])


SPAWNED_OR_CALLED = """\
import torch.distributed as dist
import torch.multiprocessing as mp


def main_worker(gpu, args):
    if args.distributed:
        dist.init_process_group("gloo", rank=gpu, world_size=2)
    print("worker", gpu)


def main(args):
    if args.distributed:
        mp.spawn(main_worker, nprocs=2, args=(args,))
    else:
        main_worker(0, args)


if __name__ == "__main__":
    main(parse_args())
"""


def test_a_worker_handed_to_spawn_runs_on_every_rank_though_its_one_call_is_one_processs():
    """`main_worker` is called directly only in the one-process `else:`, but it is also handed
    to `mp.spawn`: it runs in every worker (DDP105 speaks: the group is never destroyed)."""
    assert _codes(SPAWNED_OR_CALLED, "DDP105") == ["7 DDP105"]


SELF_TEST = """\
import torch
import torch.distributed as dist


def shard(items):
    return items[dist.get_rank()::dist.get_world_size()]


def main():
    {start}
    print(len(shard(list(range(10)))))


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("start, flagged", [("pass", False), ('dist.init_process_group("gloo")', True)])
def test_a_modules_self_test_that_starts_no_group_runs_as_one_process(start, flagged):
    """A module's own `__main__` block that starts no process group is run by hand, as one
    process (DDP302 silent); one whose `main()` starts the group runs on every rank."""
    assert _codes(SELF_TEST.format(start=start), "DDP302") == (["11 DDP302"] if flagged else [])


DRIVER = """\
import torch.distributed as dist


def clip(grads, verbose=False):
    total = sum(g.norm() for g in grads)
    dist.all_reduce(total)
    if verbose:
        print("grad norm", total)
    return total


class Driver:
    def __init__(self, params):
        self.log_to_screen = params["log_to_screen"] if "log_to_screen" in params else False

    def fit(self, grads):
        for epoch in range(2):
            clip(grads)
            clip(grads, verbose=self.log_to_screen)
            if self.log_to_screen:
                print("epoch", epoch)
"""

LAUNCHER = """\
import torch.distributed as dist

from driver import Driver

if __name__ == "__main__":
    dist.init_process_group("gloo")
    params = {{"log_to_screen": True}}
    params["log_to_screen"] = {value}
    Driver(params).fit([])
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("value, flagged", [('(dist.get_rank() == 0) and params["log_to_screen"]', False), ("True", True)])
def test_a_field_the_launcher_sets_to_a_rank0_test_guards_the_library(tmp_path: Path, value, flagged):
    """The launcher sets `params["log_to_screen"]` to a rank-0 test; the driver module it imports
    reads `self.log_to_screen`, and hands it to a helper whose other callers leave `verbose`
    False: both prints are rank 0's (DDP302 silent). Set to True, both print on every rank."""
    write_files(tmp_path, {"driver.py": DRIVER, "train.py": LAUNCHER.format(value=value)})
    assert codes(tmp_path / "driver.py", "DDP302") == (["8 DDP302", "21 DDP302"] if flagged else [])


ABSL_LAUNCHER = """\
import torch.distributed as dist
import torch.multiprocessing as mp
from absl import app


def report(results):
    print("results", results)


def worker(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    if rank == 0:
        report(rank)
    dist.destroy_process_group()


def one_gpu():
    report(0)


def main(argv):
    if len(argv) > 1:
        mp.spawn(worker, args=(2,), nprocs=2)
    else:
        {call}


if __name__ == "__main__":
    app.run(main)
"""


@pytest.mark.parametrize("call, flagged", [("one_gpu()", False), ("mp.spawn(one_gpu, nprocs=2)", True)])
def test_a_helper_called_on_rank0_or_by_the_launchers_entry_runs_once(call, flagged):
    """`report` is called on rank 0 in the workers and by `one_gpu()`, which only `main` calls,
    and `main` is handed to `app.run` at the top level: the launcher's one process (DDP302
    silent). Spawned as workers, `one_gpu` reports on every rank."""
    assert _codes(ABSL_LAUNCHER.format(call=call), "DDP302") == (["7 DDP302"] if flagged else [])


PICKED = """\
import torch.distributed as dist
from tqdm import tqdm


def validate(loader):
    return [x for x in tqdm(loader)]


def validate_sphere(loader):
    return [x for x in tqdm(loader)]


def main(world_size, sphere):
    dist.init_process_group("gloo")
    validate_fn = {picked}
    for epoch in range(2):
        validate_fn([1, 2])
    if world_size < 2:
        validate_sphere([1, 2])
    dist.destroy_process_group()


if __name__ == "__main__":
    main(2, True)
"""


@pytest.mark.parametrize("picked, flagged", [("validate_sphere if sphere else validate", True), ("validate", False)])
def test_a_function_picked_as_a_value_runs_where_the_value_is_called(picked, flagged):
    """`validate_sphere`'s one direct call is one process's (`if world_size < 2:`), but when the
    training loop calls it through `validate_fn`, it runs on every rank (DDP304 speaks)."""
    assert _codes(PICKED.format(picked=picked), "DDP304") == (["6 DDP304", "10 DDP304"] if flagged else ["6 DDP304"])


TRAINER_METHOD = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, model, rank):
        self.model = model
        self.rank = rank

    def show(self):
        for name, p in self.model.named_parameters():
            print(name, p.shape)

    def step(self, x):
        self.model(x).sum().backward()
{call}

def main():
    dist.init_process_group("gloo")
    trainer = Trainer(DDP(torch.nn.Linear(2, 2)), dist.get_rank())
    for _ in range(3):
        trainer.step(torch.randn(4, 2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize(
    "call, flagged",
    [
        ("", False),  # nothing calls it
        ("        if self.rank == 0:\n            self.show()\n", False),  # rank 0 alone calls it
        ('        getattr(self, "show")()\n', True),  # named by a string: its calls are not known
        ("        self.show()\n", True),  # every rank calls it
    ],
)
def test_a_method_of_the_programs_own_class_runs_where_its_calls_run(call, flagged):
    """A method of a plain class of the program (no framework base class that may call it) that
    nothing calls, or only rank 0 calls (`if self.rank == 0: self.show()`), prints once at most
    (DDP302 silent); called on every rank, its print is N copies."""
    found = _codes(TRAINER_METHOD.format(call=call), "DDP302")
    assert found == (["13 DDP302"] if flagged else [])


LAUNCHED = """\
import argparse

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29500", rank=args.rank, world_size=torch.cuda.device_count())
    for epoch in range(3):
        print("epoch", epoch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""

STARTER = """\
import argparse
import os
import subprocess

import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--script")
    args = parser.parse_args()
    processes = []
    for i in range(torch.cuda.device_count()):
        out = None if i == 0 else open(os.devnull, "w")
        processes.append(subprocess.Popen({python} + [args.script, f"--rank={{i}}"], stdout=out))
    for p in processes:
        p.wait()


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("python, flagged", [("['python3']", False), ("[sys.executable]", False), ("['echo']", True)])
def test_a_launcher_beside_the_script_that_starts_python_with_its_own_stdout_per_process(tmp_path: Path, python, flagged):
    """`distribute.py --script train.py` beside the script starts each rank as `['python3'] +
    command` with the output of all but the first sent to os.devnull: one copy of each line
    (DDP302 silent), as with `[sys.executable]`; a starter of something else is no launcher."""
    imports = "import sys\n" if "sys" in python else ""
    write_files(tmp_path, {"train.py": LAUNCHED, "distribute.py": imports + STARTER.format(python=python)})
    assert [c for c in codes(tmp_path / "train.py", "DDP302")] == (["13 DDP302"] if flagged else [])


SPAWNER = """\
import argparse

import fire
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm


def worker(rank, world_size):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29500", rank=rank, world_size=world_size)
    for step in tqdm(range(10){disable}):
        pass
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preview", action="store_true")
    args = parser.parse_args()
    if args.preview:
        for i in tqdm(range(4)):
            print(i)
        return
    mp.spawn(worker, args=(2,), nprocs=2)


if __name__ == "__main__":
    fire.Fire(main)
"""


@pytest.mark.parametrize("disable, flagged", [("", ["11 DDP304"]), (", disable=rank != 0", [])])
def test_code_of_the_function_that_spawns_the_workers_runs_in_one_process(disable, flagged):
    """`if args.preview: ...; return` before `mp.spawn(...)` runs in the launcher alone (its
    function handed to `fire.Fire`): its bar is drawn once (DDP304 silent there); the worker's
    bar is every rank's."""
    assert _codes(SPAWNER.format(disable=disable), "DDP304") == flagged


RUNNER = """\
import os

import torch
import torch.distributed as dist


class Runner:
    def __init__(self, model, device=torch.device("cuda:0")):
        self.model = model.to(device)


def main():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    runner = Runner(torch.nn.Linear(2, 2){device})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("device, flagged", [(", device", []), (", device=device", []), ("", ["8 DDP106"])])
def test_a_gpu_index_as_a_parameters_default_that_every_call_overrides(device, flagged):
    """`device=torch.device("cuda:0")` as a constructor's default is never used when every
    construction passes the device (DDP106 silent); a construction that leaves it out uses GPU 0
    on every rank."""
    assert _codes(RUNNER.format(device=device), "DDP106") == flagged


SAVER = """\
import os

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    is_master = int(os.environ["LOCAL_RANK"]) in (-1, 0)
    model = torch.nn.Linear(2, 2)

    def due(epoch):
        if {test}:
            return False
        return epoch % 2 == 0

    for epoch in range(4):
        if due(epoch):
            torch.save(model.state_dict(), "last.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("test, flagged", [("not is_master", []), ("epoch < 1", ["19 DDP301"])])
def test_a_predicate_that_returns_false_off_rank0_guards_what_it_decides(test, flagged):
    """`def due(epoch): if not is_master: return False; ...` then `if due(epoch): torch.save(...)`:
    only rank 0 saves (DDP301 silent); a predicate that tests something else guards no rank."""
    assert _codes(SAVER.format(test=test), "DDP301") == flagged


QUIET_BY_DEFAULT = """\
import torch.distributed as dist
from tqdm import tqdm


class Trainer:
    def run_epoch(self, loader, show_bar=False):
        if show_bar:
            loader = tqdm(loader)
        for batch in loader:
            pass


def main():
    dist.init_process_group("gloo")
    trainer = Trainer()
    for epoch in range(2):
        trainer.run_epoch(range(8){passed})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("passed, flagged", [("", []), (", show_bar=True", ["8 DDP304"]), (", True", ["8 DDP304"])])
def test_a_branch_under_a_parameter_off_by_default_that_no_call_turns_on_never_runs(passed, flagged):
    """`if show_bar:` where `show_bar=False` and no call passes it: the bar is never drawn
    (DDP304 silent); a call that turns it on, by keyword or by position, draws it on every rank."""
    assert _codes(QUIET_BY_DEFAULT.format(passed=passed), "DDP304") == flagged


REPORT_AFTER_REDUCE = """\
import os

import torch
import torch.distributed as dist


def main(distributed):
    if distributed:
        dist.init_process_group("gloo")
    loss = torch.tensor([1.0])
    if distributed:
        dist.reduce(loss, 0)
        if dist.get_rank() == 0:
            loss = loss / dist.get_world_size()
        else:
{exit}
    print("eval loss", loss.item())
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main("WORLD_SIZE" in os.environ)
"""


@pytest.mark.parametrize("exit, flagged", [("            return", []), ("            pass", ["17 DDP302"])])
def test_code_after_a_rank0_branch_whose_else_returns_is_rank0s(exit, flagged):
    """`if distributed: ...; if rank == 0: ... else: return` leaves rank 0 (or the one process
    of a run without a group) to run what follows (DDP302 silent); an `else` that goes on leaves
    every rank."""
    assert _codes(REPORT_AFTER_REDUCE.format(exit=exit), "DDP302") == flagged


SWITCHED_OFF = """\
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    if {test}:
        print("shuffling the batch across ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("test, flagged", [("False", []), ("0", []), ("True", ["7 DDP302"])])
def test_code_switched_off_by_a_constant_never_runs(test, flagged):
    """`if False:` (code switched off by hand) never runs on any rank (DDP302 silent)."""
    assert _codes(SWITCHED_OFF.format(test=test), "DDP302") == flagged


LOAD_IN_CONSTRUCTOR = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, net, checkpoint=None):
        self.net = net
        if checkpoint is not None:
            self.resume(checkpoint)
        self.net = DDP(self.net)
{later}

    def resume(self, checkpoint):
        self.restore(torch.load(checkpoint, map_location="cpu"))

    def restore(self, state):
        self.net.load_state_dict(state)


def main():
    dist.init_process_group("gloo")
    Trainer(torch.nn.Linear(2, 2), "last.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("later, flagged", [("", []), ('        self.resume("best.pt")', ["18 DDP121"])])
def test_a_load_the_constructor_reaches_through_methods_before_it_wraps_goes_into_the_plain_model(later, flagged):
    """`__init__` calls `resume()`, which calls `restore()`, before it wraps `self.net`: the load
    goes into the plain model (DDP121 silent); a call after the wrap loads into the wrapper."""
    assert _codes(LOAD_IN_CONSTRUCTOR.format(later=later), "DDP121") == flagged


THROUGH_LIBRARY = {
    "pyproject.toml": "[project]\nname = \"demo\"\n",
    "pretrain/train.py": """\
        import lib.launch as launch
        from lib.trainer import Trainer


        def main(gpus):
            launch.run_workers(gpus, Trainer().train)


        if __name__ == "__main__":
            main(2)
        """,
    "pretrain/lib/__init__.py": "",
    "pretrain/lib/launch.py": """\
        import multiprocessing as mp

        import lib.dist as du


        def _worker(rank, world_size, fn):
            du.start(rank, world_size)
            fn()


        def run_workers(n, fn):
            procs = [mp.Process(target=_worker, args=(i, n, fn)) for i in range(n)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
        """,
    "pretrain/lib/dist.py": """\
        import torch
        import torch.distributed as dist


        def start(rank, world_size):
            {set_device}
            dist.init_process_group("nccl", rank=rank, world_size=world_size)
        """,
    "pretrain/lib/trainer.py": """\
        import torch
        import torch.distributed as dist

        import lib.dist as du


        class Trainer:
            def train(self):
                labels = torch.arange(4).cuda()
                dist.all_reduce(labels)
        """,
}


@pytest.mark.parametrize("set_device, flagged", [("torch.cuda.set_device(rank)", False), ("pass", True)])
def test_a_module_the_script_reaches_through_a_library_module_is_imported_from_the_scripts_folder(
    tmp_path, set_device, flagged
):
    """`lib/trainer.py` is imported by `pretrain/train.py`, whose `lib.launch` imports `lib.dist`:
    Python finds `lib.dist` on the script's folder (sys.path[0]), not beside `lib/launch.py`, so
    the program includes the `set_device` the launcher's workers run (DDP108 silent)."""
    write_files(tmp_path, {**THROUGH_LIBRARY, "pretrain/lib/dist.py": THROUGH_LIBRARY["pretrain/lib/dist.py"].format(set_device=set_device)})
    assert codes(tmp_path / "pretrain/lib/trainer.py", "DDP108") == (["9 DDP108"] if flagged else [])




TRAINER_LAUNCHES = """\
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import load_best


class Trainer:
    def __init__(self, world_size):
        self.world_size = world_size

    def run(self, model):
        self.start_workers(model)
        return load_best(model, "best.pt")

    def start_workers(self, model):
        procs = [mp.Process(target=self.train, args=(rank, model)) for rank in range(self.world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()

    def train(self, rank, model):
        dist.init_process_group("nccl", rank=rank, world_size=self.world_size)
        {in_worker}
        dist.destroy_process_group()
"""
HELPERS = """\
import torch
import torch.distributed as dist


def is_main():
    return not dist.is_initialized() or dist.get_rank() == 0


def load_best(model, path):
    model.load_state_dict(torch.load(path))
    return model
"""
EXPERIMENT = """\
from trainer import Trainer


def experiment(model, world_size):
    return Trainer(world_size).run(model)


if __name__ == "__main__":
    experiment(None, 2)
"""


@pytest.mark.parametrize("in_worker, flagged", [("pass", False), ('load_best(model, "best.pt")', True)])
def test_a_method_that_starts_the_workers_through_another_runs_in_the_launcher(tmp_path, in_worker, flagged):
    """`run()` calls `self.start_workers()`, which starts `mp.Process(target=self.train)`, and
    then loads the best model: `run` runs in the launcher's one process, so the helper's load
    (only `run` calls it) is one process's (DDP109 silent); called in `train` too, every rank
    loads onto GPU 0."""
    write_files(tmp_path, {
        "trainer.py": TRAINER_LAUNCHES.format(in_worker=in_worker), "helpers.py": HELPERS, "experiment.py": EXPERIMENT,
    })  # fmt: skip
    assert codes(tmp_path / "helpers.py", "DDP109") == (["10 DDP109"] if flagged else [])


SRC_LAYOUT = {
    "pyproject.toml": "[project]\nname = \"demo\"\n",
    "src/demo/__init__.py": "",
    "src/demo/helpers.py": """\
        import torch
        import torch.distributed as dist


        def load_best(path):
            return torch.load(path)
        """,
    "scripts/train.py": """\
        import torch.distributed as dist

        from demo.helpers import load_best


        if __name__ == "__main__":
            dist.init_process_group("nccl")
            {call}
        """,
}


@pytest.mark.parametrize("call, flagged", [('if dist.get_rank() == 0:\n                print(load_best("best.pt"))', False), ('load_best("best.pt")', True)])
def test_a_package_in_a_src_layout_is_imported_by_its_name(tmp_path, call, flagged):
    """`src/demo/helpers.py` is `demo.helpers` (a src layout): the script that imports it is its
    caller, and calls it on rank 0 only (DDP109 silent); called on every rank, it is flagged."""
    write_files(tmp_path, {**SRC_LAYOUT, "scripts/train.py": SRC_LAYOUT["scripts/train.py"].format(call=call)})
    assert codes(tmp_path / "src/demo/helpers.py", "DDP109") == (["6 DDP109"] if flagged else [])
