"""Qualified names of the PyTorch APIs that ddpify recognises, and helpers to match them.

Every set holds all the spellings of its objects that libcst's qualified names can give: the
public name (`torch.save`) and the module that defines it (`from torch.serialization import
save` is `torch.serialization.save`); `spelled` adds the latter from one table, so a pass or a
rule that reads a set matches every spelling alike. Passes and rules never write a `"torch.`
name of their own (tests/test_layout.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import libcst as cst
from libcst.metadata import QualifiedName

# Where torch defines what its public modules re-export: public module -> [(defining module,
# the names it defines there; None: all of them)].
_DEFINED_IN: dict[str, list[tuple[str, frozenset[str] | None]]] = {
    "torch": [
        ("torch.serialization", frozenset({"save", "load"})),
        ("torch.random", frozenset({"manual_seed", "initial_seed", "seed", "get_rng_state", "set_rng_state"})),
    ],
    "torch.distributed": [("torch.distributed.distributed_c10d", None)],
    "torch.nn": [
        ("torch.nn.parallel", frozenset({"DataParallel", "DistributedDataParallel"})),
        ("torch.nn.modules.batchnorm", frozenset({"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm"})),
    ],
    "torch.nn.parallel": [
        ("torch.nn.parallel.distributed", frozenset({"DistributedDataParallel"})),
        ("torch.nn.parallel.data_parallel", frozenset({"DataParallel"})),
    ],
    "torch.utils.data": [
        ("torch.utils.data.dataloader", frozenset({"DataLoader"})),
        ("torch.utils.data.distributed", frozenset({"DistributedSampler"})),
        ("torch.utils.data.sampler", frozenset(
            {"RandomSampler", "SequentialSampler", "SubsetRandomSampler", "BatchSampler", "WeightedRandomSampler"}
        )),
        ("torch.utils.data.dataset", frozenset(
            {"Dataset", "IterableDataset", "TensorDataset", "Subset", "ConcatDataset", "random_split"}
        )),
    ],
    "torch.utils.tensorboard": [("torch.utils.tensorboard.writer", frozenset({"SummaryWriter"}))],
    "tensorboardX": [("tensorboardX.writer", frozenset({"SummaryWriter"}))],
    "torch.multiprocessing": [("torch.multiprocessing.spawn", frozenset({"spawn", "start_processes"}))],
}


def spellings(name: str) -> set[str]:
    """`name` and every other qualified name of the same object (`torch.nn.DataParallel`,
    `torch.nn.parallel.DataParallel`, `torch.nn.parallel.data_parallel.DataParallel`)."""
    found, todo = {name}, [name]
    while todo:
        module, _, attr = todo.pop().rpartition(".")
        for home, defined in _DEFINED_IN.get(module, ()):
            other = f"{home}.{attr}"
            if (defined is None or attr in defined) and other not in found:
                found.add(other)
                todo.append(other)
    return found


def spelled(names: Iterable[str]) -> frozenset[str]:
    """A set of qualified names with all their spellings."""
    return frozenset(s for name in names for s in spellings(name))


DATALOADER = spelled({"torch.utils.data.DataLoader"})
RANDOM_SAMPLER = spelled({"torch.utils.data.RandomSampler"})
SEQUENTIAL_SAMPLER = spelled({"torch.utils.data.SequentialSampler"})
SUBSET_RANDOM_SAMPLER = spelled({"torch.utils.data.SubsetRandomSampler"})
BATCH_SAMPLER = spelled({"torch.utils.data.BatchSampler"})
TORCH_DEVICE = frozenset({"torch.device"})
DATASETS = spelled({"torch.utils.data.Dataset", "torch.utils.data.IterableDataset"})
ITERABLE_DATASET = spelled({"torch.utils.data.IterableDataset"})
CURRENT_ACCELERATOR = frozenset({"torch.accelerator.current_accelerator"})
TORCH_SAVE = spelled({"torch.save"})
TORCH_LOAD = spelled({"torch.load"})
OPEN = frozenset({"builtins.open", "open"})
# Library calls that print as they work, and the keyword that silences them.
MODEL_PROFILERS = frozenset({"torchinfo.summary", "torchsummary.summary", "thop.profile", "ptflops.get_model_complexity_info"})  # they run the model
PRINTING_CALLS = {"thop.profile": "verbose", "torchinfo.summary": "verbose", "ptflops.get_model_complexity_info": "print_per_layer_stat"}
# Commands a script runs (a scorer that reads the predictions it just wrote).
COMMANDS = frozenset({"os.system", "os.popen", "subprocess.run", "subprocess.call", "subprocess.check_call",
                      "subprocess.check_output", "subprocess.Popen"})
DATA_PARALLEL = spelled({"torch.nn.DataParallel"})
SET_DEVICE = frozenset({"torch.cuda.set_device"})
PRINT = frozenset({"builtins.print", "print"})
OPTIMIZER_PREFIX = "torch.optim."
# Where optimizer classes live besides torch.optim (each spelling a module prefix of the class).
OPTIMIZER_MODULES = (
    OPTIMIZER_PREFIX, "transformers.AdamW", "transformers.Adafactor", "transformers.optimization.", "apex.optimizers.",
    "bitsandbytes.optim.", "torch_optimizer.", "timm.optim.", "deepspeed.ops.adam.", "deepspeed.ops.lamb.",
    "lion_pytorch.", "adabelief_pytorch.", "pytorch_lamb.", "came_pytorch.", "schedulefree.",
)  # fmt: skip


def is_optimizer(qnames) -> bool:
    """Is a callee an optimizer class (torch.optim's, or a library's: `transformers.AdamW`,
    apex's `FusedAdam`, bitsandbytes' `Adam8bit`), not a learning-rate scheduler?"""
    return any(
        q.startswith(OPTIMIZER_MODULES) and "lr_scheduler" not in q and "schedul" not in q.rsplit(".", 1)[-1].lower()
        and q.rsplit(".", 1)[-1][:1].isupper() and q.rsplit(".", 1)[-1] not in NOT_OPTIMIZERS
        for q in qnames
    )


NOT_OPTIMIZERS = frozenset({"AveragedModel", "SWALR"})  # torch.optim.swa_utils: a model's running average, a schedule
CUDA_PREFIX = "torch.cuda."  # `torch.cuda.X`: the script names CUDA
# Methods and functions that test whether a file or folder is there (`os.path.exists(p)`,
# `Path(p).is_file()`): an `if` on one is a cache test, whose branch a rank takes by when it looks.
EXISTENCE_TESTS = frozenset({"exists", "isfile", "is_file", "isdir", "is_dir"})
# A function of a library the analysis has no entry for writes a file when its name says so
# (`save_sample`, `write_wav`, `export_mesh`) and an argument names a file of an output kind
# (`root / ("clip_%d.wav" % i)`, `f"{out}/{step}.png"`): side_effects.writes_named_file.
WRITER_WORDS = frozenset({"save", "write", "dump", "export", "store", "imsave", "imwrite", "savefig", "mimsave",
                          "savez", "savetxt", "tofile"})  # fmt: skip
READER_WORDS = frozenset({"load", "read", "open", "restore", "fetch", "download", "extract", "unpack", "get",
                          "parse", "from", "exists", "remove", "delete"})  # fmt: skip
OUTPUT_SUFFIXES = frozenset(
    {"wav", "flac", "mp3", "ogg", "png", "jpg", "jpeg", "gif", "bmp", "tif", "tiff", "svg", "pdf", "eps", "npy",
     "npz", "csv", "tsv", "json", "yaml", "yml", "txt", "log", "pkl", "pickle", "pt", "pth", "ckpt", "bin", "h5",
     "hdf5", "mp4", "avi", "html", "xlsx", "parquet", "onnx", "safetensors"}
)  # fmt: skip
# Libraries that draw figures: the statements that draw one (`plt.scatter(...)`, `plt.close()`)
# beside the call that saves it go where it goes (rank 0), guard_rank_zero's figure statements.
FIGURE_LIBRARIES = ("matplotlib", "seaborn", "plotly", "bokeh", "PIL.Image")  # PIL.Image: ImageDraw too
# What asks about the GPUs without using one (`args.cuda = not args.no_cuda and
# torch.cuda.is_available()`): the setup may follow it, and then read the flag it sets.
CUDA_QUESTIONS = spelled({"torch.cuda.is_available", "torch.cuda.device_count"})
NN_PREFIX = "torch.nn."  # modules and functions of torch.nn (losses among them)
FUNCTIONAL_PREFIX = "torch.nn.functional."
BATCHNORMS = spelled(f"torch.nn.BatchNorm{d}d" for d in (1, 2, 3))
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
SUMMARY_WRITERS = spelled({"torch.utils.tensorboard.SummaryWriter", "tensorboardX.SummaryWriter"})
# Clients of tracking services whose methods log (`viz = Visdom()`, then `viz.line(...)`): made,
# and used, on rank 0 only, like a SummaryWriter.
TRACKER_CLIENTS = spelled({"visdom.Visdom", "comet_ml.Experiment", "aim.Run", "clearml.Task.init", "neptune.init",
                           "neptune.init_run", "tensorboard_logger.Logger"})  # fmt: skip
MAKEDIRS = frozenset({"os.makedirs"})
MKDIR = frozenset({"os.mkdir"})
# Random generators a script makes for itself (`rng = random.Random(seed)`), whose methods draw.
GENERATOR_MAKERS = spelled({"random.Random", "numpy.random.default_rng", "numpy.random.RandomState", "torch.Generator"})
RANDOM_DRAWS = frozenset(  # ways to pick batch indices (or make batches) at random
    {"torch.randint", "torch.randperm", "torch.randn", "torch.rand", "torch.normal", "numpy.random.randn",
     "numpy.random.rand", "numpy.random.normal", "numpy.random.uniform", "numpy.random.randint", "numpy.random.choice", "numpy.random.permutation",
     "random.randint", "random.randrange", "random.sample", "random.choice", "random.shuffle"}
)  # fmt: skip
# Draws that pick samples (indices, a permutation), not values such as noise.
RANDOM_INDEX_DRAWS = RANDOM_DRAWS - {"torch.randn", "torch.rand", "torch.normal", "numpy.random.randn", "numpy.random.rand",
                                     "numpy.random.normal", "numpy.random.uniform"}  # fmt: skip
# Draws a module's forward may branch on (`if torch.rand(1) < p:`): RANDOM_VALUES and these.
RANDOM_TENSORS = frozenset({"torch.rand_like", "torch.bernoulli"})
TORCH_PREFIX = "torch."  # anything of torch's
# Draws of one value (a learning rate, an epoch count): RANDOM_DRAWS and the scalar draws.
RANDOM_VALUES = RANDOM_DRAWS | {
    f"random.{n}" for n in ("random", "uniform", "gauss", "normalvariate", "lognormvariate", "expovariate",
                            "betavariate", "triangular", "choices", "getrandbits")
} | {f"numpy.random.{n}" for n in ("random", "random_sample", "lognormal", "exponential")}  # fmt: skip
# Reads of the clock: a name made from one (a run folder `0612_142233`) differs between ranks.
CLOCK = frozenset(
    {"datetime.datetime.now", "datetime.datetime.today", "datetime.datetime.utcnow", "datetime.date.today",
     "time.time", "time.strftime", "time.localtime", "time.gmtime", "time.ctime", "time.time_ns"}
)  # fmt: skip
# Calls that take a path to write or make (a clock-named value reaching one names files).
UUIDS = frozenset({"uuid.uuid1", "uuid.uuid4"})
PATH_SINKS = MAKEDIRS | MKDIR | TORCH_SAVE | OPEN | SUMMARY_WRITERS | {"os.path.join", "pathlib.Path", "shutil.copyfile"}
TORCH_SEED = spelled({"torch.manual_seed"})
RANDOM_SPLIT = spelled({"torch.utils.data.random_split"})
SEEDS = TORCH_SEED | {"numpy.random.seed", "random.seed"}
# The modules whose global generators SEEDS seed, as prefixes of their names (`np` as imported).
RANDOM_MODULES = (TORCH_PREFIX, "numpy.", "np.", "random.")
TQDM = frozenset({"tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm", "tqdm.std.tqdm", "tqdm.trange", "tqdm.auto.trange"})
NO_GRAD = frozenset({"torch.no_grad", "torch.inference_mode"})

# torch.distributed, every function also as `torch.distributed.distributed_c10d.X`.
INIT_PROCESS_GROUP = spelled({"torch.distributed.init_process_group"})
DESTROY_PROCESS_GROUP = spelled({"torch.distributed.destroy_process_group"})
BARRIERS = spelled({"torch.distributed.barrier", "torch.distributed.monitored_barrier"})
BROADCAST_OBJECTS = spelled({"torch.distributed.broadcast_object_list"})
GLOBAL_RANK_CALLS = spelled({"torch.distributed.get_rank"})
NODE_LOCAL_RANK_CALLS = spelled({"torch.distributed.get_node_local_rank"})
RANK_CALLS = GLOBAL_RANK_CALLS | NODE_LOCAL_RANK_CALLS
GET_RANK = spelled({"torch.distributed.get_rank"})
GET_WORLD_SIZE = spelled({"torch.distributed.get_world_size"})
# calls that make a new tensor from their arguments (a copy: reducing it leaves the originals as they were)
TENSOR_FACTORIES = spelled({"torch.tensor", "torch.Tensor", "torch.FloatTensor", "torch.LongTensor", "torch.stack", "torch.cat"})
# calls that make a tensor on the default device (the CPU) unless given `device=`
NEW_TENSORS = spelled(
    "torch." + n for n in ("zeros", "ones", "empty", "full", "tensor", "Tensor", "FloatTensor", "LongTensor", "arange", "randn", "rand")
)
# collectives whose list only the destination (source) rank may pass: (qualified names, keyword, position)
DESTINATION_LISTS = (
    (spelled({"torch.distributed.gather"}), "gather_list", 1),
    (spelled({"torch.distributed.gather_object"}), "object_gather_list", 1),
    (spelled({"torch.distributed.scatter"}), "scatter_list", 1),
    (spelled({"torch.distributed.scatter_object_list"}), "scatter_object_input_list", 1),
)
# gathers of a tensor of one shape from every rank (the tensor is the second argument)
SHAPED_GATHERS = spelled({"torch.distributed.all_gather", "torch.distributed.all_gather_into_tensor"})
ZERO_OPTIMIZERS = spelled({"torch.distributed.optim.ZeroRedundancyOptimizer"})
PLATEAU_SCHEDULERS = spelled({"torch.optim.lr_scheduler.ReduceLROnPlateau"})
DEFAULT_DEVICE_SETTERS = spelled({"torch.set_default_device", "torch.set_default_tensor_type"})
ACTIVATION_CHECKPOINTS = spelled({"torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential"})
TORCH_NN = "torch.nn."  # the prefix of torch.nn's layers and Parameter
# Collectives: every rank must call them, in the same order.
COLLECTIVES = spelled(
    "torch.distributed." + n
    for n in (
        "barrier", "monitored_barrier", "all_reduce", "all_gather", "all_gather_into_tensor",
        "all_gather_object", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
        "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
        "scatter_object_list", "new_group", "destroy_process_group",
    )
)  # fmt: skip
ALL_REDUCE = spelled({"torch.distributed.all_reduce", "torch.distributed.all_gather_object", "torch.distributed.all_gather"})
DDP_CLASSES = spelled({"torch.nn.DistributedDataParallel", "torch.nn.parallel.DistributedDataParallel"})
# FSDP2: `fully_shard(module)` shards a module in place (no wrapper: the module keeps its class,
# its parameters become DTensor shards). `torch.distributed._composable.fsdp` is its first home
# (torch 2.4-2.5), `torch.distributed.fsdp._fully_shard` where torch defines it now.
FULLY_SHARD = frozenset(
    {"torch.distributed.fsdp.fully_shard", "torch.distributed._composable.fsdp.fully_shard",
     "torch.distributed._composable.fsdp.fully_shard.fully_shard", "torch.distributed.fsdp._fully_shard.fully_shard",
     "torch.distributed.fsdp._fully_shard._fully_shard.fully_shard"}
)  # fmt: skip
# `replicate(module)`: DDP's gradient all-reduce applied in place (composable, no wrapper), what
# `--to fsdp2` uses for a model FSDP2 cannot shard.
REPLICATE = frozenset({"torch.distributed._composable.replicate.replicate", "torch.distributed._composable.replicate"})
DISTRIBUTED_SAMPLER = spelled({"torch.utils.data.DistributedSampler"})
SYNC_BATCHNORM = frozenset(f"{s}.convert_sync_batchnorm" for s in spellings("torch.nn.SyncBatchNorm"))
SPAWN = spelled({"torch.multiprocessing.spawn"})
START_PROCESSES = spelled({"torch.multiprocessing.start_processes"})
PROCESS_CLASSES = frozenset({"multiprocessing.Process", "torch.multiprocessing.Process", "multiprocessing.context.Process"})
CURRENT_DEVICE = frozenset({"torch.cuda.current_device"})
# What a distributed script uses; one with a process group, a DDP wrap and a DistributedSampler
# (or no DataLoader) is left alone (analysis.script.fully_distributed).
DISTRIBUTED_MARKERS = INIT_PROCESS_GROUP | DDP_CLASSES | FULLY_SHARD | REPLICATE | DISTRIBUTED_SAMPLER | SPAWN
AUTOGRAD_BACKWARD = frozenset({"torch.autograd.backward"})
AUTOGRAD_GRAD = frozenset({"torch.autograd.grad"})
# Calls that run (or patch for running) the module they are given with weights of their own
# (analysis/functional.py: such a model is not wrapped in DDP).
FUNCTIONAL_CALL = frozenset(
    {"torch.func.functional_call", "torch.nn.utils.stateless.functional_call", "torch.nn.utils._stateless.functional_call",
     "higher.innerloop_ctx", "higher.monkeypatch", "higher.patch.monkeypatch"}
)  # fmt: skip
DEEPCOPY = frozenset({"copy.deepcopy"})
SET_DEVICE_CALLS = frozenset({"torch.cuda.set_device", "torch.accelerator.set_device_index", "torch.cuda.device"})
# Libraries that run the distributed machinery themselves: their scripts are not ours to judge.
# methods only another framework's engine (DeepSpeed's) has: code that calls one on the model expects that engine there
ENGINE_METHODS = frozenset({"save_checkpoint", "load_checkpoint", "save_16bit_model", "save_fp16_model", "backward", "step", "optimizer"})
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "deepspeed", "horovod", "colossalai")

# torch.distributed.checkpoint.state_dict: the getters gather a full state dict (an all-gather on
# every rank) when their options say `full_state_dict=True`.
_DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict."
GET_MODEL_STATE_DICT = frozenset({_DCP_STATE_DICT + "get_model_state_dict"})
GET_OPTIMIZER_STATE_DICT = frozenset({_DCP_STATE_DICT + "get_optimizer_state_dict"})
GET_STATE_DICT = frozenset({_DCP_STATE_DICT + "get_state_dict"})
STATE_DICT_GETTERS = GET_MODEL_STATE_DICT | GET_OPTIMIZER_STATE_DICT | GET_STATE_DICT
STATE_DICT_OPTIONS = frozenset({_DCP_STATE_DICT + "StateDictOptions"})
# Other ways to make one module data parallel: what they wrap is not FSDP2's to manage.
REPLICATE = frozenset({"torch.distributed._composable.replicate", "torch.distributed._composable.replicate.replicate"})
FSDP1_CLASSES = frozenset(
    {"torch.distributed.fsdp.FullyShardedDataParallel",
     "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel"}
)  # fmt: skip

# The modules the converted code imports: `import torch.distributed as dist`, `from
# torch.nn.parallel import DistributedDataParallel as DDP`, ...
DIST_MODULE = "torch.distributed"
DDP_MODULE = "torch.nn.parallel"
FSDP_MODULE = "torch.distributed.fsdp"
REPLICATE_MODULE = "torch.distributed._composable.replicate"  # DDP without a wrapper (torchtitan's apply_ddp)
MESH_MODULE = "torch.distributed.device_mesh"
STATE_DICT_MODULE = "torch.distributed.checkpoint.state_dict"
DCP_MODULE = "torch.distributed.checkpoint"
AUTOCAST = spelled({"torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.cpu.amp.autocast"})
BFLOAT16 = frozenset({"torch.bfloat16"})
GRAD_SCALER = spelled({"torch.amp.GradScaler", "torch.cuda.amp.GradScaler"})
SAMPLER_MODULE = "torch.utils.data.distributed"
DATA_MODULE = "torch.utils.data"
MP_MODULE = "torch.multiprocessing"
DATA_MODULES = ("torch.utils.data", "torch.utils.data.sampler")  # where the samplers may be imported from

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


# Shapes of nodes, tested by the analyses and the passes (plain checks: libcst.matchers alone
# costs as much to import as libcst).
def is_name(node: cst.CSTNode | None, value: str) -> bool:
    """Is `node` the Name `value`?"""
    return isinstance(node, cst.Name) and node.value == value


def is_string(node: cst.CSTNode | None, text: str) -> bool:
    """Is `node` the literal `"text"` or `'text'` (written exactly so, in either quote style)?"""
    return isinstance(node, cst.SimpleString) and node.value in (f'"{text}"', f"'{text}'")


def is_call_of(node: cst.CSTNode | None, name: str) -> bool:
    """Is `node` a call of the plain name `name` (`range(...)`, not `x.range(...)`)?"""
    return isinstance(node, cst.Call) and is_name(node.func, name)


def is_method_call(node: cst.CSTNode | None, *names: str) -> bool:
    """Is `node` a call of a method of one of these names (`x.name(...)`, not `name(...)`)?"""
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in names


def sole_index(node: cst.CSTNode | None) -> cst.BaseExpression | None:
    """`k` in `x[k]`: a Subscript's one element, when it is an index (not a slice); else None."""
    if isinstance(node, cst.Subscript) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
        return node.slice[0].slice.value
    return None


