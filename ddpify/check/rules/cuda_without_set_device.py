import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import kwarg, positional, string_value
from ddpify.check.rules._common import every_rank, library_code
from ddpify.check.rule import Invalid, Report, Rule


class CudaWithoutSetDevice(Rule):
    """"The GPU" without saying which, in a script that never sets its device.

    ## What it does
    Flags bare `.cuda()`, `.to("cuda")`, `torch.device("cuda")` and `device="cuda"` in a
    distributed script whose program (the file, the project modules it imports, the programs
    that import it) never calls `torch.cuda.set_device(local_rank)`.

    `torch.device("cuda", rank)` names its GPU and is left alone, and so is a program that gives
    each process one GPU of its own (`os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)`): there
    `"cuda"` is that GPU.

    Code of a helper module (a loss, a model method) that nothing in the file calls is left
    alone: the training script sets the device before it runs.

    ## Why is this bad?
    `"cuda"` means the current device, which is GPU 0 in every process until
    `set_device` is called: all ranks pile onto one GPU.

    ## Example
    ```python
    dist.init_process_group("nccl")
    model = model.cuda()
    ```

    ## Use instead
    ```python
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = model.cuda()
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/notes/cuda.html#cuda-semantics
    """

    CODE = "DDP108"
    NAME = "cuda-without-set-device"
    MESSAGE = "`cuda` means GPU 0 on every rank until `torch.cuda.set_device(local_rank)` is called; set the device"
    VALID = [
        "import torch, torch.distributed as dist\ntorch.cuda.set_device(local_rank)\nmodel = model.cuda()\n",
        "model = model.cuda()\n",
        "import torch, torch.distributed as dist\ndevice = torch.device('cuda', rank)\n",
        "import os, torch, torch.distributed as dist\nos.environ['CUDA_VISIBLE_DEVICES'] = str(rank % 8)\n"
        "device = torch.device('cuda')\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nmodel = model.cuda()\n"),
        Invalid("import torch, torch.distributed as dist\ndevice = torch.device('cuda')\n"),
    ]

    def check(self, ctx):
        if ctx.has_set_device or ctx.gpu_per_process_by_launcher:
            return  # or each process sees one GPU of its own: `cuda` is that GPU
        for ci in ctx.calls:
            if not ctx.has_importers and library_code(ctx, ci.node):
                continue  # a helper module's code: its caller sets the device first
            if not every_rank(ctx, ci.node):
                continue  # the launcher before it spawns the ranks, a one-process branch, rank 0 alone
            if ci.receiver is not None and ci.name == "cuda" and not ci.node.args:
                yield Report(ci.node)
            elif ci.is_(*N.TORCH_DEVICE) or (ci.receiver is not None and ci.name == "to"):
                if isinstance(ctx.parent(ci.node), cst.ComparisonTarget) or isinstance(ctx.parent(ci.node), cst.Comparison):
                    continue  # `device == torch.device("cuda")`: a test of the device, nothing placed
                pos = positional(ci.node)
                if pos and string_value(pos[0].value) == "cuda" and not _names_an_index(ci, pos):
                    yield Report(ci.node)


def _names_an_index(ci, pos) -> bool:
    """`torch.device("cuda", rank)` / `torch.device("cuda", index=rank)`: a GPU is named."""
    return ci.is_(*N.TORCH_DEVICE) and (len(pos) > 1 or kwarg(ci.node, "index") is not None)
