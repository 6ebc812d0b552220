"""The shared control-flow facts (ddpify/analysis/flow.py): where paths end, what can follow
what, and which branches run without a process group."""

from __future__ import annotations

import libcst as cst
import pytest

from ddpify.analysis.flow import flow
from ddpify.analysis.index import index_of, iter_nodes

PATHS = '''
import sys
def setup():
    if early():
        return n()
    if cuda():
        a()
        return 1
    b()
    for x in y:
        c()
        if z:
            continue
        d()
        break
        e()
    g()
    try:
        h()
        raise X
    except E:
        i()
    j()
    if q:
        k()
        sys.exit(1)
    else:
        l()
        return
    m()
'''

MODES = '''
import torch.distributed as dist
def main():
    if LOCAL_RANK != -1:
        assert not opt.evolve, "no"
    if not opt.evolve:
        train()
    else:
        evolve()
    if args.distributed:
        ddp()
    else:
        single()
def solo():
    assert not dist.is_initialized()
    p()
class Trainer:
    def __init__(self):
        self.is_ddp = dist.is_available() and dist.is_initialized()
        if self.is_ddp:
            sharded()
        else:
            whole()
def sentinel(settings, model):
    if settings.local_rank != -1:
        wrapped()
    else:
        plain()
    if hasattr(model, "module"):
        inner()
    else:
        bare()
def quit_early(files):
    if not files:
        warn()
        return
    if files is None:
        fail()
        raise SystemExit(1)
    work()
'''


def _calls(src: str):
    module = cst.parse_module(src)
    index = index_of(module)
    by_name = {module.code_for_node(c.func): c for c in iter_nodes(module) if isinstance(c, cst.Call)}
    return flow(index), by_name


@pytest.mark.parametrize(
    "a, b, reaches",
    [
        ("a", "b", False),  # `return` ends the branch
        ("n", "b", False),  # `return n()`: the call's own statement leaves
        ("early", "b", True),
        ("b", "c", True),
        ("c", "d", True),  # `continue` only under an `if`
        ("d", "e", False),  # after `break`
        ("c", "g", True),  # out of the loop
        ("e", "g", True),
        ("h", "i", True),  # the `raise` in `try` goes to its handler
        ("h", "j", True),
        ("k", "l", False),  # the other branch
        ("j", "k", True),
        ("k", "m", False),  # `sys.exit()`
        ("l", "m", False),
        ("j", "m", False),  # both branches leave
        ("m", "a", False),  # earlier in the source
    ],
)
def test_reaches(a, b, reaches):
    paths, calls = _calls(PATHS)
    assert paths.reaches(calls[a], calls[b]) is reaches


@pytest.mark.parametrize(
    "name, single",
    [("train", False), ("evolve", True), ("ddp", False), ("single", True), ("p", True), ("work", False),
     ("sharded", False), ("whole", True),  # a flag bound to `dist.is_available() and dist.is_initialized()`
     ("wrapped", False), ("plain", True), ("inner", False), ("bare", True)],  # `local_rank != -1`, `hasattr(m, "module")`
)
def test_single_process_branches(name, single):
    paths, calls = _calls(MODES)
    assert paths.single_process(calls[name]) is single


@pytest.mark.parametrize("name, returns, on_exit", [("warn", True, True), ("warn", False, False), ("fail", False, True), ("work", True, False)])
def test_on_exit_path(name, returns, on_exit):
    paths, calls = _calls(MODES)
    assert paths.on_exit_path(calls[name], returns=returns) is on_exit


def test_flags_asserted_off_in_a_one_line_suite_or_block():
    paths, _ = _calls("if world_size > 1: assert not opt.search\nif args.distributed:\n    if x:\n        pass\n    assert not opt.evolve\n")
    assert paths.flags_off_under_ddp == {"opt.search", "opt.evolve"}


@pytest.mark.parametrize(
    "body, ends",
    [
        ("try:\n    a()\nexcept E:\n    return 1\nelse:\n    return 2\n", "function"),  # both ways out
        ("try:\n    return a()\nexcept E:\n    pass\n", None),  # the handler goes on
        ("try:\n    a()\nfinally:\n    raise X\n", "function"),
        ("if x:\n    break\nelse:\n    return\n", "loop"),  # the nearer way out
        ("with lock:\n    sys.exit(1)\n", "function"),
    ],
)
def test_where_a_statement_ends(body, ends):
    module = cst.parse_module("import sys\ndef f():\n    for _ in y:\n" + "".join(f"        {line}\n" for line in body.splitlines()))
    paths = flow(index_of(module))
    loop = module.body[1].body.body[0]
    assert paths.ends(loop.body.body[0]) == ends


LOOKUPS = '''
import os
def setup():
    try:
        rank = int(os.environ["RANK"])
        start()
    except KeyError:
        alone()
    try:
        launch()
        size = int(os.environ["WORLD_SIZE"])
    except KeyError:
        fallback()
    try:
        begin()
        after()
    except Exception as e:
        report(e)
    try:
        last()
    except TypeError:
        retry()
'''


@pytest.mark.parametrize(
    "a, b, reaches",
    [
        ("start", "alone", False),  # no lookup left after `start()`: a KeyError came before it
        ("launch", "fallback", True),  # a lookup after `launch()` may still fail
        ("begin", "report", True),  # any exception (`after()` may raise once `begin()` is done)
        ("last", "retry", False),  # the handler runs only when `last()` itself failed
    ],
)
def test_a_lookup_handler_follows_only_the_lookups(a, b, reaches):
    paths, calls = _calls(LOOKUPS)
    assert paths.reaches(calls[a], calls[b]) is reaches


def test_in_error_handler():
    paths, calls = _calls(LOOKUPS)
    assert paths.in_error_handler(calls["report"]) and not paths.in_error_handler(calls["begin"])


def test_a_flag_that_starts_the_group_is_a_test_of_the_run_mode():
    """`if cfg.MODEL.DIST_TRAIN: dist.init_process_group(...)`: wherever the flag is tested, its
    `else:` runs without a group."""
    paths, calls = _calls(
        "import torch.distributed as dist\n"
        "def main(cfg):\n    if cfg.MODEL.DIST_TRAIN:\n        dist.init_process_group('nccl')\n"
        "def train(cfg):\n    if cfg.MODEL.DIST_TRAIN:\n        gathered()\n    else:\n        alone()\n"
    )
    assert paths.single_process(calls["alone"]) and not paths.single_process(calls["gathered"])
