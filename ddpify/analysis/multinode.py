"""What changes when a script runs on several nodes: a rank guard is per node (the local rank,
``if local_rank == 0:``) or per job (the global rank, ``if dist.get_rank() == 0:``); data is
downloaded or unpacked by fetches; and torchrun sets the rendezvous endpoint (``MASTER_ADDR``,
``MASTER_PORT``) and the ranks in the environment.
"""

from __future__ import annotations

import re
from typing import Iterator, Optional

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis import side_effects
from ddpify.analysis.index import CallInfo, FileIndex, dotted_name, iter_nodes, last_name
from ddpify.analysis.literals import int_value, is_false, kwarg, positional, string_value
from ddpify.analysis.rank import MAIN_PROCESS_RE, RANK_NAMES, RANK_WORD, RankAnalysis, mentions_rank, rank_analysis

# Calls that download or unpack files (with `download=True` datasets and `.extractall()`).
FETCHES = frozenset(
    {"requests.get", "urllib.request.urlretrieve", "urllib.request.urlopen", "torch.hub.download_url_to_file",
     "torchvision.datasets.utils.download_url", "torchvision.datasets.utils.download_and_extract_archive",
     "torchvision.datasets.utils.extract_archive", "shutil.unpack_archive"}
)  # fmt: skip
# Per-node data preparation besides fetches: folders made for the data.
PREPARES = N.MAKEDIRS | N.MKDIR
_DATA_FOLDER = re.compile(r"data|cache|root|download", re.IGNORECASE)
# What torchrun puts in every worker's environment.
TORCHRUN_VARIABLES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"}
)
RENDEZVOUS_VARIABLES = frozenset({"MASTER_ADDR", "MASTER_PORT"})
ENVIRON = "os.environ"
SPAWN = N.SPAWN | N.START_PROCESSES

LOCAL, GLOBAL, OPAQUE = "local", "global", "opaque"
# Output meant once per job: checkpoints, messages, trackers, result files.
ONCE = (
    N.PRINT | N.TORCH_SAVE | N.LOGGING_CALLS | N.SIDE_EFFECTS | N.SUMMARY_WRITERS
    | {"wandb.init", "mlflow.start_run"}
)  # fmt: skip
ONCE_METHODS = frozenset({"savefig", "to_csv", "to_json", "writerow", "writerows", "save_pretrained", "addHandler"})
LOG_METHODS = frozenset({"debug", "info", "warning", "error", "critical", "exception", "log"})
WRITERS = N.SUMMARY_WRITERS | {"wandb.init", "mlflow.start_run"}
SAVE_HELPER = re.compile(r"^_?save_?(checkpoint|ckpt|model|state|weights)s?$|^save_on_(master|main)$", re.IGNORECASE)
_PER_NODE = re.compile(r"node|host|cache|preprocess|processed|token|vocab", re.IGNORECASE)
GLOBAL_RANK_ENV = frozenset({"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"})


def fetches(ci: CallInfo) -> bool:
    """`datasets.MNIST(root, download=True)`, `urlretrieve(url, path)`, `tar.extractall(root)`..."""
    flag = next((a for a in ci.node.args if a.keyword is not None and a.keyword.value == "download"), None)
    if flag is not None:
        return not is_false(flag.value)
    return bool(ci.qnames & FETCHES) or (ci.name == "extractall" and ci.receiver is not None)


def prepares_data(index: FileIndex, ci: CallInfo) -> bool:
    """A fetch, a folder made for the data (`os.makedirs(args.data_dir)`, `Path(root).mkdir()`;
    not `os.makedirs(args.output_dir)`), or a file the script writes and reads back (a
    vocabulary written at start: each node needs it on its own disk)."""
    if fetches(ci) or written_and_read_back(index, ci):
        return True
    if ci.qnames & PREPARES or (ci.name == "mkdir" and ci.receiver is not None):
        folder = ci.node.args[0].value if ci.qnames & PREPARES and ci.node.args else ci.receiver
        return folder is not None and bool(_DATA_FOLDER.search(index.code(folder)))
    return False


