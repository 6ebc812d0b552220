import re

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import iter_nodes, last_name
from ddpify.check.context import dotted_name, has_star_kwargs, kwarg, positional, string_value
from ddpify.check.fix import add_kwarg
from ddpify.check.rule import FIX_SAFE, Invalid, Report, Rule
from ddpify.check.rules._common import every_rank, in_memory


class TorchLoadWithoutMapLocation(Rule):
    """`torch.load` without `map_location` in a distributed script.

    ## What it does
    Flags `torch.load(path)` without `map_location` in a file that uses torch.distributed.

    Only a load of model state: what it reads goes into `load_state_dict` or is read for a
    state key (`ckpt["model"]`), or the file, the name it is bound to or the function around it
    is named as a checkpoint (`args.resume`, `"best.pth"`, `def load_checkpoint`), and nothing
    names it as data (`args.data_path`, `"training_args.bin"`): a file of plain Python values
    holds no GPU tensors.

    A file named after the rank (`f"state_{rank}.pt"`, also through a variable) is left alone:
    this rank saved it from its own GPU, and its tensors come back to that GPU. So is a load
    on rank 0 only (`if rank in (-1, 0):`): GPU 0 is rank 0's own.

    ## Why is this bad?
    Tensors are restored onto the device they were saved from, usually `cuda:0`: every rank
    loads its copy onto GPU 0, which runs out of memory or slows everyone down.

    ## Example
    ```python
    state = torch.load("checkpoint.pt")
    ```

    ## Use instead
    ```python
    state = torch.load("checkpoint.pt", map_location="cpu")
    ```

    ## Fix safety
    Safe: the checkpoint loads the same values, only onto the CPU instead of GPU 0, and
    `load_state_dict` copies them onto the model's device. Tensors used directly from the
    loaded object are on the CPU afterwards and may need `.to(device)`.

    ## References
    - https://pytorch.org/docs/stable/generated/torch.load.html
    - https://pytorch.org/tutorials/intermediate/ddp_tutorial.html#save-and-load-checkpoints
    """

    CODE = "DDP109"
    NAME = "torch-load-without-map-location"
    MESSAGE = "`torch.load` without `map_location` loads onto GPU 0 on every rank; pass `map_location`"
    FIX = FIX_SAFE
    VALID = [
        "import torch, torch.distributed as dist\ns = torch.load(p, map_location='cpu')\n",
        "import torch\ns = torch.load(p)\n",
        "import torch, torch.distributed as dist\nif dist.get_rank() == 0:\n    s = torch.load(p)\n",
        # a data file, not model state: no sign of tensors saved from a GPU
        "import torch, torch.distributed as dist\nsamples = torch.load(args.data_path)\n",
    ]
    INVALID = [
        Invalid(
            "import torch, torch.distributed as dist\nckpt = torch.load(p)\n",
            "import torch, torch.distributed as dist\nckpt = torch.load(p, map_location=\"cpu\")\n",
        ),
        Invalid(
            "import torch, torch.distributed as dist\ns = torch.load(\n    p,\n)\nmodel.load_state_dict(s)\n",
            "import torch, torch.distributed as dist\ns = torch.load(\n    p, map_location=\"cpu\",\n)\nmodel.load_state_dict(s)\n",
        ),
    ]

    def check(self, ctx):
        for ci in ctx.calls_to(*N.TORCH_LOAD):
            call = ci.node
            if kwarg(call, "map_location") or has_star_kwargs(call) or len(positional(call)) >= 2:
                continue
            if positional(call) and in_memory(ctx, positional(call)[0].value):
                continue  # bytes in memory (serialized on this process), not a checkpoint file
            if not every_rank(ctx, call):
                continue  # rank 0 alone loads it (GPU 0 is its own), this rank's own file (`f"queue{rank}.pth"`:
                # saved from its GPU, it comes back there), a one-process run's, or a helper nothing calls
            if not _loads_model_state(ctx, ci):
                continue  # a data file, the run's arguments, a manifest: no sign of GPU tensors in it
            if _saves_cpu_copies(ctx):
                continue  # the program's own checkpoints hold CPU tensors: nothing lands on GPU 0
            fixed = add_kwarg(call, "map_location", cst.SimpleString('"cpu"'))
            yield Report(call, fixes=[(call, fixed)])


def _saves_cpu_copies(ctx) -> bool:
    """Does every `torch.save` of this file save a state dict whose tensors were moved to the CPU
    first (`for k, p in state.items(): state[k] = p.cpu()`, `{k: v.cpu() for k, v in ...}`)?"""
    saves = ctx.calls_to(*N.TORCH_SAVE)
    return bool(saves) and all(_cpu_copy(ctx, ci) for ci in saves)


