import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import is_true, kwarg
from ddpify.check.rule import Invalid, Report, Rule


class AsyncCollectiveNeverWaited(Rule):
    """An asynchronous collective whose work handle is thrown away.

    ## What it does
    Flags `dist.all_reduce(t, async_op=True)` (any collective given `async_op=True`) used as a
    statement of its own: the handle it returns, the only way to wait for the result, is
    dropped.

    ## Why is this bad?
    With `async_op=True` the call returns before the ranks have exchanged anything; `t` holds
    the result only after `handle.wait()`. Code that reads or changes `t` next (`t.div_(world)`,
    copying it back into the gradients) works on this rank's own values, or on a half-filled
    buffer: the ranks step with different gradients and drift apart.

    ## Example
    ```python
    dist.all_reduce(flat, async_op=True)
    flat.div_(world_size)
    ```

    ## Use instead
    ```python
    work = dist.all_reduce(flat, async_op=True)
    ...  # overlap other work here
    work.wait()
    flat.div_(world_size)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://github.com/OpenNMT/OpenNMT-py/issues/2295
    - https://pytorch.org/docs/stable/distributed.html#synchronous-and-asynchronous-collective-operations
    """

    CODE = "DDP164"
    NAME = "async-collective-never-waited"
    DISTRIBUTED_ONLY = False
    MESSAGE = "a collective with `async_op=True` whose work handle is dropped: nothing waits for the result; keep the handle and call `.wait()` before reading the tensor"
    VALID = [
        "import torch.distributed as dist\nwork = dist.all_reduce(t, async_op=True)\nwork.wait()\n",
        "import torch.distributed as dist\nhandles.append(dist.all_reduce(t, async_op=True))\n",
    ]
    INVALID = [Invalid("import torch.distributed as dist\ndist.all_reduce(t, async_op=True)\nt.div_(2)\n")]

    def check(self, ctx):
        for ci in ctx.calls_to(*N.COLLECTIVES):
            flag = kwarg(ci.node, "async_op")
            if flag is not None and is_true(flag.value) and isinstance(ctx.parent(ci.node), cst.Expr):
                yield Report(ci.node)