def file_key(index: FileIndex, path: cst.BaseExpression, call: cst.Call, code: Optional[str] = None) -> tuple:
    """The file a path names, as far as the code tells: its code (or `code`), and the function
    it is used in when it reads that function's own names as values: `path` in `save_json(obj,
    path)` and in `load_json(path)` are each caller's file, not one file. (An attribute of an
    object handed around, `config.save_path`, names the same file wherever it is read.)"""
    scope = index.scope_of(call)
    own = index.own_names(scope) - {"self"} if isinstance(scope, cst.FunctionDef) else set()
    dotted = {id(part) for n in iter_nodes(path) if isinstance(n, cst.Attribute) for part in (n.value, n.attr)}
    values = {n.value for n in iter_nodes(path) if isinstance(n, cst.Name) and id(n) not in dotted}
    return (index.code(path) if code is None else code, scope if values & own else None)


def written_and_read_back(index: FileIndex, ci: CallInfo) -> bool:
    """`open(path, "w")` when the file also opens `path` to read it, or torch.loads it."""
    if not (ci.qnames & N.OPEN and _mode(ci.node).startswith(("w", "a", "x"))):
        return False
    path = positional(ci.node)[0].value if positional(ci.node) else None
    if path is None:
        return False
    key = file_key(index, path, ci.node)
    for other in index.calls:
        args = positional(other.node)
        if other is ci or not args or file_key(index, args[0].value, other.node) != key:
            continue
        if other.qnames & N.TORCH_LOAD or (other.qnames & N.OPEN and not _mode(other.node).startswith(("w", "a", "x"))):
            return True
    return False


def cache_test(index: FileIndex, stmt: cst.CSTNode) -> bool:
    """`if os.path.exists(path): load it / else: build it, torch.save(it, path)` (or `if not
    exists(path): build and save`): a cache every rank would build and write, each reading it
    when it looks. Its local rank 0 should run the `if` first, the others after a barrier (then
    every rank of the node takes the branch that reads)."""
    if not isinstance(stmt, cst.If):
        return False
    tested = {index.code(p) for c in iter_nodes(stmt.test) if isinstance(c, cst.Call) for p in _tested_paths(c)}
    if not tested:
        return False
    inside = [ci for ci in index.calls_under(stmt) if not _within(index, ci.node, stmt.test)]
    if any(_trains(index, ci) for ci in inside):
        return False  # `if exists(best): load / else: train and save`: every rank must train, no cache
    return any(tested & {index.code(p) for p in _written_paths(index, ci)} for ci in inside)


def _trains(index: FileIndex, ci: CallInfo, depth: int = 0) -> bool:
    """Does the call train: `loss.backward()`, `optimizer.step()`, or a function of the
    project that does (`fit(model, loader)`, followed two calls deep)?"""
    if ci.name in TRAINS:
        return True
    if depth > 1:
        return False
    definitions = index.definitions() if len(index.roots) > 1 else {}
    local = {f.name.value: f for f in index.all_functions}
    fn = next((definitions[q] for q in ci.qnames if isinstance(definitions.get(q), cst.FunctionDef)), None)
    fn = fn or (local.get(ci.name) if ci.name else None)
    return fn is not None and any(_trains(index, inner, depth + 1) for inner in index.calls_under(fn))


# Calls that train (a branch holding one is no cache to build on one rank: the others would wait
# in a barrier while it reaches DDP's collectives alone).
TRAINS = frozenset({"backward", "step", "zero_grad"})


def _tested_paths(call: cst.Call) -> list[cst.BaseExpression]:
    """The path an existence test asks about: `os.path.exists(p)` -> p; `Path(p).is_file()` ->
    `Path(p)` and p; `p.exists()` -> p."""
    if last_name(call.func) not in N.EXISTENCE_TESTS:
        return []
    args = positional(call)
    if args:
        return [args[0].value]
    owner = call.func.value if isinstance(call.func, cst.Attribute) else None
    if owner is None:
        return []
    inner = positional(owner) if isinstance(owner, cst.Call) else []
    return [owner, *(a.value for a in inner[:1])]


def _written_paths(index: FileIndex, ci: CallInfo) -> list[cst.BaseExpression]:
    """The arguments that may name the file a writing call writes (all of them: which one is
    the path differs from writer to writer), none for other calls."""
    if ci.qnames & N.OPEN:
        return [positional(ci.node)[0].value] if positional(ci.node) and _mode(ci.node).startswith(("w", "a", "x")) else []
    if not side_effects.writes(ci.qnames, ci.name, method=ci.receiver is not None) and not (
        ci.name == "save" and ci.receiver is not None
    ):
        return []
    return [a.value for a in ci.node.args] + ([ci.receiver] if ci.receiver is not None else [])


