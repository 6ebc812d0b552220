"""Sibling trainers: several classes or functions that each build an optimizer and train their own
model (a pretraining trainer, then the main one), run one after the other by the entry.

The process group must exist before the first of them runs, and be made once: the place is the
function (or the `__main__` block) that every training path passes through, found by walking down
from the entry while a single statement leads to all the training, just above the first statement
that leads to any of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.schedule import reaches
from ddpify.analysis.script import ScopeNode, Script

DEPTH = 6  # calls followed down from the entry


@dataclass
class SharedCaller:
    """Where every trainer is reached from: the scope, its block of statements (the `__main__`
    block for the module), and the first statement of that block that leads to training."""

    scope: ScopeNode
    block: cst.Module | cst.IndentedBlock
    first: cst.BaseStatement


def shared_caller(script: Script) -> SharedCaller | None:
    """The nearest scope that runs every sibling trainer (None: one trainer, or no such scope)."""
    scopes = _training_scopes(script)
    owners = {script.class_of(fn) or fn for fn in scopes}
    if len(owners) < 2:
        return None
    scopes |= {m for o in owners if isinstance(o, cst.ClassDef) for m in script.methods(o).values()}
    scope: ScopeNode = script.module
    block = _main_block(script)
    found = None
    for _ in range(DEPTH):
        hits = [s for s in block.body if not isinstance(s, (cst.FunctionDef, cst.ClassDef)) and reaches(script, s, scopes)]
        if not hits:
            return found  # (a trainer that trains, then runs the others: set up at its top)
        found = SharedCaller(scope, block, hits[0])
        callee = _only_callee(script, hits[0], scopes) if len(hits) == 1 else None
        if callee is None:
            return found
        scope, block = callee, callee.body
    return found


def _training_scopes(script: Script) -> set[cst.FunctionDef]:
    """The functions where a trained model is bound: every model, a sibling trainer's of the same
    name, and a second trainer class's left unconverted."""
    scopes = [*script.models.values(), *(s for _, s in script.sibling_models)]
    scopes += [script.scope_of(call) for call, _, _ in script.unconverted_models]
    return {s for s in scopes if isinstance(s, cst.FunctionDef)}


def _main_block(script: Script) -> cst.Module | cst.IndentedBlock:
    """The module's `if __name__ == "__main__":` block, or the module itself."""
    for stmt in script.module.body:
        if isinstance(stmt, cst.If) and N.tests_module_name(stmt.test) and isinstance(stmt.body, cst.IndentedBlock):
            return stmt.body
    return script.module


def _only_callee(script: Script, stmt: cst.BaseStatement, scopes: set) -> cst.FunctionDef | None:
    """The function a simple statement calls that leads to all the training (`main()`,
    `runner.run(cfg)`), when it is the statement's one call that does."""
    if not isinstance(stmt, cst.SimpleStatementLine):
        return None
    leading = []
    for call in script.calls_in(stmt):
        callee = script.local_function(call) or script.method_of_object(call)
        if isinstance(callee, cst.FunctionDef) and (callee in scopes or reaches(script, callee, scopes)):
            leading.append(callee)
    return leading[0] if len(set(leading)) == 1 else None
