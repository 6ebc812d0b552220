"""Smaller shapes around the issue-4 patterns: what convert does where it must not guess."""

from __future__ import annotations

import textwrap
from pathlib import Path

from ddpify.engine import ConvertOptions, convert_source

ROOT = Path(__file__).resolve().parent.parent


def convert(code: str, tail: str = ""):
    return convert_source(textwrap.dedent(code) + tail, "train.py")


LOOP = """
for epoch in range(2):
    for phase in ["fit", "check"]:
        for x, y in loaders[phase]:
            loss = model(x).sub(y).pow(2).mean()
            loss.backward()
            optimizer.step()
"""


def test_split_loaders_without_a_training_split_get_a_todo():
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sets = {"fit": [], "check": []}
        loaders = {x: DataLoader(sets[x], batch_size=4, shuffle=True) for x in ["fit", "check"]}
        """,
        LOOP,
    )
    assert [t.message for t in result.todos] == [
        "`loaders` holds a DataLoader per split: give the training one a DistributedSampler "
        "(set_epoch every epoch) and the others a slice per rank"
    ]
    assert "DistributedSampler(" not in result.code


def test_split_loader_datasets_built_inline_get_a_todo():
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loaders = {x: DataLoader(make(x), batch_size=4, shuffle=True) for x in ["train", "val"]}
        """,
        LOOP.replace('"fit", "check"', '"train", "val"'),
    )
    assert [t.message for t in result.todos] == ["shard the `loaders` loaders by rank: their dataset is built inline"]


def test_random_batches_without_a_seed_get_one_per_rank_after_setup():
    result = convert(
        """
        import torch
        data = torch.randn(100, 3)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(10):
            ix = torch.randint(len(data), (8,))
            loss = model(data[ix]).pow(2).mean()
            loss.backward()
            optimizer.step()
        """
    )
    assert result.todos == []
    code = result.code
    seed = "torch.manual_seed(torch.initial_seed() + dist.get_rank())"
    assert seed in code and code.index("dist.init_process_group(") < code.index(seed) < code.index("for step in")


def test_random_batches_from_a_generator_are_left_to_the_user():
    result = convert(
        """
        import torch
        g = torch.Generator().manual_seed(0)
        data = torch.randn(100, 3)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(10):
            ix = torch.randint(len(data), (8,), generator=g)
            loss = model(data[ix]).pow(2).mean()
            loss.backward()
            optimizer.step()
        """
    )
    assert [t.message.split(":")[0] for t in result.todos] == [
        "the data is not read through a DataLoader, so every process trains on all of it"
    ]


def test_sequential_batches_over_a_parameter_get_a_todo():
    result = convert(
        """
        import torch
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def train(source):
            for i in range(0, source.size(0) - 1, 8):
                loss = model(source[i : i + 8]).pow(2).mean()
                loss.backward()
                optimizer.step()

        train(torch.randn(64, 3))
        """
    )
    assert len(result.todos) == 1 and "rows_per_rank" not in result.code


def test_a_print_that_runs_the_model_is_split():
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader([], batch_size=4, shuffle=True)

        def score():
            return model(torch.ones(1, 2)).item()

        for epoch in range(2):
            for x, y in loader:
                model(x).sum().backward()
                optimizer.step()
            print("score", score())
        """
    )
    assert "    score_result = score()\n    if dist.get_rank() == 0:\n        print(\"score\", score_result)\n" in result.code
    assert result.todos == []


def test_split_metrics_averaged_per_batch_get_a_todo():
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sets = {"train": [], "val": []}
        loaders = {x: DataLoader(sets[x], batch_size=4, shuffle=True) for x in ["train", "val"]}
        for epoch in range(2):
            for phase in ["train", "val"]:
                total = 0.0
                for x, y in loaders[phase]:
                    loss = model(x).sub(y).pow(2).mean()
                    loss.backward()
                    optimizer.step()
                    total += loss.item()
                print(phase, total / len(loaders[phase]))
        """
    )
    assert [t.message.split(":")[0] for t in result.todos] == ["the metrics of this loop divide by this rank's batch count"]
    assert 'samplers["train"].set_epoch(epoch)' in result.code


def test_full_batch_training_stays_replicated_and_says_so():
    result = convert(
        """
        import torch
        features, labels = torch.randn(50, 3), torch.randn(50, 1)
        mask = torch.arange(50) < 30
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for epoch in range(20):
            optimizer.zero_grad()
            loss = (model(features)[mask] - labels[mask]).pow(2).mean()
            loss.backward()
            optimizer.step()
            if epoch % 10 == 0:
                print(epoch, loss.item())
        """
    )
    assert result.todos == []
    assert any(n.message.startswith("full-batch training: every process takes the same step") for n in result.notes)
    assert "rows_per_rank" not in result.code and "manual_seed" not in result.code


def test_a_dict_of_loaders_the_loop_does_not_walk_leaves_the_loader_alone():
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train_loader = DataLoader([], batch_size=4, shuffle=True)
        registry = {"train": train_loader}
        for epoch in range(2):
            for x, y in train_loader:
                model(x).sum().backward()
                optimizer.step()
        """
    )
    assert result.todos == []
    assert "train_sampler = DistributedSampler(" in result.code and "train_sampler.set_epoch(epoch)" in result.code


def test_a_step_helper_called_per_batch_is_not_full_batch():
    result = convert(
        """
        import torch
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(8)]

        def train_step(x, y):
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            optimizer.step()

        for epoch in range(2):
            for x, y in batches:
                train_step(x, y)
        """
    )
    assert [t.message.split(":")[0] for t in result.todos] == [
        "the data is not read through a DataLoader, so every process trains on all of it"
    ]


def test_global_batch_on_hand_made_batches_says_what_to_divide():
    code = """
        import torch
        batch_size = 8
        data = torch.randn(100, 3)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(10):
            ix = torch.randint(len(data), (batch_size,))
            model(data[ix]).sum().backward()
            optimizer.step()
        """
    result = convert_source(textwrap.dedent(code), "train.py", ConvertOptions(global_batch=True))
    assert [t.message for t in result.todos] == [
        "--global-batch: this script cuts its own batches, so divide its batch size by dist.get_world_size() where it is set"
    ]


def test_global_batch_before_the_process_group_reads_the_environment():
    code = """
        import torch
        from torch.utils.data import DataLoader
        loader = DataLoader(list(range(64)), batch_size=16, shuffle=True)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = torch.nn.Linear(1, 1).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for epoch in range(2):
            for x in loader:
                model(x.float().unsqueeze(1)).sum().backward()
                optimizer.step()
        """
    result = convert_source(textwrap.dedent(code), "train.py", ConvertOptions(global_batch=True))
    assert 'batch_size=16 // int(os.environ.get("WORLD_SIZE", 1))' in result.code
    assert result.code.index("DataLoader(") < result.code.index("dist.init_process_group(")


def test_random_batches_reseed_after_the_data_and_once_before_the_epochs():
    result = convert(
        """
        import torch
        torch.manual_seed(0)
        data = torch.randn(100, 3)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_epoch():
            for step in range(10):
                ix = torch.randint(len(data), (8,))
                model(data[ix]).sum().backward()
                optimizer.step()

        for epoch in range(3):
            train_epoch()
        """
    )
    code, seed = result.code, "torch.manual_seed(torch.initial_seed() + dist.get_rank())"
    assert result.todos == [] and code.count(seed) == 1
    assert code.index("data = torch.randn(100, 3)") < code.index(seed) < code.index("for epoch in range(3):")
    assert "torch.manual_seed(0)\n" in code  # the data and the weights are still the same on every rank


def test_training_sums_reset_each_epoch_are_reduced_but_step_counters_are_not():
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(torch.randn(64, 3), batch_size=8, shuffle=True)
        global_step = 0
        for epoch in range(3):
            running = 0.0
            for batch_idx, x in enumerate(loader):
                loss = model(x).pow(2).mean()
                loss.backward()
                optimizer.step()
                running += loss.item()
                global_step += 1
            print(epoch, global_step, running / (batch_idx + 1))
        """
    )
    code = result.code
    assert "running = all_reduce_sum(running) / dist.get_world_size()\n" in code  # per-rank batch count: averaged
    assert "global_step = all_reduce_sum" not in code  # carries over epochs: a counter, not a metric
    assert code.count("all_reduce_sum(") == 2  # the helper and the one call


def test_device_option_naming_a_gpu_becomes_this_process_gpu():
    result = convert(
        """
        import argparse
        import torch
        from torch.utils.data import DataLoader
        parser = argparse.ArgumentParser()
        parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
        args = parser.parse_args()
        model = torch.nn.Linear(3, 1).to(args.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(torch.randn(64, 3), batch_size=8, shuffle=True)
        for epoch in range(2):
            for x in loader:
                model(x.to(args.device)).sum().backward()
                optimizer.step()
        """
    )
    code = result.code
    fix = 'if args.device.startswith("cuda"):  # --device names a GPU: this process\'s own\n'
    assert code.index("args = parser.parse_args()\n" + fix) < code.index("dist.init_process_group(")
    assert "    args.device = f\"cuda:{os.environ.get('LOCAL_RANK', 0)}\"\n" in code
    # the setup is not wedged between the parser's add_argument lines
    assert code.index("local_rank = int(") > code.index("args = parser.parse_args()")


