import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.flow import flow
from ddpify.analysis.index import iter_nodes, last_name
from ddpify.check.context import dotted_name, is_false, kwarg, positional, string_value
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import callers_decide, every_rank, in_memory, library_code, mentions_rank

_DUMPS = N.spelled({"json.dump", "pickle.dump", "yaml.dump", "yaml.safe_dump", "joblib.dump", "numpy.save",
                    "numpy.savez", "numpy.savez_compressed", "numpy.savetxt"})  # fmt: skip
_FILE_OPS = N.spelled({"shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copy", "shutil.copy2",
                       "shutil.copytree", "os.remove", "os.unlink", "os.rename", "os.replace"})  # fmt: skip
_MAKE_DIRS = N.spelled({"os.mkdir", "os.makedirs"})
_PER_PROCESS = ("tempfile.", "os.getpid", "uuid.")
_OPEN_MESSAGE = (
    "every rank opens this same file to write it (N copies interleaved, or appended N times); "
    "write it on rank 0, or name the rank in the path"
)
_EXISTS_MESSAGE = (
    "every rank creates this folder and only the first succeeds: the others raise FileExistsError; "
    "create it on rank 0 and `dist.barrier()`, or pass `exist_ok=True`"
)


class FileWrittenOnEveryRank(Rule):
    """A file dumped, removed, moved or copied, or a folder created, by every rank.

    ## What it does
    Flags `json.dump`, `pickle.dump`, `yaml.dump`, `joblib.dump`, numpy's `save`/`savez`/`savetxt`,
    and `shutil.rmtree`/`move`/`copy*`, `os.remove`/`unlink`/`rename`/`replace`, and
    `os.mkdir`/`os.makedirs` without `exist_ok=True` and with no test that the folder is absent
    (the second rank's call raises `FileExistsError`), outside a
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
        for ci in ctx.calls_to(*_DUMPS, *_FILE_OPS, *_MAKE_DIRS, "builtins.open"):
            if ci.qnames & _MAKE_DIRS and not _fails_when_present(ctx, ci):
                continue
            if "builtins.open" in ci.qnames and not _opened_to_write_only(ctx, ci):
                continue
            target = _target(ctx, ci)
            if target is None or in_memory(ctx, target) or _per_process(ctx, target):
                continue
            if paths.in_error_handler(ci.node):
                continue
            if every_rank(ctx, ci.node) and not _opened_per_rank(ctx, ci.node, target) and not library_code(ctx, ci.node) \
                    and not callers_decide(ctx, ci, target):  # fmt: skip
                yield Report(ci.node, _EXISTS_MESSAGE if ci.qnames & _MAKE_DIRS else _OPEN_MESSAGE if "builtins.open" in ci.qnames else None)


def _target(ctx, ci) -> cst.BaseExpression | None:
    """The file a call touches: a dump's file (or handle), an operation's first path."""
    args = positional(ci.node)
    if ci.qnames & (_FILE_OPS | _MAKE_DIRS) or "builtins.open" in ci.qnames:
        return args[0].value if args else (getattr(kwarg(ci.node, "name") or kwarg(ci.node, "path"), "value", None))
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


def _fails_when_present(ctx, ci) -> bool:
    """`os.mkdir(p)`, `os.makedirs(p)` or `os.makedirs(p, exist_ok=False)` run unconditionally:
    it raises when the folder exists. Not `exist_ok=True`, nor under a test that it is absent
    (`if not os.path.exists(p):`, a race between ranks, not a certain failure)."""
    flag = kwarg(ci.node, "exist_ok")
    if flag is not None and not is_false(flag.value) or len(ci.node.args) > 2 and ci.node.args[2].keyword is None:
        return False
    return not any(isinstance(p, (cst.If, cst.IfExp)) and "exist" in ctx.code(p.test) for p in ctx.ancestors(ci.node))


def _opened_to_write_only(ctx, ci) -> bool:
    """`open(path, "w")` / `"a"` (a literal mode) written through its handle, which no dump is
    given (the dump reports that file itself): `with open(cfg_path, "w") as f: f.write(str(args))`."""
    mode = kwarg(ci.node, "mode") or (ci.node.args[1] if len(ci.node.args) > 1 and ci.node.args[1].keyword is None else None)
    text = string_value(mode.value) if mode is not None else None
    if not text or not set(text) & {"w", "a", "x"}:
        return False
    path = ci.node.args[0].value if ci.node.args else None
    if path is None or any(isinstance(n, cst.Attribute) and dotted_name(n.value) == "self" for n in iter_nodes(path)):
        return False  # a path from the object's state (`self.path`, `join(self.root, name)`): who writes it is decided elsewhere
    with_item = ctx.parent(ci.node)
    block = ctx.parent(with_item) if isinstance(with_item, cst.WithItem) and with_item.asname is not None else None
    handle = ctx.code(with_item.asname.name) if block is not None else None

    def given(dump) -> bool:
        if any(a.value is ci.node for a in dump.node.args):
            return True  # `json.dump(cfg, open(path, "w"))`
        return block is not None and any(p is block for p in ctx.ancestors(dump.node)) and any(
            ctx.code(a.value) == handle for a in dump.node.args
        )

    return not any(given(dump) for dump in ctx.calls_to(*_DUMPS)) and _written(ctx, ci, handle, block)


def _written(ctx, ci, handle, block) -> bool:
    """Is something written through the handle (`open(p, "w").write(s)`, `f.write(...)` or
    `print(..., file=f)` in the `with` block)? A file only created (`open(p, "w").close()`, a
    touch) is the same empty file whoever makes it."""
    parent = ctx.parent(ci.node)
    if isinstance(parent, cst.Attribute) and parent.attr.value in ("write", "writelines"):
        return True
    if block is None:
        return False
    for call in ctx.calls:
        if not any(p is block for p in ctx.ancestors(call.node)):
            continue
        if call.name in ("write", "writelines") and call.receiver is not None and ctx.code(call.receiver) == handle:
            return True
        if call.name == "print" and any(ctx.code(a.value) == handle for a in call.node.args if a.keyword and a.keyword.value == "file"):
            return True
    return False
