"""Insert process-group setup from torchrun's environment and pin this process's device.

The script's own device line (`device = torch.device("cuda" if ... else "cpu")`) is
kept and pointed at `cuda:<local_rank>`; without one, a device line is added. NCCL is
used when that device is a GPU (after `torch.cuda.set_device`), gloo otherwise, and a
one-process group when the script runs under plain `python`.
"""

from __future__ import annotations

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis import distributed as D
from ddpify.analysis.schedule import clock_names_in_place, reaches
from ddpify.analysis.trainers import shared_caller
from ddpify.analysis.script import Script, ScopeNode, is_device_name, mentions, ref_of, run_by_entry
from ddpify.convert.context import Context

LOCAL_RANK = """
# torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; under plain `python` this is one process.
{local_rank} = int(os.environ.get("LOCAL_RANK", 0))
"""

DEVICE = '{device} = torch.device(f"cuda:{{{first_gpu}}}" if torch.cuda.is_available() else "cpu")\n'
CPU_DEVICE = '{device} = torch.device("cpu")\n'

ACCELERATOR_TYPE = "torch.accelerator.current_accelerator().type"
FIXUP = """if {device_type} == "cuda":  # chosen at run time: this process's GPU
    {device} = torch.device("cuda", {local_rank})
"""
DEVICE_OPTION = """if {option}.startswith("cuda"):  # --device names a GPU: this process's own
    {option} = f"cuda:{{os.environ.get('LOCAL_RANK', 0)}}"
"""

INIT = """if {device_type} == "cuda":
    torch.cuda.set_device({device})
backend = "cpu:gloo,cuda:nccl" if {device_type} == "cuda" else "gloo"  # NCCL for GPU tensors, gloo for CPU ones
if "WORLD_SIZE" in os.environ:  # launched by torchrun
    dist.init_process_group(backend)
else:  # plain `python`: a process group of one
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
"""
# In a method (a trainer's constructor): every object made runs it, the group is made once.
INIT_ONCE = """if {device_type} == "cuda":
    torch.cuda.set_device({device})
backend = "cpu:gloo,cuda:nccl" if {device_type} == "cuda" else "gloo"  # NCCL for GPU tensors, gloo for CPU ones
if not dist.is_initialized():  # else an earlier object of this class made it
    if "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group(backend)
    else:  # plain `python`: a process group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
"""


def _init(script: Script, scope, device: str, device_type: str) -> str:
    """The setup's code: once per process also where a method runs it (each object would)."""
    template = INIT_ONCE if isinstance(scope, cst.FunctionDef) and script.class_of(scope) is not None else INIT
    return template.format(device=device, device_type=device_type)


