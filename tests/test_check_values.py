"""What a value holds decides whether a rule's premise is true.

Each case is a shape met in public DDP codebases (sets fresh15 and fresh19), written in our own words: a file
of Python numbers loaded without `map_location`, a sampler set right before its own loader's
loop, a keyword given through a name bound to `False`, a counter bound by tuple unpacking, a
model that is DDP on one path and FSDP on the other, a GPU pinned through `CUDA_VISIBLE_DEVICES`.
Each is checked both ways: the shape that proves the premise wrong is silent, the nearest shape
where it holds is flagged.
"""

from __future__ import annotations

import pytest

from ddpify.check.rule import select_rules
from ddpify.check.runner import check_source


def _lines(source: str, code: str) -> list[int]:
    result = check_source(source, "train.py", select_rules(code))
    return [f.line for f in result.findings if f.code == code]


RESUME = """\
import torch
import torch.distributed as dist


def resume(path):
    dist.init_process_group("nccl")
    {target}.load_state_dict(torch.load(path))
"""


@pytest.mark.parametrize("target, flagged", [("lr_scheduler", False), ("self.grad_scaler", False), ("model", True)])
def test_a_state_of_python_numbers_loads_without_map_location(target, flagged):
    """A learning-rate scheduler's or a GradScaler's state dict holds Python numbers only:
    loading it without `map_location` puts nothing on GPU 0 (DDP109 silent); a model's does."""
    assert _lines(RESUME.format(target=target), "DDP109") == ([7] if flagged else [])


VALIDATION = """\
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def main(model, opt, train_set, valid_set):
    dist.init_process_group("gloo")
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, sampler=train_sampler)
    valid_loader = DataLoader(valid_set, sampler=DistributedSampler(valid_set))
    for epoch in range(10):
        train_sampler.set_epoch(epoch)
        for x in train_loader:
            model(x).sum().backward()
            opt.step()
        if epoch % 2 == 0:
            {sampler}.set_epoch(epoch)
            for x in valid_loader:
                model(x)
"""


@pytest.mark.parametrize("sampler, flagged", [("valid_loader.sampler", False), ("train_sampler", True)])
def test_a_sampler_set_right_before_its_own_loaders_loop_is_set_in_time(sampler, flagged):
    """`valid_loader.sampler.set_epoch(epoch)` after the training loop comes before its own
    loader's loop (DDP113 silent); the training sampler's, there, comes after its loader ran."""
    assert _lines(VALIDATION.format(sampler=sampler), "DDP113") == ([17] if flagged else [])


TWO_FORWARDS = """\
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main(net, opt, loader):
    dist.init_process_group("gloo")
    search = {value}
    model = DDP(net, find_unused_parameters=search)
    for a, b in loader:
        loss = model(a).sum() + model(b).sum()
        loss.backward()
        opt.step()
"""


@pytest.mark.parametrize("value, flagged", [("False", False), ("True", True), ("args.search", True)])
def test_a_keyword_given_through_a_name_bound_to_false_is_false(value, flagged):
    """`find_unused_parameters=search` with `search = False` the only binding: DDP does not
    search, so two forwards before one backward reduce fine (DDP119 silent)."""
    assert _lines(TWO_FORWARDS.format(value=value), "DDP119") == ([10] if flagged else [])


COUNTERS = """\
import torch
import torch.distributed as dist


def evaluate(loader, model):
    dist.init_process_group("gloo")
    correct, total = {value}
    for x, y in loader:
        total += len(y)
        correct += (model(x).argmax(1) == y).sum()
    dist.all_reduce(total)
"""


@pytest.mark.parametrize("value, flagged", [("(torch.tensor(0), torch.tensor(0))", False), ("0, 0", True)])
def test_a_counter_bound_by_tuple_unpacking_keeps_what_it_was_given(value, flagged):
    """`correct, total = (torch.tensor(0), torch.tensor(0))`: `total` is a tensor at the
    reduce (DDP137 silent); `correct, total = 0, 0` makes it a Python number."""
    assert _lines(COUNTERS.format(value=value), "DDP137") == ([11] if flagged else [])


EVAL_DDP_TRAIN_FSDP = """\
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP


def main(model, only_eval, rank):
    dist.init_process_group("nccl")
    torch.cuda.set_device(rank)
    if only_eval:
        wrapped = DDP(model)
    else:
        wrapped = {other}(model)
    state = wrapped.state_dict()
    if rank == 0:
        torch.save(state, "model.pt")
"""


@pytest.mark.parametrize("other, flagged", [("FSDP", False), ("DDP", True)])
def test_a_model_wrapped_by_ddp_on_one_path_and_fsdp_on_the_other_may_save_fsdps_keys(other, flagged):
    """A name that is DDP for evaluation and FSDP for training: the state dict saved may be
    FSDP's, which has no `module.` prefix (DDP120 silent)."""
    assert _lines(EVAL_DDP_TRAIN_FSDP.format(other=other), "DDP120") == ([14] if flagged else [])


VISIBLE = """\
import os
import torch.distributed as dist


def setup(rank, world_size):
    {pin}
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


if __name__ == "__main__":
    setup(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
"""


@pytest.mark.parametrize(
    "pin, flagged", [('os.environ["CUDA_VISIBLE_DEVICES"] = str(rank % 8)', False), ('os.environ["OMP_NUM_THREADS"] = "1"', True)]
)
def test_a_gpu_pinned_through_visible_devices_is_this_processs(pin, flagged):
    """Each process that sees only its own GPU before CUDA starts has it as `cuda:0`: NCCL
    without `set_device` is right there (DDP102 silent)."""
    assert _lines(VISIBLE.format(pin=pin), "DDP102") == ([7] if flagged else [])


