"""A rule speaks only when its premise is proven from the program (issue 32): info logs are
shown on every rank only when a handler and a plainly stated level say so; the modules a script
reaches through the folders its `_init_paths` helper puts on sys.path are read; a "local rank"
returned by the helper that starts the group, or bound to `dist.get_rank()`, is the group's rank;
a helper of a script that nothing calls runs on no rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from check_projects import codes as _codes
from check_projects import write_files as _write

LOOP = """\
    dist.init_process_group("gloo")
    for x in batches:
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
        log.info("step")
    dist.destroy_process_group()
"""


OPTION = """\
import argparse

parser = argparse.ArgumentParser()
parser.add_argument("-v", "--log-level", default="INFO")
args = parser.parse_args()
logging.basicConfig(level=args.log_level)
"""




@pytest.mark.parametrize(
    "setup, flagged",
    [
        ("", False),  # no handler: Python drops info messages
        ("logging.basicConfig(level=logging.INFO)\n", True),
        ("logging.basicConfig(level='WARNING')\n", False),  # the level hides info
        ("logging.basicConfig(level=cfg.log_level)\n", False),  # a level the code does not state
        ("LEVEL = logging.DEBUG\nlogging.basicConfig(level=LEVEL)\n", True),
        ("def setup(level=logging.INFO):\n    logging.basicConfig(level=level)\n\n\nsetup()\n", True),  # its default
        ("def setup(level):\n    logging.basicConfig(level=level)\n\n\nsetup(logging.INFO)\nsetup(logging.DEBUG)\n", False),
        ("def setup(cfg):\n    logging.basicConfig(level=cfg['state'])\n\n\nsetup(config)\n", False),  # from a config
        ("import hydra\n\n\n@hydra.main(config_path='conf')\ndef app(cfg):\n    pass\n", True),  # Hydra logs INFO
        (OPTION, True),  # the option's default: the same command line on every rank
        (OPTION + "if dist.get_rank() != 0:\n    args.log_level = 'ERROR'\n", False),  # changed by rank
    ],
    ids=["no-handler", "info", "warning", "from-config", "constant", "default", "two-levels", "config-field", "hydra",
         "option-default", "option-changed-by-rank"],  # fmt: skip
)
def test_info_logs_are_flagged_only_when_every_rank_shows_them(tmp_path: Path, setup: str, flagged: bool) -> None:
    head = "import logging\n\nimport torch.distributed as dist\n\nlog = logging.getLogger(__name__)\n" + setup
    (tmp_path / "train.py").write_text(head + "\n\ndef main(net, batches, opt, cfg, config):\n" + LOOP)
    codes = [c for c in _codes(tmp_path / "train.py") if c.endswith("DDP303")]
    assert bool(codes) == flagged, codes


def test_info_logs_with_a_level_set_off_rank0_by_a_config_field_are_not_flagged(tmp_path: Path) -> None:
    """The config says `state = "error"` on the other ranks and the logger maps it to a level: not
    a level the code states, so nothing is claimed about them."""
    _write(tmp_path, {
        "pyproject.toml": "",
        "log.py": """\
            import logging


            def init_logger(config):
                level = logging.INFO if config["state"] == "info" else logging.ERROR
                logging.basicConfig(level=level)
            """,
        "train.py": "import logging\n\nimport torch.distributed as dist\n\nfrom log import init_logger\n\n"
                    "log = logging.getLogger(__name__)\n\n\ndef main(net, batches, opt, config):\n"
                    "    if dist.get_rank() != 0:\n        config['state'] = 'error'\n    init_logger(config)\n" + LOOP,
    })  # fmt: skip
    assert [c for c in _codes(tmp_path / "train.py") if c.endswith("DDP303")] == []


INIT_PATHS = """\
import os.path as osp
import sys


def add_path(path):
    if path not in sys.path:
        sys.path.insert(0, path)


this_dir = osp.dirname(__file__)
add_path(osp.join(this_dir, "..", "lib"))
"""

TRAIN_WITH_INIT_PATHS = """\
import torch
import torch.distributed as dist

import _init_paths
from core.function import train


