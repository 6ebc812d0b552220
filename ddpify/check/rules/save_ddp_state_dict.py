
from ddpify.check.fix import insert_module_attr
from ddpify.check.rule import FIX_UNSAFE, Invalid, Report, Rule


class SaveDDPStateDict(Rule):
    """`state_dict()` taken from the DDP wrapper.

    ## What it does
    Flags `ddp_model.state_dict()` where `ddp_model` holds the `DistributedDataParallel` wrapper.

    A program that loads the state back into the wrapper too (`module.` keys on both sides: a
    resume of its own checkpoints, a best-model copy) is consistent and is not flagged.

    ## Why is this bad?
    Every key gets a `module.` prefix: the checkpoint no longer loads into the plain model
    (single-GPU script, inference, or `model.module` on resume) without renaming keys.

    ## Example
    ```python
    torch.save(ddp_model.state_dict(), "model.pt")
    ```

    ## Use instead
    ```python
    torch.save(ddp_model.module.state_dict(), "model.pt")
    ```

    ## Fix safety
    Unsafe: it changes the keys of every checkpoint saved from now on (no `module.` prefix),
    so code that loads them into the wrapper, and old checkpoints loaded by new code, part
    ways (see DDP121). `--fix` leaves it; `--fix --unsafe-fixes` applies it.

    ## References
    - https://pytorch.org/tutorials/intermediate/ddp_tutorial.html#save-and-load-checkpoints
    - https://github.com/pytorch/examples/blob/main/distributed/ddp-tutorial-series/multigpu_torchrun.py
    """

    CODE = "DDP120"
    NAME = "save-ddp-state-dict"
    DDP_ONLY = True
    MESSAGE = "`state_dict()` of the DDP wrapper prefixes every key with `module.`; use `model.module.state_dict()`"
    FIX = FIX_UNSAFE
    VALID = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
        "sd = model.module.state_dict()\n",
        "from torch.nn.parallel import DistributedDataParallel as DDP\nsd = net.state_dict()\nmodel = DDP(net)\n",
        # a helper's parameter named like the DDP global, given the unwrapped model
        "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "def save(model, path):\n    torch.save(model.state_dict(), path)\n"
        "model = DDP(net)\nsave(model.module, 'm.pt')\n",
    ]
    INVALID = [
        Invalid(
            "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
            "torch.save(model.state_dict(), 'm.pt')\n",
            "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
            "torch.save(model.module.state_dict(), 'm.pt')\n",
        ),
        Invalid(
            "from torch.nn.parallel import DistributedDataParallel as DDP\nclass T:\n"
            "    def __init__(self, m):\n        self.model = DDP(m)\n"
            "    def save(self):\n        return {'model': self.model.state_dict()}\n",
            "from torch.nn.parallel import DistributedDataParallel as DDP\nclass T:\n"
            "    def __init__(self, m):\n        self.model = DDP(m)\n"
            "    def save(self):\n        return {'model': self.model.module.state_dict()}\n",
        ),
    ]

    def check(self, ctx):
        if ctx.ddp_state_round_trip:
            return  # saved from the wrapper and loaded back into it: consistent
        for ci in ctx.method_calls("state_dict"):
            if ctx.is_ddp(ci.receiver):
                func = ci.node.func
                new = func.with_changes(value=insert_module_attr(ci.receiver))
                yield Report(ci.node, fixes=[(func, new)])
