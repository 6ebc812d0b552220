"""`ddpify check` reads the program around a file: the modules it imports, and the files that
import it (a helper called on rank 0 only, logging set up by the launcher, a package whose
own `setup.py` module is not the project's root)."""

from __future__ import annotations

from pathlib import Path

from ddpify.analysis.project import find_project
from check_projects import codes as _codes
from check_projects import write_files as _write

TRAIN = """\
import torch.distributed as dist
import summary


def main(net, batches, opt):
    dist.init_process_group("gloo")
    for x in batches:
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
    {call}
    dist.destroy_process_group()
"""

SUMMARY = """\
import torch.distributed as dist


def show(net):
    for name, p in net.named_parameters():
        print(name, tuple(p.shape), "of", dist.get_world_size())
"""




def test_a_helper_the_program_calls_on_rank0_only_prints_once(tmp_path: Path) -> None:
    _write(tmp_path, {"pyproject.toml": "", "summary.py": SUMMARY,
                      "train.py": TRAIN.format(call="if dist.get_rank() == 0:\n        summary.show(net)")})
    assert _codes(tmp_path / "summary.py") == []


def test_a_helper_the_program_calls_on_every_rank_prints_on_every_rank(tmp_path: Path) -> None:
    _write(tmp_path, {"pyproject.toml": "", "summary.py": SUMMARY, "train.py": TRAIN.format(call="summary.show(net)")})
    assert _codes(tmp_path / "summary.py") == ["6 DDP302"]


LOG_SETUP = """\
import logging
import sys

import torch.distributed as dist


def setup_logging(folder):
    log = logging.getLogger("run")
    log.setLevel(logging.INFO)
    if dist.get_rank() == 0:
        log.addHandler(logging.StreamHandler(sys.stdout))
    {other}
"""

FIT = """\
import logging

import torch.distributed as dist
from log_setup import setup_logging

log = logging.getLogger("run")


def fit(net, batches, opt, folder):
    dist.init_process_group("gloo")
    setup_logging(folder)
    for step, x in enumerate(batches):
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
        log.info("step %d", step)
    dist.destroy_process_group()
"""


def test_console_on_rank0_and_a_file_per_rank_keep_info_off_other_consoles(tmp_path: Path) -> None:
    own_file = 'path = f"{folder}/log.rank{dist.get_rank()}.txt"\n    log.addHandler(logging.FileHandler(path))'
    _write(tmp_path, {"pyproject.toml": "", "log_setup.py": LOG_SETUP.format(other=own_file), "fit.py": FIT})
    assert _codes(tmp_path / "fit.py") == []


def test_a_console_handler_on_every_rank_logs_on_every_rank(tmp_path: Path) -> None:
    shared = "log.addHandler(logging.StreamHandler(sys.stderr))"
    _write(tmp_path, {"pyproject.toml": "", "log_setup.py": LOG_SETUP.format(other=shared), "fit.py": FIT})
    assert _codes(tmp_path / "fit.py") == ["16 DDP303"]


def test_a_packages_own_setup_module_is_not_the_project_root(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pyproject.toml": "",
        "pkg/__init__.py": "",
        "pkg/tools.py": "def helper():\n    return 1\n",
        "pkg/eval/__init__.py": "",
        "pkg/eval/setup.py": "def build():\n    return 2\n",
        "pkg/eval/linear.py": "from pkg.tools import helper\nfrom pkg.eval.setup import build\nhelper()\nbuild()\n",
    })  # fmt: skip
    found = find_project(tmp_path / "pkg" / "eval" / "linear.py")
    assert found.root == tmp_path.resolve()
    assert {"pkg.tools", "pkg.eval.setup"} <= set(found.modules.values())


def test_a_call_of_a_name_imported_over_a_local_function_is_not_a_call_of_it() -> None:
    import libcst as cst

    from ddpify.analysis.index import index_of

    module = cst.parse_module(
        "def profile(x):\n    return x\n"
        "def flops(model):\n    from thop import profile\n    return profile(model)\n"
        "def twice(x):\n    return profile(profile(x))\n"
    )
    index = index_of(module)
    [local] = [f for f in index.all_functions if f.name.value == "profile"]
    assert [module.code_for_node(c.node) for c in index.call_sites(local)] == ["profile(profile(x))", "profile(x)"]