def test_unseeded_random_split_gets_the_same_generator_on_every_rank():
    code = """
        import torch
        from torch.utils.data import DataLoader, TensorDataset, random_split
        {seed}
        dataset = TensorDataset(torch.randn(100, 3))
        train_set, val_set = random_split(dataset, [80, 20])
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(train_set, batch_size=8, shuffle=True)
        for epoch in range(2):
            for (x,) in loader:
                model(x).sum().backward()
                optimizer.step()
        """
    unseeded = convert(code.format(seed="")).code
    assert "random_split(dataset, [80, 20], generator=torch.Generator().manual_seed(0))" in unseeded
    seeded = convert(code.format(seed="torch.manual_seed(0)")).code
    assert "random_split(dataset, [80, 20])\n" in seeded  # the global seed already makes it the same


EVAL_SCRIPT = """
import torch
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset
model = torch.nn.Linear(3, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
train_set, eval_set = TensorDataset(torch.randn(64, 3)), TensorDataset(torch.randn(32, 3))
train_loader = DataLoader(train_set, batch_size=8, shuffle=True)
eval_loader = DataLoader(eval_set, sampler=SequentialSampler(eval_set), batch_size=8)
for epoch in range(2):
    for (x,) in train_loader:
        model(x).sum().backward()
        optimizer.step()
    {body}
"""


def test_in_order_evaluation_reads_a_slice_per_rank():
    body = "total = 0.0\n    for (x,) in eval_loader:\n        total += model(x).sum().item()\n    print(total)"
    result = convert_source(EVAL_SCRIPT.format(body=body), "train.py")
    assert "sampler=range(dist.get_rank(), len(eval_set), dist.get_world_size())" in result.code
    assert "SequentialSampler" not in result.code and result.todos == []


def test_evaluation_collecting_per_sample_results_runs_whole_on_every_rank():
    body = "preds = []\n    for (x,) in eval_loader:\n        preds.append(model(x).argmax(1))\n    print(torch.cat(preds).shape)"
    result = convert_source(EVAL_SCRIPT.format(body=body), "train.py")
    assert "sampler=SequentialSampler(eval_set)" in result.code and result.todos == []
    assert any("every rank evaluates the whole set (it collects per-sample results)" in n.message for n in result.changes)


def test_fixed_draws_from_an_iterator_advance_the_epoch_and_get_a_todo():
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(torch.randn(64, 3), batch_size=8, shuffle=True)
        for epoch in range(2):
            it = iter(loader)
            for _ in range(6):
                x = next(it)
                model(x).sum().backward()
                optimizer.step()
        """
    )
    code = result.code
    start = code.index("for epoch in range(2):\n    sampler.set_epoch(sampler.epoch + 1)  # a new pass")
    assert start < code.index("# TODO(ddpify): each rank now holds") < code.index("    it = iter(loader)")
    assert [t.message for t in result.todos] == [
        "each rank now holds 1/world_size of `loader`'s batches: draw at most len(loader) batches "
        "from this iterator, or make it again on StopIteration"
    ]


def test_a_model_returned_by_a_factory_is_wrapped_where_it_lands():
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader

        def load_train_objs():
            model = torch.nn.Linear(3, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            return model, optimizer

        def main():
            model, optimizer = load_train_objs()
            loader = DataLoader(torch.randn(64, 3), batch_size=8, shuffle=True)
            for epoch in range(2):
                for x in loader:
                    model(x).sum().backward()
                    optimizer.step()

        main()
        """
    )
    main = result.code[result.code.index("def main"):]
    assert main.index("model, optimizer = load_train_objs()") < main.index("model = DDP(model") < main.index("for epoch")
    assert main.index("dist.init_process_group") < main.index("model, optimizer = load_train_objs()")
    assert "DDP(" not in result.code[: result.code.index("def main")]


def test_a_factory_called_twice_keeps_the_model_where_it_is_built():
    """Two callers: no single place to wrap the model the factory returns; it is refused."""
    import pytest

    from ddpify.engine import ConvertError

    code = """
        import torch

        def build():
            model = torch.nn.Linear(3, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            return model, optimizer

        def main():
            model, optimizer = build()
            other, other_optimizer = build()
            for x in torch.randn(4, 8, 3):
                model(x).sum().backward()
                optimizer.step()

        main()
        """
    with pytest.raises(ConvertError) as raised:
        convert(code)
    assert raised.value.line == 7 and "returned to more than one caller" in str(raised.value)


def test_an_object_given_the_model_gets_the_ddp_model():
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader

        class Trainer:
            def __init__(self, model, optimizer):
                self.model, self.optimizer = model, optimizer

        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = Trainer(model, optimizer)
        loader = DataLoader(torch.randn(64, 3), batch_size=8, shuffle=True)
        for epoch in range(2):
            for x in loader:
                trainer.model(x).sum().backward()
                trainer.optimizer.step()
        """
    )
    code = result.code
    assert code.index("model = DDP(model") < code.index("trainer = Trainer(model, optimizer)")


METERS = """
import torch
from torch.utils.data import DataLoader

class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n

model = torch.nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
train_loader = DataLoader(torch.randn(64, 3), batch_size=8, shuffle=True)
val_loader = DataLoader(torch.randn(32, 3), batch_size=8)
for epoch in range(2):
    losses = []
    for x in train_loader:
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(sum(losses) / len(losses))
    meter = AverageMeter()
    for x in val_loader:
        meter.update(model(x).pow(2).mean().item(), x.size(0))
    if meter.sum / meter.count < 0.1:
        break
"""


def test_meters_evaluate_the_whole_set_and_per_epoch_lists_get_a_todo():
    result = convert_source(METERS, "train.py")
    assert "val_loader = DataLoader(torch.randn(32, 3), batch_size=8)\n" in result.code  # not sliced
    assert any("every rank evaluates the whole set (it keeps its metrics in objects" in n.message for n in result.changes)
    assert [t.message.split(" collect ")[0] for t in result.todos] == ["`losses`"]


def test_mkdir_after_an_isdir_check_cannot_race_between_ranks():
    result = convert(
        """
        import os
        import torch
        from torch.utils.data import DataLoader
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(torch.randn(64, 3), batch_size=8, shuffle=True)
        for epoch in range(2):
            for x in loader:
                model(x).sum().backward()
                optimizer.step()
            if not os.path.isdir("checkpoint"):
                os.mkdir("checkpoint")
            torch.save(model.state_dict(), "checkpoint/ckpt.pth")
        """
    )
    assert '        os.makedirs("checkpoint", exist_ok=True)\n' in result.code
    assert "os.mkdir(" not in result.code


def test_a_loader_returned_by_a_factory_gets_its_sampler_there():
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader

        def prepare_dataloader(dataset, batch_size):
            return DataLoader(dataset, batch_size=batch_size, shuffle=True)

        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train_data = prepare_dataloader(torch.randn(64, 3), 8)
        for epoch in range(2):
            for x in train_data:
                model(x).sum().backward()
                optimizer.step()
        """
    )
    code = result.code
    assert "    train_data_sampler = DistributedSampler(dataset, shuffle=True" in code
    assert "    return DataLoader(dataset, batch_size=batch_size, sampler=train_data_sampler)" in code
    assert "    train_data.sampler.set_epoch(epoch)\n" in code and result.todos == []


def test_a_sampler_chosen_inline_is_sharded_in_both_branches():
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
        shuffle = True
        data = torch.randn(64, 3)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(data, batch_size=8, sampler=RandomSampler(data) if shuffle else SequentialSampler(data))
        for epoch in range(2):
            for x in loader:
                model(x).sum().backward()
                optimizer.step()
        """
    )
    code = result.code
    assert "sampler=DistributedSampler(data, shuffle=True) if shuffle else DistributedSampler(data, shuffle=False)" in code
    assert "    loader.sampler.set_epoch(epoch)\n" in code and result.todos == []


def test_an_if_that_steps_only_a_scheduler_is_no_accumulation_boundary():
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
        loader = DataLoader(torch.randn(64, 3), batch_size=8, shuffle=True)
        for epoch in range(3):
            for i, x in enumerate(loader):
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
                if epoch < 1:
                    warmup.step()
        """
    )
    assert "no_sync" not in result.code