def run(ctx: Context) -> None:
    script, edits = ctx.script, ctx.edits
    shared = shared_caller(script)  # several trainers: the place every one of them is reached from
    if shared is not None and _set_up_elsewhere(script, shared.scope):
        shared = None  # the script's own setup: its device line is where it is
    found = None
    for scope in [shared.scope] if shared is not None else _candidate_scopes(script):
        found = found or _device_statement(script, scope)
    late = None
    if found is not None and _after_training_starts(script, found[0]):
        late, found = found[0], None  # `device = ...` defined for inference at the end: set up before training instead
    if _existing_setup(ctx, found):
        return
    names = {"local_rank": ctx.local_rank}
    if found is not None:
        stmt, ctx.device, is_torch_device = found
        ctx.setup_scope = script.scope_of(stmt)
        ctx.device_stmt = stmt
        ctx.device_type = f"{ctx.device}.type" if is_torch_device else f"torch.device({ctx.device}).type"
        _point_at_local_rank(ctx, stmt)
        if any(_chosen_at_run_time(v) for _, v in _assignments(stmt)):
            ctx.device_fixup = True  # `else: self.device = config.device`
        existing = _local_rank_variable(ctx, ctx.setup_scope)
        if existing is None:
            edits.insert_above(stmt, _opening(LOCAL_RANK, stmt is script.block_of(ctx.setup_scope).body[0]).format(**names))
        else:
            ctx.local_rank = names["local_rank"] = existing
        if ctx.device_fixup:
            edits.insert_after(stmt, FIXUP.format(device=ctx.device, device_type=ctx.device_type, **names))
        edits.insert_after(stmt, _init(script, ctx.setup_scope, ctx.device, ctx.device_type))
        body = list(script.block_of(ctx.setup_scope).body)
        ctx.init_index = body.index(stmt) + 1
        edits.change(stmt, f"`{ctx.device}` is this process's GPU (`cuda:<local_rank>`) or the CPU")
    else:
        ctx.setup_scope = script.model_scope
        body = list(script.block_of(ctx.setup_scope).body)
        anchor = _anchor(script, body)
        early = _needed_earlier(script) if shared is None else None
        constructor = _constructor(ctx) if shared is None else None
        if shared is not None:  # several trainers, run one after the other: set up once, before the first
            ctx.setup_scope, body = shared.scope, list(shared.block.body)
            anchor = min(_anchor(script, body), shared.first, key=body.index)
            if isinstance(shared.scope, cst.Module) and isinstance(shared.block, cst.IndentedBlock):
                script.main_block = shared.block
            edits.change(anchor, "the process group is set up here, once, before any of the trainers runs")
        elif constructor is not None:  # another method of its object may run first and use the group
            ctx.setup_scope, body = constructor, list(constructor.body.body)
            anchor = next(s for s in body if not _is_docstring(s) or s is body[-1])
            ctx.device = "self.device" if not _bound_anywhere(script, "self.device") else "self.process_device"
            edits.change(anchor, f"the process group is set up when the object is made: `{script.model_scope.name.value}()` may run after its other methods")
        elif early is not None:  # the group must exist before the model's function is called
            block, anchor = early
            script.main_block = script.main_block or block
            ctx.setup_scope = script.module
            body = list(block.body)
            edits.change(anchor, "the process group is set up before this line: it shares a name read from the clock")
        if isinstance(ctx.setup_scope, cst.Module) and (constant := _module_device_constant(script)) is not None:
            ctx.device = constant  # `DEVICE = torch.device("cuda:0")` above the main block: rebound there, per process
            edits.change(anchor, f"`{constant}` (the module's device) is rebound to this process's GPU where the script runs")
        ctx.device_type = f"{ctx.device}.type"
        on_gpu = script.uses_gpu
        device_line = DEVICE if on_gpu else CPU_DEVICE
        gate = script.gpu_gate if on_gpu else None
        if gate is not None and _bound_before(script, gate, body, anchor):  # `if args.cuda: model.cuda()`
            device_line = device_line.replace(" if torch.cuda.is_available()", f" if {gate} and torch.cuda.is_available()")
            edits.change(anchor, f"`{ctx.device}` is this process's GPU when `{gate}` (as the script's GPU moves), else the CPU")
        first_gpu = ctx.local_rank if ctx.gpus_per_process == 1 else f"{ctx.gpus_per_process} * {ctx.local_rank}"
        names = {"local_rank": ctx.local_rank, "first_gpu": first_gpu}
        edits.insert_above(
            anchor,
            _opening(LOCAL_RANK, anchor is body[0]).format(**names)
            + device_line.format(device=ctx.device, **names)
            + _init(script, ctx.setup_scope, ctx.device, ctx.device_type),
        )
        ctx.init_index = body.index(anchor)
        if not on_gpu:
            edits.change(anchor, "the script never uses a GPU: every process trains on the CPU (gloo)")
        _shadowed_parameter(ctx, anchor)
    if late is not None and ctx.local_rank_visible(script.scope_of(late)):
        if not any(isinstance(v, cst.Call) for _, v in _assignments(late)):  # place_on_device does torch.device(...)
            _point_at_local_rank(ctx, late)  # inference after training: this process's GPU too
    _rebound_device(ctx)
    _device_option(ctx)
    edits.need_import("os")
    edits.need_import(N.DIST_MODULE, asname="dist")
    edits.change(
        body[min(ctx.init_index, len(body) - 1)],
        "process group from torchrun's environment (NCCL with CUDA after set_device, gloo on CPU)",
    )