def _within(index: FileIndex, node: cst.CSTNode, outer: cst.CSTNode) -> bool:
    return node is outer or any(a is outer for a in index.ancestors(node))


def _mode(call: cst.Call) -> str:
    args = positional(call)
    mode = args[1].value if len(args) > 1 else next((a.value for a in call.args if a.keyword and a.keyword.value == "mode"), None)
    return (string_value(mode) or "") if mode is not None else "r"


# environment ---------------------------------------------------------------------------------


def env_read(index: FileIndex, e: cst.CSTNode) -> Optional[str]:
    """The variable `os.environ["X"]`, `os.environ.get("X")` or `os.getenv("X")` reads."""
    if isinstance(e, cst.Subscript) and ENVIRON in index.qnames(e.value):
        if len(e.slice) == 1 and isinstance(e.slice[0].slice, cst.Index):
            return string_value(e.slice[0].slice.value)
        return None
    if isinstance(e, cst.Call) and e.args and isinstance(e.func, cst.Attribute):
        if (e.func.attr.value == "get" and ENVIRON in index.qnames(e.func.value)) or "os.getenv" in index.qnames(e.func):
            return string_value(e.args[0].value)
    return None


def env_writes(index: FileIndex) -> Iterator[tuple[str, cst.CSTNode, cst.BaseExpression]]:
    """(variable, node, value) for each `os.environ["X"] = value`, `os.environ.update(X=value)`
    (or a dict of literal keys) and `os.environ.setdefault("X", value)` of the file."""
    for sub in index.subscripts:
        target = index.parents.get(sub)
        statement = index.parents.get(target)
        if isinstance(target, cst.AssignTarget) and isinstance(statement, cst.Assign):
            name = env_read(index, sub)
            if name is not None:
                yield name, sub, statement.value
    for ci in index.calls:
        if ci.receiver is None or ENVIRON not in index.qnames(ci.receiver):
            continue
        args = ci.node.args
        if ci.name == "update":
            for arg in args:
                if arg.keyword is not None:
                    yield arg.keyword.value, arg, arg.value
                elif isinstance(arg.value, cst.Dict):
                    for el in arg.value.elements:
                        key = string_value(el.key) if isinstance(el, cst.DictElement) else None
                        if key is not None:
                            yield key, el, el.value
        elif ci.name == "setdefault" and len(args) == 2 and string_value(args[0].value) is not None:
            yield string_value(args[0].value), ci.node, args[1].value


def env_tested(index: FileIndex, test: cst.BaseExpression, variables: frozenset[str]) -> bool:
    """Does an `if` test ask whether one of `variables` is in the environment (`"WORLD_SIZE" not
    in os.environ`, `os.environ.get("MASTER_ADDR") is None`, `not os.getenv("RANK")`)?"""
    for n in iter_nodes(test):
        if isinstance(n, cst.Comparison) and len(n.comparisons) == 1:
            comp = n.comparisons[0]
            if isinstance(comp.operator, (cst.In, cst.NotIn)) and string_value(n.left) in variables:
                if ENVIRON in index.qnames(comp.comparator):
                    return True
        if env_read(index, n) in variables:
            return True
    return False


def launched_by_torchrun(index: FileIndex) -> bool:
    """Does the script expect torchrun's environment: it reads RANK, LOCAL_RANK, WORLD_SIZE...
    without setting them itself (an `mp.spawn` worker that fills them in is not), or calls
    `init_process_group` without a rank or world size and spawns no processes?"""
    return index.cached("torchrun", _launched_by_torchrun)


def _launched_by_torchrun(index: FileIndex) -> bool:
    written = {name for name, _, _ in env_writes(index)}
    reads = {env_read(index, n) for n in index.subscripts} | {env_read(index, ci.node) for ci in index.calls}
    if (reads - written) & TORCHRUN_VARIABLES:
        return True
    if index.calls_to(*SPAWN) or written & TORCHRUN_VARIABLES:
        return False
    return any(
        not any(a.keyword is not None and a.keyword.value in ("rank", "world_size", "store") for a in ci.node.args)
        and len(positional(ci.node)) < 4  # world_size and rank come 4th and 5th
        for ci in index.calls_to(*N.INIT_PROCESS_GROUP)
    )


# rank guards ---------------------------------------------------------------------------------