def main(local_rank, net, batches, opt):
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    train(net, batches, opt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(0, None, [], None)
"""

FUNCTION = """\
import torch.distributed as dist


def train(net, batches, opt):
    for x in batches:
        x = x.cuda()
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
    dist.barrier()
"""


def test_a_helper_module_that_puts_lib_on_sys_path_joins_the_script_to_its_modules(tmp_path: Path) -> None:
    """`import _init_paths` (whose `add_path` helper inserts `../lib`), then `from core.function
    import train`: the training function in lib/ is the script's, which set the device first
    (DDP108 silent); without the set_device it fires."""
    _write(tmp_path, {"pyproject.toml": "", "tools/_init_paths.py": INIT_PATHS, "tools/train.py": TRAIN_WITH_INIT_PATHS,
                      "lib/core/__init__.py": "", "lib/core/function.py": FUNCTION})  # fmt: skip
    assert _codes(tmp_path / "lib" / "core" / "function.py", "DDP108") == []
    _write(tmp_path, {"tools/train.py": TRAIN_WITH_INIT_PATHS.replace("    torch.cuda.set_device(local_rank)\n", "")})
    assert _codes(tmp_path / "lib" / "core" / "function.py", "DDP108") == ["6 DDP108"]


INIT_HELPERS = """\
import os

import torch.distributed as dist


def init_dist_pytorch(backend="nccl"):
    dist.init_process_group(backend)
    return dist.get_world_size(), {rank}


def init_dist_slurm(backend="nccl"):
    dist.init_process_group(backend)
    return dist.get_world_size(), {rank}
"""

TRAIN_WITH_LAUNCHER = """\
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

import utils


def main(cfg, launcher):
    total_gpus, cfg.LOCAL_RANK = getattr(utils, "init_dist_%s" % launcher)()
    writer = SummaryWriter("runs") if cfg.LOCAL_RANK == 0 else None
    dist.barrier()
    return writer
"""


@pytest.mark.parametrize("returned, flagged", [("dist.get_rank()", False), ("int(os.environ['LOCAL_RANK'])", True)])
def test_a_local_rank_returned_by_the_helper_that_starts_the_group_is_what_it_returns(
    tmp_path: Path, returned: str, flagged: bool
) -> None:
    """`getattr(utils, "init_dist_%s" % launcher)()`: every `init_dist_*` of utils may run; when
    they return `dist.get_rank()`, `cfg.LOCAL_RANK == 0` is a job-wide guard (DDP307 silent)."""
    _write(tmp_path, {"pyproject.toml": "", "utils.py": INIT_HELPERS.format(rank=returned), "train.py": TRAIN_WITH_LAUNCHER})
    assert [c for c in _codes(tmp_path / "train.py", "DDP307") if c.endswith("DDP307")] == (["9 DDP307"] if flagged else [])


SCRIPT_WITH_IDLE_HELPER = """\
import os

import torch
import torch.distributed as dist


def load_old_checkpoint(path):
    return torch.load(path)


def main():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    state = torch.load("last.pt", map_location=f"cuda:{local_rank}")
    # load_old_checkpoint("old.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("called", [False, True])
def test_a_helper_of_a_script_that_nothing_calls_runs_on_no_rank(tmp_path: Path, called: bool) -> None:
    """A script nothing imports is its whole program: its helper whose only call is commented out
    runs nowhere (DDP109 silent); called from `main()`, it runs on every rank."""
    source = SCRIPT_WITH_IDLE_HELPER.replace("# load_old_checkpoint", "load_old_checkpoint") if called else SCRIPT_WITH_IDLE_HELPER
    (tmp_path / "train.py").write_text(source)
    assert [c for c in _codes(tmp_path / "train.py", "DDP109") if c.endswith("DDP109")] == (["8 DDP109"] if called else [])


@pytest.mark.parametrize("bound, flagged", [("dist.get_rank()", False), ("int(os.environ['LOCAL_RANK'])", True)])
def test_a_name_called_local_rank_holds_what_it_is_bound_to(tmp_path: Path, bound: str, flagged: bool) -> None:
    """`local_rank = dist.get_rank()`: the guard `if local_rank == 0:` is job-wide (DDP307 silent)."""
    (tmp_path / "train.py").write_text(
        "import os\n\nimport torch\nimport torch.distributed as dist\n\n"
        f"dist.init_process_group('nccl')\nlocal_rank = {bound}\nmodel = torch.nn.Linear(2, 2)\n"
        "if local_rank == 0:\n    torch.save(model.state_dict(), 'model.pt')\ndist.destroy_process_group()\n"
    )
    assert [c for c in _codes(tmp_path / "train.py", "DDP307") if c.endswith("DDP307")] == (["9 DDP307"] if flagged else [])


SAVE_HELPERS = """\
import torch
import torch.distributed as dist


def persistent_save(obj, filename):
    with open(filename + ".tmp", "wb") as f:
        _save(obj, f)


def _save(obj, f):
    if isinstance(f, str):
        with open(f, "wb") as h:
            persistent_save(obj, h)
        return
    torch.save(obj, f)
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_a_save_helper_two_calls_deep_is_decided_by_its_callers(tmp_path: Path, guarded: bool) -> None:
    """`persistent_save(state, path)` opens the file and hands the handle to `_save`, which
    retries through `persistent_save` itself: the training script's call on rank 0 decides who
    writes (DDP301 silent); on every rank it is flagged at the save."""
    call = "if dist.get_rank() == 0:\n        utils.persistent_save(state, 'last.pt')" if guarded else "utils.persistent_save(state, 'last.pt')"
    _write(tmp_path, {"pyproject.toml": "", "utils.py": SAVE_HELPERS, "train.py": (
        "import torch.distributed as dist\n\nimport utils\n\n\ndef main(net, batches, opt, state):\n"
        "    dist.init_process_group('gloo')\n    for x in batches:\n        opt.zero_grad()\n"
        "        net(x).sum().backward()\n        opt.step()\n    " + call + "\n    dist.destroy_process_group()\n"
    )})  # fmt: skip
    assert [c for c in _codes(tmp_path / "utils.py", "DDP301") if c.endswith("DDP301")] == ([] if guarded else ["15 DDP301"])


DECORATED_SAVE = """\
import functools

import torch
import torch.distributed as dist


def master_only(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if dist.get_rank() == 0:
            return func(*args, **kwargs)
        return None
    return wrapper


{decorator}
def save(model, path):
    torch.save(model.state_dict(), path)


def main(model, batches, opt):
    dist.init_process_group("gloo")
    for x in batches:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    save(model, "last.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(None, [], None)
"""


@pytest.mark.parametrize("decorator, flagged", [("@master_only", False), ("@functools.lru_cache", True)])
def test_a_rank0_decorator_makes_its_function_rank0s(tmp_path: Path, decorator: str, flagged: bool) -> None:
    """`@master_only` (a project decorator whose wrapper calls the function under `if rank == 0`)
    runs the save on rank 0 only: DDP301 silent; another decorator leaves it every rank's."""
    (tmp_path / "train.py").write_text(DECORATED_SAVE.format(decorator=decorator))
    assert [c for c in _codes(tmp_path / "train.py", "DDP301") if c.endswith("DDP301")] == (["18 DDP301"] if flagged else [])


@pytest.mark.parametrize("stream, flagged", [("sys.stderr if is_leader_process() else open(os.devnull, 'w')", False), ("sys.stderr", True)])
def test_a_progress_bar_drawn_into_a_stream_chosen_by_the_rank(tmp_path: Path, stream: str, flagged: bool) -> None:
    """`tqdm(..., file=out)` with `out = sys.stderr if is_leader_process() else devnull`: the
    other ranks draw into nothing (DDP304 silent)."""
    (tmp_path / "train.py").write_text(
        "import os\nimport sys\n\nimport torch.distributed as dist\nfrom tqdm import tqdm\n\n\n"
        "def is_leader_process():\n    return not dist.is_initialized() or dist.get_rank() == 0\n\n\n"
        "def main(model, batches, opt):\n    dist.init_process_group('gloo')\n"
        f"    out = {stream}\n    for x in tqdm(batches, file=out):\n        opt.zero_grad()\n"
        "        model(x).sum().backward()\n        opt.step()\n    dist.destroy_process_group()\n"
    )
    assert [c for c in _codes(tmp_path / "train.py", "DDP304") if c.endswith("DDP304")] == (["15 DDP304"] if flagged else [])


@pytest.mark.parametrize("check, flagged", [("    if n // world * world != n:\n        raise ValueError(n)\n", False), ("", True)])
def test_shards_after_a_divisibility_check_are_equal(tmp_path: Path, check: str, flagged: bool) -> None:
    """`if n // world * world != n: raise` before `x.split(sizes)[rank]`: every rank's shard is
    the same size (DDP114 silent)."""
    (tmp_path / "train.py").write_text(
        "import torch\nimport torch.distributed as dist\n\n\ndef step(model, opt, rays, rank, world):\n"
        "    n = rays.shape[0]\n" + check + "    sizes = [n // world] * world\n    sizes[-1] = n - sum(sizes[:-1])\n"
        "    mine = torch.split(rays, sizes)[rank]\n    for chunk in mine.split(64):\n        opt.zero_grad()\n"
        "        model(chunk).sum().backward()\n        opt.step()\n"
    )
    codes = [c for c in _codes(tmp_path / "train.py", "DDP114") if c.endswith("DDP114")]
    assert bool(codes) is flagged, codes


def test_a_flag_the_launcher_starts_the_group_under_is_the_run_mode_in_the_trainer(tmp_path: Path) -> None:
    """train.py: `if cfg.DIST_TRAIN: dist.init_process_group(...)`; processor.py saves in the
    `else:` of `if cfg.DIST_TRAIN:` with no rank guard: one process, one writer (DDP301 silent),
    and its model is not the wrapper there (DDP120 silent)."""
    _write(tmp_path, {
        "pyproject.toml": "",
        "train.py": "import torch.distributed as dist\n\nfrom processor import fit\n\n\ndef main(cfg, model, batches, opt):\n"
                    "    if cfg.DIST_TRAIN:\n        dist.init_process_group('nccl')\n    fit(cfg, model, batches, opt)\n\n\n"
                    "if __name__ == '__main__':\n    main(None, None, [], None)\n",
        "processor.py": "import torch\nimport torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n\n\n"
                        "def fit(cfg, model, batches, opt):\n    if cfg.DIST_TRAIN:\n        model = DDP(model)\n"
                        "    for x in batches:\n        opt.zero_grad()\n        model(x).sum().backward()\n        opt.step()\n"
                        "    if cfg.DIST_TRAIN:\n        if dist.get_rank() == 0:\n            torch.save(model.module.state_dict(), 'm.pt')\n"
                        "    else:\n        torch.save(model.state_dict(), 'm.pt')\n",
    })  # fmt: skip
    assert [c for c in _codes(tmp_path / "processor.py") if c.endswith(("DDP301", "DDP120"))] == []


def test_a_large_project_follows_import_lines_that_name_the_package() -> None:
    from ddpify.analysis.project import _names_with_package

    names = _names_with_package(Path("/repo/s3prl/utility/helper.py"), "helper")
    assert names.search("from s3prl.utility.helper import is_leader_process")
    assert names.search("from utility import helper")
    assert names.search("from .helper import x") and names.search("from . import helper")
    assert not names.search("from tools.helper_functions import x") and not names.search("import helper")


EXPERIMENT = """\
import logging
import os

import torch
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP


class Experiment:
    def __init__(self, conf, model):
        self._log = logging.getLogger(__name__)
        self._use_wandb = True
        self._model = model
        dist.init_process_group("nccl")
{clear}        self._model.load_state_dict(torch.load(conf.ckpt, map_location="cpu"))
        self._log.info("model loaded")

    def start_training(self, batches, opt):
        self._model = DDP(self._model)
        if self._use_wandb:
            wandb.init(project="exp")
        for x in batches:
            opt.zero_grad()
            self._model(x).sum().backward()
            opt.step()
            self._log.info("step")
        dist.destroy_process_group()


logging.basicConfig(level=logging.INFO)
"""


@pytest.mark.parametrize("cleared", [True, False])
def test_switches_cleared_off_rank0_in_the_constructor(tmp_path: Path, cleared: bool) -> None:
    """`if rank not in [0, -1]: self._log.setLevel("ERROR")` in the constructor (a method, whose
    callers are not all in sight): info logs are not known to show on every rank (DDP303 silent).
    The constructor's load runs before `start_training` wraps the model (DDP121 silent either way)."""
    clear = (
        "        if int(os.environ['RANK']) not in [0, -1]:\n"
        "            self._log.setLevel('ERROR')\n            self._use_wandb = False\n"
    ) if cleared else ""
    (tmp_path / "train.py").write_text(EXPERIMENT.format(clear=clear))
    codes = sorted({c.split()[1] for c in _codes(tmp_path / "train.py") if c.split()[1] in ("DDP303", "DDP305", "DDP121")})
    assert codes == ([] if cleared else ["DDP303"])


LAUNCHER = """\
import torch.multiprocessing as mp

import data
import worker


def read_configs():
    data.fetch("cifar")
    print("configs read")
    return {}


if __name__ == "__main__":
    cfg = read_configs()
    mp.spawn(worker.run, args=(cfg,), nprocs=2)
"""


@pytest.mark.parametrize("caller", ["launch.py", "worker.py"])
def test_code_only_the_launcher_runs_before_it_spawns_is_not_every_ranks(tmp_path: Path, caller: str) -> None:
    """`data.fetch(...)` called while the launcher reads its configs, before `mp.spawn`: the
    download runs once (DDP115 silent); called by the spawned worker, on every rank."""
    launch = LAUNCHER if caller == "launch.py" else LAUNCHER.replace('    data.fetch("cifar")\n', "")
    run = "    data.fetch('cifar')\n" if caller == "worker.py" else ""
    _write(tmp_path, {
        "pyproject.toml": "", "launch.py": launch,
        "data.py": "import torch.distributed as dist\nfrom torchvision.datasets import CIFAR10\n\n\n"
                   "def fetch(name):\n    return CIFAR10(root='data', download=True)\n",
        "worker.py": "import torch.distributed as dist\n\nimport data\n\n\ndef run(rank, cfg):\n"
                     "    dist.init_process_group('gloo', rank=rank, world_size=2)\n" + run + "    dist.destroy_process_group()\n",
    })  # fmt: skip
    assert bool([c for c in _codes(tmp_path / "data.py", "DDP115") if c.endswith("DDP115")]) is (caller == "worker.py")


def test_a_loader_only_a_sanity_loop_reads_is_not_the_training_loader(tmp_path: Path) -> None:
    """`for batch in tr_dataloader: show(batch); break` and nothing else reads it: DDP110 silent."""
    (tmp_path / "train.py").write_text(
        "import torch.distributed as dist\nfrom torch.utils.data import DataLoader\n\n"
        "dist.init_process_group('gloo')\ntr_dataloader = DataLoader(ds, batch_size=8, shuffle=True)\n"
        "for step, batch in enumerate(tr_dataloader):\n    print(batch.shape)\n    break\n"
    )
    assert [c for c in _codes(tmp_path / "train.py", "DDP110") if c.endswith("DDP110")] == []


def test_a_test_that_imports_the_script_is_not_part_of_its_program(tmp_path: Path) -> None:
    """tests/test_train.py imports train.py and destroys a group of its own: the script still never
    destroys its group (DDP105)."""
    _write(tmp_path, {
        "pyproject.toml": "",
        "train.py": "import torch.distributed as dist\n\n\ndef main():\n    dist.init_process_group('gloo')\n\n\n"
                    "if __name__ == '__main__':\n    main()\n",
        "tests/test_train.py": "import torch.distributed as dist\n\nimport train\n\n\ndef test_main():\n"
                               "    train.main()\n    dist.destroy_process_group()\n",
    })  # fmt: skip
    assert [c for c in _codes(tmp_path / "train.py", "DDP105") if c.endswith("DDP105")] == ["5 DDP105"]


def test_the_function_that_starts_the_workers_runs_once(tmp_path: Path) -> None:
    """`Launcher.launch` starts an `mp.Process` per rank and joins them, printing before and after:
    one parent process prints (DDP302 silent there); the worker's print is every rank's."""
    (tmp_path / "launch.py").write_text(
        "import torch.distributed as dist\nimport torch.multiprocessing as mp\n\n\n"
        "def work(rank, batches, model, opt):\n    dist.init_process_group('gloo', rank=rank, world_size=2)\n"
        "    for x in batches:\n        opt.zero_grad()\n        model(x).sum().backward()\n        opt.step()\n"
        "        print('step')\n    dist.destroy_process_group()\n\n\n"
        "class Launcher:\n    def launch(self, batches, model, opt):\n"
        "        procs = [mp.Process(target=work, args=(r, batches, model, opt)) for r in range(2)]\n"
        "        for p in procs:\n            print('starting')\n            p.start()\n"
        "        for p in procs:\n            p.join()\n            print('joined')\n"
    )
    assert [c for c in _codes(tmp_path / "launch.py", "DDP302") if c.endswith("DDP302")] == ["11 DDP302"]


def test_a_group_started_only_by_a_helper_nothing_calls_is_not_missing_its_teardown(tmp_path: Path) -> None:
    """env.py's `init_dist()` is imported by train.py but never called (the script starts its group
    inline, and never destroys it): DDP105 at the script's call only."""
    _write(tmp_path, {
        "pyproject.toml": "",
        "env.py": "import torch.distributed as dist\n\n\ndef init_dist():\n    dist.init_process_group('nccl')\n",
        "train.py": "import torch.distributed as dist\n\nfrom env import init_dist  # noqa: F401\n\n\ndef main():\n"
                    "    dist.init_process_group('nccl')\n\n\nif __name__ == '__main__':\n    main()\n",
    })  # fmt: skip
    assert [c for c in _codes(tmp_path / "env.py", "DDP105") if c.endswith("DDP105")] == []
    assert [c for c in _codes(tmp_path / "train.py", "DDP105") if c.endswith("DDP105")] == ["7 DDP105"]


@pytest.mark.parametrize("quiet, flagged", [("    if dist.get_rank() != 0:\n        sys.stderr = open(os.devnull, 'w')\n", False), ("", True)])
def test_progress_bars_of_a_program_that_points_stderr_elsewhere(tmp_path: Path, quiet: str, flagged: bool) -> None:
    (tmp_path / "train.py").write_text(
        "import os\nimport sys\n\nimport torch.distributed as dist\nfrom tqdm import tqdm\n\n\n"
        "def main(model, batches, opt):\n    dist.init_process_group('gloo')\n" + quiet +
        "    for x in tqdm(batches):\n        opt.zero_grad()\n        model(x).sum().backward()\n        opt.step()\n"
        "    dist.destroy_process_group()\n"
    )
    assert bool([c for c in _codes(tmp_path / "train.py", "DDP304") if c.endswith("DDP304")]) is flagged


SPAWNING = """\
import os

import matplotlib.pyplot as plt
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, args, model):
        self.args = args
        self.model = DDP(model) if args.multi_gpu else model

    def plot(self, values):
        plt.plot(values)
        plt.savefig("loss.png")

    def train(self, batches, opt):
        accumulate = self.model.no_sync if self.args.multi_gpu else None
        for step, x in enumerate(batches):
            loss = self.model(x).sum()
            loss.backward()
            if step % 4 == 0:
                opt.step()
        if not self.args.multi_gpu or self.args.rank == 0:
            self.plot([1, 2])
        return accumulate


def worker(rank, args):
    dist.init_process_group("nccl", rank=rank, world_size=2)
    Trainer(args, None).train([], None)
    for name, p in Trainer(args, None).model.state_dict().items():
        dist.broadcast(p, 0)
    dist.destroy_process_group()


def main(args):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "29500"
    if args.multi_gpu:
        mp.spawn(worker, args=(args,), nprocs=2)
"""


def test_a_one_machine_spawning_program_with_a_switch(tmp_path: Path) -> None:
    """`if args.multi_gpu: mp.spawn(...)` makes `not self.args.multi_gpu` the one-process run: the
    plot under `not multi_gpu or rank == 0` is rank 0's (DDP306 silent); `self.model.no_sync`
    stored and called later is a use of it (DDP204 silent); the state dict walked for a broadcast
    is not saved (DDP120 silent); the rendezvous set by the parent that spawns this machine's
    workers is not a torchrun rank's (DDP123 silent)."""
    (tmp_path / "train.py").write_text(SPAWNING)
    assert [c for c in _codes(tmp_path / "train.py") if c.split()[1] in ("DDP306", "DDP204", "DDP120", "DDP123")] == []


def test_a_program_whose_group_is_switched_off_by_a_constant_runs_as_one_process(tmp_path: Path) -> None:
    """`is_distributed, world_size = (False, 1)  # get_distrib_config()`, then `if is_distributed:
    dist.init_process_group(...)`: nothing runs on several ranks (no DDP302, DDP105)."""
    source = (
        "import torch.distributed as dist\n\n\ndef main(model, batches, opt):\n"
        "    is_distributed, world_size = ({flag}, 1)  # get_distrib_config()\n"
        "    if is_distributed:\n        dist.init_process_group('nccl', world_size=world_size)\n"
        "    for x in batches:\n        opt.zero_grad()\n        model(x).sum().backward()\n        opt.step()\n"
        "        print('step')\n"
    )
    (tmp_path / "train.py").write_text(source.format(flag="False"))
    assert [c for c in _codes(tmp_path / "train.py") if c.split()[1] in ("DDP302", "DDP105")] == []
    (tmp_path / "train.py").write_text(source.format(flag="True"))
    assert [c for c in _codes(tmp_path / "train.py") if c.split()[1] in ("DDP302", "DDP105")] == ["7 DDP105", "12 DDP302"]


def test_a_guard_that_raises_on_a_single_gpu_off_rank0_does_not_make_the_rest_rank0s(tmp_path: Path) -> None:
    """`if num_gpus == 1 and rank != 0: raise` is false on every rank of a multi-GPU run: the
    training after it is every rank's, and its collective under `if num_gpus > 1:` is no hang."""
    (tmp_path / "train.py").write_text(
        "import torch\nimport torch.distributed as dist\n\n\ndef train(num_gpus, rank, model, batches, opt):\n"
        "    if num_gpus > 1:\n        dist.init_process_group('nccl', rank=rank, world_size=num_gpus)\n"
        "    for x in batches:\n        loss = model(x).sum()\n        opt.zero_grad()\n        loss.backward()\n        opt.step()\n"
        "        if num_gpus > 1:\n            dist.all_reduce(loss)\n\n\n"
        "def main(num_gpus, rank):\n    if num_gpus == 1 and rank != 0:\n        raise RuntimeError('one GPU, rank > 0')\n"
        "    train(num_gpus, rank, None, [], None)\n"
    )
    assert [c for c in _codes(tmp_path / "train.py") if c.endswith("DDP116")] == []


def test_a_parameter_every_caller_fills_with_a_rank0_test_is_a_rank0_flag(tmp_path: Path) -> None:
    """`print_variables(model, log=dist.get_rank() == 0)`, then `if log: print(...)`: rank 0's."""
    (tmp_path / "train.py").write_text(
        "import torch.distributed as dist\n\n\ndef print_variables(model, log):\n    for name, p in model.named_parameters():\n"
        "        if log:\n            print(name, p.shape)\n\n\ndef main(model, batches, opt):\n    dist.init_process_group('gloo')\n"
        "    print_variables(model, log=dist.get_rank() == 0)\n    for x in batches:\n        opt.zero_grad()\n"
        "        model(x).sum().backward()\n        opt.step()\n    dist.destroy_process_group()\n"
    )
    assert [c for c in _codes(tmp_path / "train.py") if c.endswith("DDP302")] == []


def test_set_epoch_for_the_next_epoch_at_the_end_of_the_loop(tmp_path: Path) -> None:
    """`sampler.set_epoch(epoch + 1)` after the epoch's training sets the coming epoch's order."""
    (tmp_path / "train.py").write_text(
        "import torch.distributed as dist\nfrom torch.utils.data import DataLoader, DistributedSampler\n\n\n"
        "def main(model, ds, opt):\n    dist.init_process_group('gloo')\n    sampler = DistributedSampler(ds)\n"
        "    loader = DataLoader(ds, sampler=sampler)\n    for epoch in range(3):\n        for x in loader:\n"
        "            opt.zero_grad()\n            model(x).sum().backward()\n            opt.step()\n"
        "        sampler.set_epoch({arg})\n    dist.destroy_process_group()\n"
    )
    (tmp_path / "train.py").write_text((tmp_path / "train.py").read_text().replace("{arg}", "epoch + 1"))
    assert [c for c in _codes(tmp_path / "train.py") if c.endswith("DDP113")] == []
    (tmp_path / "train.py").write_text((tmp_path / "train.py").read_text().replace("epoch + 1", "epoch"))
    assert [c for c in _codes(tmp_path / "train.py") if c.endswith("DDP113")] == ["14 DDP113"]
