import libcst as cst

from ddpify.analysis.multinode import (
    RENDEZVOUS_VARIABLES, SPAWN, TORCHRUN_VARIABLES, env_read, env_tested, env_writes, launched_by_torchrun,
)  # fmt: skip
from ddpify.check.context import INIT_PROCESS_GROUP, SPAWN, int_value, iter_nodes, kwarg, positional, string_value
from ddpify.check.rule import Invalid, Report, Rule

_LAUNCHER = TORCHRUN_VARIABLES | RENDEZVOUS_VARIABLES


class HardCodedRendezvous(Rule):
    """Rendezvous address or port hard-coded in a script launched by torchrun.

    ## What it does
    Flags `os.environ["MASTER_ADDR"] = "localhost"`, a fixed `MASTER_PORT` (also through
    `os.environ.update(...)`) and `init_process_group(init_method="tcp://127.0.0.1:29500")` in
    a script that reads torchrun's environment (`LOCAL_RANK`, `RANK`, `WORLD_SIZE`) or calls
    `init_process_group` without a rank. Values set only when torchrun did not launch the script
    (under `if "MASTER_ADDR" not in os.environ:` or `if "WORLD_SIZE" not in os.environ:`, the
    `else` of `if "LOCAL_RANK" in os.environ:`, the `except` of a `try` that reads torchrun's
    variables, in an `mp.spawn` worker), a group of one (`world_size=1`) and
    `os.environ.setdefault(...)`, which keeps torchrun's value, are not flagged.

    ## Why is this bad?
    torchrun sets `MASTER_ADDR` and `MASTER_PORT` to the rendezvous endpoint of the job; the
    script overwrites them, so on several nodes every node looks for the master on itself and
    the process group never forms (a hang, then a timeout).

    ## Example
    ```python
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("nccl")
    ```

    ## Use instead
    ```python
    dist.init_process_group("nccl")  # torchrun --rdzv-endpoint=host:port sets them
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/elastic/run.html (torchrun, "Environment Variables")
    """

    CODE = "DDP123"
    NAME = "hard-coded-rendezvous"
    MESSAGE = "hard-coded `MASTER_ADDR`/`MASTER_PORT` overrides torchrun's rendezvous endpoint (other nodes never meet it); let torchrun set them"
    VALID = [
        "import os, torch.distributed as dist\nif 'MASTER_ADDR' not in os.environ:\n"
        "    os.environ['MASTER_ADDR'] = 'localhost'\nrank = int(os.environ['RANK'])\ndist.init_process_group('nccl')\n",
        "import os, torch.distributed as dist\nos.environ.setdefault('MASTER_ADDR', 'localhost')\n"
        "local_rank = int(os.environ['LOCAL_RANK'])\ndist.init_process_group('nccl')\n",
        # mp.spawn: no torchrun, the processes meet on this machine
        "import os, torch.distributed as dist\ndef setup(rank, world_size):\n    os.environ['MASTER_ADDR'] = 'localhost'\n"
        "    os.environ['MASTER_PORT'] = '12355'\n    dist.init_process_group('nccl', rank=rank, world_size=world_size)\n",
    ]
    INVALID = [
        Invalid("import os, torch.distributed as dist\nos.environ['MASTER_ADDR'] = 'localhost'\n"
                "local_rank = int(os.environ['LOCAL_RANK'])\ndist.init_process_group('nccl')\n"),
        Invalid("import os, torch.distributed as dist\nos.environ['MASTER_PORT'] = '29500'\ndist.init_process_group('nccl')\n"),
        Invalid("import os, torch.distributed as dist\nrank = int(os.environ['RANK'])\n"
                "dist.init_process_group('nccl', init_method='tcp://127.0.0.1:29500', rank=rank, world_size=2)\n"),
    ]

    def check(self, ctx):
        if not launched_by_torchrun(ctx.index):
            return
        for name, node, value in env_writes(ctx.index):
            if name in RENDEZVOUS_VARIABLES and not isinstance(node, cst.Call) and _constant(value):
                if not _fallback(ctx, node) and not _spawns_here(ctx, node):
                    yield Report(node)
        for ci in ctx.calls_to(*INIT_PROCESS_GROUP):
            args = positional(ci.node)
            method = kwarg(ci.node, "init_method") or (args[1] if len(args) > 1 else None)
            size = kwarg(ci.node, "world_size")
            if size is not None and int_value(size.value) == 1:
                continue  # a group of one process: nobody else to meet
            if method is not None and _tcp_literal_host(method.value) and not _fallback(ctx, ci.node):
                yield Report(method)


def _constant(value) -> bool:
    """`"localhost"`, `12355`, `str(12355)`."""
    if isinstance(value, (cst.SimpleString, cst.ConcatenatedString, cst.Integer)):
        return True
    if isinstance(value, cst.FormattedString):
        return all(isinstance(p, cst.FormattedStringText) for p in value.parts)
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "str" and len(value.args) == 1:
        return _constant(value.args[0].value)
    return False


def _tcp_literal_host(value) -> bool:
    """`"tcp://127.0.0.1:29500"`, `f"tcp://localhost:{port}"`: the host is written in the code."""
    if isinstance(value, cst.FormattedString):
        first = value.parts[0] if value.parts else None
        text = first.value if isinstance(first, cst.FormattedStringText) else ""
    else:
        text = string_value(value) or ""
    return text.startswith("tcp://") and len(text) > len("tcp://") and text[len("tcp://")] not in ":/"


def _fallback(ctx, node, depth: int = 0) -> bool:
    """Code that runs only when torchrun did not launch the script: under a test of its
    environment, or in an `mp.spawn` worker (or a function only those call)."""
    for p in ctx.ancestors(node):
        if isinstance(p, (cst.If, cst.IfExp, cst.While)) and env_tested(ctx.index, p.test, _LAUNCHER):
            return True
        if isinstance(p, cst.Try) and any(h in set(ctx.ancestors(node)) for h in p.handlers):
            if any(env_read(ctx.index, n) in _LAUNCHER for n in iter_nodes(p.body)):
                return True  # `try: rank = int(os.environ["RANK"]) ... except KeyError: <no launcher>`
        if isinstance(p, cst.FunctionDef):
            spawned = any(
                positional(s.node) and ctx.code(positional(s.node)[0].value) == p.name.value for s in ctx.calls_to(*SPAWN)
            )
            sites = ctx.call_sites(p)
            return spawned or (depth < 3 and bool(sites) and all(_fallback(ctx, s.node, depth + 1) for s in sites))
    return False


def _spawns_here(ctx, node) -> bool:
    """Set by the function that then starts this machine's workers itself (`os.environ["MASTER_ADDR"]
    = "localhost"`, then `mp.spawn(worker, nprocs=n)`): a one-machine launcher, not a torchrun rank."""
    func = ctx.enclosing_func(node)
    return any(ci.func is func and ctx.line(ci.node) > ctx.line(node) for ci in ctx.calls_to(*SPAWN))