def is_local_rank(index: FileIndex, e: cst.CSTNode) -> bool:
    """`local_rank`, `args.local_rank`, `int(os.environ["LOCAL_RANK"])`, `dist.get_node_local_rank()`;
    not a name the program passes as `init_process_group(rank=...)` (the group's rank: global
    for this program), nor a helper of the project named so that may return the global rank."""
    if isinstance(e, cst.Call):
        if index.qnames(e.func) & N.NODE_LOCAL_RANK_CALLS:
            return True
        if last_name(e.func) == "int" and e.args:
            return is_local_rank(index, e.args[0].value)
        if env_read(index, e) == "LOCAL_RANK":
            return True
        named = last_name(e.func) or ""
        return "local_rank" in named.lower() and not any(_may_return_global_rank(index, f) for f in index.functions.get(named, []))
    if isinstance(e, cst.Subscript):
        return env_read(index, e) == "LOCAL_RANK"
    if isinstance(e, (cst.Name, cst.Attribute)):
        return "local_rank" in (last_name(e) or "").lower() and index.code(e) not in _group_ranks(index) | _helper_ranks(index)
    return False


def _helper_ranks(index: FileIndex) -> set[str]:
    """The code of names bound to the global rank (`local_rank = dist.get_rank()`, `args.local_rank
    += args.node_index * args.gpu_per_node`) or from a project helper that may return it (`total_gpus, cfg.LOCAL_RANK = getattr(common_utils,
    "init_dist_%s" % launcher)(...)`, whose every `init_dist_*` returns `dist.get_rank()`):
    whatever they are called, they hold it."""
    found = index.__dict__.get("_helper_ranks")
    if found is None:
        found = index.__dict__["_helper_ranks"] = set()
        for root in index.roots:
            for node in iter_nodes(root):
                if isinstance(node, cst.AugAssign) and isinstance(node.operator, cst.AddAssign) and int_value(node.value) is None:
                    if "local_rank" in (last_name(node.target) or "").lower():  # `args.local_rank += node_index * gpus`
                        found.add(index.code(node.target))
                    continue
                if not (isinstance(node, cst.Assign) and isinstance(node.value, cst.Call)):
                    continue
                targets = [
                    e.value if isinstance(t.target, cst.Tuple) else e
                    for t in node.targets for e in (t.target.elements if isinstance(t.target, cst.Tuple) else [t.target])
                ]  # fmt: skip
                named = {index.code(t) for t in targets if "local_rank" in (last_name(t) or "").lower()}
                info = index.call_info.get(node.value)
                if named and (
                    info is not None and info.qnames & N.GLOBAL_RANK_CALLS
                    or any(_may_return_global_rank(index, f) for f in _helpers_called(index, node.value))
                ):
                    found |= named
    return found


def _helpers_called(index: FileIndex, call: cst.Call) -> list:
    """The project functions a call may run: by its name, or every function whose name starts
    with the text of a name built at run time (`getattr(utils, "init_dist_%s" % launcher)(...)`)."""
    func = call.func
    if isinstance(func, cst.Call) and last_name(func.func) == "getattr" and len(func.args) >= 2:
        name = func.args[1].value
        text = name.left if isinstance(name, cst.BinaryOperation) else name
        if isinstance(name, cst.FormattedString):
            text = name.parts[0] if name.parts and isinstance(name.parts[0], cst.FormattedStringText) else None
            prefix = text.value if text is not None else ""
        else:
            prefix = (string_value(text) or "").split("%")[0].split("{")[0]
        return [f for n, fs in index.functions.items() if prefix and n.startswith(prefix) for f in fs]
    info = index.call_info.get(call)
    return index.local_callees(info) if info is not None else []


def _group_ranks(index: FileIndex) -> set[str]:
    """The code of what the program passes as the process group's rank (`init_process_group(...,
    rank=local_rank)`): whatever its name, that value is the global rank of this program."""
    found = index.__dict__.get("_group_ranks")
    if found is None:
        found = index.__dict__["_group_ranks"] = set()
        for ci in index.calls_to(*N.INIT_PROCESS_GROUP):
            pos = positional(ci.node)
            args = [a for a in ci.node.args if a.keyword is not None and a.keyword.value == "rank"] or pos[4:5]
            found.update(index.code(a.value) for a in args)
    return found