def _cpu_copy(ctx, ci) -> bool:
    args = positional(ci.node)
    name = dotted_name(args[0].value) if args else None
    if name is None:
        return False
    scope = ci.func.body if ci.func is not None else ctx.module
    for node in iter_nodes(scope):
        if isinstance(node, cst.Assign) and any(
            isinstance(t.target, cst.Subscript) and dotted_name(t.target.value) == name for t in node.targets
        ) and _moves_to_cpu(node.value):
            return True  # `state[key] = param.cpu()`
    return any(b.dotted == name and b.func is ci.func and _moves_to_cpu(b.value) for b in ctx.assignments)


def _moves_to_cpu(value) -> bool:
    """`p.cpu()`, `p.detach().cpu()`, `{k: v.cpu() for ...}`, `p.to("cpu")`."""
    if isinstance(value, cst.DictComp):
        value = value.value
    if not (isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute)):
        return False
    method = value.func.attr.value
    return method == "cpu" or (method == "to" and bool(value.args) and string_value(value.args[0].value) == "cpu")


_STATE_WORDS = re.compile(
    r"ckpt|checkpoint|resume|weight|pretrain|state|snapshot|model|best|latest|last|\.pth?\b|\.tar\b|restore", re.IGNORECASE
)
_DATA_WORDS = re.compile(
    r"data|args|config|cfg|manifest|alignment|vocab|meta|stats|split|feature|embed|index|label|annotation|cache", re.IGNORECASE
)
_NO_TENSORS = re.compile(r"sched|scaler|^amp$", re.IGNORECASE)  # their state dicts hold Python numbers only
_STATE_KEYS = re.compile(r"model|state|optim|net|ema|weight|param|scaler|sched", re.IGNORECASE)


def _loads_model_state(ctx, ci) -> bool:
    """Does what this `torch.load` reads hold model state (the premise: tensors saved from a GPU)?
    It goes into `load_state_dict` (directly, or through the name it is bound to) or is read for a
    state key (`ckpt["model"]`); or, unless the file or the name it is bound to is named as data
    (`args.data_path`, `"training_args.bin"`, `manifest_pth`), the file, that name or the function
    around it is named as a checkpoint (`args.resume`, `"best.pth"`, `def load_checkpoint`). Loaded
    straight into a learning-rate scheduler, a GradScaler or apex's `amp`, whose state dicts hold
    Python numbers only, it holds no GPU tensors."""
    call = ci.node
    bound = _bound_name(ctx, call)
    scope = ci.func if ci.func is not None else ctx.module
    for node in iter_nodes(scope):
        if isinstance(node, cst.Call) and last_name(node.func) == "load_state_dict":
            text = " ".join(ctx.code(a.value) for a in node.args)
            if any(call is n for a in node.args for n in iter_nodes(a)):  # `x.load_state_dict(torch.load(f))`: what x holds
                return not _NO_TENSORS.search(last_name(node.func.value) or "") if isinstance(node.func, cst.Attribute) else True
            if bound and re.search(rf"\b{re.escape(bound)}\b", text):
                return True
        if bound and isinstance(node, cst.Subscript) and dotted_name(node.value) == bound and len(node.slice) == 1:
            key = node.slice[0].slice
            if isinstance(key, cst.Index) and _STATE_KEYS.search(string_value(key.value) or ""):
                return True
    args = positional(call)
    path = _file_words(args[0].value) if args else ""
    named = f"{path} {(bound or '').rpartition('.')[2]}"
    if _DATA_WORDS.search(named):
        return False
    return bool(_STATE_WORDS.search(named) or ci.func is not None and _STATE_WORDS.search(ci.func.name.value))


def _file_words(path: cst.BaseExpression) -> str:
    """The words that name a file: its string parts and the last name of each variable in it
    (`os.path.join(args.data_root, "train.pt")` -> `data_root train.pt`)."""
    words = []
    for node in iter_nodes(path):
        if isinstance(node, cst.SimpleString):
            words.append(string_value(node) or "")
        elif isinstance(node, cst.FormattedStringText):
            words.append(node.value)
        elif isinstance(node, cst.Attribute):
            words.append(node.attr.value)
    if isinstance(path, cst.Name):
        words.append(path.value)
    words += [a.value.value for a in iter_nodes(path) if isinstance(a, cst.Arg) and isinstance(a.value, cst.Name)]
    return " ".join(words)


def _bound_name(ctx, call) -> str | None:
    """`ckpt` in `ckpt = torch.load(p)`, `model_state, opt_state = torch.load(p)` (the first)."""
    parent = ctx.parent(call)
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
        target = parent.targets[0].target
        if isinstance(target, (cst.Tuple, cst.List)) and target.elements:
            target = target.elements[0].value
        return dotted_name(target)
    return None