FALLBACK = """\
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main(net, loader, opt):
    dist.init_process_group("gloo")
    model = DDP(net)
    for x in loader:
        {call}
        model(x).sum().backward()
        opt.step()
"""


@pytest.mark.parametrize(
    "call, flagged",
    [("try:\n            model.module.freeze_head()\n        except AttributeError:\n            model.freeze_head()", False),
     ("model.freeze_head()", True)],
)
def test_the_wrappers_attribute_read_only_when_module_failed_holds_no_wrapper(call, flagged):
    """`try: model.module.x() / except: model.x()`: the second read runs only for a model with no
    `.module`, which is not wrapped (DDP124 silent)."""
    assert _lines(FALLBACK.format(call=call), "DDP124") == ([9] if flagged else [])


RESEEDED = """\
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def train(model, opt, data, seed):
    dist.init_process_group("gloo")
    for epoch in range(10):
        sampler = DistributedSampler(data, seed={seed})
        for x in DataLoader(data, sampler=sampler):
            model(x).sum().backward()
            opt.step()
"""


@pytest.mark.parametrize("seed, flagged", [("seed + epoch", False), ("seed", True)])
def test_a_sampler_built_each_epoch_with_a_seed_that_reads_the_epoch_shuffles_anew(seed, flagged):
    """`DistributedSampler(data, seed=seed + epoch)` made in the epoch loop: a new order each
    epoch without `set_epoch` (DDP112 silent); with the same seed each time, the same order."""
    assert _lines(RESEEDED.format(seed=seed), "DDP112") == ([9] if flagged else [])


OTHER_CLASS_LOGGER = """\
import logging

import torch.distributed as dist

logging.basicConfig(level=logging.INFO)


class RankLogger:
    def __init__(self, rank):
        self.rank = rank
        self.logger = logging.getLogger("train")

    def __getattr__(self, name):
        if self.rank != 0:
            return lambda *args, **kwargs: None
        return getattr(self.logger, name)


class Trainer:
    def __init__(self, logger):
        self.logger = {bound}

    def train(self, loader):
        for x in loader:
            self.logger.info("step %s", x)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    Trainer(RankLogger(dist.get_rank())).train([1, 2])
"""


@pytest.mark.parametrize("bound, flagged", [("logger", False), ('logging.getLogger("trainer")', True)])
def test_self_logger_of_another_class_is_not_this_classs_logging_logger(bound, flagged):
    """`RankLogger.self.logger` is a logging logger; `Trainer.self.logger` holds the project's
    RankLogger, which drops messages off rank 0 (DDP303 silent). Bound to `logging.getLogger` in
    Trainer itself, it is the logging one."""
    assert _lines(OTHER_CLASS_LOGGER.format(bound=bound), "DDP303") == ([25] if flagged else [])


MODULE_METHODS = """\
import torch
import torch.distributed as dist
import torch.nn as nn


class Potential(nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank
        self.net = nn.Linear(4, 1)

    def fit(self, loader, opt, is_distributed=False):
        for x in loader:
            self.net(x).sum().backward()
            opt.step()
            if is_distributed:
                if self.rank == 0:
                    self.save()
            else:
                {single}

    def best(self, path):
        return torch.load(path)

    def save(self):
        torch.save(self.state_dict(), "last.pt")


if __name__ == "__main__":
    dist.init_process_group("nccl")
    model = Potential(dist.get_rank())
    model.fit([torch.ones(4)], torch.optim.SGD(model.parameters()), is_distributed=True)
    {every_rank}
"""


@pytest.mark.parametrize("single, every_rank, flagged", [
    ('self.save()\n                self.best("last.pt")', "", False),
    ("pass", 'model.save()\n    model.best("last.pt")', True),
])  # fmt: skip
def test_a_models_own_method_runs_where_its_calls_run(single, every_rank, flagged):
    """A method of an `nn.Module` subclass outside nn.Module's API (`best`) runs only where the
    program calls it: here the one-process branch (DDP109 silent). Called by every rank, its
    load lands on GPU 0 on each."""
    source = MODULE_METHODS.format(single=single, every_rank=every_rank)
    assert _lines(source, "DDP109") == ([23] if flagged else [])


EMA_SOURCE = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main(net):
    dist.init_process_group("gloo")
    model = DDP(net)
    ema = {{k: v.detach().clone() for k, v in model.state_dict().items()}}
    source = model.state_dict()
    {use}
"""


@pytest.mark.parametrize("use, flagged", [
    ("for k in ema:\n        ema[k].mul_(0.99).add_(source[k], alpha=0.01)", False),
    ('torch.save(source, "model.pt")', True),
])  # fmt: skip
def test_a_wrapper_state_read_item_by_item_is_not_saved(use, flagged):
    """`source = model.state_dict()` read only as `source[k]` (an EMA update keyed like the EMA
    state taken from the same wrapper) reaches no file (DDP120 silent); saved whole, its keys
    carry `module.`."""
    assert _lines(EMA_SOURCE.format(use=use), "DDP120") == ([10] if flagged else [])


MICRO_BATCHES = """\
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, net, loader, opt):
        dist.init_process_group("gloo")
        self.model = DDP(net)
        self.loader, self.opt = loader, opt

    def fit(self, steps):
        data = iter(self.loader)
        for step in range(steps):
            self.step(self.prepare(next(data)))

    def prepare(self, batch):
        return {{"x": batch[0], "y": batch[1]}}

    def step(self, batch):
        size = {size}
        for i in range(0, size, 4):
            part = {{k: v[i:i + 4] for k, v in batch.items()}}
            self.model(part["x"]).sum().backward()
        self.opt.step()
