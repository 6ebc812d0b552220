import re

import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import kwarg, positional
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._collectives import runs_collective
from ddpify.check.rules._common import before, exclusive


class ReadBeforeRankZeroWrite(Rule):
    """A file rank 0 saves is read back by every rank with no barrier between.

    ## What it does
    Flags `torch.load(path)` (or `open(path)` to read) run by every rank, later in the same
    function than a `torch.save` to the same file that runs on rank 0 only, when no
    `dist.barrier()` (or other collective) sits between the two. Both calls name the same file
    when their paths are spelled alike, or formatted from one template (`'{}.pkl'.format(epoch)`
    and then `'{}.pkl'.format(best)`: a best-epoch reload).

    ## Why is this bad?
    Nothing makes the other ranks wait for rank 0's write: they open the file before it exists
    (`FileNotFoundError`) or while it is half written, and crash or load stale weights.

    ## Example
    ```python
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), "{}.pkl".format(epoch))
    ...
    model.module.load_state_dict(torch.load("{}.pkl".format(best_epoch)))
    ```

    ## Use instead
    ```python
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), "{}.pkl".format(epoch))
    ...
    dist.barrier()  # rank 0 has written the file
    model.module.load_state_dict(torch.load("{}.pkl".format(best_epoch)))
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/tutorials/intermediate/ddp_tutorial.html#save-and-load-checkpoints
    """

    CODE = "DDP150"
    NAME = "read-before-rank-zero-write"
    MESSAGE = (
        "every rank reads a file that rank 0 saves above (line {line}) with no `dist.barrier()` between: "
        "the other ranks may read it before it is written; call `dist.barrier()` before the read"
    )
    VALID = [
        "import torch, torch.distributed as dist\nif dist.get_rank() == 0:\n    torch.save(sd, 'best.pt')\n"
        "dist.barrier()\nsd = torch.load('best.pt')\n",
        "import torch, torch.distributed as dist\ntorch.save(sd, 'best.pt')\nsd = torch.load('best.pt')\n",
        "import torch, torch.distributed as dist\nif dist.get_rank() == 0:\n    torch.save(sd, 'best.pt')\n"
        "    sd = torch.load('best.pt')\n",
    ]
    INVALID = [
        Invalid(
            "import torch, torch.distributed as dist\nfor epoch in range(3):\n    if dist.get_rank() == 0:\n"
            "        torch.save(sd, '{}.pkl'.format(epoch))\nsd = torch.load('{}.pkl'.format(best))\n"
        ),
    ]

    def check(self, ctx):
        saves = [ci for ci in ctx.calls_to(*N.TORCH_SAVE) if ctx.in_rank0(ci.node) and _saved_path(ci.node) is not None]
        if not saves:
            return
        syncs = [ci.node for ci in ctx.calls if runs_collective(ctx, ci)]
        for ci in ctx.calls:
            path = _read_path(ci)
            if path is None or ctx.in_rank0(ci.node) or _rank_dependent(ctx, ci.node):
                continue
            key = _file_key(ctx, path)
            for save in saves:
                if _file_key(ctx, _saved_path(save.node)) != key or not _unsynced(ctx, save.node, ci.node, syncs):
                    continue
                yield Report(ci.node, self.MESSAGE.format(line=ctx.line(save.node)))
                break


def _saved_path(call: cst.Call):
    args = positional(call)
    target = kwarg(call, "f") or (args[1] if len(args) > 1 else None)
    return target.value if target is not None else None


def _read_path(ci):
    """The path a `torch.load(path)` or `open(path)` (to read) takes."""
    args = positional(ci.node)
    if not args:
        return None
    if ci.qnames & N.TORCH_LOAD:
        return args[0].value
    if ci.qnames & N.OPEN:
        mode = args[1].value if len(args) > 1 else getattr(kwarg(ci.node, "mode"), "value", None)
        if mode is None or isinstance(mode, cst.SimpleString) and "r" in mode.evaluated_value:
            return args[0].value
    return None


def _rank_dependent(ctx, node) -> bool:
    """Under a test of the rank, or of the file's existence (ranks may take either branch)."""
    for p in ctx.ancestors(node):
        if isinstance(p, cst.If) and (ctx.reads_rank(p.test) or re.search(r"\b(exists|isfile|is_file)\(", ctx.code(p.test))):
            return True
        if isinstance(p, (cst.FunctionDef, cst.ClassDef)):
            return False
    return False


_PLACEHOLDER = re.compile(r"\{[^{}]*\}|%[-+ #0]*\d*(?:\.\d+)?[sdifgeEr]")


def _file_key(ctx, path) -> str:
    """The file a path names: its code, with the fields of a template (`'{}.pkl'.format(x)`,
    f-strings, `'%d.pt' % x`) made alike, so one template formatted twice is one file name."""
    if isinstance(path, cst.Call) and isinstance(path.func, cst.Attribute) and path.func.attr.value == "format":
        if isinstance(path.func.value, cst.SimpleString):
            return _PLACEHOLDER.sub("{}", path.func.value.evaluated_value)
    if isinstance(path, cst.BinaryOperation) and isinstance(path.operator, cst.Modulo):
        if isinstance(path.left, cst.SimpleString):
            return _PLACEHOLDER.sub("{}", path.left.evaluated_value)
    if isinstance(path, cst.FormattedString):
        return "".join(p.value if isinstance(p, cst.FormattedStringText) else "{}" for p in path.parts)
    if isinstance(path, cst.SimpleString):
        return path.evaluated_value
    return ctx.code(path)


def _unsynced(ctx, save, read, syncs) -> bool:
    """The read comes after the save in one function (or both at the top level), in no other
    branch, with no collective in between in the source."""
    if ctx.enclosing_func(save) is not ctx.enclosing_func(read) or not before(ctx, save, read) or exclusive(ctx, save, read):
        return False
    return not any(before(ctx, save, s) and before(ctx, s, read) for s in syncs)