def sole_statement(stmt: cst.CSTNode | None) -> cst.BaseSmallStatement | None:
    """The statement of a line that holds just one (`x = 1`, not `x = 1; y = 2`); else None."""
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        return stmt.body[0]
    return None


def sole_assign(stmt: cst.CSTNode | None) -> cst.Assign | None:
    """The assignment of a line `target = value` (one statement, one target); else None."""
    small = sole_statement(stmt)
    return small if isinstance(small, cst.Assign) and len(small.targets) == 1 else None


def tests_module_name(test: cst.BaseExpression) -> bool:
    """Does an `if` test compare `__name__` (`if __name__ == "__main__":`)?"""
    return isinstance(test, cst.Comparison) and is_name(test.left, "__name__")


def len_arg(node: cst.CSTNode | None) -> cst.BaseExpression | None:
    """`x` in `len(x)` (a call of `len` with one argument); else None."""
    return node.args[0].value if is_call_of(node, "len") and len(node.args) == 1 else None


def length_of(node: cst.CSTNode) -> str | None:
    """The name `x` whose length `x.size(0)`, `len(x)` or `x.shape[0]` reads; else None."""
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Name):
        x = len_arg(node)
    elif isinstance(node, cst.Call):
        x = receiver(node) if is_method_call(node, "size") and len(node.args) == 1 and _is_zero(node.args[0].value) else None
    elif isinstance(node, cst.Subscript) and isinstance(node.value, cst.Attribute) and node.value.attr.value == "shape":
        x = node.value.value if _is_zero(sole_index(node)) else None
    else:
        return None
    return x.value if isinstance(x, cst.Name) else None