def _set_up_elsewhere(script: Script, scope: ScopeNode) -> bool:
    """Does code the entry runs set up a process group, none of it in `scope` (where a conversion
    puts the setup of sibling trainers)?"""
    inits = [c for c in script.calls if script.is_call_to(c, D.INIT_PROCESS_GROUP) and run_by_entry(script, c)]
    return bool(inits) and all(script.scope_of(c) is not scope for c in inits)


def _existing_setup(ctx: Context, found) -> bool:
    """The script sets up its process group already: learn the names and place later passes
    need (the setup's scope, the device, LOCAL_RANK's variable) and add nothing but what a
    GPU device line still lacks."""
    script, edits = ctx.script, ctx.edits
    inits = [c for c in script.calls if script.is_call_to(c, D.INIT_PROCESS_GROUP) and run_by_entry(script, c)]
    if not inits:
        return False
    init = inits[-1]
    scope = script.scope_of(init)
    top = script.top_statement(init, scope)
    if top is None and isinstance(scope, cst.FunctionDef):  # `ddp_setup()` called where training starts
        callers = [c for c in script.calls if script.local_function(c) is scope]
        if len(callers) == 1:
            scope = script.scope_of(callers[0])
            top = script.top_statement(callers[0], scope)
    if top is None:
        scope = script.model_scope
        top = script.top_statement(init, scope)
    ctx.setup_scope = scope
    body = list(script.block_of(scope).body)
    ctx.init_index = body.index(top) + 1 if top in body else 0
    if found is not None:
        stmt, ctx.device, is_torch_device = found
        ctx.device_stmt = stmt
        ctx.device_type = f"{ctx.device}.type" if is_torch_device else f"torch.device({ctx.device}).type"
    ctx.local_rank = _local_rank_variable(ctx, scope) or ctx.local_rank
    if (
        found is not None
        and _local_rank_variable(ctx, scope) is None
        and ctx.local_rank not in script.bound.get(scope, set())
        and any(n.value == ctx.local_rank for n in script.nodes_in(script.block_of(scope), cst.Name))
    ):  # the setup reads LOCAL_RANK's variable, which is gone
        first = ctx.device_stmt is script.block_of(script.scope_of(ctx.device_stmt)).body[0]
        edits.insert_above(ctx.device_stmt, _opening(LOCAL_RANK, first).format(local_rank=ctx.local_rank))
    if found is not None:
        _point_at_local_rank(ctx, ctx.device_stmt)
        if any(_chosen_at_run_time(v) for _, v in _assignments(ctx.device_stmt)):
            ctx.device_fixup = True
        fixed = any(
            ref_of(a.targets[0].target) == ctx.device and D.is_per_process_device(script, a.value, ctx.local_rank)
            for a in script.assigns.get(script.scope_of(ctx.device_stmt), [])
        )
        if ctx.device_fixup and not fixed:
            edits.insert_after(ctx.device_stmt, FIXUP.format(device=ctx.device, device_type=ctx.device_type, local_rank=ctx.local_rank))
    _device_option(ctx)
    return True


def _shadowed_parameter(ctx: Context, anchor: cst.CSTNode) -> None:
    """`def train(n_epoch=100, device="cuda:1")`: the new per-process device takes the parameter's
    name at the top of the function, so what a caller passes there no longer counts; say so."""
    scope = ctx.setup_scope
    if isinstance(scope, cst.FunctionDef) and ctx.device in {p.name.value for p in scope.params.params + scope.params.kwonly_params}:
        ctx.edits.note(
            anchor, f"the `{ctx.device}` parameter of `{scope.name.value}()` no longer has any effect: each process uses its own device (`cuda:<local_rank>` or the CPU)"
        )


