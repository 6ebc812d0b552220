"""State the conversion passes share: the script's analysis, the edit plan, chosen names."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ddpify.analysis.script import Script, ScopeNode
from ddpify.convert.edits import Edits

RANK0 = "dist.get_rank() == 0"
RANK0_BEFORE_INIT = 'int(os.environ.get("RANK", 0)) == 0'


@dataclass
class Context:
    """Analysis + edits + the names the setup pass chose for later passes."""

    script: Script
    edits: Edits
    setup_scope: ScopeNode | None = None
    init_index: int = 0  # index in the setup scope's body of the first statement after setup
    device_stmt: cst.CSTNode | None = None  # the script's own device line, if it has one
    wrap_after: cst.CSTNode | None = None  # the statement after which the model is DDP
    device: str = "device"
    device_type: str = "device.type"  # expression giving "cuda" or "cpu"
    local_rank: str = "local_rank"

    def device_visible(self, scope: ScopeNode) -> bool:
        """Can code in `scope` name this process's device?"""
        if scope is self.setup_scope or isinstance(self.setup_scope, cst.Module):
            return True
        return isinstance(scope, cst.FunctionDef) and any(
            p.name.value == self.device for p in scope.params.params
        )

    def rank0_condition(self, stmt: cst.CSTNode) -> str:
        """`dist.get_rank() == 0`, or the environment's RANK before the group exists."""
        script = self.script
        scope = script.scope_of(stmt)
        if scope is self.setup_scope:
            body = list(script.body_of(scope).body)
            if body.index(script.top_statement(stmt, scope)) < self.init_index:
                return RANK0_BEFORE_INIT
        return RANK0