def _is_zero(node: cst.CSTNode | None) -> bool:
    return isinstance(node, cst.Integer) and node.value == "0"

# nn.Module's own methods and attributes (what any model answers, whatever its class).
NN_MODULE_API = frozenset(
    {"add_module", "apply", "bfloat16", "buffers", "call_super_init", "children", "compile", "cpu", "cuda", "double",
     "dump_patches", "eval", "extra_repr", "float", "forward", "get_buffer", "get_extra_state", "get_parameter",
     "get_submodule", "half", "ipu", "load_state_dict", "modules", "mtia", "named_buffers", "named_children",
     "named_modules", "named_parameters", "parameters", "register_backward_hook", "register_buffer",
     "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
     "register_full_backward_pre_hook", "register_load_state_dict_post_hook", "register_load_state_dict_pre_hook",
     "register_module", "register_parameter", "register_state_dict_pre_hook", "requires_grad_", "set_extra_state",
     "set_submodule", "share_memory", "state_dict", "T_destination", "to", "to_empty", "train", "training", "type",
     "xpu", "zero_grad"}
)  # fmt: skip
# What DistributedDataParallel adds to nn.Module's API.
DDP_OWN_API = frozenset(
    {"module", "no_sync", "join", "join_hook", "join_device", "join_process_group", "register_comm_hook",
     "device_ids", "output_device", "process_group", "broadcast_buffers", "find_unused_parameters", "static_graph",
     "gradient_as_bucket_view", "reducer", "dim", "device", "device_type", "bucket_bytes_cap"}
)  # fmt: skip
# What fully_shard adds to a module (FSDPModule's methods).
FSDP_MODULE_API = frozenset(
    {"reshard", "unshard", "set_requires_gradient_sync", "set_reshard_after_backward", "set_is_last_backward",
     "set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch", "set_requires_all_reduce"}
)  # fmt: skip

# nn.Module methods that return the module itself (`model = model.eval()` keeps what `model` was).
SELF_RETURNING = frozenset({"train", "eval", "to", "cuda", "cpu", "float", "half", "double", "bfloat16", "requires_grad_"})


def module_itself(value):
    """`model` in `model.eval()`, `model.to(device).train()`: the object such a chain returns."""
    while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value in SELF_RETURNING:
        value = value.func.value
    return value

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
