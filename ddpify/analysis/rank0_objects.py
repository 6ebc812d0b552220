"""Objects that exist on rank 0 only, and every statement that reads them.

A writer (`writer = SummaryWriter(...)`, `run = wandb.init(...)`) is made on rank 0 only in a
converted script (`... if <rank 0> else None`, or written so already): on the other ranks the name
holds None. So every statement that reads it must run on rank 0 only: a method call
(`writer.add_scalar(...)`, `run.config.update(...)`), an attribute read as a value
(`folder = os.path.join(writer.log_dir, "weights")`), and, in turn, every statement that reads a
value computed from it (`os.makedirs(folder)`). Handing the object to a function or class of the
project is not a use: its uses there are followed (`self.writer` in a trainer's methods, a
helper's parameter), and the other ranks hand on None.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.script import ScopeNode, Script, kept_by_objects, param_receiving, ref_of

# Made on rank 0 only by a conversion (their calls and values are output of one process).
RANK0_WRITERS = N.SUMMARY_WRITERS | N.TRACKER_CLIENTS | frozenset({"wandb.init"})


@dataclass(frozen=True)
class Rank0Use:
    """A statement that reads a rank-0-only object, or a value computed from one."""

    statement: cst.CSTNode  # a simple statement line, or a compound statement read in its header
    reads: str  # the name it reads (`writer`, `self.writer`, `folder`)
    source: str  # the object that value comes from (`writer`)
    every_rank: bool = False  # it also trains or communicates: it cannot run on rank 0 only


def rank0_objects(script: Script) -> list[tuple[str, ScopeNode, cst.Assign]]:
    """Names bound to a writer made on rank 0 only: `writer = SummaryWriter(...)` (a conversion
    guards it) or `writer = SummaryWriter(...) if <rank 0> else None`."""
    found = []
    for scope, assigns in script.assigns.items():
        for assign in assigns:
            value = assign.value
            if isinstance(value, cst.IfExp) and isinstance(value.orelse, cst.Name) and value.orelse.value == "None":
                value = value.body
            ref = ref_of(assign.targets[0].target)
            if ref and isinstance(value, cst.Call) and script.is_call_to(value, RANK0_WRITERS):
                found.append((ref, scope, assign))
    return found


def rank0_uses(script: Script, objects: list[tuple[str, ScopeNode, cst.Assign]]) -> list[Rank0Use]:
    """Every statement that reads one of `objects` or a value computed from one, following the
    object into the project's functions and classes it is handed to (in source order)."""
    bindings = {assign for _, _, assign in objects}
    todo = [(ref, scope, ref) for ref, scope, _ in objects]
    seen: set[tuple[str, ScopeNode]] = set()
    found: dict[cst.CSTNode, Rank0Use] = {}
    while todo:
        ref, scope, source = todo.pop()
        if (ref, scope) in seen or len(seen) > 200:
            continue
        seen.add((ref, scope))
        for where in script.scopes_for(ref, scope):
            todo += [(attr, init, source) for attr, init in kept_by_objects(script, ref, where)]
            todo += [(param, fn, source) for param, fn in _handed_to_functions(script, ref, where)]
            for node in _reads(script, ref, where):
                if _handed_on(script, node):
                    continue
                stmt = _statement(script, node)
                if stmt is None or stmt in found or any(script.inside(a, stmt) for a in bindings):
                    continue
                found[stmt] = use = Rank0Use(stmt, ref, source, _trains_or_communicates(script, stmt))
                if not use.every_rank:  # (what it binds is then every rank's, if wrong: a TODO says so)
                    todo += [(target, script.scope_of(stmt), source) for target in _targets(stmt)]
    return sorted(found.values(), key=lambda use: script.line(use.statement))


def _trains_or_communicates(script: Script, stmt: cst.CSTNode) -> bool:
    """Does `stmt` run a backward pass, a helper that trains, or a collective (which every rank
    must run)?"""
    return any(
        N.call_name(call) == "backward"
        or script.local_function(call) in script.training_functions
        or script.is_call_to(call, N.COLLECTIVES)
        for call in script.calls_in(stmt)
    )


def _reads(script: Script, ref: str, scope: ScopeNode) -> list[cst.CSTNode]:
    """The nodes in `scope` (not in a nested function) that read `ref`'s value."""
    kind = cst.Attribute if "." in ref else cst.Name
    found = []
    for node in script.nodes_of(kind):
        if ref_of(node) != ref or script.scope_of(node) is not scope:
            continue
        parent = script.parent(node)
        if isinstance(parent, cst.AssignTarget) and parent.target is node:
            continue  # (re)bound here, not read
        if isinstance(parent, cst.Attribute) and parent.attr is node:
            continue  # `x.writer`: another object's attribute
        if isinstance(parent, cst.Param) or (isinstance(parent, cst.Arg) and parent.keyword is node):
            continue  # a parameter's name, a keyword's name
        if isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.ImportAlias, cst.AsName)):
            continue
        found.append(node)
    return found


def _handed_on(script: Script, node: cst.CSTNode) -> bool:
    """`Trainer(model, writer)`, `log_epoch(writer, ...)`: the object is an argument of a
    function or class of the project, whose own uses are followed."""
    arg = script.parent(node)
    call = script.parent(arg) if isinstance(arg, cst.Arg) and arg.value is node else None
    return isinstance(call, cst.Call) and (script.local_function(call) is not None or script.class_called(call) is not None)


def _handed_to_functions(script: Script, ref: str, scope: ScopeNode) -> list[tuple[str, cst.FunctionDef]]:
    """The parameters of the project's functions that receive `ref` from calls in `scope`."""
    found = []
    for call in script.calls_in(scope):
        fn = script.local_function(call) if script.scope_of(call) is scope else None
        param = param_receiving(fn, call, ref) if fn is not None else None
        if param is not None:
            found.append((param, fn))
    return found


def _statement(script: Script, node: cst.CSTNode) -> cst.CSTNode | None:
    """The statement that reads `node`: its line, or the compound statement whose header does."""
    for ancestor in script.ancestors(node):
        if isinstance(ancestor, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            return ancestor
    return None


def _targets(stmt: cst.CSTNode) -> list[str]:
    """The names (or `self.x`) a statement binds: what then holds a value of rank 0's."""
    nodes: list[cst.CSTNode] = []
    if isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            if isinstance(small, cst.Assign):
                nodes += [t.target for t in small.targets]
            elif isinstance(small, (cst.AnnAssign, cst.AugAssign)):
                nodes.append(small.target)
    elif isinstance(stmt, cst.For):
        nodes.append(stmt.target)
    elif isinstance(stmt, cst.With):
        nodes += [item.asname.name for item in stmt.items if item.asname is not None]
    found = []
    for node in nodes:
        elements = [e.value for e in node.elements] if isinstance(node, (cst.Tuple, cst.List)) else [node]
        found += [ref for e in elements if (ref := ref_of(e))]
    return found