def _rebound_device(ctx: Context) -> None:
    """`device, device_ids = prepare_device(n_gpu)` after the setup (or in the model's function,
    called after it): the script's own helper picks "the GPU" (cuda:0 on every rank); this
    process's GPU replaces it right after."""
    script, edits = ctx.script, ctx.edits
    body = list(script.block_of(ctx.setup_scope).body)[ctx.init_index :]
    if script.model_scope is not ctx.setup_scope and script.model_scope is not None:
        body += list(script.block_of(script.model_scope).body)  # set up before the model's function is called
    for stmt in body:
        if not (isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Assign)):
            continue
        assign = stmt.body[0]
        targets = [assign.targets[0].target]
        if isinstance(targets[0], (cst.Tuple, cst.List)):
            targets = [e.value for e in targets[0].elements]
        if not any(ref_of(t) == ctx.device for t in targets) or not isinstance(assign.value, cst.Call):
            continue
        if script.local_function(assign.value) is None:
            continue
        following = D.sibling(script, stmt, 1)
        if following is not None and D.reads_rank(script, following) and mentions(following, ctx.device):
            continue  # re-pointed already
        device_type = f"torch.device({ctx.device}).type"
        edits.insert_after(stmt, FIXUP.format(device=ctx.device, device_type=device_type, local_rank=ctx.local_rank))
        edits.change(stmt, f"`{ctx.device}` from `{N.call_name(assign.value)}(...)` becomes this process's GPU")


def _local_rank_variable(ctx: Context, scope: ScopeNode) -> str | None:
    """The name `scope` binds to LOCAL_RANK from the environment (`local_rank = int(os.environ...)`)."""
    script = ctx.script
    for assign in script.assigns.get(scope, []):
        target = ref_of(assign.targets[0].target)
        strings = script.nodes_in(assign.value, cst.SimpleString)
        if target and strings and D.reads_rank(script, assign.value):
            if any(s.evaluated_value == "LOCAL_RANK" for s in strings):
                return target
    return None


def _device_option(ctx: Context) -> None:
    """`--device cuda:0` (a default or a value given at run time that names a GPU) means this process's GPU:
    right after `args = parser.parse_args()`, a GPU device becomes `cuda:<LOCAL_RANK>`."""
    script, edits = ctx.script, ctx.edits
    options = [
        c for c in script.calls
        if N.call_name(c) == "add_argument" and c.args and isinstance(c.args[0].value, cst.SimpleString)
        and c.args[0].value.evaluated_value == "--device" and N.keyword(c, "dest") is None
        and _names_gpu(N.keyword(c, "default"))
    ]  # fmt: skip
    parsed = [c for c in script.calls if N.call_name(c) == "parse_args" and isinstance(script.parent(c), cst.Assign)]
    if not options or len(parsed) != 1:
        return
    target = script.parent(parsed[0]).targets[0].target
    line = script.statement_line(parsed[0])
    if not isinstance(target, cst.Name) or line is None:
        return
    following = D.sibling(script, line, 1)
    if following is not None and D.reads_rank(script, following) and mentions(following, f"{target.value}"):
        return  # already re-pointed at this process's GPU
    edits.insert_after(line, DEVICE_OPTION.format(option=f"{target.value}.device"))
    edits.change(line, f"`{target.value}.device` naming a GPU becomes this process's (`cuda:<LOCAL_RANK>`)")


def _names_gpu(arg: cst.Arg | None) -> bool:
    """A default that names a GPU, or a device name that a user may swap for one (`--device cuda`)."""
    if arg is None:
        return False
    value = arg.value
    if isinstance(value, cst.IfExp):
        return N.is_cuda_string(value.body) or N.is_cuda_string(value.orelse)
    if isinstance(value, cst.SimpleString) and value.evaluated_value in ("cpu", "mps"):
        return True
    return N.is_cuda_string(value)


def _candidate_scopes(script: Script) -> list[ScopeNode]:
    """Where to look for the script's device line: the model's function, its class, the module."""
    scopes = [script.model_scope]
    cls = script.class_of(script.model_scope)
    if cls is not None:
        scopes += [fn for fn in script.methods(cls).values() if fn is not script.model_scope]
    if not isinstance(script.model_scope, cst.Module):
        scopes.append(script.module)
    return scopes


def _device_statement(script: Script, scope: ScopeNode) -> tuple[cst.BaseStatement, str, bool] | None:
    """The first top-level statement of `scope` that binds a device: (stmt, name, is torch.device)."""
    for stmt in script.block_of(scope).body:
        assigns = _assignments(stmt)
        if not assigns:
            continue
        targets = {t for t, _ in assigns}
        values = [v for _, v in assigns]
        if len(targets) == 1 and all(_is_device_value(script, v) or _chosen_at_run_time(v) for v in values):
            if not any(_is_device_value(script, v) for v in values) and not (script.uses_gpu and is_device_name(next(iter(targets)))):
                continue  # `device = args.device` counts where the project names CUDA: a value set elsewhere
            is_torch_device = all(_is_torch_device(script, v) for v in values)
            return stmt, targets.pop(), is_torch_device
    return None