def test_an_if_that_steps_the_optimizer_through_a_scaler_is_one():
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler()
        loader = DataLoader(torch.randn(64, 3), batch_size=8, shuffle=True)
        for epoch in range(3):
            for i, x in enumerate(loader):
                scaler.scale(model(x).sum()).backward()
                if (i + 1) % 4 == 0:
                    scaler.step(opt)
                    scaler.update()
        """
    )
    assert "with contextlib.nullcontext() if (i + 1) % 4 == 0 else model.no_sync():" in result.code


def test_per_process_log_files_stay_on_every_rank_and_a_mkdtemp_folder_is_rank0s():
    result = convert(
        """
        import logging
        import os
        import tempfile
        import torch
        from torch.utils.data import DataLoader

        def main():
            logger = logging.getLogger("train")
            logger.addHandler(logging.FileHandler(f"worker{os.getpid()}.log"))
            ckpt_dir = tempfile.mkdtemp()
            model = torch.nn.Linear(3, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = DataLoader(torch.randn(64, 3), batch_size=8, shuffle=True)
            for epoch in range(2):
                for x in loader:
                    model(x).sum().backward()
                    optimizer.step()
                torch.save(model.state_dict(), os.path.join(ckpt_dir, "best.pt"))
            model.load_state_dict(torch.load(os.path.join(ckpt_dir, "best.pt")))
        """
    )
    code = result.code
    assert '    logger.addHandler(logging.FileHandler(f"worker{os.getpid()}.log"))\n' in code  # not guarded
    setup = code.index("dist.init_process_group(")
    assert setup < code.index("dist.broadcast_object_list(ckpt_dir_of_rank0)") < code.index("for epoch in range(2)")
    assert "        if dist.get_rank() == 0:\n            torch.save(model.module.state_dict(), os.path.join(ckpt_dir" in code
    assert code.index("dist.barrier()  # rank 0 has written this file") < code.index("torch.load(os.path.join(ckpt_dir")


def test_a_temporary_directory_is_rank0s_until_every_rank_is_done_with_it():
    result = convert(
        """
        import tempfile
        import torch
        from torch.utils.data import DataLoader

        def train(model, optimizer, loader):
            with tempfile.TemporaryDirectory() as tmp:
                for epoch in range(2):
                    for x in loader:
                        model(x).sum().backward()
                        optimizer.step()
                    torch.save(model.state_dict(), f"{tmp}/best.pt")
                model.load_state_dict(torch.load(f"{tmp}/best.pt"))
                return model

        def main():
            model = torch.nn.Linear(3, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            train(model, optimizer, DataLoader(torch.randn(64, 3), batch_size=8, shuffle=True))
        """
    )
    code = result.code
    share = "        tmp_of_rank0 = [tmp]\n        dist.broadcast_object_list(tmp_of_rank0)"
    assert code.index("with tempfile.TemporaryDirectory() as tmp:\n" + share) > 0
    assert "            if dist.get_rank() == 0:\n                torch.save(model.module.state_dict()" in code
    done = "        dist.barrier()  # every rank is done with rank 0's temporary folder before it goes\n        return model\n"
    assert done in code and code.count("broadcast_object_list") == 1


def test_a_checkpoint_that_stores_the_rank_is_still_one_file():
    result = convert(
        """
        import os
        import torch
        from torch.utils.data import DataLoader
        rank = int(os.environ.get("RANK", 0))
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(torch.randn(64, 3), batch_size=8, shuffle=True)
        for epoch in range(2):
            for x in loader:
                model(x).sum().backward()
                optimizer.step()
            torch.save({"model": model.state_dict(), "rank": rank}, "ckpt.pt")
            torch.save(model.state_dict(), f"ckpt_rank{rank}.pt")
        """
    )
    code = result.code
    assert '    if dist.get_rank() == 0:\n        torch.save({"model": model.module.state_dict(), "rank": rank}, "ckpt.pt")' in code
    assert '    torch.save(model.module.state_dict(), f"ckpt_rank{rank}.pt")\n' in code  # every rank its own


def test_a_download_the_script_does_itself_is_done_by_rank_zero_first():
    """requests.get + tarfile extractall on every rank write the same files at once (the GCN
    example's Cora download): each node's local rank 0 alone fetches (nodes may have their own
    disks), the others wait, then everyone reads; with --shared-fs, rank 0 of the job."""
    source = """
        import tarfile
        import requests
        import torch

        def main():
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            print("Downloading dataset...")
            with requests.get("https://example.org/data.tgz", stream=True) as tgz_file:
                with tarfile.open(fileobj=tgz_file.raw, mode="r:gz") as tgz_object:
                    tgz_object.extractall()
            features = torch.load("data/features.pt")
            model = torch.nn.Linear(3, 1).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for epoch in range(2):
                model(features).sum().backward()
                optimizer.step()

        main()
        """
    result = convert(source)
    code = result.code
    # only local rank 0 fetches and unpacks (another rank doing it again would rewrite the files
    # while it reads them), then every rank waits for it before reading
    fetch = code.index("        with requests.get(")
    assert code[:fetch].endswith("    if local_rank == 0:\n") and code.index("init_process_group") < fetch
    after = code.index("    dist.barrier()  # downloaded: every rank reads it\n", fetch)
    assert after < code.index("torch.load(")
    assert any("once per node, by its local rank 0" in note.message for note in result.changes)
    shared = convert_source(textwrap.dedent(source), "train.py", ConvertOptions(shared_fs=True)).code
    fetch = shared.index("        with requests.get(")
    assert shared[: shared.index("\n", shared.rindex("if ", 0, fetch))].endswith("if dist.get_rank() == 0:")


RESUMABLE = """
import argparse
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--resume", {option})
parser.add_argument("--eval-only", default="")
args = parser.parse_args()
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), batch_size=8, shuffle=True)
start = 0
if args.eval_only:
    model.load_state_dict(torch.load(args.eval_only))
{gate}
for epoch in range(start, 3):
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    torch.save({{"model": model.state_dict(), "opt": optimizer.state_dict(), "epoch": epoch + 1}}, {saved})
"""
RESTART_LINE = 'if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0 and os.path.exists('


def _resumable(gate: str, saved: str = '"last.pt"', option: str = 'default=""'):
    source = RESUMABLE.format(gate=textwrap.dedent(gate).strip(), saved=saved, option=option)
    result = convert_source(source, "train.py")
    notes = [n.message for n in result.notes] + [n.message for n in result.changes]
    return result.code, notes


def test_a_resume_option_is_pointed_at_the_last_checkpoint_after_a_restart():
    code, notes = _resumable("""
        if args.resume:
            state = torch.load(args.resume)
            optimizer.load_state_dict(state["opt"])
            start = state["epoch"]
    """)
    line = code.index(RESTART_LINE)
    assert code[line:].startswith(RESTART_LINE + '"last.pt"):\n    args.resume = "last.pt"\nif args.resume:')
    assert code.count(RESTART_LINE) == 1  # `--eval-only PATH` only loads weights: no resume gate
    assert any("goes on from the last checkpoint" in n for n in notes)
    again = convert_source(code, "train_ddp.py")
    assert again.code == code  # converting the output changes nothing


def test_a_resume_flag_around_the_saved_path_is_set():
    code, _ = _resumable("""
        if args.resume:
            state = torch.load("last.pt")
            model.load_state_dict(state["model"])
            start = state["epoch"]
    """, option='action="store_true"')
    assert RESTART_LINE + '"last.pt"):\n    args.resume = True\n' in code


def test_a_resume_mode_compared_with_a_literal_is_set():
    """nanoGPT's `init_from == "resume"`, as an elif of the chain: the line goes above the chain."""
    code, _ = _resumable("""
        init_from = args.resume or "scratch"
        if init_from == "scratch":
            pass
        elif init_from == "resume":
            state = torch.load("last.pt")
            optimizer.load_state_dict(state["opt"])
    """)
    assert RESTART_LINE + '"last.pt"):\n    init_from = "resume"\nif init_from == "scratch":' in code


def test_a_save_path_bound_again_in_the_loop_is_not_the_resume_path():
    """`path` names the checkpoint to preload at the gate, then each epoch's new file in the loop:
    the gate cannot be pointed at what the loop saves (`path = path` would be nonsense, and
    os.path.exists(None) a crash after a restart), so a note says so."""
    source = textwrap.dedent("""
        import torch
        import torch.nn as nn
        from torch.utils.data import DataLoader, TensorDataset

        def train(preload):
            model = nn.Linear(4, 2)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), batch_size=8, shuffle=True)
            start = 0
            path = f"weights_{preload}.pt" if preload else None
            if path:
                state = torch.load(path)
                optimizer.load_state_dict(state["opt"])
                start = state["epoch"] + 1
            for epoch in range(start, 3):
                for x, y in loader:
                    optimizer.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    optimizer.step()
                path = f"weights_{epoch}.pt"
                torch.save({"opt": optimizer.state_dict(), "epoch": epoch}, path)

        train(None)
    """)
    result = convert_source(source, "train.py")
    assert RESTART_LINE not in result.code, result.code
    assert any("the path of the checkpoint saved in training is not known here" in n.message for n in result.notes)


def test_checkpoints_without_a_usable_resume_path_get_a_note():
    _, per_epoch = _resumable("""
        if args.resume:
            state = torch.load(args.resume)
            optimizer.load_state_dict(state["opt"])
    """, saved='f"ckpt_{epoch}.pt"')
    assert any("the path of the checkpoint saved in training is not known here" in n for n in per_epoch)
    code, other = _resumable("""
        if args.resume:
            state = torch.load("best.pt")
            optimizer.load_state_dict(state["opt"])
    """, option='action="store_true"')
    assert RESTART_LINE not in code
    assert any('loads "best.pt", not the checkpoint saved in training ("last.pt")' in n for n in other)
    code, none = _resumable("")
    assert RESTART_LINE not in code
    assert any(n.startswith("no resume path (loading model, optimizer and epoch before training)") for n in none)
    code, exists = _resumable("""
        if os.path.exists("last.pt"):
            state = torch.load("last.pt")
            optimizer.load_state_dict(state["opt"])
    """)
    assert RESTART_LINE not in code  # a gate on the file's existence resumes after a restart by itself
    assert not any(n.startswith("no resume path") for n in exists), exists


def test_a_file_written_at_start_and_read_back_is_written_on_every_node():
    """A vocabulary written before the model is wrapped and read back is data on each node's
    disk: its local rank 0 writes it (with --shared-fs, rank 0 once); results written after
    training stay rank 0's."""
    source = (ROOT / "fixtures" / "nodes" / "vocab_at_start.py").read_text()
    code = convert_source(source, "train.py").code
    vocab = code.index('\n        with open("vocab.json", "w") as f:')
    assert code[:vocab].endswith("\n    if local_rank == 0:")
    assert code.index("dist.barrier()", vocab) < code.index('with open("vocab.json") as f:')
    results = code.index('\n        with open("results.json", "w") as f:')
    assert code[:results].endswith("\n    if dist.get_rank() == 0:")
    shared = convert_source(source, "train.py", ConvertOptions(shared_fs=True)).code
    assert shared[: shared.index('\n        with open("vocab.json", "w") as f:')].endswith("\n    if dist.get_rank() == 0:")
    from ddpify.check.runner import check_source

    assert check_source(code, "train_ddp.py", ["DDP307"]).findings == []  # the per-node guard is no DDP307


def test_a_module_level_resume_flag_read_in_a_function_gets_a_note_not_an_edit():
    """Assigning `RESUME` inside main() would make it local there, unbound without a restart."""
    source = RESUMABLE.format(gate="", saved='"last.pt"', option='default=""').replace(
        "start = 0\n", "start = 0\nRESUME = False\n\n\ndef main():\n    global start\n    if RESUME:\n"
        "        state = torch.load(\"last.pt\")\n        optimizer.load_state_dict(state[\"opt\"])\n"
        "        start = state[\"epoch\"]\n\n\nmain()\n"
    )
    result = convert_source(source, "train.py")
    assert RESTART_LINE not in result.code
    assert any("`RESUME` is not this function's own name" in n.message for n in result.notes)


LOCAL_GUARDED = """
import torch
from torch.utils.data import DataLoader
data = [(torch.randn(4), torch.randn(1)) for _ in range(32)]
loader = DataLoader(data, batch_size=4, shuffle=True)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
local_rank = {value}
for epoch in range(2):
    for x, y in loader:
        loss = model(x).sub(y).pow(2).mean()
        loss.backward()
        optimizer.step()
{guard}
"""


def test_a_local_rank_guard_around_job_wide_output_tests_the_global_rank():
    """`local_rank in (-1, 0)` and `local_rank == 0` are true once per node: the checkpoint and
    the log they hold become rank 0's of the whole job, and check has nothing left to say."""
    from ddpify.check.runner import check_source

    cases = {
        "    if local_rank in (-1, 0):\n        print(epoch)\n": "    if dist.get_rank() == 0:\n        print(epoch)\n",
        "    if epoch % 2 == 0 and local_rank == 0:\n        torch.save(model.state_dict(), 'm.pt')\n":
            "    if epoch % 2 == 0 and dist.get_rank() == 0:\n        torch.save(model.module.state_dict(), 'm.pt')\n",
        "    if local_rank not in [-1, 0]:\n        continue\n    print(epoch)\n":
            "    if dist.get_rank() != 0:\n        continue\n    print(epoch)\n",
        "    if local_rank <= 0:\n        print(epoch)\n": "    if dist.get_rank() == 0:\n        print(epoch)\n",
        "    if not local_rank > 0:\n        print(epoch)\n": "    if dist.get_rank() == 0:\n        print(epoch)\n",
        "    if epoch > 0 and (local_rank == -1 or local_rank == 0):\n        print(epoch)\n":
            "    if epoch > 0 and dist.get_rank() == 0:\n        print(epoch)\n",
    }  # fmt: skip
    for guard, expected in cases.items():
        result = convert_source(LOCAL_GUARDED.format(value="-1", guard=guard), "train.py")
        assert expected in result.code, result.code
        assert any("tests the local rank (once per node): job-wide output is guarded by" in c.message for c in result.changes)
        assert check_source(result.code, "train_ddp.py", ["DDP307"]).findings == []
        assert convert_source(result.code, "train_ddp.py").code == result.code


def test_what_a_local_rank_guard_made_is_used_under_the_global_rank_too():
    """A writer or a log file made under the new global guard is None or unbound on the other
    nodes' local rank 0: the local-rank guards around its use change with it."""
    made = {
        "writer = SummaryWriter() if local_rank in (-1, 0) else None\n": "writer.add_scalar('loss', loss.item(), epoch)",
        "if local_rank in (-1, 0):\n    log = open('log.txt', 'w')\n": "log.write(str(epoch))",
    }
    for before, use in made.items():
        source = LOCAL_GUARDED.format(value="-1", guard=f"    if local_rank in (-1, 0):\n        {use}\n")
        source = "from torch.utils.tensorboard import SummaryWriter\n" + source.replace("for epoch", before + "for epoch", 1)
        code = convert_source(source, "train.py").code
        assert "local_rank in (-1, 0)" not in code, code
        assert f"    if dist.get_rank() == 0:\n        {use}\n" in code


def test_a_local_rank_guard_around_data_preparation_stays():
    """Per-node data (a folder made for the data) is what a local-rank guard is for."""
    guard = "    if local_rank in (-1, 0):\n        os.makedirs('data/cache', exist_ok=True)\n        print(epoch)\n"
    code = convert_source("import os\n" + LOCAL_GUARDED.format(value="-1", guard=guard), "train.py").code
    assert "    if local_rank in (-1, 0):\n" in code


def _project(folder: Path, files: dict[str, str]) -> Path:
    """A small project in `folder` (a pyproject.toml marks its root); returns the entry."""
    (folder / "pyproject.toml").write_text("")
    for name, code in files.items():
        (folder / name).write_text(textwrap.dedent(code))
    return folder / "train.py"


HELPER_ENTRY = """
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import engine
    from sampling import show

    class Net(torch.nn.Sequential):
        def summary(self):
            return str(len(self))

    model = Net(torch.nn.Linear(4, 1), torch.nn.BatchNorm1d(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
    for epoch in range(2):
        engine.train_epoch(loader, model, optimizer)
        if epoch % 2 == 0:
            print(show(model))
"""
TRAIN_EPOCH = """
    def train_epoch(loader, model, optimizer):
        for x, y in loader:
            loss = (model(x) - y).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
"""


def test_helpers_of_other_modules_get_the_plain_model(tmp_path):
    """A function of another module that reads the model's own methods (through a function it
    hands the model to), or that runs on rank 0 only (a DDP forward there waits for the other
    ranks), gets `model.module`, in a project converted as one program and in one whose other
    modules stay as they are."""
    from ddpify.projects import convert_project

    helpers = {
        "reads its own methods": "def describe(net):\n    return net.summary()\n\ndef show(m):\n    return describe(m)\n",
        "runs on rank 0 only": "import torch\n\n@torch.no_grad()\ndef show(net):\n    return float(net(torch.ones(2, 4)).sum())\n",
    }
    for why, sampling in helpers.items():
        for together in (True, False):
            files = {"train.py": HELPER_ENTRY, "sampling.py": sampling, "engine.py": TRAIN_EPOCH}
            if not together:  # the loop in the entry; engine.py only a name
                files["train.py"] = HELPER_ENTRY.replace(
                    "engine.train_epoch(loader, model, optimizer)",
                    "for x, y in loader:\n            optimizer.zero_grad()\n"
                    "            (model(x) - y).pow(2).mean().backward()\n            optimizer.step()",
                )
            folder = tmp_path / f"{len(why)}{together}"
            folder.mkdir()
            result = convert_project(_project(folder, files))
            code = {path.name: r.code for path, (r, _, _) in result.changed.items()}
            assert "print(show(model.module))" in code["train.py"], (why, together, code["train.py"])
            assert "sampling.py" not in code
            if together:
                assert "engine.train_epoch(loader, model, optimizer)" in code["train.py"]  # trains: the wrapper


DATA_PARALLEL_RESUME = """
import torch
from torch import nn
from torch.utils.data import DataLoader

model = nn.Linear(4, 1)
{before}
model = nn.DataParallel(model).cuda()
{after}
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(list(range(8)), batch_size=4, shuffle=True)
for epoch in range(2):
    for x in loader:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
"""


def test_state_dicts_loaded_into_a_data_parallel_model_lose_the_prefix():
    """A script that loaded into its nn.DataParallel model loads `module.` keys: the converted
    script loads into the plain model, so it strips them (where present); a load before the
    DataParallel wrap, or into `model.module`, loaded plain keys and stays."""
    strip = '{k.removeprefix("module."): v for k, v in torch.load("old.pt", map_location=device).items()}'
    cases = {
        ("", 'model.load_state_dict(torch.load("old.pt"))'): f"model.load_state_dict({strip})",
        ("", 'model.load_state_dict(state_dict=torch.load("old.pt"), strict=True)'): f"model.load_state_dict(state_dict={strip}, strict=True)",
        ('model.load_state_dict(torch.load("old.pt"))', ""): 'model.load_state_dict(torch.load("old.pt", map_location=device))',
        ("", 'model.module.load_state_dict(torch.load("old.pt"))'): 'model.load_state_dict(torch.load("old.pt", map_location=device))',
    }  # fmt: skip
    for (before, after), expected in cases.items():
        result = convert_source(DATA_PARALLEL_RESUME.format(before=before, after=after), "train.py")
        assert expected in result.code, result.code
        assert convert_source(result.code, "train_ddp.py").code == result.code


def test_a_parameter_named_alike_in_a_writer_and_a_reader_is_not_one_file():
    """`save_json(obj, path)` writes and `load_json(path)` reads a `path` each caller chooses:
    not the same file, so no barrier goes into the reader, and the writer is not one of data read
    back (once per node); a file the script names itself, written on rank 0 and read back, still
    waits for rank 0."""
    source = textwrap.dedent("""
        import json
        import torch
        from torch.utils.data import DataLoader

        def save_json(obj, path):
            with open(path, "w") as f:
                json.dump(obj, f)

        def load_json(path):
            with open(path) as f:
                return json.load(f)

        settings = load_json("defaults.json")
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=settings["lr"])
        loader = DataLoader(torch.randn(8, 2), batch_size=2, shuffle=True)
        for epoch in range(2):
            for x in loader:
                model(x).sum().backward()
                optimizer.step()
            save_json({"epoch": epoch}, "progress.json")
        torch.save(model.state_dict(), "last.pt")
        model.load_state_dict(torch.load("last.pt"))
    """)
    result = convert_source(source, "train.py")
    reader = result.code[result.code.index("def load_json"):result.code.index("settings =")]
    assert "barrier" not in reader, result.code
    assert result.code.count("dist.barrier()  # rank 0 has written this file") == 1, result.code
    assert "dist.barrier()  # rank 0 has written this file\nmodel.module.load_state_dict(" in result.code, result.code
    # nor is a file the script writes per epoch data that it reads back: rank 0 of the job writes it
    assert 'def save_json(obj, path):\n    if dist.get_rank() == 0:' in result.code, result.code


def test_a_path_carried_by_an_object_is_one_file_but_a_cached_read_gets_no_barrier():
    """`cfg.best` saved in `fit(cfg)` and loaded in `check(cfg)`: one file (the object carries
    it), so the load waits for rank 0; a read under `if os.path.exists(cfg.vocab):` (a cache
    either built or read) gets no barrier: ranks may take either branch."""
    source = textwrap.dedent("""
        import os
        import pickle
        import types
        import torch
        from torch.utils.data import DataLoader

        def build(cfg):
            words = {"a": 0}
            pickle.dump(words, open(cfg.vocab, "wb"))
            return words

        def vocabulary(cfg):
            if os.path.exists(cfg.vocab):
                return pickle.load(open(cfg.vocab, "rb"))
            return build(cfg)

        def fit(cfg, model, loader):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for epoch in range(2):
                for x in loader:
                    model(x).sum().backward()
                    opt.step()
                torch.save(model.state_dict(), cfg.best)

        def check(cfg, model):
            model.load_state_dict(torch.load(cfg.best))

        cfg = types.SimpleNamespace(best="best.pt", vocab="vocab.pkl")
        words = vocabulary(cfg)
        model = torch.nn.Linear(2, 1)
        fit(cfg, model, DataLoader(torch.randn(8, 2), batch_size=2, shuffle=True))
        check(cfg, model)
    """)
    code = convert_source(source, "train.py").code
    assert "    dist.barrier()  # rank 0 has written this file\n    model.load_state_dict(" in code, code
    assert code.count("# rank 0 has written this file") == 1, code


def test_an_error_report_before_the_process_gives_up_stays_on_every_rank():
    """`print("loss diverged"); sys.exit(1)` (or `raise`): the rank that fails says why, whichever
    it is, as `ddpify check` expects; an ordinary print still goes to rank 0."""
    source = textwrap.dedent("""
        import sys
        import torch
        from torch.utils.data import DataLoader
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(torch.randn(8, 2), batch_size=2, shuffle=True)
        for epoch in range(2):
            for x in loader:
                loss = model(x).sum()
                if not torch.isfinite(loss):
                    print("loss diverged, stopping")
                    sys.exit(1)
                if loss.item() > 1e6:
                    print("loss exploded")
                    raise RuntimeError("exploded")
                loss.backward()
                opt.step()
            print("epoch", epoch)
    """)
    code = convert_source(source, "train.py").code
    assert '        if not torch.isfinite(loss):\n            print("loss diverged, stopping")' in code, code
    assert '        if loss.item() > 1e6:\n            print("loss exploded")' in code, code
    assert '    if dist.get_rank() == 0:\n        print("epoch", epoch)' in code, code


def test_an_else_that_only_wrapped_in_data_parallel_goes():
    """`if cuda: net = DataParallel(net).cuda()` / `else: net = DataParallel(net)`: the `if` keeps
    its move to the device, the `else` goes whole (no `else: pass`)."""
    source = textwrap.dedent("""
        import torch
        from torch.utils.data import DataLoader
        net = torch.nn.Linear(2, 1)
        if torch.cuda.is_available():
            net = torch.nn.DataParallel(net).cuda()
        else:
            net = torch.nn.DataParallel(net)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        loader = DataLoader(torch.randn(8, 2), batch_size=2, shuffle=True)
        for epoch in range(2):
            for x in loader:
                net(x).sum().backward()
                optimizer.step()
    """)
    result = convert_source(source, "train.py")
    assert "if torch.cuda.is_available():\n    net = net.to(device)\noptimizer" in result.code, result.code
    assert "else:\n    net" not in result.code and "pass" not in result.code, result.code
    assert convert_source(result.code, "train_ddp.py").code == result.code


def test_a_trainer_that_wrapped_in_data_parallel_loads_without_the_prefix():
    result = convert(
        """
        import torch
        from torch import nn

        class Trainer:
            def __init__(self, model, loader):
                self.model = nn.DataParallel(model).cuda()
                self.loader = loader
                self.optimizer = torch.optim.Adam(self.model.parameters())

            def resume(self, path):
                self.model.load_state_dict(torch.load(path)["model"])

            def fit(self):
                for x in self.loader:
                    self.optimizer.zero_grad()
                    self.model(x).sum().backward()
                    self.optimizer.step()
        """
    )
    strip = '{k.removeprefix("module."): v for k, v in torch.load(path, map_location="cpu")["model"].items()}'
    assert f"self.model.module.load_state_dict({strip})" in result.code, result.code


def test_self_tests_of_imported_modules_stay_as_they_are(tmp_path):
    """`if __name__ == "__main__":` in a module the entry imports runs only when that module is
    run as a script: a conversion of the project (here as one program: the epoch is a helper of
    another module) neither guards its prints nor counts its backward pass as training."""
    from ddpify.projects import convert_project

    models = (
        "import torch\n\n\nclass Net(torch.nn.Linear):\n    pass\n\n\n"
        'if __name__ == "__main__":\n    net = Net(4, 1)\n    net(torch.ones(1, 4)).sum().backward()\n'
        '    print("grad", net.weight.grad.shape)\n    torch.save(net.state_dict(), "selftest.pt")\n'
    )
    entry = HELPER_ENTRY.replace("from sampling import show\n", "from models import Net as Plain\n")
    entry = entry.replace("Net(torch.nn.Linear(4, 1), torch.nn.BatchNorm1d(1))", "Plain(4, 1)").replace("print(show(model))", 'print("epoch", epoch)')
    result = convert_project(_project(tmp_path, {"train.py": entry, "models.py": models, "engine.py": TRAIN_EPOCH}))
    changed = {path.name for path in result.changed}
    assert changed == {"train.py"}, changed
    assert "DDP(model" in result.changed[tmp_path / "train.py"][0].code


RANK0_OBJECT = """
import os
import torch
import wandb
from torch.utils.data import DataLoader

run = wandb.init(project="toy")
run.config.update({{"lr": 0.1}})
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(list(range(8)), batch_size=4, shuffle=True)
{use}
for epoch in range({epochs}):
    for x in loader:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    torch.save(model.state_dict(), os.path.join(out_dir, "last.pt"))
"""


def test_values_of_a_rank0_only_object_are_read_on_rank0_only():
    """`run = wandb.init(...)` exists on rank 0 only: `run.config.update(...)`, a folder named
    from it and every use of that folder run there too; a value from it that decides the
    training on every rank cannot, and gets a TODO."""
    source = RANK0_OBJECT.format(use="out_dir = os.path.join(run.dir, 'weights')\nos.makedirs(out_dir, exist_ok=True)", epochs=2)
    result = convert_source(source, "train.py")
    assert 'if int(os.environ.get("RANK", 0)) == 0:\n    run.config.update(' in result.code, result.code  # before the group
    assert "if dist.get_rank() == 0:\n    out_dir = os.path.join(run.dir, 'weights')\n    os.makedirs(out_dir, exist_ok=True)\n" in result.code
    assert "    if dist.get_rank() == 0:\n        torch.save(model.module.state_dict(), os.path.join(out_dir" in result.code
    assert result.todos == []
    assert convert_source(result.code, "train_ddp.py").code == result.code
    source = RANK0_OBJECT.format(use="out_dir = run.dir\nepochs = len(run.name)", epochs="epochs")
    result = convert_source(source, "train.py")
    assert [t.message for t in result.todos] == ["`epochs` comes from `run`, which exists on rank 0 only: compute it on every rank"]


def test_torch_serialization_spellings_are_torch_save_and_load():
    """`from torch.serialization import save, load`, `torch.serialization.save` and an aliased
    module are torch.save/torch.load: guarded, given a map_location, and check-clean after."""
    from ddpify.check.runner import check_source

    result = convert(
        """
        import torch
        import torch.serialization as ser
        from torch.serialization import load, save
        from torch.utils.data.dataloader import DataLoader
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader([(torch.zeros(2), torch.zeros(1))] * 8, batch_size=4, shuffle=True)
        for epoch in range(2):
            for x, y in loader:
                model(x).sub(y).pow(2).mean().backward()
                optimizer.step()
            save(model.state_dict(), "m.pt")
            torch.serialization.save(optimizer.state_dict(), "o.pt")
        model.load_state_dict(load("m.pt"))
        optimizer.load_state_dict(ser.load("o.pt"))
        """
    )
    assert "    if dist.get_rank() == 0:\n        save(model.module.state_dict()" in result.code
    assert 'load("m.pt", map_location=device)' in result.code
    assert 'ser.load("o.pt", map_location=device)' in result.code
    assert "DistributedSampler(" in result.code
    findings = check_source(result.code, "train_ddp.py", codes=["DDP301", "DDP109"]).findings
    assert findings == [], findings


RANDOM_PRELUDE = """
import random
import numpy as np
import torch
from torch.utils.data import DataLoader
"""


def test_a_schedule_drawn_at_random_is_rank0s_and_data_draws_stay_each_ranks():
    """A learning rate drawn in main() and handed to a training function is broadcast from
    rank 0 after setup; a NumPy array of samples and a per-batch coin stay each rank's own."""
    result = convert(
        RANDOM_PRELUDE
        + textwrap.dedent(
            """
        def train(model, loader, optimizer, epochs):
            for epoch in range(epochs):
                for x, y in loader:
                    if random.random() < 0.5:
                        x = -x
                    model(x).sub(y).pow(2).mean().backward()
                    optimizer.step()

        def main():
            noise = np.random.rand(8, 2)
            epochs = random.randint(2, 4)
            model = torch.nn.Linear(2, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = DataLoader([(torch.zeros(2), torch.zeros(1))] * 8, batch_size=4, shuffle=True)
            train(model, loader, optimizer, epochs)

        main()
        """
        )
    )
    assert "drawn_by_rank0 = [epochs]" in result.code and "[epochs] = drawn_by_rank0" in result.code
    assert result.code.index("dist.init_process_group") < result.code.index("dist.broadcast_object_list(drawn_by_rank0)")
    assert [c.message for c in result.changes if "drawn at random" in c.message] == [
        "`epochs` drawn at random: every rank takes rank 0's (dist.broadcast_object_list)"
    ]
    assert not result.todos


def test_a_module_level_schedule_is_drawn_alike_on_every_rank():
    """A global drawn at import, read by the training function, before any process group exists:
    nothing can broadcast it there, so the draw comes from one generator seeded by torchrun's
    job id, the same on every rank (and from the system's entropy as one process)."""
    result = convert(
        RANDOM_PRELUDE
        + textwrap.dedent(
            """
            EPOCHS = random.choice([2, 3])

            def main():
                model = torch.nn.Linear(2, 1)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                loader = DataLoader([(torch.zeros(2), torch.zeros(1))] * 8, batch_size=4, shuffle=True)
                for epoch in range(EPOCHS):
                    for x, y in loader:
                        model(x).sub(y).pow(2).mean().backward()
                        optimizer.step()

            main()
            """
        )
    )
    assert not result.todos
    assert 'job_random = random.Random(os.environ.get("TORCHELASTIC_RUN_ID"))' in result.code
    assert "EPOCHS = job_random.choice([2, 3])" in result.code
    assert "drawn_by_rank0" not in result.code


def test_a_run_folder_named_by_the_clock_is_made_by_rank0_and_its_name_shared():
    """`run_dir` from `datetime.now().strftime(...)`, made with exist_ok=False before the
    process group exists: rank 0 makes it, every rank takes its name; a start time kept as a
    number stays each rank's own."""
    result = convert(
        """
        import os
        import time
        from datetime import datetime
        import torch
        from torch.utils.data import DataLoader

        def main():
            start = time.time()
            run_dir = os.path.join("runs", datetime.now().strftime("%m%d_%H%M%S"))
            os.makedirs(run_dir, exist_ok=False)
            model = torch.nn.Linear(2, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = DataLoader([(torch.zeros(2), torch.zeros(1))] * 8, batch_size=4, shuffle=True)
            for epoch in range(2):
                for x, y in loader:
                    model(x).sub(y).pow(2).mean().backward()
                    optimizer.step()
                torch.save(model.state_dict(), os.path.join(run_dir, "m.pt"))
            print("took", time.time() - start)

        main()
        """
    )
    code = result.code
    assert '    if int(os.environ.get("RANK", 0)) == 0:\n        os.makedirs(run_dir, exist_ok=False)\n' in code
    assert code.index("dist.init_process_group") < code.index("dist.broadcast_object_list(run_dir_of_rank0)")
    assert "[run_dir] = run_dir_of_rank0\n" in code and "start_of_rank0" not in code
    assert "`run_dir` named by the clock, made by rank 0 alone: every rank takes rank 0's (dist.broadcast_object_list)" in [
        c.message for c in result.changes
    ]
    assert not result.todos


# Issue 21: which model an optimizer trains, and what DDP wraps (analysis/optimizers.py).
NET = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.depth = 2
        self.backbone = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.backbone(x)))

    def get_1x_lr_params(self):
        for module in [self.backbone]:
            for p in module.parameters():
                if p.requires_grad:
                    yield p

    def get_parameters(self, initial_lr):
        return [{"params": self.backbone.parameters(), "lr": initial_lr}, {"params": self.head.parameters(), "lr": 10 * initial_lr}]


loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
"""
STEP = """
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


def test_the_model_behind_parameter_groups_and_factories_is_wrapped():
    """Groups from the model's own methods, a list built first, decay/no-decay groups appended in
    a loop over `named_parameters()`, a factory given the model or its parameters: each trains
    `model`, which is wrapped."""
    optimizers = [
        'optimizer = torch.optim.SGD([{"params": model.get_1x_lr_params(), "lr": 0.1}], lr=0.1)\n',
        "optimizer = torch.optim.SGD(model.get_parameters(initial_lr=0.1), lr=0.1)\n",
        "params = [{'params': model.backbone.parameters()}, {'params': model.head.parameters(), 'lr': 1.0}]\n"
        "optimizer = torch.optim.SGD(params, lr=0.1)\n",
        "decay, no_decay = [], []\n"
        "for name, p in model.named_parameters():\n"
        "    (no_decay if name.endswith('bias') else decay).append(p)\n"
        "optimizer = torch.optim.AdamW([{'params': decay}, {'params': no_decay, 'weight_decay': 0.0}], lr=0.1)\n",
    ]
    factory = (
        "def make_optimizer(cfg, net):\n"
        "    groups = [p for p in net.parameters() if p.requires_grad]\n"
        "    return torch.optim.AdamW(groups, lr=cfg['lr'])\n\n\n"
    )
    sources = [NET + "model = Net()\n" + made + STEP for made in optimizers]
    sources.append(NET + factory + "model = Net()\noptimizer = make_optimizer({'lr': 0.1}, model)\n" + STEP)
    given = "def make(params, lr):\n    return torch.optim.SGD(params, lr=lr)\n\n\n"
    sources.append(NET + given + "model = Net()\noptimizer = make(model.parameters(), 0.1)\n" + STEP)
    for source in sources:
        result = convert_source(source, "train.py")
        assert "model = DDP(model" in result.code, result.code
        assert "DDP(net" not in result.code and not result.todos, result.code