"""


@pytest.mark.parametrize("size, flagged", [('batch["x"].shape[0]', False), ("10_000", True)])
def test_micro_batches_of_a_batch_counted_through_a_name_are_this_ranks(size, flagged):
    """`size = batch["x"].shape[0]`, then `range(0, size, 4)`: micro-batches of the batch the
    loader gave this rank (DDP155 silent)."""
    assert _lines(MICRO_BATCHES.format(size=size), "DDP155") == ([21] if flagged else [])


FIRST_WORKER = """\
import torch.distributed as dist


def is_first_worker():
    return not dist.is_available() or not dist.is_initialized() or {test}


def train(model, loader, opt):
    dist.init_process_group("gloo")
    for x in loader:
        model(x).sum().backward()
        opt.step()
        if is_first_worker():
            print("step done")


if __name__ == "__main__":
    train(None, [], None)
"""


@pytest.mark.parametrize("test, flagged", [("dist.get_rank() == 0", False), ("dist.get_rank() >= 0", True)])
def test_a_predicate_that_returns_a_rank0_test_guards_what_it_decides(test, flagged):
    """`def is_first_worker(): return not dist.is_initialized() or dist.get_rank() == 0`: true on
    rank 0 alone (or without a group), so `if is_first_worker(): print(...)` is one voice."""
    assert _lines(FIRST_WORKER.format(test=test), "DDP302") == ([14] if flagged else [])


DEFAULT_GPU = """\
import torch.distributed as dist


def main(args, model, loader, opt):
    default_gpu = False
    if args.local_rank != -1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        if {test}:
            default_gpu = True
    else:
        default_gpu = True
    for x in loader:
        model(x).sum().backward()
        opt.step()
        if default_gpu:
            print("step done")
"""


@pytest.mark.parametrize("test, flagged", [("rank == 0", False), ("args.verbose", True)])
def test_a_flag_set_true_only_on_rank0_or_without_a_group_is_a_rank0_test(test, flagged):
    """`default_gpu = False`, set True under `if rank == 0:` or in the one-process `else:`: the
    prints it guards are rank 0's (DDP302 silent)."""
    assert _lines(DEFAULT_GPU.format(test=test), "DDP302") == ([17] if flagged else [])


STREAM = """\
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset


class Stream(IterableDataset):
    def __init__(self, lines):
        self.lines = lines

    def __iter__(self):
        for i, line in enumerate(self.lines):
            if {keep}:
                yield line


def train(model, lines, opt):
    dist.init_process_group("gloo")
    train_loader = DataLoader(Stream(lines), batch_size=8)
    for x in train_loader:
        model(x).sum().backward()
        opt.step()
"""


@pytest.mark.parametrize("keep, flagged", [("i % dist.get_world_size() == dist.get_rank()", False), ("line", True)])
def test_an_iterable_dataset_that_keeps_this_ranks_items_is_split(keep, flagged):
    """An IterableDataset whose `__iter__` keeps every world-size-th item from this rank's: each
    rank reads its own part without a sampler (DDP110 silent)."""
    assert _lines(STREAM.format(keep=keep), "DDP110") == ([17] if flagged else [])


TAGGED_LOGS = """\
import logging

import torch.distributed as dist

logger = logging.getLogger("train")
logging.basicConfig(level=logging.INFO)


def tag_logs(name):
    def stamp(record):
        record.processName = name
        return True

    logger.addFilter(stamp)


def train(rank, model, loader, opt):
    dist.init_process_group("gloo")
    tag_logs({name})
    for x in loader:
        model(x).sum().backward()
        opt.step()
        logger.info("step done")


if __name__ == "__main__":
    train(0, None, [], None)
"""


@pytest.mark.parametrize("name, flagged", [('f"trainer-{rank}"', False), ('"trainer"', True)])
def test_logs_stamped_with_the_rank_by_a_filter_are_per_rank_on_purpose(name, flagged):
    """A filter made from the rank stamps every record with it (`tag_logs(f"trainer-{rank}")`):
    each rank's lines say which rank wrote them (DDP303 silent)."""
    assert _lines(TAGGED_LOGS.format(name=name), "DDP303") == ([23] if flagged else [])


SERIALIZED = """\
import io

import torch
import torch.distributed as dist


def checkpoint_roundtrip(state):
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    with {target} as buffer:
        torch.save(state, buffer)
    with {source} as buffer:
        return torch.load(buffer)
"""


@pytest.mark.parametrize("target, source, flagged", [
    ("io.BytesIO()", "io.BytesIO(data)", False),
    ('open("state.pt", "wb")', 'open("state.pt", "rb")', True),
])  # fmt: skip
def test_a_state_serialized_into_memory_writes_and_reads_no_file(target, source, flagged):
    """`with io.BytesIO() as buffer: torch.save(state, buffer)`: bytes in memory, not a file every
    rank writes (DDP301 silent), nor a checkpoint loaded onto GPU 0 (DDP109 silent)."""
    source_code = SERIALIZED.format(target=target, source=source)
    assert _lines(source_code, "DDP301") + _lines(source_code, "DDP109") == ([11, 13] if flagged else [])