def _module_device_constant(script: Script) -> str | None:
    """A device the module binds at its top (`DEVICE = torch.device("cuda:0" if ... else "cpu")`),
    which its functions read as a global."""
    for stmt in script.module.body:
        pairs = _assignments(stmt) if isinstance(stmt, cst.SimpleStatementLine) else []
        if len(pairs) == 1 and isinstance(pairs[0][1], cst.Call) and _is_device_value(script, pairs[0][1]) and "." not in pairs[0][0]:
            return pairs[0][0]
    return None


def _assignments(stmt: cst.CSTNode) -> list[tuple[str, cst.BaseExpression]]:
    """`name = value` pairs of a simple assignment, or of every branch of an if/elif/else."""
    assign = N.sole_assign(stmt)
    if assign is not None:
        ref = ref_of(assign.targets[0].target)
        return [(ref, assign.value)] if ref else []
    if isinstance(stmt, cst.If) and stmt.orelse is not None:
        # if/elif/else: every branch must be one assignment to the same name.
        pairs = []
        branch: cst.CSTNode | None = stmt
        while branch is not None:
            block = branch.body
            if len(block.body) != 1 or not _assignments(block.body[0]):
                return []
            pairs += _assignments(block.body[0])
            branch = branch.orelse if isinstance(branch, cst.If) else None
        return pairs
    return []


def _is_device_value(script: Script, value: cst.BaseExpression) -> bool:
    if isinstance(value, cst.Call) and script.is_call_to(value, N.TORCH_DEVICE | N.CURRENT_ACCELERATOR):
        return True
    if N.is_cuda_string(value):
        return True
    return isinstance(value, cst.IfExp) and any(_is_gpu(script, b) for b in (value.body, value.orelse))


def _after_training_starts(script: Script, stmt: cst.CSTNode) -> bool:
    """Does a statement before `stmt`, in its block, train (backward, a training helper, a loop
    that trains) or put something on a GPU (`.cuda(...)`, `.to(0)`): the device line came too late
    to hold the setup."""
    block = script.parent(stmt)
    body = list(getattr(block, "body", ()))
    for earlier in body[: body.index(stmt)] if stmt in body else ():
        if isinstance(earlier, (cst.FunctionDef, cst.ClassDef)):
            continue
        for call in script.calls_in(earlier):
            if N.call_name(call) == "backward" and N.receiver(call) is not None:
                return True
            if script.local_function(call) in script.training_functions:
                return True
            if N.call_name(call) == "cuda" and isinstance(call.func, cst.Attribute):
                return True
            if N.call_name(call) == "to" and N.positional(call) and isinstance(N.positional(call)[0].value, cst.Integer):
                return True
    return False


def _chosen_at_run_time(value: cst.BaseExpression) -> bool:
    """`config.device`, `args.device`, `config["device"]`: a device named by a setting (one branch
    of an if/else)."""
    if isinstance(value, cst.Subscript) and len(value.slice) == 1 and isinstance(value.slice[0].slice, cst.Index):
        key = value.slice[0].slice.value
        return isinstance(key, cst.SimpleString) and "device" in str(key.evaluated_value)
    return isinstance(value, cst.Attribute) and "device" in value.attr.value


def _is_torch_device(script: Script, value: cst.BaseExpression) -> bool:
    if isinstance(value, cst.IfExp):
        return _is_torch_device(script, value.body) and _is_torch_device(script, value.orelse)
    return isinstance(value, cst.Call) and script.is_call_to(value, N.TORCH_DEVICE | N.CURRENT_ACCELERATOR)


