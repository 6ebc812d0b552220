"""Datasets fetched at start-up are fetched once per node, by its local rank 0, then read by
that node's other ranks (each node has its own disk; `--shared-fs`: once per job, by rank 0).

    if local_rank != 0:
        dist.barrier()  # wait for this node's local rank 0 to download
    train_set = datasets.MNIST(root, train=True, download=True)
    if local_rank == 0:
        dist.barrier()  # downloaded on this node: let its other ranks read it

Every rank meets the barrier once, so one pair of barriers serves every node. A fetch is a
dataset built with `download=True` (the other ranks then find the files and skip the download),
or a statement that downloads or unpacks files itself (`requests.get(url)`,
`urllib.request.urlretrieve`, `torch.hub.download_url_to_file`, `tarfile.open(...).extractall()`):
that one runs on local rank 0 only, then every rank meets at a barrier, because running it again
on another rank of the node would rewrite the files while its local rank 0 reads them.

    if local_rank == 0:
        with requests.get(url, stream=True) as archive: ...extractall()
    dist.barrier()  # downloaded: every rank reads it

A fetch under a test of its file's existence (`if not os.path.exists(path):` download and
write, `else:` read) gets the pair of barriers too: every rank runs the `if`, the others after
local rank 0, and take the branch that reads. So does a cache the script builds itself (`if
os.path.exists(cached): features = torch.load(cached) / else: build, torch.save(features,
cached)`): else every rank would build and write it, and read it while another writes. In a
function of another module (a dataset helper other entries import) those barriers wait only
where a process group exists.

Consecutive fetches share one pair of barriers. The barriers sit outside any step loop; the
closing one may follow the loader built from the dataset (shard_data lifts the dataset out of
a `DataLoader(datasets.MNIST(..., download=True))` into a statement of its own, above it).
The local rank is the setup's `local_rank` where the fetch can see it, else torchrun's
`LOCAL_RANK` (Context.local_rank_at).
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import distributed as D
from ddpify.analysis import names as N
from ddpify.analysis.multinode import cache_test, fetches, guard_kind
from ddpify.analysis.rank import rank_analysis
from ddpify.convert.context import RANK0, Context
from ddpify.convert.per_process import PerProcess, shared_temp_dirs

TODO = "every rank downloads here, before the process group exists: download once beforehand"
BEFORE = "if {group}{rank} != 0:\n    dist.barrier()  # wait for {who} to {verb}\n"
AFTER = "if {group}{rank} == 0:\n    dist.barrier()  # {done}{where}: let {others} read it\n"
# A dataset fetched in a function of another module, which the program calls once the group
# exists (`get_training_dataloader()` in utils.py): its barriers wait only where a group exists,
# since another script of the project may call the function as one process (its test.py).
IN_A_GROUP = "dist.is_initialized() and "
FETCHED = "dist.barrier()  # downloaded: every rank reads it\n"


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    statements = []
    for call in script.calls:
        if not _fetches(script, call):
            continue
        scope = script.scope_of(call)
        stmt = script.statement_line(call) if N.keyword(call, "download") is not None else None
        stmt = stmt or script.top_statement(call, scope) or script.statement_line(call)
        if stmt is None or stmt in statements or any(script.inside(stmt, s) for s in statements):
            continue
        if ctx.rank0_condition(stmt) != RANK0 and not _after_setup_elsewhere(ctx, stmt):
            edits.todo(_left_on(script, stmt, TODO), stmt, TODO)
            continue
        statements.append(stmt)
    caches = [
        s for s in _caches(ctx) if not any(script.inside(s, o) or script.inside(o, s) for o in statements)
        and (ctx.rank0_condition(s) == RANK0 or ctx.setup_scope is None or script.root_of(s) is not script.root_of(ctx.setup_scope))
    ]  # before the group exists in its own module, no barrier could wait: its local rank 0 writes (guard_rank_zero)
    statements += caches
    shared = ctx.options.shared_fs
    for stmt in [s for s in statements if not _by_keyword(script, s)]:
        statements.remove(stmt)
        if D.guarded_by_rank(script, stmt) or _under_rank_test(script, stmt):
            continue  # on (local) rank 0 only already (a converted script)
        edits.guard(stmt, RANK0 if shared else f"{ctx.local_rank_at(stmt)} == 0")
        if not D.barrier_in(script, D.sibling(script, stmt, 1)):
            edits.insert_after(stmt, FETCHED)
        edits.change(stmt, _said(shared, "files are downloaded and unpacked"))
    for stmt in statements:
        block = list(script.parent(stmt).body)
        index = block.index(stmt)
        rank = "dist.get_rank()" if shared else ctx.local_rank_at(stmt)
        group = IN_A_GROUP if ctx.rank0_condition(stmt) != RANK0 else ""
        verb, done = ("build the cache", "cached") if stmt in caches else ("download", "downloaded")
        if (index == 0 or block[index - 1] not in statements) and not _opened_before(script, block, index):
            who = "rank 0" if shared else "this node's local rank 0"
            edits.insert_before(stmt, BEFORE.format(group=group, rank=rank, who=who, verb=verb))
        if (index == len(block) - 1 or block[index + 1] not in statements) and not _closed_after(script, block, index):
            where, others = ("", "the other ranks") if shared else (" on this node", "its other ranks")
            edits.insert_after(stmt, AFTER.format(group=group, rank=rank, where=where, others=others, done=done))
        edits.change(stmt, _said(shared, "cache is built and written" if stmt in caches else "dataset is downloaded"))


def _caches(ctx: Context) -> list[cst.If]:
    """The `if`s that test a file's existence and write that file in a branch (multinode's
    cache_test), outside the data pipeline and any test of the rank, each a statement of a block."""
    script = ctx.script
    own = PerProcess(script, shared_temp_dirs(ctx))
    found: list[cst.If] = []
    for call in script.calls:
        if N.call_name(call) not in N.EXISTENCE_TESTS:
            continue
        stmt = next((a for a in script.ancestors(call) if isinstance(a, cst.If)), None)
        if stmt is None or stmt in found or not script.inside(call, stmt.test):
            continue
        block = getattr(script.parent(stmt), "body", ())  # an `elif` is the orelse of an If: not a block's statement
        if not isinstance(block, (list, tuple)) or stmt not in block or own.in_pipeline(stmt) or own.prepares_data(stmt):
            continue  # an `elif`, or a Dataset's own files (per_process)
        if not D.guarded_by_rank(script, stmt) and not _under_rank_test(script, stmt) and cache_test(script.index, stmt):
            found.append(stmt)
    return found


def _after_setup_elsewhere(ctx: Context, stmt: cst.CSTNode) -> bool:
    """Is `stmt` a dataset fetch (`download=True`) in a function of another module that this
    program calls only once the process group exists?"""
    script = ctx.script
    scope = script.scope_of(stmt)
    if ctx.driver or ctx.setup_scope is None or not isinstance(scope, cst.FunctionDef) or not _by_keyword(script, stmt):
        return False
    if script.root_of(stmt) is script.root_of(ctx.setup_scope) or scope in ctx.called_before_init():
        return False
    callers = [c for c in script.calls if script.local_function(c) is scope or script.project_definition(c.func) is scope]
    return bool(callers) and all(ctx.rank0_condition(script.statement_line(c) or c) == RANK0 for c in callers)


def _left_on(script, stmt: cst.CSTNode, message: str) -> cst.CSTNode:
    """Where the TODO about a fetch goes: `stmt`, or the statement just below it that carries it
    already (a converted script: the dataset was hoisted out of its loader, the TODO stayed on
    the loader's line)."""
    block = getattr(script.parent(stmt), "body", None)
    if not isinstance(block, (list, tuple)) or stmt not in block:
        return stmt
    text = f"# TODO(ddpify): {message}"
    index = list(block).index(stmt)
    for below in list(block)[index : index + 4]:
        if any(getattr(line.comment, "value", None) == text for line in getattr(below, "leading_lines", ())):
            return below
    return stmt


def _said(shared: bool, what: str) -> str:
    if shared:
        return f"the {what} once per job, by rank 0 (--shared-fs); the other ranks wait at a barrier"
    return f"the {what} once per node, by its local rank 0 (node-local disks; --shared-fs: once per job); its other ranks wait at a barrier"


def _under_rank_test(script, stmt: cst.CSTNode) -> bool:
    """Is `stmt` an `if` on the rank, or inside one on the global or the local rank?"""
    rank = rank_analysis(script.index)
    for node in [stmt, *script.ancestors(stmt)]:
        if isinstance(node, cst.If) and guard_kind(rank, node.test) is not None:
            return True
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            return False
    return False


def _fetches(script, call: cst.Call) -> bool:
    return fetches(script.index.call_info[call])


def _closed_after(script, block: list[cst.CSTNode], index: int) -> bool:
    """A barrier follows the fetch before anything loops over the data (a converted script; a
    later fetch between them shares it: `train = MNIST(..., download=True)` hoisted out of its
    loader, then the loaders, then the test set's fetch)."""
    for stmt in block[index + 1 :]:
        if D.barrier_in(script, stmt):
            return True
        if isinstance(stmt, (cst.For, cst.While)):
            return False
    return False


def _opened_before(script, block: list[cst.CSTNode], index: int) -> bool:
    """A barrier comes before the fetch, with only setup and other fetches between (a converted script)."""
    for stmt in reversed(block[:index]):
        if D.barrier_in(script, stmt):
            return True
        if isinstance(stmt, (cst.For, cst.While)) or not _fetches_in(script, stmt) and _uses_data(script, stmt):
            return False
    return False


def _uses_data(script, stmt: cst.CSTNode) -> bool:
    """Does a statement do more than build loaders and samplers (which read no file yet)?"""
    return not any(
        script.is_call_to(c, N.DATALOADER) or script.is_call_to(c, D.DISTRIBUTED_SAMPLER) for c in script.calls_in(stmt)
    )


def _fetches_in(script, stmt: cst.CSTNode) -> bool:
    return any(_fetches(script, c) for c in script.calls_in(stmt))


def _by_keyword(script, stmt: cst.CSTNode) -> bool:
    """A fetch that every rank may run once its local rank 0 has (the others find the files):
    a `download=True` dataset, or a fetch under a test of the file's existence, whose other
    branch reads the file (`if not os.path.exists(path): download; write` / `else: read`)."""
    if isinstance(stmt, cst.If) and any(N.call_name(c) in N.EXISTENCE_TESTS for c in script.calls_in(stmt.test)):
        return True
    return any(N.keyword(c, "download") is not None for c in script.calls_in(stmt) if _fetches(script, c))
