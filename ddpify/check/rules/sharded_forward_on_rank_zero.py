from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._fsdp2 import is_sharded

# Methods of a model that run its forward (Hugging Face's `generate`).
FORWARD_METHODS = frozenset({"forward", "generate"})


class ShardedForwardOnRankZero(Rule):
    """Model sharded with `fully_shard` run on rank 0 only.

    ## What it does
    Flags a call of a model sharded with FSDP2's `fully_shard` (or holding sharded modules:
    `model` after `fully_shard(block)` for its blocks), of its `forward` or `generate`, inside a
    rank-0-only branch or a function only called from one: evaluation, sampling or a generation
    demo on rank 0. The model passed to a local helper counts there too (`if rank == 0:
    evaluate(model, loader)`).

    ## Why is this bad?
    Each sharded module all-gathers its parameters from every rank before it runs: a
    collective. On rank 0 alone it waits for ranks that never join; the other ranks wait at
    their next collective; the job hangs (checked under torchrun, also under `torch.no_grad()`).
    Unlike DDP, there is no `model.module` to run locally: every rank holds only a shard.

    ## Example
    ```python
    if rank == 0:
        with torch.no_grad():
            sample = model.generate(prompt, max_new_tokens=50)
    ```

    ## Use instead
    ```python
    with torch.no_grad():
        sample = model.generate(prompt, max_new_tokens=50)  # every rank
    if rank == 0:
        print(tokenizer.decode(sample[0]))
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
    """

    CODE = "DDP133"
    NAME = "sharded-forward-on-rank-zero"
    MESSAGE = (
        "sharded model run on rank 0 only: each sharded module all-gathers its parameters from every rank (hang); "
        "run it on every rank and use the output on rank 0"
    )
    VALID = [
        "import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\nfully_shard(model)\n"
        "out = model(x)\nif dist.get_rank() == 0:\n    print(out)\n",
        # the model before sharding
        "import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
        "if dist.get_rank() == 0:\n    print(model(x))\nfully_shard(model)\n",
        # a fresh, unsharded model under the same name
        "import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\nfully_shard(model)\n"
        "model = Net()\nif dist.get_rank() == 0:\n    print(model(x))\n",
    ]
    INVALID = [
        Invalid(
            "import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\nfully_shard(model)\n"
            "if dist.get_rank() == 0:\n    out = model(x)\n"
        ),
        Invalid(
            "import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
            "def sample(m, prompt):\n    return m.generate(prompt)\n"
            "def main():\n    model = Net()\n    for block in model.blocks:\n        fully_shard(block)\n"
            "    fully_shard(model)\n    if dist.get_rank() == 0:\n        sample(model, prompt)\n"
        ),
    ]

    def check(self, ctx):
        if not ctx.is_fsdp2:
            return
        for ci in ctx.calls:
            called = is_sharded(ctx, ci.node.func) or (
                ci.name in FORWARD_METHODS and ci.receiver is not None and is_sharded(ctx, ci.receiver)
            )
            if called and ctx.in_rank0(ci.node):
                yield Report(ci.node)