UNWRAPPED_COPY = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, net, rank):
        dist.init_process_group("gloo")
        self.net = DDP(net)
        self.rank = rank

    def save(self):
        {choose}
        if self.rank == 0:
            torch.save(net.state_dict(), "net.pt")
"""


@pytest.mark.parametrize("choose, flagged", [
    ("if isinstance(self.net, torch.nn.DataParallel) or isinstance(self.net, DDP):\n"
     "            net = self.net.module\n        else:\n            net = self.net", False),
    ("net = self.net", True),
])  # fmt: skip
def test_a_copy_made_where_the_code_found_the_model_unwrapped_holds_no_wrapper(choose, flagged):
    """`else: net = self.net` of `if isinstance(self.net, DDP): net = self.net.module`: `net` is
    never the wrapper, so its state dict has no `module.` keys (DDP120 silent)."""
    assert _lines(UNWRAPPED_COPY.format(choose=choose), "DDP120") == ([15] if flagged else [])


LEAVES_UNDER_DDP = """\
import torch.distributed as dist
from tqdm import tqdm


class Trainer:
    def __init__(self, env):
        self.ddp = env == "DDP"
        self.verbose = False
        if self.ddp:
            dist.init_process_group("gloo")

    def validate_one_process(self, loader, model):
        if self.{flag}:
            print("validation runs on one process only")
            exit(0)
        for batch in tqdm(loader):
            model(batch)

    def fit(self, loader, model, opt):
        for batch in loader:
            model(batch).sum().backward()
            opt.step()
        self.validate_one_process(loader, model)
"""


@pytest.mark.parametrize("flag, flagged", [("ddp", False), ("verbose", True)])
def test_code_after_leaving_when_distributed_runs_in_one_process(flag, flagged):
    """`if self.ddp: ...; exit(0)` first: what follows runs only without a group (DDP304 silent)."""
    assert _lines(LEAVES_UNDER_DDP.format(flag=flag), "DDP304") == ([16] if flagged else [])


UNWRAP_BY_TEST = """\
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def evaluate(model, batch):
    {unwrap}
    return model.generate(batch)


def main(net, loader, opt):
    dist.init_process_group("gloo")
    model = DDP(net)
    for batch in loader:
        model(batch).sum().backward()
        opt.step()
    evaluate(model, batch)
"""


@pytest.mark.parametrize("unwrap, flagged", [('model = model.module if hasattr(model, "module") else model', False), ("pass", True)])
def test_a_model_unwrapped_by_a_conditional_expression_is_the_network(unwrap, flagged):
    """`model = model.module if hasattr(model, "module") else model`: from there `model.generate`
    is the network's own method (DDP124 silent)."""
    assert _lines(UNWRAP_BY_TEST.format(unwrap=unwrap), "DDP124") == ([7] if flagged else [])


EARLY_STOP = """\
import torch.distributed as dist


def train(args, model, loader, opt):
    if args.local_rank != -1:
        dist.init_process_group("gloo")
    for step, batch in enumerate(loader):
        model(batch).sum().backward()
        opt.step()
        if args.local_rank in [-1, 0]:
            if {test}:
                return step
"""


@pytest.mark.parametrize("test, flagged", [("args.local_rank == -1 and args.stop_early", False), ("args.stop_early", True)])
def test_an_exit_that_only_a_run_without_a_group_takes_leaves_no_rank_behind(test, flagged):
    """A return under `if local_rank in [-1, 0]:` and then `if local_rank == -1 and ...:`: only a
    run without a group takes it, so no rank is left waiting (DDP118 silent)."""
    assert _lines(EARLY_STOP.format(test=test), "DDP118") == ([12] if flagged else [])


FIRST_BUILDS_CACHE = """\
import os

import torch
import torch.distributed as dist


def load_features(args, build):
    if args.local_rank not in [-1, 0]:
        dist.barrier()  # the others wait while the first process builds the cache
    if os.path.exists(args.cache) and not args.overwrite_cache:
        features = torch.load(args.cache)
    else:
        print("building features")
        features = build()
        if args.local_rank in [-1, 0]:
            torch.save(features, args.cache)
    {release}
    return features


def main(args, build, model, opt):
    dist.init_process_group("gloo")
    for x in load_features(args, build):
        model(x).sum().backward()
        opt.step()
"""


@pytest.mark.parametrize("release, flagged", [("if args.local_rank == 0:\n        dist.barrier()", False), ("pass", True)])
def test_the_branch_that_builds_a_cache_between_the_first_processs_barriers_is_its(release, flagged):
    """HuggingFace's idiom: the other ranks wait, rank 0 builds the missing cache and releases
    them, and they find it: the print in the building branch is rank 0's (DDP302 silent)."""
    assert _lines(FIRST_BUILDS_CACHE.format(release=release), "DDP302") == ([13] if flagged else [])


VERSION_FALLBACK = """\
import torch.distributed as dist


def setup(backend, device, report):
    try:
        dist.init_process_group(backend, device_id=device){after}
    except TypeError:  # an older torch without device_id
        dist.init_process_group(backend)


if __name__ == "__main__":
    setup("nccl", None, print)
"""


@pytest.mark.parametrize("after, flagged", [("", False), ('\n        report("group up")', True)])
def test_an_init_retried_in_the_handler_of_its_own_failure_runs_once(after, flagged):
    """`try: init(..., device_id=d) / except TypeError: init(...)`: the handler runs only when the
    first call failed, so the group is started once (DDP126 silent); with a statement after it in
    the `try`, a failure there would start it again."""
    assert _lines(VERSION_FALLBACK.format(after=after), "DDP126") == ([9] if flagged else [])


