import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.literals import string_value
from ddpify.check.context import iter_nodes, kwarg
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._inplace import in_place_collectives, tensor_arg


class CollectiveOnCpuTensor(Rule):
    """A collective on a CPU tensor in an NCCL process group.

    ## What it does
    Flags `dist.all_reduce(t)`, `dist.reduce(t, ...)` and `dist.broadcast(t, ...)` where every
    binding of `t` in its function makes a tensor without a device (`torch.zeros(2)`,
    `torch.tensor([loss, n])`) or moves it to the CPU (`x.cpu()`), in a program that starts an
    NCCL group (`init_process_group("nccl")`, also `"nccl" if cuda else "gloo"`) and sets no
    default device.

    ## Why is this bad?
    NCCL reduces CUDA tensors only: the call raises (`No backend type associated with device
    type cpu`) on every rank, typically at the first evaluation, after an epoch of training. On
    CPU with gloo the same script works, so it passes every test without a GPU.

    ## Example
    ```python
    stats = torch.zeros(2)
    dist.all_reduce(stats)
    ```

    ## Use instead
    ```python
    stats = torch.zeros(2, device=device)
    dist.all_reduce(stats)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/distributed.html#backends
    """

    CODE = "DDP160"
    NAME = "collective-on-cpu-tensor"
    MESSAGE = "this tensor is on the CPU and the group is NCCL, which reduces CUDA tensors only: it raises on GPUs; make it with `device=`"
    VALID = [
        "import torch, torch.distributed as dist\ndist.init_process_group('nccl')\n"
        "stats = torch.zeros(2, device=device)\ndist.all_reduce(stats)\n",
        "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\nstats = torch.zeros(2)\ndist.all_reduce(stats)\n",
        "import torch, torch.distributed as dist\ndist.init_process_group('nccl')\nstats = torch.zeros(2).cuda()\ndist.all_reduce(stats)\n",
    ]
    INVALID = [
        Invalid("import torch, torch.distributed as dist\ndist.init_process_group('nccl' if torch.cuda.is_available() else 'gloo')\n"
                "def evaluate():\n    stats = torch.zeros(2)\n    dist.all_reduce(stats)\n"),
    ]  # fmt: skip

    def check(self, ctx):
        if not _nccl(ctx) or ctx.calls_to(*N.DEFAULT_DEVICE_SETTERS):
            return
        for ci in in_place_collectives(ctx):
            tensor = tensor_arg(ci)
            if isinstance(tensor, cst.Name) and _on_cpu(ctx, tensor, ci.func):
                yield Report(tensor)


def _nccl(ctx) -> bool:
    """Does the program start an NCCL group (the backend's text names it)?"""
    for ci in ctx.calls_to(*N.INIT_PROCESS_GROUP):
        backend = kwarg(ci.node, "backend") or (ci.node.args[0] if ci.node.args and ci.node.args[0].keyword is None else None)
        if backend is not None and any(string_value(n) == "nccl" for n in iter_nodes(backend.value)):
            return True
    return False


def _on_cpu(ctx, tensor: cst.Name, func) -> bool:
    """Is every binding of `tensor` in its function a tensor made without a device or `x.cpu()`?"""
    if func is not None and tensor.value in ctx.index.param_names(func):
        return False
    bindings = [b for b in ctx.assignments if b.dotted == tensor.value and b.func is func]
    return bool(bindings) and all(_cpu_value(ctx, b.value) for b in bindings)


def _cpu_value(ctx, value: cst.BaseExpression) -> bool:
    if not isinstance(value, cst.Call):
        return False
    if isinstance(value.func, cst.Attribute) and value.func.attr.value == "cpu":
        return True
    return bool(ctx.qnames(value.func) & N.NEW_TENSORS) and kwarg(value, "device") is None