def _is_gpu(script: Script, value: cst.BaseExpression) -> bool:
    """"cuda...", torch.device("cuda...") or torch.accelerator.current_accelerator()."""
    if isinstance(value, cst.Call) and script.is_call_to(value, N.CURRENT_ACCELERATOR):
        return True
    if isinstance(value, cst.Call) and script.is_call_to(value, N.TORCH_DEVICE):
        args = N.positional(value)
        return bool(args) and N.is_cuda_string(args[0].value)
    return N.is_cuda_string(value)


def _point_at_local_rank(ctx: Context, stmt: cst.CSTNode) -> None:
    """Make every "cuda" in the device statement mean `cuda:<local_rank>`."""
    script, edits = ctx.script, ctx.edits
    first_gpu = ctx.local_rank if ctx.gpus_per_process == 1 else f"{ctx.gpus_per_process} * {ctx.local_rank}"
    per_rank = f'f"cuda:{{{first_gpu}}}"'
    or_cpu = f'{per_rank} if torch.cuda.is_available() else "cpu"'
    branches = isinstance(stmt, cst.If)  # each branch already chose CUDA or not
    for _, value in _assignments(stmt):
        if isinstance(value, cst.Call) and script.is_call_to(value, N.CURRENT_ACCELERATOR):
            # torch.accelerator.current_accelerator(): the same kind of device, this rank's index.
            edits.replace(value, edits.expression(f"torch.device({ACCELERATOR_TYPE}, {ctx.local_rank})"))
            continue
        if isinstance(value, cst.Call) and script.is_call_to(value, N.TORCH_DEVICE):
            args = N.positional(value)
            if args and isinstance(args[0].value, cst.Integer):
                # torch.device(0): GPU 0, i.e. this process's GPU.
                edits.replace(value, edits.expression(f"torch.device({per_rank if branches else or_cpu})"))
                continue
            if args and not isinstance(args[0].value, (cst.SimpleString, cst.IfExp)) and len(args) == 1:
                # torch.device(args.device): a GPU chosen at run time becomes this rank's GPU.
                ctx.device_fixup = True
                continue
            if args and N.is_cuda_string(args[0].value):
                # torch.device("cuda") / torch.device("cuda", 0): this process's GPU (or the CPU).
                edits.replace(value, edits.expression(f"torch.device({per_rank if branches else or_cpu})"))
                continue
            if args and isinstance(args[0].value, cst.IfExp):
                value = args[0].value
        if N.is_cuda_string(value):
            edits.replace(value, edits.expression(per_rank if branches else or_cpu))
        elif isinstance(value, cst.IfExp):
            for branch in (value.body, value.orelse):
                if isinstance(branch, cst.Call) and script.is_call_to(branch, N.CURRENT_ACCELERATOR):
                    edits.replace(branch, edits.expression(f"torch.device({ACCELERATOR_TYPE}, {ctx.local_rank})"))
                elif N.is_cuda_string(branch):
                    edits.replace(branch, edits.expression(per_rank))
                elif _is_gpu(script, branch):
                    edits.replace(branch, edits.expression(f"torch.device({per_rank})"))


def _bound_before(script: Script, gate: str, body: list[cst.CSTNode], anchor: cst.CSTNode) -> bool:
    """Is the gate's first name (`args` of `args.cuda`) bound by a statement above `anchor`, a
    parameter of the function `body` belongs to, or a global of the module that function reads?"""
    name = gate.split(".")[0]
    scope = script.scope_of(anchor)
    above = body[: body.index(anchor)]
    assigns = script.assigns.get(scope, [])
    # `args.cuda = not args.no_cuda and ...` set by the script: that assignment must come first
    setting = [a for a in assigns if gate != name and script.module.code_for_node(a.targets[0].target) == gate]
    if setting:
        return all(any(script.inside(a, stmt) for stmt in above) for a in setting)
    if isinstance(scope, cst.FunctionDef) and name in {p.name.value for p in scope.params.params}:
        return True
    if isinstance(scope, cst.FunctionDef) and name not in script.bound.get(scope, ()):
        # a global the function reads (`args` parsed at the top of the script): bound by the
        # time the function runs, since its own GPU moves read the gate too
        return any(ref_of(a.targets[0].target) == name for a in script.assigns.get(script.module, []))
    return any(ref_of(a.targets[0].target) == name and any(script.inside(a, stmt) for stmt in above) for a in assigns)