EVERY_STEP = """\
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def train(net, loader, opt):
    dist.init_process_group("gloo")
    model = DDP(net)
    interval = {interval}
    for i, x in enumerate(loader):
        model(x).sum().backward()
        if (i + 1) % interval == 0:
            opt.step()
            opt.zero_grad()
"""


@pytest.mark.parametrize("interval, flagged", [("1", False), ("4", True)])
def test_a_step_every_1_batches_accumulates_nothing(interval, flagged):
    """`(i + 1) % interval == 0` with `interval = 1`: the optimizer steps after every backward,
    so there is no micro-batch whose all-reduce `no_sync` could skip (DDP204 silent)."""
    assert _lines(EVERY_STEP.format(interval=interval), "DDP204") == ([10] if flagged else [])


DEVICE_OPTION = """\
import argparse
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda:0")
args = parser.parse_args()
if args.distributed:
    dist.init_process_group("nccl")
    args.device = {rebound}
model = torch.nn.Linear(2, 2).to(args.device)
"""


@pytest.mark.parametrize("rebound, flagged", [('f"cuda:{os.environ[\'LOCAL_RANK\']}"', False), ('"cuda:0"', True)])
def test_an_options_default_set_to_this_processs_gpu_is_not_every_ranks(rebound, flagged):
    """`--device` defaults to `cuda:0`, and the distributed branch sets it to this process's GPU
    (DDP106 silent); set to another constant, every rank still shares GPU 0."""
    assert _lines(DEVICE_OPTION.format(rebound=rebound), "DDP106") == ([8] if flagged else [])


GROUP_RANK = """\
import os

import torch.distributed as dist

local_rank = int(os.environ["LOCAL_RANK"])
rank = {rank}
dist.init_process_group("nccl", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
"""


@pytest.mark.parametrize(
    "rank, flagged",
    [("int(os.environ['RANK'])", False), ("dist.get_node_local_rank()", True), ("local_rank", True)],
)
def test_the_groups_rank_given_as_the_local_rank(rank, flagged):
    """`init_process_group(rank=...)` with this process's index on its node claims the same
    ranks on every node (DDP157); the global rank does not."""
    assert _lines(GROUP_RANK.format(rank=rank), "DDP157") == ([7] if flagged else [])


DUMP = """\
import json
import os
import tempfile

import torch.distributed as dist

dist.init_process_group("nccl")
rank = dist.get_rank()
path = {path}
with open(path, "w") as f:
    json.dump({{"lr": 0.1}}, f)
"""


@pytest.mark.parametrize(
    "path, flagged",
    [('"run/config.json"', True), ('f"run/config_{rank}.json"', False), ("tempfile.mktemp()", False)],
)
def test_a_file_dumped_by_every_rank(path, flagged):
    """Every rank dumps into one file (DDP308); a per-rank or per-process file is on purpose."""
    assert _lines(DUMP.format(path=path), "DDP308") == ([11] if flagged else [])


BOOL_FLAG = """\
import torch.distributed as dist

dist.init_process_group("nccl")
rank = dist.get_rank()
is_main_process = rank == 0
show = bool({flag} and log_every > 0)
if show:
    print("loss", loss)
"""


@pytest.mark.parametrize("flag, flagged", [("is_main_process", False), ("verbose", True)])
def test_a_flag_bound_to_bool_of_a_rank0_test_guards_its_branch(flag, flagged):
    """`bool(is_main_process and logging_enabled)` is true on rank 0 alone (DDP302 silent); the
    same flag of a setting that is true on every rank is not."""
    assert _lines(BOOL_FLAG.format(flag=flag), "DDP302") == ([8] if flagged else [])


NODE_OFFSET = """\
import argparse

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
torch.cuda.set_device(args.local_rank)
dist.init_process_group("nccl")
{offset}
if args.local_rank in [-1, 0]:
    torch.save(model.state_dict(), "model.pt")
"""


@pytest.mark.parametrize("offset, flagged", [("args.local_rank += args.node_index * args.gpu_per_node", False), ("", True)])
def test_a_local_rank_offset_by_its_node_is_the_global_rank(offset, flagged):
    """`args.local_rank += node_index * gpus_per_node` turns the local rank into the global one:
    a test of it after that is job-wide, not once per node (DDP307 silent)."""
    assert bool(_lines(NODE_OFFSET.format(offset=offset), "DDP307")) is flagged


EVALUATE_UNWRAPPED = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def evaluate(args, model):
    return model(batch)


def train(args, model):
    if args.local_rank != -1:
        model = DDP(model, device_ids=[args.local_rank])
    for step in range(10):
        model(batch).backward()
        if {test}:
            evaluate(args, model)
"""


@pytest.mark.parametrize("test, flagged", [("args.local_rank == -1", False), ("args.local_rank in [-1, 0]", True)])
def test_a_model_passed_only_where_no_group_runs_is_not_the_wrapper(test, flagged):
    """`evaluate(args, model)` called only under `args.local_rank == -1` (one process, nothing
    wrapped) does not run the DDP forward on rank 0 alone (DDP117 silent); under a rank-0 test it does."""
    assert _lines(EVALUATE_UNWRAPPED.format(test=test), "DDP117") == ([7] if flagged else [])


TWO_CLASSES = """\
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class BaseTrainer:
    def setup(self):
        dist.init_process_group("nccl")
        self.model = DDP(self.model)


class {other}:
    def describe(self):
        return self.model.yaml