def _may_return_global_rank(index: FileIndex, func) -> bool:
    """Does a project helper (`get_fs_local_rank()`) read the global rank somewhere in it (a
    shared filesystem's "local" rank is the global one)?"""
    return any(
        c.qnames & N.RANK_CALLS or env_read(index, c.node) in GLOBAL_RANK_ENV or "global_rank" in (c.name or "").lower()
        for c in index.calls_under(func)
    )


def guard_kind(rank: RankAnalysis, test: cst.BaseExpression, _depth: int = 0) -> Optional[str]:
    """LOCAL: a rank-0 test of the local rank only, true once per node (`local_rank == 0`,
    `local_rank in (-1, 0)`, `rank % ngpus_per_node == 0`); GLOBAL: it reads the global rank
    (true once per job); OPAQUE: a flag, helper or GPU index we cannot see into; None: no rank
    read. A test that reads both kinds is GLOBAL (`local_rank == 0 and rank == 0`)."""
    kinds: set[str] = set()
    stack: list[cst.CSTNode] = [test]
    while stack:
        n = stack.pop()
        kind, descend = _kind(rank, n, _depth)
        if kind is not None:
            kinds.add(kind)
        if descend:
            stack.extend(n.children)
    for kind in (GLOBAL, OPAQUE, LOCAL):
        if kind in kinds:
            return kind
    return None


def _kind(rank: RankAnalysis, n: cst.CSTNode, depth: int) -> tuple[Optional[str], bool]:
    """What one part of a test reads, and whether to look inside it."""
    index = rank.index
    if not isinstance(n, (cst.Call, cst.Subscript, cst.Name, cst.Attribute, cst.BinaryOperation)):
        return None, True
    if is_local_rank(index, n):
        return LOCAL, False
    if isinstance(n, cst.BinaryOperation):  # `rank % ngpus_per_node`: the rank within its node
        return (LOCAL, False) if isinstance(n.operator, cst.Modulo) and rank.is_rank_expr(n.left) else (None, True)
    if isinstance(n, cst.Subscript):
        return (GLOBAL, False) if env_read(index, n) in GLOBAL_RANK_ENV else (None, True)
    if isinstance(n, cst.Call):
        if index.qnames(n.func) & N.RANK_CALLS or env_read(index, n) in GLOBAL_RANK_ENV:
            return GLOBAL, False
        if last_name(n.func) == "int":
            return None, True
        named = last_name(n.func) or ""
        if MAIN_PROCESS_RE.match(named):
            return OPAQUE, False
        return (GLOBAL, False) if RANK_WORD.search(named) else (None, True)
    named = last_name(n) or ""
    flags = [b for b in rank.rank_flags if b.dotted == index.code(n)] if depth < 3 else []
    if flags:  # `is_main = rank == 0`
        kinds = {guard_kind(rank, b.value, depth + 1) or OPAQUE for b in flags}
        return next(k for k in (GLOBAL, OPAQUE, LOCAL) if k in kinds | {LOCAL}), False
    if RANK_WORD.search(named):
        return GLOBAL, False
    if named.lower() in RANK_NAMES or MAIN_PROCESS_RE.match(named):
        return OPAQUE, False
    return None, False


class Guard:
    """A rank-0 guard: its test, and the code it holds (an `if`, or the block after an
    `if rank != 0: return`)."""

    __slots__ = ("test", "region")

    def __init__(self, test: cst.BaseExpression, region: cst.CSTNode) -> None:
        self.test = test
        self.region = region


def rank0_paths(rank: RankAnalysis, node: cst.CSTNode, _depth: int = 0) -> list[tuple[list[Guard], cst.CSTNode]]:
    """Each way `node` runs on rank 0 only: the guards above it, innermost first, through the
    call sites of functions only called there, and the node to point at (`node` when a guard of
    its own function holds it, else the call site that does)."""
    index = rank.index
    guards: list[Guard] = []
    child = node
    for p in index.ancestors(node):
        if isinstance(p, (cst.If, cst.IfExp)):
            if child is p.body and rank.rank_test(p.test) == 1 or child is p.orelse and rank.false_only_on_rank0(p.test):
                guards.append(Guard(p.test, p))
        elif isinstance(p, (cst.IndentedBlock, cst.Module)) and not isinstance(child, cst.BaseSuite):
            body = list(p.body)
            start = rank.guard_start(p)
            if child in body and body.index(child) > start:
                guards.append(Guard(body[start].test, p))
        elif isinstance(p, cst.FunctionDef):
            if _depth >= 3 or not rank.rank0_function(p):
                break
            paths = []
            for site in index.call_sites(p):
                for outer, at in rank0_paths(rank, site.node, _depth + 1):
                    paths.append((guards + outer, node if guards else at))
            return paths
        elif isinstance(p, (cst.Lambda, cst.ClassDef)):
            break
        child = p
    return [(guards, node)] if guards else []