def test_a_plain_trainer_object_is_never_wrapped():
    """`class Solver:` builds optimizers over the models it holds: those models are wrapped (each
    after it is moved), never the Solver itself."""
    source = NET.replace("loader = ", "LOADER = ") + (
        "class Solver:\n"
        "    def __init__(self, loader):\n"
        "        self.loader = loader\n"
        "        self.build_model()\n\n"
        "    def build_model(self):\n"
        "        self.G = Net()\n"
        "        self.g_opt = torch.optim.Adam(self.G.parameters(), lr=1e-3)\n"
        "        self.G.to('cuda')\n\n"
        "    def train(self):\n"
        "        for x, y in self.loader:\n"
        "            loss = nn.functional.mse_loss(self.G(x.cuda()), y.cuda())\n"
        "            self.g_opt.zero_grad()\n"
        "            loss.backward()\n"
        "            self.g_opt.step()\n"
        "        torch.save(self.G.state_dict(), 'G.pt')\n\n\n"
        "Solver(LOADER).train()\n"
    )
    code = convert_source(source, "train.py").code
    assert "self.G = DDP(self.G" in code, code
    assert "DDP(self," not in code and "DDP(self.to" not in code and "self = DDP" not in code, code
    assert "torch.save(self.G.module.state_dict(), 'G.pt')" in code  # built in a method `__init__` runs