"""


@pytest.mark.parametrize("other, flagged", [("Tuner", False), ("DetectionTrainer(BaseTrainer)", True)])
def test_self_model_of_another_class_is_not_the_wrapped_one(other, flagged):
    """`self.model` in a class of the same file that does not derive from the one that wraps it is
    another object (DDP124 silent); in a subclass it is the wrapper."""
    assert _lines(TWO_CLASSES.format(other=other), "DDP124") == ([13] if flagged else [])


LOOP_VARIABLE = """\
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
for name, v in model.named_parameters():
    print(name)
model = DDP(model)
for name, v in {loop}:
    if "head" in name:
        v.requires_grad = False
for step in range(10):
    model(batch).sum().backward()
"""


@pytest.mark.parametrize("loop, flagged", [("teacher.state_dict().items()", False), ("model.named_parameters()", True)])
def test_a_loop_variable_is_the_parameter_of_its_own_loop(loop, flagged):
    """`v` of a loop over another model's state after the wrap is not the wrapped model's
    parameter, though an earlier loop over it used the same name (DDP141 silent)."""
    assert _lines(LOOP_VARIABLE.format(loop=loop), "DDP141") == ([10] if flagged else [])


SENDER = """\
import torch.distributed as dist

dist.init_process_group("nccl")
rank = dist.get_rank()
if {test}:
    dist.broadcast(buffer.to(device), src=0)
"""


@pytest.mark.parametrize("test, flagged", [("rank == 0", False), ("rank != 0", True)])
def test_a_broadcast_from_its_own_source_keeps_nothing(test, flagged):
    """Rank 0 broadcasting a copy from src=0 sends it: nothing comes back to keep (DDP139
    silent); a receiving rank loses what it receives into the copy."""
    assert _lines(SENDER.format(test=test), "DDP139") == ([6] if flagged else [])


PARALLEL_FLAG = """\
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

parallel = bool(args.parallel_training)
if parallel == True:
    dist.init_process_group("nccl")
if {test}:
    train_loader = DataLoader(train_set, sampler=DistributedSampler(train_set), batch_size=8)
else:
    train_loader = DataLoader(train_set, shuffle=True, batch_size=8)
for x in train_loader:
    model(x).sum().backward()
"""


@pytest.mark.parametrize("test, flagged", [("(parallel == True)", False), ("args.fast", True)])
def test_a_switch_compared_with_true_is_the_switch(test, flagged):
    """`if (parallel == True):` is the group's switch: its `else:` is the one-process run, whose
    loader needs no sampler (DDP110 silent); under another test the loader is every rank's."""
    assert _lines(PARALLEL_FLAG.format(test=test), "DDP110") == ([10] if flagged else [])


ENGINE = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("nccl")
    model = DDP(net)
    model.load_state_dict(torch.load(args.load_file))
    trainer = Engine(model={given})
    if dist.get_rank() == 0:
        trainer.save()


class Engine:
    def __init__(self, model):
        self.model = model

    def save(self):
        torch.save(self.model.state_dict(), "model.pth")
"""


@pytest.mark.parametrize("given, flagged", [("model", False), ("model.module", True)])
def test_a_wrapper_handed_to_a_constructor_is_the_objects_model(given, flagged):
    """`Engine(model=model)` keeps the wrapper as `self.model`: its save writes `module.` keys, so
    loading them into the wrapper is a consistent round trip (DDP121 silent); an engine given
    `model.module` saves plain keys, and the load into the wrapper breaks."""
    assert _lines(ENGINE.format(given=given), "DDP121") == ([9] if flagged else [])


SPAWN_MAIN = """\
import os

import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    train(rank)


if __name__ == "__main__":
    {start}
    print("Done!")
"""


@pytest.mark.parametrize(
    "start, flagged",
    [("mp.spawn(main, nprocs=2, args=(2,), join=True)", False), ('main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))', True)],
)
def test_output_after_spawn_in_the_main_block_is_the_launchers(start, flagged):
    """The `__main__` block that spawns the workers runs in the launcher alone (workers import
    the script as `__mp_main__`): its print appears once (DDP302 silent). Under torchrun the
    same block runs in every rank."""
    assert _lines(SPAWN_MAIN.format(start=start), "DDP302") == ([14] if flagged else [])


def test_the_forward_walker_walks_each_statement_sequence_once(monkeypatch):
    """DDP130 walks every path through `forward`; an `if` walks the rest after each branch, so 20
    `if`s in a row are 2**20 paths. Each remaining sequence is walked once: the work stays linear
    (unimatch's forward, with dozens of `if`s, ran for over 15 minutes before)."""
    from ddpify.check.rules import unused_parameters_without_search as rule

    walked = []
    original = rule._Walker._block
    monkeypatch.setattr(rule._Walker, "_block", lambda self, stmts: walked.append(1) or original(self, stmts))
    flags = "".join(f"        if self.flag{i}:\n            x = self.layer{i}(x)\n" for i in range(20))
    layers = "".join(f"        self.layer{i} = nn.Linear(4, 4)\n" for i in range(20))
    source = (
        "import torch.nn as nn\nimport torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n\n"
        f"class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n{layers}\n"
        f"    def forward(self, x):\n{flags}        return x\n\n"
        "dist.init_process_group('nccl')\nmodel = DDP(Net())\nfor x in loader:\n    model(x).sum().backward()\n"
    )
    check_source(source, "train.py", select_rules("DDP130"))
    assert walked and len(walked) < 20 * 20


VALIDATE_AFTER_TRAIN = """\
import torch.distributed as dist


def main(train_loader, val_loader, model, epochs):
    dist.init_process_group("nccl")
    for epoch in range(epochs):
        train_loader.sampler.set_epoch(epoch)
        train(train_loader, model)
        {loader}.sampler.set_epoch(epoch)
        validate(val_loader, model)


def train(loader, model):
    for x in loader:
        model(x).sum().backward()
"""


@pytest.mark.parametrize("loader, flagged", [("val_loader", False), ("train_loader", True)])
def test_a_sampler_set_before_its_loader_is_handed_on_is_in_time(loader, flagged):
    """`val_loader.sampler.set_epoch(epoch)` after training, right before `validate(val_loader,
    ...)` reads that loader: set in time (DDP113 silent). The training loader's sampler set
    after `train(train_loader, ...)` read it is late."""
    assert _lines(VALIDATE_AFTER_TRAIN.format(loader=loader), "DDP113") == ([9] if flagged else [])


DEVICE_SWITCH = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank, device, net, batches):
    if device == torch.device("cuda"):
        dist.init_process_group("nccl", rank=rank, world_size=2)
        torch.cuda.set_device(rank)
        model = DDP(net.to(rank), device_ids=[rank])
    else:
        model = net
    for x in batches:
        model(x).sum().backward()
    if {test}:
        model.save("model.pt")
