"""A finding whose premise the file does not prove says what it assumed; a proven one does not."""

from __future__ import annotations

import pytest

from ddpify.check.rule import select_rules
from ddpify.check.runner import check_source

HEAD = "import torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nfrom torch.utils.data import DataLoader\n"

TRAINED_LOADER = HEAD + (
    "dist.init_process_group('gloo')\nmodel = DDP(net)\nloader = DataLoader(ds, batch_size=8)\n"
    "for x in loader:\n    model(x).sum().backward()\n    opt.step()\n"
)
NAMED_LOADER = HEAD + "dist.init_process_group('gloo')\nmodel = DDP(net)\ntrain_loader = DataLoader(ds, batch_size=8)\n"
RANK0_FORWARD = HEAD + "dist.init_process_group('gloo')\nmodel = DDP(net{kw})\nif dist.get_rank() == 0:\n    model(x)\n"


def _messages(source: str, code: str) -> list[str]:
    result = check_source(source, "train.py", select_rules(None))
    return [f.message for f in result.findings if f.code == code]


@pytest.mark.parametrize(
    "source, code, assumed",
    [
        (TRAINED_LOADER, "DDP110", False),
        (NAMED_LOADER, "DDP110", True),
        (RANK0_FORWARD.format(kw=", find_unused_parameters=True"), "DDP117", False),
        (RANK0_FORWARD.format(kw=""), "DDP117", True),
    ],
)
def test_finding_says_what_it_assumed(source, code, assumed):
    messages = _messages(source, code)
    assert len(messages) == 1, messages
    assert ("assumed" in messages[0]) is assumed, messages[0]
