
from ddpify.analysis import names as N
from ddpify.check.context import kwarg, positional
from ddpify.check.rules._common import library_code
from ddpify.check.rule import Invalid, Report, Rule


class NcclWithoutSetDevice(Rule):
    """NCCL process group without `torch.cuda.set_device`.

    ## What it does
    Flags `init_process_group` with the `"nccl"` backend in a program that never calls
    `torch.cuda.set_device(local_rank)` (nor passes `device_id=`): not in the file, the project
    modules it imports, nor elsewhere in the programs that import it.

    A program that gives each process one GPU of its own before CUDA starts
    (`os.environ["CUDA_VISIBLE_DEVICES"] = str(rank % 8)`) is left alone: `cuda:0` is that GPU.

    An `init_distributed()`-style helper in a module that never calls it is left alone: the
    training script that calls it may set the device first.

    ## Why is this bad?
    Every process starts on GPU 0. NCCL's first collective then creates a context on GPU 0
    for every rank (wasting memory, or hanging/"invalid usage" when ranks share a GPU), and
    bare `.cuda()` calls put every rank's tensors on GPU 0.

    ## Example
    ```python
    dist.init_process_group("nccl")
    model = model.to(local_rank)
    ```

    ## Use instead
    ```python
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    ```

    ## Fix safety
    No automatic fix: the right device index depends on how the script learns its local rank.

    ## References
    - https://pytorch.org/docs/stable/distributed.html#torch.distributed.init_process_group
    - https://github.com/pytorch/examples/blob/main/distributed/ddp-tutorial-series/multigpu_torchrun.py
    """

    CODE = "DDP102"
    NAME = "nccl-without-set-device"
    MESSAGE = "NCCL backend without `torch.cuda.set_device(local_rank)`; set this process's GPU first"
    VALID = [
        "import torch, torch.distributed as dist\ntorch.cuda.set_device(local_rank)\n"
        "dist.init_process_group(backend='nccl')\n",
        "import torch.distributed as dist\ndist.init_process_group(backend='gloo')\n",
    ]
    INVALID = [Invalid("import torch.distributed as dist\ndist.init_process_group(backend='nccl')\n")]

    def check(self, ctx):
        if ctx.has_set_device or ctx.gpu_per_process_by_launcher:
            return  # or each process sees one GPU of its own (`CUDA_VISIBLE_DEVICES = str(rank)`): `cuda:0` is it
        for ci in ctx.calls_to(*N.INIT_PROCESS_GROUP):
            arg = kwarg(ci.node, "backend")
            value = arg.value if arg else (positional(ci.node)[0].value if positional(ci.node) else None)
            if value is not None and "nccl" in ctx.code(value).lower() and (ctx.has_importers or not library_code(ctx, ci.node, setup_helper=True)):
                yield Report(ci.node)