"""


@pytest.mark.parametrize("test, flagged", [('device == torch.device("cpu")', False), ("rank == 0", True)])
def test_another_value_of_the_device_switch_holds_the_plain_model(test, flagged):
    """The model is wrapped only under `device == torch.device("cuda")`: under `device ==
    torch.device("cpu")` it is the plain network, and `model.save` is its own method (DDP124
    silent); on rank 0 of the cuda run it is the wrapper. A comparison with
    `torch.device("cuda")` places nothing on a GPU (DDP108 silent)."""
    source = DEVICE_SWITCH.format(test=test)
    assert _lines(source, "DDP124") == ([16] if flagged else [])
    assert _lines(source, "DDP108") == []


MODULE_METHOD = """\
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def train(net, batches, path):
    dist.init_process_group("nccl")
    model = DDP(net)
    for x in batches:
        {line}
        loss = out.sum()
        loss.backward()
"""


@pytest.mark.parametrize("line, flagged", [("model.module.load(path); out = model(x)", False), ("out = model.module.encode(x)", True)])
def test_a_module_method_whose_result_is_dropped_feeds_no_loss(line, flagged):
    """`model.module.load(path)` before the forward: its result is dropped, so it is no forward
    that bypasses the wrapper (DDP140 silent); `model.module.encode(x)` feeding the loss is."""
    assert _lines(MODULE_METHOD.format(line=line), "DDP140") == ([9] if flagged else [])


SUBGROUP_BROADCAST = """\
import torch.distributed as dist


def share(obj, tp_rank, dp_group):
    dist.init_process_group("nccl")
    if tp_rank == 0:
        box = [obj]
        dist.broadcast_object_list(box, src=0{group})
        return box[0]
"""


@pytest.mark.parametrize("group, flagged", [(", group=dp_group", False), ("", True)])
def test_a_collective_over_a_subgroup_in_a_rank_branch_is_not_known_to_hang(group, flagged):
    """A broadcast over `dp_group` in `if tp_rank == 0:`: the group's members may be exactly
    the ranks that take the branch (DDP116 silent); over the whole world it leaves ranks behind."""
    assert _lines(SUBGROUP_BROADCAST.format(group=group), "DDP116") == ([8] if flagged else [])


NAMED_SAMPLER = """\
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler


def loaders(train_data, kind):
    dist.init_process_group("nccl")
    if kind == "random":
        train_sampler = {random}
    else:
        train_sampler = train_data.weighted_sampler()
    train_loader = DataLoader(train_data, batch_size=8, sampler=train_sampler)
    return train_loader
"""


@pytest.mark.parametrize("random, flagged", [("DistributedSampler(train_data)", False), ("RandomSampler(train_data)", True)])
def test_a_random_sampler_bound_to_a_name_is_not_split(random, flagged):
    """`train_sampler = RandomSampler(train_data)` in the branch a config picks, then
    `DataLoader(..., sampler=train_sampler)`: every rank draws from the whole set (DDP110)."""
    assert _lines(NAMED_SAMPLER.format(random=random), "DDP110") == ([12] if flagged else [])


WRITES = """\
import json
import os

import torch.distributed as dist


def main(args):
    dist.init_process_group("nccl")
    {line}


if __name__ == "__main__":
    main(None)
"""


@pytest.mark.parametrize(
    "line, flagged",
    [
        ('with open(os.path.join(args.out, "args.txt"), "w") as f:\n        f.write(str(args))', True),
        ('with open(os.path.join(args.out, "args.txt")) as f:\n        print(f.read())', False),
        ('with open(f"preds_{dist.get_rank()}.txt", "w") as f:\n        f.write("y")', False),
        ("os.makedirs(args.out)", True),
        ("os.makedirs(args.out, exist_ok=True)", False),
        ("if not os.path.exists(args.out):\n        os.makedirs(args.out)", False),
    ],
)
def test_a_file_opened_to_write_or_a_folder_made_on_every_rank(line, flagged):
    """`open(path, "w")` of one path on every rank writes N copies (DDP308); reading it, or a
    path that names the rank, does not. `os.makedirs(path)` on every rank raises
    FileExistsError on all but the first; `exist_ok=True` does not, and a test that the
    folder is absent is a race, not a certain failure (silent)."""
    assert _lines(WRITES.format(line=line), "DDP308") == ([9] if flagged else [])


FROZEN = """\
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def wrap(model):
    {check}return DDP(model.cuda())


