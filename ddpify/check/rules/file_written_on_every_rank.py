import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.flow import flow
from ddpify.analysis.index import iter_nodes, last_name
from ddpify.check.context import kwarg, positional
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import callers_decide, every_rank, in_memory, library_code, mentions_rank

_DUMPS = N.spelled({"json.dump", "pickle.dump", "yaml.dump", "yaml.safe_dump", "joblib.dump", "numpy.save",
                    "numpy.savez", "numpy.savez_compressed", "numpy.savetxt"})  # fmt: skip
_FILE_OPS = N.spelled({"shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copy", "shutil.copy2",
                       "shutil.copytree", "os.remove", "os.unlink", "os.rename", "os.replace"})  # fmt: skip
_PER_PROCESS = ("tempfile.", "os.getpid", "uuid.")


class FileWrittenOnEveryRank(Rule):
    """A file dumped, removed, moved or copied by every rank.

    ## What it does
    Flags `json.dump`, `pickle.dump`, `yaml.dump`, `joblib.dump`, numpy's `save`/`savez`/`savetxt`,
    and `shutil.rmtree`/`move`/`copy*`, `os.remove`/`unlink`/`rename`/`replace` outside a
    rank-0-only branch of a distributed script. Left alone, as for DDP301: a path that names the
    rank or the process (also through a name bound to one; a `tempfile` path), a buffer in memory,
    a failure path, code of a helper module whose callers decide, and a helper whose file comes
    from its parameters when every call of it is rank 0's or names a per-rank file.

    ## Why is this bad?
    Every rank writes the same file at once (a truncated or interleaved result), or one rank
    deletes or moves a folder another rank is writing into or reading from (`FileNotFoundError`
    on some ranks, a checkpoint lost), depending on which process gets there first.

    ## Example
    ```python
    shutil.rmtree(args.output_dir, ignore_errors=True)
    os.makedirs(args.output_dir)
    ```

    ## Use instead
    ```python
    if rank == 0:
        shutil.rmtree(args.output_dir, ignore_errors=True)
        os.makedirs(args.output_dir)
    dist.barrier()
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/tutorials/intermediate/ddp_tutorial.html#save-and-load-checkpoints
    """

    CODE = "DDP308"
    NAME = "file-written-on-every-rank"
    MESSAGE = "every rank writes, removes or moves this same file at once (a race); do it on rank 0 and `dist.barrier()`"
    VALID = [
        "import json, torch.distributed as dist\nif dist.get_rank() == 0:\n    json.dump(cfg, open('cfg.json', 'w'))\n",
        "import pickle, torch.distributed as dist\nrank = dist.get_rank()\nwith open(f'preds_{rank}.pkl', 'wb') as f:\n"
        "    pickle.dump(preds, f)\n",
        "import shutil, tempfile, torch.distributed as dist\ntmp = tempfile.mkdtemp()\nshutil.rmtree(tmp)\n",
    ]
    INVALID = [
        Invalid("import shutil, torch.distributed as dist\ndist.init_process_group('nccl')\nshutil.rmtree('out')\n"),
        Invalid("import json, torch.distributed as dist\ndist.init_process_group('nccl')\nwith open('cfg.json', 'w') as f:\n"
                "    json.dump(cfg, f)\n"),
    ]  # fmt: skip

    def check(self, ctx):
        paths = flow(ctx.index)
        for ci in ctx.calls_to(*_DUMPS, *_FILE_OPS):
            target = _target(ctx, ci)
            if target is None or in_memory(ctx, target) or _per_process(ctx, target):
                continue
            if paths.in_error_handler(ci.node):
                continue
            if every_rank(ctx, ci.node) and not _opened_per_rank(ctx, ci.node, target) and not library_code(ctx, ci.node) \
                    and not callers_decide(ctx, ci, target):  # fmt: skip
                yield Report(ci.node)


def _target(ctx, ci) -> cst.BaseExpression | None:
    """The file a call touches: a dump's file (or handle), an operation's first path."""
    args = positional(ci.node)
    if ci.qnames & _FILE_OPS:
        return args[0].value if args else None
    if ci.qnames & N.spelled({"numpy.save", "numpy.savez", "numpy.savez_compressed", "numpy.savetxt"}):
        given = kwarg(ci.node, "file") or kwarg(ci.node, "fname") or (args[0] if args else None)
    else:
        given = kwarg(ci.node, "fp") or kwarg(ci.node, "stream") or kwarg(ci.node, "filename") or (args[1] if len(args) > 1 else None)
    return given.value if given is not None else None


def _per_process(ctx, target: cst.BaseExpression) -> bool:
    """A path made per process (`tempfile.mkdtemp()`, `os.getpid()`), here or where its name is bound."""
    func = ctx.enclosing_func(target)
    values = [target] + [b.value for b in ctx.assignments if b.func is func and b.dotted == ctx.code(target)]
    return any(q.startswith(_PER_PROCESS) for v in values for n in iter_nodes(v) if isinstance(n, cst.Call) for q in ctx.qnames(n.func))


def _opened_per_rank(ctx, node: cst.CSTNode, target: cst.BaseExpression) -> bool:
    """`with open(f"preds_{rank}.pkl", "wb") as f: pickle.dump(preds, f)`: the handle's file names the rank."""
    if not isinstance(target, cst.Name):
        return False
    for p in ctx.ancestors(node):
        if isinstance(p, cst.With):
            for item in p.items:
                bound = item.asname.name if item.asname is not None else None
                if isinstance(bound, cst.Name) and bound.value == target.value and isinstance(item.item, cst.Call):
                    opened = item.item
                    return last_name(opened.func) == "open" and bool(opened.args) and (
                        mentions_rank(ctx, opened) or _per_process(ctx, opened.args[0].value)
                    )
        if isinstance(p, cst.FunctionDef):
            break
    return False

