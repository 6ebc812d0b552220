"""Which tests of the rank make a branch rank 0's (ddpify/analysis/rank.py)."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.analysis.index import index_of, iter_nodes
from ddpify.analysis.rank import rank_analysis

SOURCE = '''
import torch.distributed as dist
rank = dist.get_rank()
is_main = rank == 0
quiet = args.dry_run or not is_main
tracker = Null() if quiet else start_tracker()
if self.rank is 0:
    identity_zero()
if rank == 0 or args.every_rank:
    opted_in()
if args.dry_run or rank != 0:
    skipped()
else:
    rank_zero_else()
'''


@pytest.mark.parametrize(
    "name, rank0",
    [
        ("start_tracker", True),  # the `else` of `dry_run or not is_main`
        ("identity_zero", True),  # `is 0` on CPython's small ints
        ("opted_in", False),  # every rank when the option is on
        ("rank_zero_else", True),
        ("skipped", False),
    ],
)
def test_rank0_branches(name, rank0):
    module = cst.parse_module(SOURCE)
    index = index_of(module)
    call = next(c for c in iter_nodes(module) if isinstance(c, cst.Call) and module.code_for_node(c.func) == name)
    assert rank_analysis(index).in_rank0(call) is rank0


def test_an_opt_in_to_every_rank_is_still_a_test_of_the_rank():
    module = cst.parse_module(SOURCE)
    index = index_of(module)
    call = next(c for c in iter_nodes(module) if isinstance(c, cst.Call) and module.code_for_node(c.func) == "opted_in")
    assert rank_analysis(index).under_rank_test(call)


def test_code_after_a_rank_test_that_returns_is_the_other_ranks():
    """`if self.rank == 0: return` then `sys.stdout = open(os.devnull, "w")` (a context manager's
    `__enter__`): the rest of the block is decided by the rank."""
    module = cst.parse_module(
        "class Hidden:\n    def __enter__(self):\n        if self.rank == 0:\n            return\n"
        "        silence()\n    def __exit__(self, *exc):\n        restore()\n"
    )
    ranks = rank_analysis(index_of(module))
    calls = {module.code_for_node(c.func): c for c in iter_nodes(module) if isinstance(c, cst.Call)}
    assert ranks.under_rank_test(calls["silence"]) and not ranks.in_rank0(calls["silence"])
    assert not ranks.under_rank_test(calls["restore"])


@pytest.mark.parametrize(
    "expr, reads",
    [("load_on_all_ranks", False), ("args.num_ranks", False), ("ranking_loss", False), ("self.global_rank", True),
     ("get_local_rank()", True), ("cfg.rank", True)],
)
def test_ranks_plural_and_rankings_are_not_the_rank(expr, reads):
    """A flag or count named for several ranks (`load_on_all_ranks`, `num_ranks`) or a ranking
    metric is not this process's rank."""
    module = cst.parse_module(f"if {expr}:\n    pass\n")
    test = module.body[0].test
    assert rank_analysis(index_of(module)).reads_rank(test) is reads


def test_a_field_cleared_off_rank0_is_a_rank0_flag():
    """`if rank not in [0, -1]: self._use_wandb = False; cfg.ckpt_dir = None`: `if
    self._use_wandb:` and `if cfg.ckpt_dir is not None:` are rank 0's."""
    module = cst.parse_module(
        "import os\nclass E:\n    def __init__(self, cfg):\n        rank = int(os.environ['RANK'])\n"
        "        if rank not in [0, -1]:\n            self._use_wandb = False\n            cfg.ckpt_dir = None\n"
        "    def run(self, cfg):\n        if self._use_wandb:\n            track()\n"
        "        if cfg.ckpt_dir is not None:\n            save()\n        if self.other:\n            every()\n"
    )
    ranks = rank_analysis(index_of(module))
    calls = {module.code_for_node(c.func): c for c in iter_nodes(module) if isinstance(c, cst.Call)}
    assert ranks.in_rank0(calls["track"]) and ranks.in_rank0(calls["save"]) and not ranks.in_rank0(calls["every"])