def test_a_wrapper_module_built_around_the_network_is_what_ddp_wraps():
    """`net = LossWrapper(backbone)`: the training runs `net`, so `net` is wrapped (after it is
    built) and its own attributes are read through `.module`; `model = LossWrapper(model)` too."""
    wrapper = (
        "class LossWrapper(nn.Module):\n"
        "    def __init__(self, net):\n"
        "        super().__init__()\n"
        "        self.net = net\n"
        "        self.depth = net.depth\n\n"
        "    def forward(self, x, y):\n"
        "        return nn.functional.mse_loss(self.net(x), y)\n\n\n"
    )
    step = STEP.replace("nn.functional.mse_loss(model(x), y)", "model(x, y) * model.depth")
    renamed = step.replace("model(x, y) * model.depth", "net(x, y) * net.depth")
    cases = {
        "model = Net()\nmodel = LossWrapper(model)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n" + step: "model",
        "backbone = Net()\noptimizer = torch.optim.SGD(backbone.parameters(), lr=0.1)\nnet = LossWrapper(backbone)\n" + renamed: "net",
    }
    for tail, wrapped in cases.items():
        code = convert_source(NET + wrapper + tail, "train.py").code
        assert f"{wrapped} = DDP({wrapped}" in code, code
        assert f"{wrapped}(x, y) * {wrapped}.module.depth" in code, code
        assert code.index(f"{wrapped} = LossWrapper(") < code.index(f"{wrapped} = DDP("), code


