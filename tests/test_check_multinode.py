"""The multi-node rules: a local-rank guard around job-wide output (DDP307), a download on
global rank 0 only (DDP906, opt-in), a hard-coded rendezvous endpoint (DDP123)."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.analysis.index import index_of
from ddpify.analysis.multinode import GLOBAL, LOCAL, OPAQUE, guard_kind, launched_by_torchrun
from ddpify.analysis.rank import rank_analysis
from ddpify.check.rule import select_rules
from ddpify.check.runner import check_source

TORCHRUN = "import os, torch, torch.distributed as dist\nlocal_rank = int(os.environ['LOCAL_RANK'])\n"


def found(source: str, code: str) -> list[str]:
    return [f"{f.line}:{f.column}" for f in check_source(source, "t.py", [code]).findings]


@pytest.mark.parametrize(
    "test,kind",
    [
        ("local_rank == 0", LOCAL),
        ("args.local_rank == 0", LOCAL),
        ("int(os.environ['LOCAL_RANK']) == 0", LOCAL),
        ("int(os.environ.get('LOCAL_RANK', 0)) == 0", LOCAL),
        ("dist.get_node_local_rank() == 0", LOCAL),
        ("local_rank != 0", LOCAL),
        ("dist.get_rank() == 0", GLOBAL),
        ("rank == 0", GLOBAL),
        ("int(os.environ['RANK']) == 0", GLOBAL),
        ("local_rank == 0 and dist.get_rank() == 0", GLOBAL),
        ("node_rank == 0 and local_rank == 0", GLOBAL),
        ("local_rank in (-1, 0)", LOCAL),
        ("args.local_rank in [-1, 0]", LOCAL),
        ("args.rank % ngpus == 0", LOCAL),
        ("gpu == 0", OPAQUE),
        ("is_main_process()", OPAQUE),
        ("is_local_master", LOCAL),  # a flag: `is_local_master = local_rank == 0`
        ("is_master", GLOBAL),  # a flag: `is_master = dist.get_rank() == 0`
    ],
)
def test_guard_kind(test, kind):
    source = (
        "import os, torch.distributed as dist\nis_local_master = local_rank == 0\n"
        f"is_master = dist.get_rank() == 0\nif {test}:\n    pass\n"
    )
    index = index_of(cst.parse_module(source))
    guard = next(s for s in index.module.body if isinstance(s, cst.If))
    assert guard_kind(rank_analysis(index), guard.test) == kind


@pytest.mark.parametrize(
    "source,expected",
    [
        (TORCHRUN, True),
        ("import torch.distributed as dist\ndist.init_process_group('nccl')\n", True),
        ("import torch.distributed as dist\ndist.init_process_group(backend='nccl', init_method='env://', timeout=t, device_id=d)\n", True),
        ("import torch.distributed as dist\ndef w(r, n):\n    dist.init_process_group('gloo', rank=r, world_size=n)\n", False),
        # an mp.spawn shim fills torchrun's variables in itself
        ("import os, torch.distributed as dist, torch.multiprocessing as mp\ndef w(r):\n    os.environ['RANK'] = str(r)\n"
         "    rank = int(os.environ['RANK'])\n    dist.init_process_group('gloo')\nmp.spawn(w, nprocs=2)\n", False),
    ],
)
def test_launched_by_torchrun(source, expected):
    assert launched_by_torchrun(index_of(cst.parse_module(source))) is expected


# DDP307 -------------------------------------------------------------------------------------


def test_one_finding_per_guard_at_its_test():
    source = TORCHRUN + "if local_rank == 0:\n    print('a')\n    print('b')\n    torch.save(sd, 'm.pt')\n"
    assert found(source, "DDP307") == ["3:4"]


def test_the_message_quotes_the_guard():
    source = TORCHRUN + "if args.local_rank in [-1, 0]:\n    print('a')\n"
    [finding] = check_source(source, "t.py", ["DDP307"]).findings
    assert finding.message.startswith("`args.local_rank in [-1, 0]` tests the local rank: this runs once per node")


@pytest.mark.parametrize(
    "body",
    [
        "import logging\nlogger = logging.getLogger(__name__)\nif local_rank == 0:\n    logger.info('epoch %d', e)\n",
        "import wandb\nrun = wandb.init(project='p') if local_rank == 0 else None\n",
        "if local_rank == 0:\n    with open('results.csv', 'a') as f:\n        f.write('x')\n",
        "is_local_master = local_rank == 0\nif is_local_master:\n    print('done')\n",
        "if dist.get_node_local_rank() == 0:\n    save_checkpoint(model, 'ckpt.pt')\n",
        "def report():\n    print('done')\nif local_rank != 0:\n    pass\nelse:\n    report()\n",
        # a folder for the output is not data preparation
        "if local_rank == 0:\n    os.makedirs(args.output_dir, exist_ok=True)\n    torch.save(sd, 'out/m.pt')\n",
        # the legacy idiom: under torchrun the local rank is never -1
        "if local_rank in (-1, 0):\n    print('done')\n",
        "def save(args, sd):\n    if args.local_rank not in [-1, 0]:\n        return\n    torch.save(sd, 'm.pt')\n",
        # the rank within its node
        "if dist.get_rank() % torch.cuda.device_count() == 0:\n    torch.save(sd, 'm.pt')\n",
    ],
)
def test_flags_job_wide_output_under_a_local_guard(body):
    assert found(TORCHRUN + body, "DDP307")


@pytest.mark.parametrize(
    "body",
    [
        # the global rank, or both
        "if dist.get_rank() == 0:\n    print('done')\n",
        "if local_rank == 0 and dist.get_rank() == 0:\n    print('done')\n",
        # a helper that guards on the global rank itself
        "def save_on_master(sd):\n    if dist.get_rank() == 0:\n        torch.save(sd, 'm.pt')\n"
        "if local_rank == 0:\n    save_on_master(sd)\n",
        # per-node data preparation
        "if local_rank == 0:\n    os.makedirs('data', exist_ok=True)\n    print('preparing data')\ndist.barrier()\n",
        "if local_rank == 0:\n    tarfile.open('d.tar').extractall('data')\n    print('unpacked')\n",
        "if local_rank == 0:\n    torch.save(features, 'data/cache.pt')\n",
        # a file written at start and read back (a vocabulary): node data, as convert writes it
        "if local_rank == 0:\n    with open('vocab.json', 'w') as f:\n        json.dump(vocab, f)\n"
        "dist.barrier()\nwith open('vocab.json') as f:\n    vocab = json.load(f)\n",
        # only reads, or the writer's calls (its creation is the finding)
        "if local_rank == 0:\n    writer.add_scalar('loss', 1.0, 0)\n",
        # output that names the node
        "if local_rank == 0:\n    print(f'{socket.gethostname()}: ready')\n",
        "if local_rank == 0:  # noqa: DDP307\n    print('done')\n",
    ],
)
def test_leaves_global_guards_and_data_preparation(body):
    assert found(TORCHRUN + body, "DDP307") == []


# DDP906 -------------------------------------------------------------------------------------


def test_download_helper_reported_at_its_call():
    source = (
        TORCHRUN + "import urllib.request\ndef fetch():\n    urllib.request.urlretrieve(URL, 'd.tar')\n"
        "if dist.get_rank() == 0:\n    fetch()\ndist.barrier()\n"
    )
    assert found(source, "DDP906") == ["7:5"]


@pytest.mark.parametrize(
    "body",
    [
        "if dist.get_rank() == 0:\n    MNIST('d', download=True)\n",  # no barrier
        "if local_rank == 0:\n    MNIST('d', download=True)\ndist.barrier()\n",
        "if dist.get_rank() == 0:\n    MNIST('d', download=False)\ndist.barrier()\n",
    ],
)
def test_download_left_alone(body):
    assert found(TORCHRUN + body, "DDP906") == []


def test_download_on_one_node_is_opt_in():
    source = TORCHRUN + "if dist.get_rank() == 0:\n    MNIST('d', download=True)\ndist.barrier()\n"
    assert "DDP906" not in select_rules(None) and "DDP906" in select_rules(["ALL"])
    assert check_source(source, "t.py", select_rules(None)).findings == []
    assert found(source, "DDP906") == ["4:16"]  # the `download=True`


# DDP123 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        "os.environ['MASTER_ADDR'] = 'localhost'\n",
        "os.environ['MASTER_PORT'] = str(29500)\n",
        "os.environ.update({'MASTER_ADDR': '127.0.0.1'})\n",
        "from os import environ\nenviron['MASTER_ADDR'] = 'node001'\n",
        "dist.init_process_group('nccl', init_method=f'tcp://localhost:{port}', rank=r, world_size=w)\n",
        "dist.init_process_group('nccl', 'tcp://127.0.0.1:29500', rank=r, world_size=w)\n",
        "if args.debug:\n    os.environ['MASTER_ADDR'] = 'localhost'\n",
    ],
)
def test_flags_a_hard_coded_rendezvous(body):
    assert found(TORCHRUN + body, "DDP123")


@pytest.mark.parametrize(
    "body",
    [
        "os.environ['MASTER_ADDR'] = args.master_addr\n",  # chosen by the user
        "os.environ['MASTER_PORT'] = str(free_port())\n",
        "os.environ.setdefault('MASTER_ADDR', 'localhost')\n",  # keeps torchrun's value
        "dist.init_process_group('nccl', init_method=f'tcp://{addr}:{port}', rank=r, world_size=w)\n",
        "dist.init_process_group('nccl', init_method='env://')\n",
        "if 'MASTER_ADDR' not in os.environ:\n    os.environ['MASTER_ADDR'] = 'localhost'\n",
        "if os.environ.get('WORLD_SIZE') is None:\n    os.environ['MASTER_PORT'] = '29500'\n",
        "def fallback():\n    os.environ['MASTER_ADDR'] = 'localhost'\n"
        "if 'LOCAL_RANK' in os.environ:\n    main()\nelse:\n    fallback()\n",
    ],
)
def test_leaves_launcher_fallbacks(body):
    assert found(TORCHRUN + body, "DDP123") == []


def test_rendezvous_left_alone_without_torchrun():
    source = (
        "import os, torch.distributed as dist, torch.multiprocessing as mp\ndef worker(rank, n):\n"
        "    os.environ['MASTER_ADDR'] = 'localhost'\n    dist.init_process_group('gloo', rank=rank, world_size=n)\n"
        "mp.spawn(worker, args=(2,), nprocs=2)\n"
    )
    assert found(source, "DDP123") == []
