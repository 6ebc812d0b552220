from ddpify.analysis import names as N
from ddpify.check.context import COLLECTIVES
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import in_conditional_inside_loop


class CollectiveEveryStep(Rule):
    """Extra collective every training step (for logging).

    ## What it does
    Flags `all_reduce`, `all_gather`, `reduce`, `broadcast`, ... called unconditionally in
    the step loop.

    ## Why is this bad?
    Each one is a blocking round trip across all GPUs on top of DDP's own gradient
    all-reduce, usually only to log a loss. Accumulate locally and reduce once per epoch or
    every `log_interval` steps.

    ## Example
    ```python
    for x, y in loader:
        loss = step(x, y)
        dist.all_reduce(loss)
        losses.append(loss.item())
    ```

    ## Use instead
    ```python
    for i, (x, y) in enumerate(loader):
        loss = step(x, y)
        if i % log_interval == 0:
            dist.all_reduce(loss)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/notes/ddp.html
    """

    CODE = "DDP203"
    NAME = "collective-every-step"
    MESSAGE = "collective every training step adds a cross-GPU sync; reduce once per epoch or every `log_interval` steps"
    SEVERITY = "warning"
    VALID = [
        "import torch.distributed as dist\nfor i, x in enumerate(loader):\n    l = model(x).sum()\n"
        "    l.backward()\n    if i % 10 == 0:\n        dist.all_reduce(l)\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nfor x in loader:\n    l = model(x).sum()\n"
                "    l.backward()\n    dist.all_reduce(l)\n"),
    ]

    def check(self, ctx):
        for ci in ctx.calls_to(*(COLLECTIVES - N.BARRIERS)):
            if ctx.in_step(ci.node) and not in_conditional_inside_loop(ctx, ci.node):
                yield Report(ci.node)