def test_module_is_read_only_where_every_path_wrapped_the_model():
    """A trainer wraps its model in `fit()`; `evaluate()` may run before (plain) or after
    (wrapped): it reads the network through `unwrap(...)`, `fit()` itself through `.module`."""
    source = NET.replace("loader = ", "LOADER = ") + (
        "class Trainer:\n"
        "    def __init__(self, loader):\n"
        "        self.loader = loader\n"
        "        self.model = Net()\n\n"
        "    def evaluate(self, x):\n"
        "        return self.model.depth * self.model(x).sum().item()\n\n"
        "    def fit(self):\n"
        "        self.model = self.model.to('cuda')\n"
        "        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)\n"
        "        for x, y in self.loader:\n"
        "            loss = nn.functional.mse_loss(self.model(x.cuda()), y.cuda())\n"
        "            optimizer.zero_grad()\n"
        "            loss.backward()\n"
        "            optimizer.step()\n"
        "        torch.save(self.model.state_dict(), 'model.pt')\n\n\n"
        "trainer = Trainer(LOADER)\n"
        "print(trainer.evaluate(torch.randn(2, 4).cuda()))\n"
        "trainer.fit()\n"
    )
    code = convert_source(source, "train.py").code
    assert "return unwrap(self.model).depth * self.model(x)" in code, code
    assert "torch.save(self.model.module.state_dict(), 'model.pt')" in code
    assert "def unwrap(model):" in code and "model.module if isinstance(model, DDP) else model" in code


def test_accumulation_condition_reading_a_model_attribute_goes_through_module():
    """`if batches_done % model.hyperparams["subdivisions"] == 0: optimizer.step()`: the
    `no_sync` guard the conversion writes reads the attribute through `.module` too (DDP has no
    `hyperparams`), as the `if` does, and converting again changes nothing."""
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader
        class Net(torch.nn.Linear):
            hyperparams = {"subdivisions": 2}
        model = Net(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(list(range(8)), batch_size=2, shuffle=True)
        for epoch in range(2):
            for i, x in enumerate(loader):
                model(x.float().view(-1, 1).repeat(1, 2)).sum().backward()
                if i % model.hyperparams["subdivisions"] == 0:
                    optimizer.step()
                    optimizer.zero_grad()
        """
    )
    assert 'if i % model.module.hyperparams["subdivisions"] == 0 else model.no_sync():' in result.code
    assert 'if i % model.module.hyperparams["subdivisions"] == 0:\n' in result.code


HELPER_LOADERS = """
    import torch
    from torchvision import datasets
    def loaders(batch):
        train = torch.utils.data.DataLoader(datasets.MNIST("d", train=True, download=True), batch_size=batch, shuffle=True)
        test = torch.utils.data.DataLoader(datasets.MNIST("d", train=False, download=True), batch_size=batch)
        return train, test
    """


def _helper_module_data(tmp_path, loaders_first: bool) -> str:
    """data.py (HELPER_LOADERS) as converted with a train.py that calls `loaders(8)` below the
    device line (the group exists by then), or above it (`loaders_first`)."""
    from ddpify.projects import convert_project

    lines = ['device = torch.device("cuda" if torch.cuda.is_available() else "cpu")', "train_loader, test_loader = loaders(8)"]
    first, second = reversed(lines) if loaders_first else lines
    entry = _project(tmp_path, {
        "data.py": HELPER_LOADERS,
        "train.py": f"""
            import torch
            from data import loaders
            {first}
            {second}
            model = torch.nn.Linear(784, 10).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for epoch in range(2):
                for x, y in train_loader:
                    torch.nn.functional.cross_entropy(model(x.view(-1, 784).to(device)), y.to(device)).backward()
                    optimizer.step()
            """,
    })  # fmt: skip
    result = convert_project(entry)
    return next(r.code for path, (r, _, _) in result.changed.items() if path.name == "data.py")


def test_downloads_inside_loaders_of_a_helper_module_wait_where_a_group_exists(tmp_path):
    """`DataLoader(MNIST(root, train=True, download=True), ...)` twice in a helper module that the
    program calls once its group exists: one pair of barriers around both fetches, each under
    `dist.is_initialized()` (another script may call the helper as one process); the training set
    is hoisted out of its loader for its sampler, and converting again changes nothing."""
    data = _helper_module_data(tmp_path, loaders_first=False)
    assert "TODO" not in data, data
    assert data.count('if dist.is_initialized() and int(os.environ.get("LOCAL_RANK", 0)) != 0:\n        dist.barrier()') == 1, data
    assert data.count('if dist.is_initialized() and int(os.environ.get("LOCAL_RANK", 0)) == 0:\n        dist.barrier()') == 1, data
    assert data.index("!= 0:") < data.index('MNIST("d", train=True') < data.index('MNIST("d", train=False') < data.index("== 0:")
    assert "train_sampler = DistributedSampler(train_dataset, shuffle=True" in data


def test_downloads_in_a_helper_called_before_the_group_exists_get_a_todo(tmp_path):
    """The same helper called before the setup (`loaders(8)` above the device line): no group to
    wait in yet, so every rank downloads there, said by a TODO on each fetch."""
    data = _helper_module_data(tmp_path, loaders_first=True)
    assert data.count("# TODO(ddpify): every rank downloads here") == 2, data
    assert "dist.barrier()" not in data, data


def test_a_keyword_added_to_a_call_laid_out_over_lines_keeps_its_layout():
    """`tqdm(` items and `total=n` on lines of their own `)`: the new `disable=` goes on a line
    of its own too, and the newline before `)` stays before `)` (no blank line with spaces)."""
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader
        from tqdm import tqdm
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(list(range(8)), batch_size=2, shuffle=True)
        for epoch in range(2):
            for x in tqdm(
                loader,
                total=len(loader)
            ):
                model(x.float().view(-1, 1).repeat(1, 2)).sum().backward()
                optimizer.step()
        """
    )
    assert "        total=len(loader),\n        disable=dist.get_rank() != 0\n    ):" in result.code, result.code


def test_a_project_distributed_already_is_left_alone(tmp_path):
    """A hand-written DDP script that imports a module of its own (set up, wrapped and sharded
    across the two): nothing changes, as for a single script (before, a project was converted
    again and its already wrapped model read through `.module` before its own wrap)."""
    from ddpify.projects import convert_project

    entry = _project(tmp_path, {
        "data.py": """
            from torch.utils.data import DataLoader, DistributedSampler
            def loader(ds):
                return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds))
            """,
        "train.py": """
            import os
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP
            from data import loader
            dist.init_process_group("gloo")
            model = DDP(torch.nn.Linear(2, 1))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            batches = loader(list(range(8)))
            for epoch in range(2):
                batches.sampler.set_epoch(epoch)
                for x in batches:
                    model(x.float().view(-1, 1).repeat(1, 2)).sum().backward()
                    optimizer.step()
            dist.destroy_process_group()
            """,
    })  # fmt: skip
    result = convert_project(entry)
    assert result.already_distributed and result.changed == {}


