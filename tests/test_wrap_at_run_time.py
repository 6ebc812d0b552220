"""The DDP wrap convert inserts, run where the static view and the run disagree (issue 31, section 2).

A GPU node cannot be had here, so the inserted wrap statement itself runs in a process group of
one (gloo) with what such a node would give it: a `device` of type "cuda" and a model the script
kept on the CPU. The whole conversions run under torchrun in test_unseen_shapes.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT

from ddpify.projects import convert_project

UNSEEN = ROOT / "fixtures" / "unseen"


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _inserted_wrap(case: str, model: str) -> str:
    """The statements of the case's converted entry that wrap `model` (a guarded wrap with its `if`)."""
    (result, _, _), *_ = convert_project(UNSEEN / case / "train.py").changed.values()
    lines = result.code.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith(f"{model} = DDP("))
    first = at - 1 if lines[at - 1].lstrip().startswith("if ") else at
    indent = len(lines[first]) - len(lines[first].lstrip())
    return "\n".join(line[indent:] for line in lines[first : at + 1])


def test_a_model_on_the_cpu_gets_no_device_ids_where_the_device_is_a_gpu(group):
    """`--keep-on-cpu` on a GPU node: `device` is cuda:<local_rank>, the model's parameters are on
    the CPU; `device_ids=[local_rank]` there raises ValueError in DDP's constructor."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrap = _inserted_wrap("model_kept_on_cpu", "model")
    names = {"model": torch.nn.Linear(4, 1), "device": torch.device("cuda", 0), "local_rank": 0, "DDP": DDP}
    exec(wrap, names)
    assert isinstance(names["model"], DDP) and names["model"].device_ids is None
