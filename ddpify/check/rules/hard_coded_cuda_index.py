import re

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.options import option_dests
from ddpify.check.context import dotted_name, int_value, positional, string_value
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import argument_position, library_code, passes, single_process_branch

_CUDA_N = re.compile(r"^cuda:\d+$")


class HardCodedCudaIndex(Rule):
    """Hard-coded GPU index in a distributed script.

    ## What it does
    Flags `"cuda:0"`-style strings passed to a call (also as a side of `"cuda:0" if ... else "cpu"`), `torch.device("cuda", 0)` and
    `.cuda(0)` in a file that uses torch.distributed, unless the program gives each process a
    GPU of its own first (`os.environ["CUDA_VISIBLE_DEVICES"]` set from the rank, here or in the
    launcher that imports the file: `cuda:0` is then that GPU), or binds the name holding the
    device again from the rank (`DEVICE = torch.device(f"cuda:{local_rank}")` once set up).
    Code that runs on rank 0 only (`if rank == 0: evaluate(...)` with `x.cuda(0)` inside) is
    left alone: rank 0 is local rank 0 of the first node, whose GPU is 0.

    ## Why is this bad?
    Every process puts its tensors on the same GPU: the other GPUs idle, GPU 0 runs out of
    memory, and NCCL fails with "invalid usage" or hangs when ranks share a device (seed 003).

    ## Example
    ```python
    model = model.to("cuda:0")
    ```

    ## Use instead
    ```python
    device = torch.device(f"cuda:{local_rank}")
    model = model.to(device)
    ```

    ## Fix safety
    No automatic fix: the name of the local-rank variable is the script's.

    ## References
    - https://pytorch.org/tutorials/intermediate/ddp_tutorial.html
    """

    CODE = "DDP106"
    NAME = "hard-coded-cuda-index"
    MESSAGE = "hard-coded GPU index: every rank uses the same GPU; use `cuda:{local_rank}`"
    VALID = [
        "import torch.distributed as dist\nx = x.to(f'cuda:{local_rank}')\n",
        "import torch.distributed as dist\nsd = torch.load(p, map_location={'cuda:0': f'cuda:{rank}'})\n",
        "x = x.to('cuda:0')\n",
        "import torch.distributed as dist\n\ndef evaluate(x):\n    return x.cuda(0)\n\nif dist.get_rank() == 0:\n    evaluate(x)\n",
    ]
    INVALID = [
        Invalid("import torch.distributed as dist\nx = x.to('cuda:0')\n"),
        Invalid("import torch, torch.distributed as dist\nd = torch.device('cuda', 0)\n"),
        Invalid("import torch.distributed as dist\nmodel = model.cuda(0)\n"),
        Invalid("import torch, torch.distributed as dist\nDEVICE = torch.device('cuda:0' if torch.cuda.is_available() else 'cpu')\n"),
    ]

    def check(self, ctx):
        if ctx.gpu_per_process_by_launcher:
            return  # each process sees one GPU: `cuda:0` is its own
        for ci in ctx.calls:
            if single_process_branch(ctx, ci.node):
                continue  # `else:` of `if world_size > 1:`: one process, its GPU 0 is right
            if ctx.in_rank0(ci.node):
                continue  # rank 0 (local rank 0 of its node): GPU 0 is its own
            args = ci.node.args
            if _default_always_passed(ctx, ci.node):
                continue  # `device=torch.device("cuda:0")` as a parameter's default every caller overrides
            if ci.is_(*N.TORCH_DEVICE) and len(args) >= 2 and int_value(args[1].value) is not None:
                if string_value(args[0].value) == "cuda":
                    yield Report(ci.node)
                    continue
            if ci.receiver is not None and ci.name == "cuda":
                pos = positional(ci.node)
                if pos and int_value(pos[0].value) is not None:
                    yield Report(ci.node)
                    continue
            if _rebound_per_process(ctx, ci.node) or library_code(ctx, ci.node) or ctx.rank0_or_idle(ci.node):
                continue  # a helper module's function: its caller decides which device it gets (or never calls it)
            for arg in args:
                for value in _choices(arg.value):
                    s = string_value(value)
                    if s is not None and _CUDA_N.match(s):
                        yield Report(value)


def _choices(expr):
    """The values an argument may take: itself, or each side of `"cuda:0" if cuda else "cpu"`."""
    if isinstance(expr, cst.IfExp):
        return [*_choices(expr.body), *_choices(expr.orelse)]
    return [expr]


def _rebound_per_process(ctx, call: cst.Call) -> bool:
    """`DEVICE = torch.device("cuda:0" ...)` at the top, bound again to this process's GPU once
    the rank is known (`DEVICE = torch.device(f"cuda:{local_rank}")` in the main block); an
    option's default the program sets to this process's GPU (`args.device = f"cuda:{rank}"`)."""
    dest = option_dests([call])
    if dest:  # `add_argument("--device", default="cuda:0")`, then `args.device = f"cuda:{local_rank}"`
        return any(b.dotted.rpartition(".")[2] in dest and "." in b.dotted and ctx.reads_rank(b.value) for b in ctx.assignments)
    parent = ctx.parent(call)
    if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0].target, cst.Name)):
        return False
    name = parent.targets[0].target.value
    return any(b.dotted == name and b.value is not call and ctx.reads_rank(b.value) for b in ctx.assignments)


def _default_always_passed(ctx, node: cst.CSTNode) -> bool:
    """Is `node` a parameter's default (`device=torch.device("cuda:0")`) that every call of its
    function, here or in the files that import this one, fills (`Runner(model, device)`,
    `super().__init__(model, device)`)? A call that may leave it out (`**kwargs`, a subclass
    that inherits the constructor) leaves the default in use."""
    param = next((p for p in ctx.ancestors(node) if isinstance(p, cst.Param)), None)
    func = ctx.parent(ctx.parent(param)) if param is not None else None
    if not isinstance(func, cst.FunctionDef) or param.default is None:
        return False
    name, position = param.name.value, argument_position(func, param.name.value)
    owner = ctx.parent(ctx.parent(func))
    callee = func.name.value
    if isinstance(owner, cst.ClassDef):
        if callee == "__init__":
            callee = owner.name.value
            if any(_inherits_init(c, owner.name.value) for c in ctx.module.body if isinstance(c, cst.ClassDef)):
                return False
    sites = [c for index in [ctx.index, *ctx.program_indexes] for c in index.calls if c.name == callee]
    if func.name.value == "__init__":  # `super().__init__(model, device)` in a subclass's constructor
        sites += [c for c in ctx.calls if c.name == "__init__" and isinstance(c.receiver, cst.Call) and _in_subclass(ctx, c.node, callee)]
    return bool(sites) and all(passes(c.node, name, position) for c in sites)


def _in_subclass(ctx, node: cst.CSTNode, base: str) -> bool:
    """Is `node` in a class that names `base` among its bases?"""
    cls = next((p for p in ctx.ancestors(node) if isinstance(p, cst.ClassDef)), None)
    return cls is not None and any(dotted_name(b.value) == base for b in cls.bases)


def _inherits_init(cls: cst.ClassDef, base: str) -> bool:
    """A subclass of `base` with no constructor of its own: built with `base`'s defaults."""
    if not any(dotted_name(b.value) == base for b in cls.bases):
        return False
    return not any(isinstance(s, cst.FunctionDef) and s.name.value == "__init__" for s in cls.body.body)

