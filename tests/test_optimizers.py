"""analysis/optimizers.py: per-function facts over a program's index (its modules walked as one)."""

from __future__ import annotations

import libcst as cst

from ddpify.analysis.index import FileIndex
from ddpify.analysis.optimizers import OptimizerSummaries, Trains


def summaries(entry: str, **others: str) -> tuple[OptimizerSummaries, FileIndex]:
    index = FileIndex(cst.parse_module(entry), others={name: cst.parse_module(code) for name, code in others.items()})
    return OptimizerSummaries(index), index


def cls(index: FileIndex, name: str) -> cst.ClassDef:
    return next(c for c in index.classes if c.name.value == name)


def test_classes_are_modules_when_a_base_is_one_in_any_module():
    found, index = summaries(
        "from nets import Backbone, Plain\nclass Head(Backbone): pass\nclass Solver(Plain): pass\nclass Other(lib.Thing): pass\n",
        nets="from torch import nn\nclass Backbone(nn.Module): pass\nclass Plain(object): pass\n",
    )
    assert found.is_module(cls(index, "Head")) is True
    assert found.is_module(cls(index, "Solver")) is False  # `object`, followed into nets.py
    assert found.is_module(cls(index, "Other")) is None  # a library's base: unknown


def test_functions_that_return_an_optimizer_say_over_which_parameter():
    found, index = summaries(
        "import optim\n",
        optim=(
            "import torch\n"
            "def build(cfg, model):\n"
            "    decay = []\n"
            "    for name, p in model.named_parameters():\n"
            "        decay.append(p)\n"
            "    return torch.optim.AdamW([{'params': decay}], lr=cfg.lr)\n"
            "def wrapper(net, cfg):\n"
            "    return build(cfg, net)\n"
            "def trains(model, loader):\n"
            "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "    for x in loader:\n"
            "        model(x).sum().backward()\n"
            "        opt.step()\n"
        ),
    )
    trains = {fn.name.value: t for fn, t in found.trains.items()}
    assert trains == {"build": Trains("model", 1), "wrapper": Trains("net", 0)}  # `trains` keeps its optimizer


def test_model_methods_that_hand_out_parameters_or_build_an_optimizer():
    found, _ = summaries(
        "import torch\nfrom torch import nn\n"
        "class Net(nn.Module):\n"
        "    def groups(self, lr):\n"
        "        return [{'params': self.body.parameters(), 'lr': lr}]\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.Adam(self.parameters())\n"
        "class Solver:\n"
        "    def params(self):\n"
        "        return self.G.parameters()\n"
        "    def build(self):\n"
        "        return torch.optim.Adam(self.G.parameters())\n"
    )
    assert found.parameter_methods == {"groups"}
    assert found.optimizer_methods == {"configure_optimizers"}


def test_a_factory_given_the_parameters_trains_the_model_they_come_from():
    found, index = summaries(
        "import torch\nfrom optim import make\nmodel = torch.nn.Linear(2, 1)\noptimizer = make(model.parameters(), 0.1)\n",
        optim="import torch\ndef make(params, lr):\n    return torch.optim.SGD(params, lr=lr)\n",
    )
    assert {fn.name.value: t for fn, t in found.trains.items()} == {"make": Trains("params", 0, given=True)}
    call = next(ci.node for ci in index.calls if ci.name == "make")
    assert found.passed(call) == "model"


def test_optimizers_of_other_libraries_train_their_model():
    """`transformers.AdamW` over Hugging Face's decay / no-decay groups (built from
    `named_parameters()` through two names), apex's FusedAdam, bitsandbytes' Adam8bit: the model
    they train is wrapped; a library's scheduler is no optimizer."""
    import textwrap

    from ddpify.analysis.names import is_optimizer
    from ddpify.engine import convert_source

    assert is_optimizer({"transformers.AdamW"}) and is_optimizer({"apex.optimizers.FusedAdam"})
    assert is_optimizer({"bitsandbytes.optim.Adam8bit"}) and not is_optimizer({"transformers.optimization.get_linear_schedule_with_warmup"})
    assert not is_optimizer({"torch.optim.lr_scheduler.StepLR"})
    source = textwrap.dedent(
        """
        import torch
        from torch.utils.data import DataLoader
        from transformers import AdamW
        model = torch.nn.Linear(8, 2)
        param_optimizer = list(model.named_parameters())
        no_decay = ["bias"]
        groups = [
            {"params": [p for n, p in param_optimizer if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
            {"params": [p for n, p in param_optimizer if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
        ]
        optimizer = AdamW(groups, lr=3e-5)
        loader = DataLoader(list(range(8)), batch_size=2, shuffle=True)
        for epoch in range(2):
            for x in loader:
                model(x.float().view(-1, 1).repeat(1, 8)).sum().backward()
                optimizer.step()
        """
    )
    result = convert_source(source, "train.py")
    assert "model = DDP(model" in result.code and "DistributedSampler(" in result.code
