import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import kwarg, string_value
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import assigned_name


class SummedLoss(Rule):
    """Training loss with `reduction="sum"` under DDP.

    ## What it does
    Flags a loss built or called with `reduction="sum"` whose result is backpropagated
    (evaluation under `torch.no_grad()` and `.item()` sums are fine).

    ## Why is this bad?
    DDP *averages* gradients over ranks. With a summed loss the gradient is the per-rank sum
    divided by N: 1/N of the single-process gradient over the same N×B samples, so the
    effective learning rate silently changes with the number of GPUs.

    ## Example
    ```python
    criterion = nn.CrossEntropyLoss(reduction="sum")
    ```

    ## Use instead
    ```python
    criterion = nn.CrossEntropyLoss()  # mean; or multiply the loss by world_size
    ```

    ## Fix safety
    No automatic fix: it changes the gradient scale by design.

    ## References
    - https://pytorch.org/docs/stable/notes/ddp.html
    """

    CODE = "DDP122"
    NAME = "summed-loss"
    MESSAGE = "`reduction='sum'` loss: DDP averages gradients over ranks, so the step size depends on world size; use a mean loss"
    SEVERITY = "warning"
    VALID = [
        "import torch.distributed as dist\nimport torch.nn.functional as F\nwith torch.no_grad():\n"
        "    test_loss += F.nll_loss(out, y, reduction='sum').item()\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nimport torch.nn.functional as F\n"
                "def step(out, y):\n    loss = F.nll_loss(out, y, reduction='sum')\n    loss.backward()\n"),
        Invalid("import torch.distributed as dist\nfrom torch import nn\ncrit = nn.MSELoss(reduction='sum')\n"
                "def step(out, y):\n    crit(out, y).backward()\n"),
    ]

    def check(self, ctx):
        backward_funcs = {c.func for c in ctx.calls if ctx.is_backward(c)}
        for ci in ctx.calls:
            k = kwarg(ci.node, "reduction")
            if k is None or string_value(k.value) != "sum" or not ci.qname_startswith(N.NN_PREFIX):
                continue
            if ci.in_no_grad or isinstance(ctx.parent(ci.node), cst.Attribute):
                continue
            name = assigned_name(ctx, ci.node)
            if ci.qname_startswith(N.FUNCTIONAL_PREFIX):
                if ci.func in backward_funcs:
                    yield Report(ci.node)
            elif name and any(
                c.dotted == name and not c.in_no_grad and c.func in backward_funcs for c in ctx.calls
            ):
                yield Report(ci.node)
