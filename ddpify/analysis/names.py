"""Qualified names of the PyTorch APIs that ddpify recognises, and helpers to match them."""

from __future__ import annotations

from collections.abc import Mapping

import libcst as cst
from libcst.metadata import QualifiedName

DATALOADER = frozenset({"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"})
RANDOM_SAMPLER = frozenset({"torch.utils.data.RandomSampler", "torch.utils.data.sampler.RandomSampler"})
SEQUENTIAL_SAMPLER = frozenset(
    {"torch.utils.data.SequentialSampler", "torch.utils.data.sampler.SequentialSampler"}
)
TORCH_DEVICE = frozenset({"torch.device"})
ITERABLE_DATASET = frozenset({"torch.utils.data.IterableDataset", "torch.utils.data.dataset.IterableDataset"})
CURRENT_ACCELERATOR = frozenset({"torch.accelerator.current_accelerator"})
TORCH_SAVE = frozenset({"torch.save"})
TORCH_LOAD = frozenset({"torch.load"})
OPEN = frozenset({"builtins.open", "open"})
DATA_PARALLEL = frozenset(
    {"torch.nn.DataParallel", "torch.nn.parallel.DataParallel", "torch.nn.parallel.data_parallel.DataParallel"}
)
SET_DEVICE = frozenset({"torch.cuda.set_device"})
PRINT = frozenset({"builtins.print", "print"})
OPTIMIZER_PREFIX = "torch.optim."
LOGGING_CALLS = frozenset(
    f"logging.{level}" for level in ("debug", "info", "warning", "error", "critical", "exception", "log")
)

SIDE_EFFECTS = frozenset(
    {
        "logging.basicConfig",
        "matplotlib.pyplot.savefig",
        "wandb.log",
        "wandb.finish",
        "wandb.save",
        "torchvision.utils.save_image",
        "json.dump",
        "pickle.dump",
        "numpy.save",
        "numpy.savetxt",
        "shutil.copyfile",
    }
)
SUMMARY_WRITERS = frozenset(
    {"torch.utils.tensorboard.SummaryWriter", "torch.utils.tensorboard.writer.SummaryWriter", "tensorboardX.SummaryWriter"}
)
MAKEDIRS = frozenset({"os.makedirs"})
MKDIR = frozenset({"os.mkdir"})
RANDOM_DRAWS = frozenset(  # ways to pick batch indices (or make batches) at random
    {"torch.randint", "torch.randperm", "torch.randn", "torch.rand", "torch.normal", "numpy.random.randn",
     "numpy.random.rand", "numpy.random.normal", "numpy.random.uniform", "numpy.random.randint", "numpy.random.choice", "numpy.random.permutation",
     "random.randint", "random.randrange", "random.sample", "random.choice", "random.shuffle"}
)  # fmt: skip
TORCH_SEED = frozenset({"torch.manual_seed", "torch.random.manual_seed"})
RANDOM_SPLIT = frozenset({"torch.utils.data.random_split", "torch.utils.data.dataset.random_split"})
SEEDS = TORCH_SEED | {"numpy.random.seed", "random.seed"}
TQDM = frozenset({"tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm", "tqdm.std.tqdm", "tqdm.trange", "tqdm.auto.trange"})

# What a distributed script uses; one with a process group, a DDP wrap and a DistributedSampler
# (or no DataLoader) is left alone (analysis.script.fully_distributed).
DISTRIBUTED_MARKERS = frozenset(
    {
        "torch.distributed.init_process_group",
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
        "torch.nn.DistributedDataParallel",
        "torch.utils.data.DistributedSampler",
        "torch.utils.data.distributed.DistributedSampler",
        "torch.multiprocessing.spawn",
    }
)

# The linter's API names (`ddpify check`), next to the converter's.
DDP_CLASSES = frozenset(
    {
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
        "torch.nn.DistributedDataParallel",
    }
)
DISTRIBUTED_SAMPLER = frozenset(
    {"torch.utils.data.DistributedSampler", "torch.utils.data.distributed.DistributedSampler"}
)
# Collectives: every rank must call them, in the same order.
COLLECTIVES = frozenset(
    "torch.distributed." + n
    for n in (
        "barrier", "monitored_barrier", "all_reduce", "all_gather", "all_gather_into_tensor",
        "all_gather_object", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
        "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
        "scatter_object_list", "new_group", "destroy_process_group",
    )
)  # fmt: skip
NO_GRAD = frozenset({"torch.no_grad", "torch.inference_mode"})
RANK_CALLS = frozenset({"torch.distributed.get_rank", "torch.distributed.get_node_local_rank"})
AUTOGRAD_BACKWARD = frozenset({"torch.autograd.backward"})
SET_DEVICE_CALLS = frozenset({"torch.cuda.set_device", "torch.accelerator.set_device_index", "torch.cuda.device"})
INIT_PROCESS_GROUP = "torch.distributed.init_process_group"
# Libraries that run the distributed machinery themselves: their scripts are not ours to judge.
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "deepspeed", "horovod", "colossalai")

QualifiedNames = Mapping[cst.CSTNode, "set[QualifiedName]"]


def names_of(qnames: QualifiedNames, node: cst.CSTNode) -> set[str]:
    """The qualified names a node may refer to, as plain strings."""
    value = qnames.get(node, ())
    if callable(value):  # libcst resolves qualified names lazily
        value = value()
    return {q.name for q in value}


def is_cuda_string(node: cst.BaseExpression) -> bool:
    """`"cuda"`, `"cuda:N"` or `f"cuda:{gpu}"` as a literal string."""
    if isinstance(node, cst.FormattedString):
        first = node.parts[0] if node.parts else None
        return isinstance(first, cst.FormattedStringText) and first.value.startswith("cuda:")
    if not isinstance(node, cst.SimpleString):
        return False
    value = node.evaluated_value
    return isinstance(value, str) and (value == "cuda" or value.startswith("cuda:"))


def call_name(call: cst.Call) -> str | None:
    """The method name of `x.name(...)`, or the function name of `name(...)`."""
    if isinstance(call.func, cst.Attribute):
        return call.func.attr.value
    if isinstance(call.func, cst.Name):
        return call.func.value
    return None


def receiver(call: cst.Call) -> cst.BaseExpression | None:
    """`x` in `x.method(...)`."""
    return call.func.value if isinstance(call.func, cst.Attribute) else None


def keyword(call: cst.Call, name: str) -> cst.Arg | None:
    """The `name=` argument of a call."""
    return next((a for a in call.args if a.keyword is not None and a.keyword.value == name), None)


def positional(call: cst.Call) -> list[cst.Arg]:
    """The positional (not starred, not keyword) arguments of a call."""
    return [a for a in call.args if a.keyword is None and a.star == ""]

# nn.Module API that DistributedDataParallel answers for the wrapped module.
DDP_ATTRIBUTES = frozenset(
    {
        "train", "eval", "parameters", "named_parameters", "buffers", "named_buffers", "children",
        "named_children", "modules", "named_modules", "zero_grad", "to", "cuda", "cpu", "float",
        "double", "half", "bfloat16", "apply", "requires_grad_", "training", "forward", "no_sync",
        "module", "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
        "join", "register_comm_hook", "__call__",
    }
)  # fmt: skip