def test_a_project_distributed_already_is_copied_as_it_is_by_the_cli(tmp_path):
    """`ddpify convert train.py -o out.py` on a distributed project writes an identical copy of
    the entry and says why, as for a single script (scripts and runners expect the file)."""
    from cli_in_process import ddpify

    project = tmp_path / "proj"
    project.mkdir()
    entry = _project(project, {
        "data.py": "from torch.utils.data import DataLoader, DistributedSampler\n"
                   "def loader(ds):\n    return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds))\n",
        "train.py": "import torch\nimport torch.distributed as dist\n"
                    "from torch.nn.parallel import DistributedDataParallel as DDP\nfrom data import loader\n"
                    "dist.init_process_group('gloo')\nmodel = DDP(torch.nn.Linear(2, 1))\n"
                    "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\nfor x in loader(list(range(8))):\n"
                    "    model(x.float().view(-1, 1).repeat(1, 2)).sum().backward()\n    optimizer.step()\n"
                    "dist.destroy_process_group()\n",
    })  # fmt: skip
    out = tmp_path / "out.py"
    result = ddpify("convert", str(entry), "-o", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert out.read_text() == entry.read_text() and "already distributed" in result.stderr


def test_a_file_opened_for_writing_through_pathlib_is_written_by_rank0_whole():
    """`with path.open("wt") as f: json.dump(...)`: every rank opening the file for writing
    truncates it, so the whole `with` runs on rank 0, not only the write inside it; reading a
    library's `X.open(...)` (PIL's `Image.open`) stays on every rank."""
    result = convert(
        """
        import json
        from pathlib import Path
        from PIL import Image
        import torch
        from torch.utils.data import DataLoader

        def write_json(content, fname):
            fname = Path(fname)
            with fname.open("wt") as handle:
                json.dump(content, handle)

        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader([(torch.zeros(2), torch.zeros(1))] * 8, batch_size=4, shuffle=True)
        write_json({"lr": 0.1}, "config.json")
        with Image.open("sample.png") as picture:
            picture.load()
        for epoch in range(2):
            for x, y in loader:
                model(x).sub(y).pow(2).mean().backward()
                optimizer.step()
        """
    )
    code = result.code
    assert 'if dist.get_rank() == 0:\n        with fname.open("wt") as handle:\n            json.dump(content, handle)\n' in code
    assert '\nwith Image.open("sample.png") as picture:\n' in code


def test_parts_a_constructor_keeps_in_one_unpacking_are_followed():
    """`self.net, self.batches, self.opt = net, batches, opt`: the same as three assignments:
    the loader is sharded and reshuffled in the method, the checkpoint holds the plain network."""
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader

        class Trainer:
            def __init__(self, net, batches, opt):
                self.net, self.batches, self.opt = net, batches, opt

            def run(self, epochs):
                for epoch in range(epochs):
                    for x, y in self.batches:
                        self.net(x).sub(y).pow(2).mean().backward()
                        self.opt.step()
                torch.save(self.net.state_dict(), "net.pt")

        def main():
            net = torch.nn.Linear(2, 1)
            batches = DataLoader([(torch.zeros(2), torch.zeros(1))] * 8, batch_size=4, shuffle=True)
            Trainer(net, batches, torch.optim.SGD(net.parameters(), lr=0.1)).run(2)

        main()
        """
    )
    code = result.code
    assert "self.batches.sampler.set_epoch(epoch)" in code and "sampler=batches_sampler" in code
    assert "torch.save(self.net.module.state_dict()" in code
    assert not result.todos


def test_output_in_a_one_line_if_runs_on_rank0():
    """`if i % 2 == 0: print(...)` and `if args.tb: configure(...)` (the body on the `if`'s
    line) print and configure a logger once: the rank test joins the `if`'s own."""
    result = convert(
        """
        import argparse
        import torch
        from torch.utils.data import DataLoader
        from tensorboard_logger import configure

        parser = argparse.ArgumentParser()
        parser.add_argument("--tb", action="store_true")
        args = parser.parse_args()
        if args.tb: configure("runs/a")
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader([(torch.zeros(2), torch.zeros(1))] * 8, batch_size=4, shuffle=True)
        for epoch in range(2):
            for i, (x, y) in enumerate(loader):
                loss = model(x).sub(y).pow(2).mean()
                loss.backward()
                opt.step()
                if i % 2 == 0: print(epoch, i, loss.item())
        """
    )
    code = result.code
    assert 'if args.tb and int(os.environ.get("RANK", 0)) == 0: configure("runs/a")' in code
    assert "if i % 2 == 0 and dist.get_rank() == 0: print(epoch, i, loss.item())" in code


def test_a_script_that_picks_its_gpus_itself_does_so_only_outside_torchrun():
    """`os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu_id`: every process would see only those GPUs
    and take cuda:<local_rank> among them (one GPU listed: every rank on it); the line runs only
    when torchrun did not start the process, and the launch picks the GPUs."""
    result = convert(
        """
        import argparse
        import os
        import torch
        from torch.utils.data import DataLoader

        parser = argparse.ArgumentParser()
        parser.add_argument("--gpu-id", default="0")
        args = parser.parse_args()
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu_id
        model = torch.nn.Linear(2, 1).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader([(torch.zeros(2), torch.zeros(1))] * 8, batch_size=4, shuffle=True)
        for epoch in range(2):
            for x, y in loader:
                model(x.cuda()).sub(y.cuda()).pow(2).mean().backward()
                opt.step()
        """
    )
    assert '\nif "LOCAL_RANK" not in os.environ:\n    os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu_id\n' in result.code
    assert not result.todos
    assert any("only when torchrun did not start the process" in c.message and c.line == 10 for c in result.changes)


def test_a_metric_a_helper_computes_over_the_training_loader_is_averaged_over_ranks():
    """`train_acc = accuracy(train_loader, model)` after training (and `tr, va = evaluate(model,
    train_loader, val_loader)`, which hands the loader on): the sharded loader gives one shard's
    result, so it is averaged over ranks (every rank holds as many samples); the validation value
    beside it is every rank's own and averages to itself. Converting twice changes nothing."""
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader

        def accuracy(loader, model):
            right = seen = 0
            with torch.no_grad():
                for x, y in loader:
                    right += (model(x).argmax(1) == y).sum().item()
                    seen += len(y)
            return right / seen

        def evaluate(model, train_loader, val_loader):
            return accuracy(train_loader, model), accuracy(val_loader, model)

        model = torch.nn.Linear(2, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_loader = DataLoader([(torch.zeros(2), 1)] * 8, batch_size=4, shuffle=True)
        val_loader = DataLoader([(torch.zeros(2), 1)] * 8, batch_size=4)
        for epoch in range(2):
            for x, y in train_loader:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            tr, va = evaluate(model, train_loader, val_loader)
            print(tr, va)
        train_acc = accuracy(train_loader, model)
        print("train accuracy", train_acc)
        """
    )
    code = result.code
    assert "    tr, va = evaluate(model, train_loader, val_loader)\n    tr = all_reduce_sum(tr) / dist.get_world_size()\n" in code
    assert "train_acc = accuracy(train_loader, model)\ntrain_acc = all_reduce_sum(train_acc) / dist.get_world_size()\n" in code
    assert convert_source(code, "train.py").code == code


def test_an_import_below_the_first_use_of_its_name_is_not_counted():
    """`import os` late in the file (after top-level prints and a progress bar) does not bind
    `os` for the rank checks inserted above it: the import is added at the top of the module."""
    code = textwrap.dedent(
        """
        import torch
        from tqdm import tqdm
        from torch.utils.data import DataLoader, TensorDataset

        print("starting")
        for _ in tqdm(range(2)):
            pass
        import os
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=4, shuffle=True)
        for epoch in range(2):
            for x, y in loader:
                loss = (model(x) - y).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        print("saved in", os.getcwd())
        """
    )
    result = convert_source(code, "train.py")
    lines = result.code.splitlines()
    first_use = next(i for i, line in enumerate(lines) if "os." in line)
    assert any(line == "import os" for line in lines[:first_use]), result.code
    compile(result.code, "train.py", "exec")
    assert convert_source(result.code, "train.py").code == result.code  # converting twice changes nothing


def test_a_branch_that_loads_pretrained_parts_from_elsewhere_is_no_resume_gate():
    """`if args.model == "fused":` loading parts trained apart (paths of their own) is no resume
    path: pointing it at the checkpoint saved in training would take the branch after a restart
    and load files that may not exist, never the checkpoint. A gate whose load reads the saved
    checkpoint (through a name bound before it) still gets its restart line."""
    source = """
        import argparse
        import torch
        from torch.utils.data import DataLoader

        parser = argparse.ArgumentParser()
        parser.add_argument("--model", default="plain")
        parser.add_argument("--part-path", default="parts/part.pth")
        args = parser.parse_args()
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        start = 0
        if args.model == "{gate}":
            path = {loaded}
            state = torch.load(path)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            start = state["epoch"]
        loader = DataLoader([(torch.zeros(2), torch.zeros(1))] * 8, batch_size=4, shuffle=True)
        for epoch in range(start, 2):
            for x, y in loader:
                model(x).sub(y).pow(2).mean().backward()
                opt.step()
            torch.save({{"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch}}, "run/last.pth")
        """
    pretrained = convert(source.format(gate="fused", loaded="args.part_path"))
    assert "TORCHELASTIC_RESTART_COUNT" not in pretrained.code
    resumed = convert(source.format(gate="resume", loaded='"run/last.pth"'))
    assert 'if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0 and os.path.exists("run/last.pth"):\n    args.model = "resume"' in resumed.code


def test_what_reads_the_parameters_without_running_the_model_on_them_keeps_the_ddp_wrap():
    """A dtype taken from one parameter, an optimizer over a list of them, and autograd.grad over
    them in a function that runs after training: the model is wrapped as ever."""
    result = convert(
        """
        import torch
        model = torch.nn.Linear(4, 2)
        params = list(model.parameters())
        optimizer = torch.optim.SGD(params, lr=0.1)
        dtype = next(model.parameters()).dtype
        for step in range(3):
            loss = model(torch.randn(8, 4).to(dtype)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        def saliency(net):
            return torch.autograd.grad(net(torch.randn(2, 4)).sum(), net.parameters())

        saliency(model)
        """
    )
    assert "model = DDP(model" in result.code
    assert "average_gradients" not in result.code


def test_a_model_run_with_weights_passed_in_is_not_wrapped_and_averages_by_hand():
    """`functional_call(model, fast, ...)` on weights computed from `named_parameters()`, and
    autograd.grad over the parameters for a penalty on the gradient's norm: no DDP wrap (it could
    follow neither), rank 0's weights sent where it would go, gradients averaged after backward."""
    functional = convert(
        """
        import torch
        from torch.func import functional_call
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            params = dict(model.named_parameters())
            fast = {k: v - 0.1 for k, v in params.items()}
            loss = functional_call(model, fast, (torch.randn(8, 4),)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        """
    )
    penalty = convert(
        """
        import torch
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            grads = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            optimizer.zero_grad()
            (loss + 0.1 * sum(g.pow(2).sum() for g in grads)).backward()
            optimizer.step()
        """
    )
    for result in (functional, penalty):
        assert "DDP(" not in result.code and "model.module" not in result.code
        assert "for tensor in model.state_dict().values():" in result.code
        assert "backward()\n    average_gradients(model)" in result.code
        assert not result.todos, [t.message for t in result.todos]
    summary = [c.message for c in functional.changes]
    assert any("`model` is run with weights passed in" in line and "not wrapped in DDP" in line for line in summary), summary
    summary = [c.message for c in penalty.changes]
    assert any("`model`'s parameters are differentiated with autograd.grad: not wrapped in DDP; gradients averaged by hand after backward" in line for line in summary), summary


def test_an_epoch_loop_over_enumerate_sets_the_epoch_from_its_counter():
    """`for i, epoch in enumerate(range(1, n + 1)):`: the sampler's epoch is `i`, the pass number
    (no TODO); the loop's own names stay as they are."""
    result = convert(
        """
        import torch
        from torch.utils.data import DataLoader

        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(dataset, batch_size=8, shuffle=True)
        for i, epoch in enumerate(range(1, 3)):
            for x, y in loader:
                loss = model(x).sub(y).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        """
    )
    assert not result.todos, [t.message for t in result.todos]
    assert "for i, epoch in enumerate(range(1, 3)):\n    sampler.set_epoch(i)" in result.code