def test_a_launcher_that_imports_the_training_module_by_name_is_read(tmp_path: Path) -> None:
    """`importlib.import_module(f"app.{name}.train")` in a launcher that turns logging down off
    rank 0: the training module's info lines are rank 0's (DDP303 silent); without the
    launcher's line they are every rank's."""
    train = "import logging\n\nimport torch.distributed as dist\n\nlog = logging.getLogger()\nlogging.basicConfig(level=logging.INFO)\n\n\ndef main(net, batches, opt):\n" \
            "    dist.init_process_group('gloo')\n    for x in batches:\n        opt.zero_grad()\n" \
            "        net(x).sum().backward()\n        opt.step()\n        log.info('step')\n" \
            "    dist.destroy_process_group()\n"  # fmt: skip
    launcher = "import importlib\nimport logging\nimport os\n\n\ndef run(name):\n" \
               "    if int(os.environ['RANK']) != 0:\n        logging.getLogger().setLevel(logging.ERROR)\n" \
               "    importlib.import_module(f'app.{name}.train').main(None, [], None)\n"  # fmt: skip
    _write(tmp_path, {"pyproject.toml": "", "app/__init__.py": "", "app/vision/__init__.py": "", "app/vision/train.py": train})
    assert _codes(tmp_path / "app" / "vision" / "train.py") == ["15 DDP303"]
    _write(tmp_path, {"app/launch.py": launcher})
    assert _codes(tmp_path / "app" / "vision" / "train.py") == []


def test_a_rank_kept_in_a_dict_item_guards_like_a_rank(tmp_path: Path) -> None:
    script = "import logging\n\nimport torch.distributed as dist\nfrom torch.utils.data import DataLoader\n\n" \
             "log = logging.getLogger()\n\n\ndef main(opt, net, data, opt_step):\n" \
             "    if opt['dist']:\n        dist.init_process_group('gloo')\n    opt['rank'] = dist.get_rank() if opt['dist'] else 0\n" \
             "    if opt['dist']:\n        loader = DataLoader(data, sampler=make_sampler(data), batch_size=4)\n" \
             "    else:\n        loader = DataLoader(data, shuffle=True, batch_size=4)\n" \
             "    for x in loader:\n        net(x).sum().backward()\n        opt_step()\n        if opt['rank'] == 0:\n" \
             "            log.info('step')\n    if opt['dist']:\n        dist.destroy_process_group()\n"  # fmt: skip
    _write(tmp_path, {"train.py": script})
    assert _codes(tmp_path / "train.py") == []


ENGINE = """\
import torch


def train_one_epoch(model, loader, optimizer, loss_scaler, accum_iter):
    for step, x in enumerate(loader):
        loss = model(x).sum() / accum_iter
        loss_scaler(loss, optimizer, parameters=model.parameters(), update_grad=(step + 1) % accum_iter == 0)
        if (step + 1) % accum_iter == 0:
            optimizer.zero_grad()
"""

MAIN = """\
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from engine import train_one_epoch


def main(net, loader, loss_scaler, accum_iter):
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    model = {model}
    optimizer = torch.optim.AdamW(model.parameters())
    train_one_epoch(model, loader, optimizer, loss_scaler, accum_iter)
    dist.destroy_process_group()
"""


def test_a_wrapped_model_handed_to_an_imported_engine_is_ddp_there(tmp_path: Path) -> None:
    """engine.py, checked on its own, receives the DDP model from main.py: it is part of the
    distributed program, and its accumulation through a loss-scaler helper told when to step
    (`update_grad=(step + 1) % accum_iter == 0`) all-reduces every micro-batch (DDP204). The
    same engine given the unwrapped network is not DDP's."""
    _write(tmp_path, {"pyproject.toml": "", "engine.py": ENGINE, "main.py": MAIN.format(model="DDP(net.cuda(), device_ids=[local_rank])")})
    assert _codes(tmp_path / "engine.py") == ["7 DDP204"]
    _write(tmp_path, {"main.py": MAIN.format(model="net.cuda()")})
    assert _codes(tmp_path / "engine.py") == []


TRAIN_LOOP = """\
import torch


def train(model, loader, optimizer, path):
    for x in loader:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    torch.save({"state_dict": model.state_dict()}, path)
"""

LAUNCH = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from train import train


def main(net, loader, optimizer, path, resume):
    dist.init_process_group("nccl")
    model = DDP(net)
    {resume}
    train(model, loader, optimizer, path)
    dist.destroy_process_group()
"""


def test_a_wrapper_state_saved_in_one_file_and_loaded_into_the_wrapper_by_its_importer(tmp_path: Path) -> None:
    """train.py saves the wrapper's `state_dict()` (`module.` keys); main.py, which hands it the
    wrapper, resumes by loading into the wrapper: the round trip is consistent (DDP120 silent).
    Loaded into nothing, the saved keys carry a `module.` prefix no plain model reads."""
    _write(tmp_path, {"pyproject.toml": "", "train.py": TRAIN_LOOP,
                      "main.py": LAUNCH.format(resume="model.load_state_dict(torch.load(resume)['state_dict'])")})
    assert [c for c in _codes(tmp_path / "train.py") if c.endswith("DDP120")] == []
    _write(tmp_path, {"main.py": LAUNCH.format(resume="pass")})
    assert [c for c in _codes(tmp_path / "train.py") if c.endswith("DDP120")] == ["9 DDP120"]
