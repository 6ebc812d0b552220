import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import dotted_name
from ddpify.check.context import last_name
from ddpify.check.fix import insert_module_attr
from ddpify.check.rule import FIX_UNSAFE, Invalid, Report, Rule
from ddpify.check.rules._common import name_reads


class SaveDDPStateDict(Rule):
    """`state_dict()` taken from the DDP wrapper.

    ## What it does
    Flags `ddp_model.state_dict()` where `ddp_model` holds the `DistributedDataParallel` wrapper.

    A program that loads the state back into the wrapper too (`module.` keys on both sides: a
    resume of its own checkpoints, a best-model copy) is consistent and is not flagged; nor are
    the wrapper's keys read to load into it (`model.state_dict().keys()`, `new =
    match(model.state_dict(), ckpt)` whose result only `load_state_dict(...)` takes), nor a state
    read only item by item (`source = model.state_dict()`, then `source[key]` in an EMA update),
    nor a name the function also binds to an FSDP model (DDP for evaluation, FSDP for training):
    its keys may have no prefix.

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
        "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
        "new = match_keys(model.state_dict(), ckpt)\nload_state_dict(model, new)\n",
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
            if ctx.is_ddp(ci.receiver) and not _template_for_loading(ctx, ci.node) and not _walked(ctx, ci.node) and not _read_by_key(ctx, ci.node) and not _may_be_fsdp(ctx, ci):
                func = ci.node.func
                new = func.with_changes(value=insert_module_attr(ci.receiver))
                yield Report(ci.node, fixes=[(func, new)])


def _may_be_fsdp(ctx, ci) -> bool:
    """Does the function also bind the receiver to an FSDP model (`parallel_model = DDP(model)` for
    evaluation, `FSDP(model)` for training): its state dict may be FSDP's, which has no `module.`."""
    name = dotted_name(ci.receiver) if ci.receiver is not None else None
    return name is not None and any(b.dotted == name and b.func is ci.func for b in ctx.index.bindings_of(N.FSDP1_CLASSES))


def _walked(ctx, call: cst.Call) -> bool:
    """`for name, p in model.state_dict().items(): dist.broadcast(p, 0)`: the state is walked in
    memory, not saved, so its key names reach no file."""
    attr = ctx.parent(call)
    method = ctx.parent(attr) if isinstance(attr, cst.Attribute) and attr.attr.value in ("items", "values", "keys") else None
    loop = ctx.parent(method) if isinstance(method, cst.Call) else None
    return isinstance(loop, (cst.For, cst.CompFor)) and loop.iter is method


def _read_by_key(ctx, call: cst.Call) -> bool:
    """`source = model.state_dict()` read only item by item (`source[key]`, `source.items()`): an
    in-memory source whose keys match another state taken from the same wrapper (an EMA update),
    never written whole to a file."""
    assign = ctx.parent(call)
    if not (isinstance(assign, cst.Assign) and len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Name)):
        return False
    reads = name_reads(ctx.enclosing_func(call) or ctx.module, assign.targets[0].target.value)
    return bool(reads) and all(_by_key(ctx, n) for n in reads)


def _by_key(ctx, name: cst.Name) -> bool:
    parent = ctx.parent(name)
    if isinstance(parent, cst.Subscript) and parent.value is name:
        return True
    return isinstance(parent, cst.Attribute) and parent.value is name and parent.attr.value in ("items", "keys", "values")


def _template_for_loading(ctx, call: cst.Call) -> bool:
    """The wrapper's keys read to load into it, not to save: `model.state_dict().keys()`, or
    `new = match_keys(model.state_dict(), ckpt)` whose result only `load_state_dict(...)` reads."""
    parent = ctx.parent(call)
    if isinstance(parent, cst.Attribute) and parent.attr.value == "keys":
        return True
    arg = parent if isinstance(parent, cst.Arg) else None
    outer = ctx.parent(arg) if arg is not None else None
    if not isinstance(outer, cst.Call) or "save" in (ctx.info(outer).name or "").lower():
        return False
    assign = ctx.parent(outer)
    if not (isinstance(assign, cst.Assign) and len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Name)):
        return False
    name = assign.targets[0].target.value
    scope = ctx.enclosing_func(call) or ctx.module
    reads = name_reads(scope, name)
    return bool(reads) and all(_loaded(ctx, n) for n in reads)


def _loaded(ctx, name: cst.Name) -> bool:
    """Is this read an argument of a `load_state_dict(...)` call?"""
    arg = ctx.parent(name)
    call = ctx.parent(arg) if isinstance(arg, cst.Arg) else None
    return isinstance(call, cst.Call) and (last_name(call.func) or "") == "load_state_dict"
