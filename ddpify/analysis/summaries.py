"""What the functions of a project do with their parameters, across modules, computed on demand.

A pass that meets a call (`generate(model, 3)` in the entry, `generate` in `sampling.py`) asks
what the callee does with the argument: does it read the model's own attributes (then it needs
the plain network, not the DDP wrapper), does it train (then it needs the wrapper)? The answer
follows the callee into the functions it hands the parameter on to, in any module of the project.

One `FunctionSummaries` answers for the functions of one index: a single file's, or the whole
project's when the modules are converted as one program. A module converted on its own asks its
project's summaries (`ProjectFacts.summaries`, built from the other modules) for a callee its own
index does not hold.
"""

from __future__ import annotations

from typing import Callable

import libcst as cst

from ddpify.analysis import names as N
from ddpify.analysis.index import FileIndex, Func, iter_nodes
from ddpify.analysis.training import step_analysis


class FunctionSummaries:
    """Per-function facts over one index; `outer`: the project's, for callees this index lacks."""

    def __init__(self, index: FileIndex | Callable[[], FileIndex], outer: FunctionSummaries | None = None) -> None:
        self._index = index  # or a function that builds it, called when first needed
        self.outer = outer
        self._own: dict[Func, frozenset[str]] = {}

    @classmethod
    def of_project(cls, modules: dict[str, cst.Module], packages: frozenset[str] = frozenset()) -> FunctionSummaries:
        """The summaries of a project's modules (dotted name -> module), indexed together when
        first asked (most conversions never ask)."""
        return cls(lambda: FileIndex(cst.Module(body=[]), others=modules, packages=packages))

    @property
    def index(self) -> FileIndex:
        if callable(self._index):
            self._index = self._index()
        return self._index

    def callee(self, call: cst.Call) -> tuple[FunctionSummaries, Func] | None:
        """The project function `call` invokes (one name, one function), and the summaries that
        hold it: this index's (`f(...)`, `self.f(...)`, `module.f(...)` in a project), else the
        project's, found by the qualified name this index gives the callee (`sampling.generate`)."""
        index = self.index
        if call in index.call_info:
            found = index.local_callees(index.call_info[call])
            if len(found) == 1:
                return self, found[0]
            if found:
                return None  # several functions of that name: not known which
        if self.outer is not None:
            definitions = self.outer.index.definitions()
            found = {definitions[q] for q in index.qnames(call.func) if isinstance(definitions.get(q), cst.FunctionDef)}
            if len(found) == 1:
                return self.outer, found.pop()
        return None

    def trains(self, fn: Func) -> bool:
        """Does `fn` run a backward pass, directly or through the functions it calls?"""
        return step_analysis(self.index).trains(fn)

    def own_member_params(self, fn: Func) -> frozenset[str]:
        """The parameters of `fn` through which it reads a module's own attributes, which a DDP
        wrapper does not answer for (`decoder.init_hidden(1)`, `model.config`), itself or in a
        function it hands the parameter to (`_warm_up(decoder)`)."""
        found = self._own.get(fn)
        if found is None:
            self._own[fn] = frozenset()  # recursion: nothing, until an attribute is found
            found = self._own[fn] = self._own_member_params(fn)
        return found

    def _own_member_params(self, fn: Func) -> frozenset[str]:
        params = self.index.param_names(fn) - {"self", "cls"}
        found = set()
        for node in iter_nodes(fn.body):
            if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value in params:
                if node.attr.value not in N.DDP_ATTRIBUTES:
                    found.add(node.value.value)
            elif isinstance(node, cst.Call):
                found |= self._handed_on(node, params)
        return frozenset(found)

    def _handed_on(self, call: cst.Call, params: set[str]) -> set[str]:
        """The parameters `call` hands to a function that reads their own attributes."""
        target = self.callee(call)
        if target is None:
            return set()
        summaries, callee = target
        wanted = summaries.own_member_params(callee)
        return {
            arg.value.value
            for i, arg in enumerate(call.args)
            if isinstance(arg.value, cst.Name) and arg.value.value in params and not arg.star
            and FileIndex.param_for(callee, i, arg) in wanted
        }

    def saves(self, call: cst.Call, arg: cst.Arg) -> Func | None:
        """The function `call` invokes when it hands what `arg` passes to `torch.save` as the
        object saved (`def save_checkpoint(state, path): torch.save(state, path)`) and does not
        train."""
        target = self.callee(call)
        if target is None or target[0].trains(target[1]):
            return None
        summaries, callee = target
        param = FileIndex.param_for(callee, call.args.index(arg), arg)
        for node in iter_nodes(callee.body):
            if isinstance(node, cst.Call) and node.args and node.args[0].keyword is None and param is not None:
                if N.is_name(node.args[0].value, param) and summaries.index.qnames(node.func) & N.TORCH_SAVE:
                    return callee
        return None

    def needs_plain(self, call: cst.Call, arg: cst.Arg) -> Func | None:
        """The function `call` invokes when it reads the own attributes of what `arg` passes and
        does not train it (a sampler, a summary printer): it wants the plain module."""
        target = self.callee(call)
        if target is None:
            return None
        summaries, callee = target
        if summaries.trains(callee):
            return None
        index = call.args.index(arg)
        return callee if FileIndex.param_for(callee, index, arg) in summaries.own_member_params(callee) else None