def _needed_earlier(script: Script) -> tuple[cst.IndentedBlock, cst.BaseStatement] | None:
    """`config = Config.from_args(parser)` in the `if __name__ == "__main__":` block, before the
    call of the function that builds the model, when it names a run folder by the clock (the
    ranks share rank 0's name through the process group): that block and that statement."""
    scope = script.model_scope
    if not isinstance(scope, cst.FunctionDef) or script.root_of(scope) is not script.module:
        return None
    makers = {found.scope for found in clock_names_in_place(script) if not found.shared}
    callers = [c for c in script.calls if script.local_function(c) is scope and script.scope_of(c) is script.module]
    if not makers or len(callers) != 1:
        return None
    for stmt in script.module.body:
        if isinstance(stmt, cst.If) and N.tests_module_name(stmt.test):
            body = list(stmt.body.body)
            top = next((s for s in body if script.inside(callers[0], s)), None)
            if top is not None:
                return next(((stmt.body, s) for s in body[: body.index(top)] if reaches(script, s, makers)), None)
    return None


def _constructor(ctx: Context) -> cst.FunctionDef | None:
    """The `__init__` of the class whose method (not run by `__init__`) builds the optimizer:
    its other methods (`_get_data()` before `_select_optimizer()`) may run first and use the
    process group, so it is set up when the object is made (None: not a method, or no own
    `__init__`)."""
    script = ctx.script
    scope = script.model_scope
    cls = script.class_of(scope) if isinstance(scope, cst.FunctionDef) else None
    if cls is None or ctx._constructs(scope):
        return None
    return script.methods(cls).get("__init__")


def _bound_anywhere(script: Script, name: str) -> bool:
    return any(ref_of(a.targets[0].target) == name for assigns in script.assigns.values() for a in assigns)


def _is_docstring(stmt: cst.CSTNode) -> bool:
    small = N.sole_statement(stmt)
    return isinstance(small, cst.Expr) and isinstance(small.value, cst.SimpleString)


def _anchor(script: Script, body: list[cst.CSTNode]) -> cst.CSTNode:
    """The first top-level statement that does GPU, model, data or output work."""
    for stmt in body:
        small = N.sole_statement(stmt)
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) or isinstance(small, (cst.Import, cst.ImportFrom)) or (
            isinstance(small, cst.Expr) and isinstance(small.value, cst.SimpleString)
        ):
            continue
        if isinstance(stmt, (cst.For, cst.While, cst.With)) or _does_work(script, stmt):
            return stmt
    return body[-1]


def _does_work(script: Script, stmt: cst.CSTNode, seen: frozenset = frozenset()) -> bool:
    if script.optimizer_stmt is stmt:
        return True
    small = N.sole_statement(stmt)
    if isinstance(small, cst.Expr) and N.is_method_call(small.value, "add_argument"):
        return False  # `parser.add_argument("--device", default="cuda" if torch.cuda.is_available() ...)`
    for call in script.calls_in(stmt):
        qualified = script.names(call.func)
        if (
            N.call_name(call) in {"cuda", "to"}
            or qualified & (N.DATALOADER | N.TORCH_DEVICE | N.PRINT | N.TORCH_SAVE)
            or any(q.startswith(N.CUDA_PREFIX) for q in qualified) and not qualified & N.CUDA_QUESTIONS
            or (fn := script.local_function(call)) is not None and not _parses_options(script, fn, seen)
            or N.keyword(call, "download") is not None
        ):
            return True
    assign = N.sole_assign(stmt)
    return assign is not None and N.is_name(assign.targets[0].target, script.model_name)


def _parses_options(script: Script, fn: cst.FunctionDef, seen: frozenset) -> bool:
    """`args = parse_args()`: a function of the script that parses the command line and does no
    other work, so the setup may follow it and read the options (a GPU flag)."""
    if fn in seen or not any(N.call_name(c) in ("parse_args", "parse_known_args") for c in script.calls_in(fn)):
        return False
    return not any(_does_work(script, stmt, seen | {fn}) for stmt in fn.body.body)


def _opening(code: str, first: bool) -> str:
    """No blank line above setup that opens a block."""
    return code.lstrip("\n") if first else code
