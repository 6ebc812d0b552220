from ddpify.analysis import names as N
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import in_conditional_inside_loop


class BarrierInStepLoop(Rule):
    """`barrier()` every training step.

    ## What it does
    Flags `dist.barrier()` in the step loop (a loop that runs a backward each iteration, or
    a function called once per step). A barrier under a test inside the loop (`if step %
    save_every == 0:`, around a checkpoint) runs every N steps, not every step, and is not
    flagged.

    ## Why is this bad?
    Every step waits for the slowest rank twice (DDP's all-reduce already synchronises the
    gradients): pure idle time that grows with the number of GPUs.

    ## Example
    ```python
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward()
        dist.barrier()
    ```

    ## Use instead
    ```python
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward()
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/notes/ddp.html
    """

    CODE = "DDP202"
    NAME = "barrier-in-step-loop"
    MESSAGE = "`barrier()` every step stalls all ranks; DDP already syncs gradients, remove it or move it out of the step loop"
    SEVERITY = "warning"
    VALID = [
        "import torch.distributed as dist\nfor x in loader:\n    model(x).sum().backward()\ndist.barrier()\n",
        "import torch.distributed as dist\nfor step, x in enumerate(loader):\n    model(x).sum().backward()\n"
        "    if step % 500 == 0:\n        dist.barrier()\n",
    ]
    INVALID = [Invalid("import torch.distributed as dist\nfor x in loader:\n    model(x).sum().backward()\n    dist.barrier()\n")]

    def check(self, ctx):
        for ci in ctx.calls_to(*N.BARRIERS):
            if ctx.in_step(ci.node) and not in_conditional_inside_loop(ctx, ci.node):
                yield Report(ci.node)