def main(teacher, student):
    dist.init_process_group("nccl")
    teacher.requires_grad_(False)
    teacher = wrap(teacher)
    student = wrap(student)
"""


@pytest.mark.parametrize(
    "check, flagged",
    [("", True), ("if not any(p.requires_grad for p in model.parameters()):\n        return model\n    ", False)],
)
def test_a_frozen_model_handed_to_a_wrapping_helper(check, flagged):
    """The teacher, frozen, goes through `wrap(...)`, whose DDP raises on a model with no
    parameter that requires a gradient (DDP167 at the call); a helper that returns a frozen
    model unwrapped is right."""
    source = FROZEN.format(check=check)
    assert _lines(source, "DDP167") == ([12] if flagged else [])


OWN_SAMPLER = """\
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler


class ShardSampler(Sampler):
    def __init__(self, n, rank, world):
        self.n, self.rank, self.world, self.epoch = n, rank, world, 0

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.epoch)
        return iter(torch.randperm(self.n, generator=g)[self.rank :: self.world].tolist())

    def set_epoch(self, epoch):
        self.epoch = epoch


def main(data, model, epochs):
    dist.init_process_group("nccl")
    sampler = ShardSampler(len(data), dist.get_rank(), dist.get_world_size())
    loader = DataLoader(data, sampler=sampler)
    for epoch in range(epochs):
        {call}
        for x in loader:
            model(x).sum().backward()
"""


@pytest.mark.parametrize("call, flagged", [("sampler.set_epoch(epoch)", False), ("pass", True)])
def test_a_sampler_class_of_the_program_that_shuffles_by_epoch_needs_set_epoch(call, flagged):
    """A copy of DistributedSampler in the program (it defines `set_epoch` and `__iter__`) never
    told the epoch shuffles the same way every epoch (DDP112, MagFace's ParallelDistributedSampler)."""
    assert _lines(OWN_SAMPLER.format(call=call), "DDP112") == ([21] if flagged else [])


SAVE_MODEL = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def save_model(model, scaler, path):
    if scaler is not None:
        torch.save(model.module.state_dict(), path)
    else:
        model.{method}(save_dir=path)


def main(net, scaler, path):
    dist.init_process_group("nccl")
    model = DDP(net)
    save_model(model, scaler, path)
"""


@pytest.mark.parametrize("method, flagged", [("save_checkpoint", False), ("save_weights", True)])
def test_another_engines_checkpoint_method_is_not_read_on_the_wrapper(method, flagged):
    """`model.save_checkpoint(...)` in the branch a DeepSpeed engine takes (MAE-style
    `save_model`): the code expects that engine there, not DDP (DDP124 silent); another
    method read on the wrapper raises."""
    assert _lines(SAVE_MODEL.format(method=method), "DDP124") == ([10] if flagged else [])


def test_a_flag_passed_down_a_chain_of_helpers_is_resolved_once_per_name(monkeypatch):
    """`if verbose:` in the last of 20 helpers, each calling the next twice with its own
    `verbose`: the rank test of each parameter is worked out once, not once per call path
    (2**20; map-anything's check ran for over 80 minutes before)."""
    from ddpify.analysis import rank

    asked = []
    original = rank.RankAnalysis._name_test
    monkeypatch.setattr(rank.RankAnalysis, "_name_test", lambda self, e, name: asked.append(name) or original(self, e, name))
    chain = "".join(
        f"def step{i}(x, verbose):\n    step{i + 1}(x, verbose)\n    step{i + 1}(x + 1, verbose)\n\n\n" for i in range(20)
    )
    source = (
        "import torch.distributed as dist\n\n\n" + chain
        + "def step20(x, verbose):\n    if verbose:\n        print(x)\n\n\n"
        "def main():\n    dist.init_process_group('nccl')\n    step0(1, dist.get_rank() == 0)\n"
    )
    assert _lines(source, "DDP302") == []
    assert asked and len(asked) < 20 * 20


LAUNCHED = """\
import torch.multiprocessing as mp
from detectron2.engine import launch
from torch.nn.parallel import DistributedDataParallel as DDP


def main(net):
    model = DDP(net)
    return model


if __name__ == "__main__":
    {start}
"""


@pytest.mark.parametrize("start, flagged", [("launch(main, 2, args=(None,))", False), ("mp.spawn(main, nprocs=2)", True)])
def test_a_function_an_imported_launcher_runs_may_have_its_group(start, flagged):
    """`launch(main, num_gpus)` (detectron2) starts the group in each worker before `main` wraps
    the model (DDP101 silent); `mp.spawn` starts none, so `main` must."""
    assert _lines(LAUNCHED.format(start=start), "DDP101") == ([7] if flagged else [])


def test_a_freeze_loop_with_a_test_in_its_body_is_read_without_error():
    """`for name, p in model.named_parameters(): if name not in keep: p.requires_grad = False`:
    a compound statement in the loop's body (SLIP's linear probe) is read, not iterated (an
    internal error before), and freezes only some parameters (DDP167 silent)."""
    source = (
        "import torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n\n"
        "dist.init_process_group('nccl')\nfor name, p in model.named_parameters():\n"
        "    if name not in ('fc.weight', 'fc.bias'):\n        p.requires_grad = False\nmodel = DDP(model)\n"
    )
    assert _lines(source, "DDP167") == []
