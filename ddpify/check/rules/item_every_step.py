from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import in_conditional_inside_loop


class ItemEveryStep(Rule):
    """`.item()` every training step.

    ## What it does
    Flags `.item()` called unconditionally in the step loop. Off by default: cheap on small models.

    ## Why is this bad?
    `.item()` copies to the host and waits for the GPU, so the CPU cannot queue the next
    step while DDP's all-reduce runs: compute and communication stop overlapping.

    ## Example
    ```python
    for x, y in loader:
        ...
        total += loss.item()
    ```

    ## Use instead
    ```python
    for i, (x, y) in enumerate(loader):
        ...
        total += loss.detach()
    print(total.item())
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html#avoid-unnecessary-cpu-gpu-synchronization
    """

    CODE = "DDP903"
    NAME = "item-every-step"
    MESSAGE = "`.item()` every step synchronises the GPU; accumulate tensors and call `.item()` once per log interval"
    DEFAULT = False
    SEVERITY = "warning"
    VALID = ["import torch.distributed as dist\nfor i, x in enumerate(loader):\n    l = model(x).sum()\n"
             "    l.backward()\n    if i % 10 == 0:\n        print(l.item())\n"]
    INVALID = [Invalid("import torch.distributed as dist\nfor x in loader:\n    l = model(x).sum()\n"
                       "    l.backward()\n    total += l.item()\n")]

    def check(self, ctx):
        for ci in ctx.method_calls("item"):
            if not ci.node.args and ctx.in_step(ci.node) and not in_conditional_inside_loop(ctx, ci.node):
                yield Report(ci.node)
