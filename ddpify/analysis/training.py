"""The step loop: the loop that runs a backward pass every iteration, directly or through helper
functions and methods (``self._run_batch(...)``)."""

from __future__ import annotations

from typing import Optional

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import CallInfo, FileIndex, Func, Loop



class StepAnalysis:
    """Step-loop reasoning over one file's index; answers are cached."""

    def __init__(self, index: FileIndex) -> None:
        self.index = index
        self._step_func: dict[Func, bool] = {}
        self._step_loops: Optional[set[Loop]] = None
        self._trains: dict[Func, bool] = {}

    @staticmethod
    def is_backward(ci: CallInfo) -> bool:
        return (ci.receiver is not None and ci.name == "backward") or bool(ci.qnames & N.AUTOGRAD_BACKWARD)

    def steps(self, ci: CallInfo) -> bool:
        """Does this call run one training step (a backward, or a local function that does)?"""
        return self.is_backward(ci) or any(self.step_function(f) for f in self.index.local_callees(ci))

    def step_function(self, func: Func) -> bool:
        """A function that runs one backward per call (outside its own loops)."""
        if func in self._step_func:
            return self._step_func[func]
        self._step_func[func] = False
        result = any(self.steps(c) for c in self.index.calls if c.func is func and not c.loops)
        self._step_func[func] = result
        return result

    def trains(self, func: Func) -> bool:
        """Does `func` run a backward pass anywhere in it (its loops and nested functions too),
        directly or through the file's functions it calls?"""
        found = self._trains.get(func)
        if found is None:
            self._trains[func] = False  # recursion: assume not, until a backward is found
            found = self._trains[func] = any(
                self.is_backward(c) or any(f is not func and self.trains(f) for f in self.index.local_callees(c))
                for c in self.index.calls_under(func)
            )
        return found

    def syncs(self, outer: cst.CSTNode) -> bool:
        """Does code under `outer` (a function or a loop) talk to the other ranks: a backward pass
        (DDP's gradient all-reduce) or a collective, directly or through the file's functions?"""
        return any(
            self.is_backward(c) or c.qnames & N.COLLECTIVES or any(self.trains(f) for f in self.index.local_callees(c))
            for c in self.index.calls_under(outer)
        )

    @property
    def step_loops(self) -> set[Loop]:
        """Loops whose every iteration runs a backward pass (the innermost such loops)."""
        if self._step_loops is None:
            self._step_loops = {c.loops[-1] for c in self.index.calls if c.loops and self.steps(c)}
        return self._step_loops

    def in_step(self, node: cst.CSTNode, _seen: Optional[set] = None) -> bool:
        """Does this code run once per training step?"""
        for p in self.index.ancestors(node):
            if isinstance(p, (cst.For, cst.While)) and p in self.step_loops:
                return True
            if isinstance(p, cst.FunctionDef):
                if not self.step_function(p):
                    return False
                seen = _seen or set()
                if p in seen:
                    return False
                seen.add(p)
                return any(self.in_step(s.node, seen) for s in self.index.call_sites(p))
        return False


def step_analysis(index: FileIndex) -> StepAnalysis:
    """The file's step-loop reasoning, made once per index."""
    return index.cached("steps", StepAnalysis)