# job-wide output under a local-rank guard ---------------------------------------------------


def output_once_per_node(index: FileIndex, torchrun: bool = False) -> list[list[Guard]]:
    """Output meant once per job (a checkpoint, `print`, logging, a tracker, a results file)
    that runs once per node: each way it reaches rank 0 only through local-rank guards
    (innermost first). Guards that also hold per-node data preparation (a download, a data
    folder, a file read back) are right and left out, as is output that names the node, the
    host or the rank. Only for scripts launched by torchrun (an `mp.spawn` worker's local rank
    is its rank): `torchrun=True` for a script that will be (one being converted)."""
    if not (torchrun or launched_by_torchrun(index)):
        return []
    return index.cached("output_once_per_node", _output_once_per_node)


def _output_once_per_node(index: FileIndex) -> list[list[Guard]]:
    rank = rank_analysis(index)
    calls = index.call_info
    loggers = {b.dotted for b in index.assignments if b.value in calls and calls[b.value].is_("logging.getLogger")}
    writers = set()  # `writer = SummaryWriter(...)`, `... if local_rank == 0 else None`: its calls write too
    for b in index.assignments:
        made = b.value.body if isinstance(b.value, cst.IfExp) else b.value
        if made in calls and calls[made].qnames & WRITERS:
            writers.add(b.dotted)
    kinds: dict[cst.BaseExpression, Optional[str]] = {}  # guard test -> guard_kind, once per test

    def local(guards: list[Guard]) -> bool:
        for g in guards:
            if g.test not in kinds:
                kinds[g.test] = guard_kind(rank, g.test)
        return bool(guards) and all(kinds[g.test] == LOCAL for g in guards)

    found: dict[cst.Call, list[list[Guard]]] = {}
    for _ in range(3):  # what such a guard makes (a file, a writer) is used under other guards: those too
        for ci in index.calls:
            if ci.node in found or not _once(index, ci, loggers, writers) or not rank.in_rank0(ci.node):
                continue
            if any(isinstance(a, cst.If) and cache_test(index, a) for a in index.ancestors(ci.node)):
                continue  # a cache's file: each node's local rank 0 writes it for its other ranks
            paths = [
                guards for guards, _ in rank0_paths(rank, ci.node)
                if local(guards) and not any(prepares_data(index, c) for g in guards for c in index.calls_under(g.region))
            ]  # fmt: skip
            if not paths or mentions_rank(index, ci.node):
                continue
            if not _PER_NODE.search(" ".join(index.code(a.value) for a in ci.node.args)):
                found[ci.node] = paths
        if not found:
            break
        regions = {g.region for paths in found.values() for guards in paths for g in guards}
        made = {b.dotted for b in index.assignments if any(n in regions for n in (b.value, *index.ancestors(b.value)))}
        if made <= writers:
            break
        writers |= made
    return [guards for paths in found.values() for guards in paths]


def _once(index: FileIndex, ci: CallInfo, loggers: set[str], writers: set[str]) -> bool:
    """Output meant once per job: also a logger's messages and a writer's or tracker's calls."""
    if ci.qnames & ONCE or (ci.receiver is not None and ci.name in ONCE_METHODS):
        return True
    roots = side_effects.bound_call_roots(index.qnames, (), ci.receiver) if ci.receiver is not None else frozenset()
    if side_effects.writes(ci.qnames, ci.name, roots, method=ci.receiver is not None):
        return True
    receiver = dotted_name(ci.receiver) if ci.receiver is not None else None
    if (receiver in loggers and ci.name in LOG_METHODS) or (receiver in writers and not ci.name.startswith("get")):
        return True
    if ci.qnames & N.OPEN:
        mode = kwarg(ci.node, "mode") or (positional(ci.node)[1] if len(positional(ci.node)) > 1 else None)
        return mode is not None and any(m in (string_value(mode.value) or "") for m in "wax")
    return not index.local_callees(ci) and bool(SAVE_HELPER.match(ci.name))
