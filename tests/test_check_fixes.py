"""Every fix, safe and unsafe, applied to every check fixture and every converted golden: the
result compiles, a second round changes nothing, and no fix reads `.module` from something
that is not the DDP model (the shape of an AttributeError an unsafe fix once wrote)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ddpify.check.rule import select_rules
from ddpify.check.runner import check_source

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted(p for p in (ROOT / "fixtures" / "check").rglob("*.py") if p.parent.name != "parse")
FILES += sorted((ROOT / "fixtures" / "convert").glob("*.out.py")) + sorted((ROOT / "fixtures" / "patterns").glob("*.out.py"))


WRAP = re.compile(r"\b(DDP|DistributedDataParallel)\(")


def _module_reads_off_ddp(source: str) -> int:
    """How many `X.module` reads there are whose `X` does not hold the DDP model, by an oracle
    of its own (Python's `ast`, not ddpify's analysis, so an error of the analysis shows): `X`
    is assigned `DDP(...)` in the same function, or at module level and not rebound in the
    function, or is `self.x` assigned `DDP(...)` in a method of the class, or is a parameter that
    a call in the file passes such a name."""
    tree = ast.parse(source)
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]
    wrapped: dict[ast.AST, set[str]] = {scope: set() for scope in scopes}
    bound: dict[ast.AST, set[str]] = {scope: set() for scope in scopes}
    owner = {child: scope for scope in scopes for child in _own_nodes(scope)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                bound[owner[node]].add(ast.unparse(target))
                if WRAP.search(ast.unparse(node.value)):
                    wrapped[owner[node]].add(ast.unparse(target))
    attrs = {name for names in wrapped.values() for name in names if name.startswith("self.")}

    def holds(text: str, scope: ast.AST) -> bool:
        return text in wrapped[scope] or text in attrs or (text not in bound[scope] and text in wrapped[tree])

    passed: set[tuple[str, int]] = set()  # (function, position) that receive the model
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        name = ast.unparse(call.func).rpartition(".")[2]
        for i, arg in enumerate(call.args):
            if holds(ast.unparse(arg), owner[call]):
                passed.add((name, i))
        for kw in call.keywords:
            if kw.arg and holds(ast.unparse(kw.value), owner[call]):
                passed.add((name, kw.arg))
    off = 0
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr == "module" and isinstance(node.value, (ast.Name, ast.Attribute))):
            continue
        scope, text = owner[node], ast.unparse(node.value)
        params = [a.arg for a in scope.args.args] if scope is not tree else []
        if text in params:
            i = params.index(text)
            if (scope.name, i) in passed or (scope.name, i - 1) in passed or (scope.name, text) in passed:
                continue  # a method's `self` shifts the position by one
        if not holds(text, scope):
            off += 1
    return off


def _own_nodes(scope: ast.AST):
    """The nodes of `scope` that are not inside a nested function."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo.extend(ast.iter_child_nodes(node))


@pytest.fixture(scope="module")
def fixed_by_all():
    """path -> the file with every fix applied (`check --fix --unsafe-fixes`, all rules), or None
    when nothing is to fix: computed once per file for the two tests below that read it."""
    done = {}

    def fixed(path: Path) -> str | None:
        if path not in done:
            done[path] = check_source(path.read_text(encoding="utf-8"), str(path), select_rules(["ALL"]), fix=True, unsafe_fixes=True).fixed_source
        return done[path]

    return fixed


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_every_fix_keeps_the_code_correct(path, fixed_by_all):
    source = path.read_text(encoding="utf-8")
    codes = select_rules(["ALL"])
    fixed = fixed_by_all(path)
    if fixed is None:
        return  # nothing to fix here
    compile(fixed, str(path), "exec")
    again = check_source(fixed, str(path), codes, fix=True, unsafe_fixes=True)
    assert again.fixed_source is None, "a second round of fixes changed the file again"
    assert _module_reads_off_ddp(fixed) <= _module_reads_off_ddp(source), (
        "a fix reads `.module` from something that is not the DDP model"
    )


def test_the_files_include_fixes_to_apply(fixed_by_all):
    """The test above must exercise fixes: some files change under --fix --unsafe-fixes."""
    changed = [p for p in FILES if fixed_by_all(p)]
    assert len(changed) >= 4, changed


def test_the_oracle_sees_module_read_off_the_ddp_model():
    """The oracle itself: `.module` on the global DDP model is right; on a function's own local
    model that shares the name (the unsafe rewrite the issue reports) it is counted."""
    source = (
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "model = DDP(net)\n"
        "def save():\n    return model.{ok}state_dict()\n"
        "class GPT:\n    @classmethod\n    def load(cls, config):\n        model = GPT(config)\n        return model.{bad}state_dict()\n"
        "def export(m):\n    return m.{param}state_dict()\n"
        "export(model)\n"
    )
    assert _module_reads_off_ddp(source.format(ok="module.", bad="", param="module.")) == 0
    assert _module_reads_off_ddp(source.format(ok="module.", bad="module.", param="module.")) == 1
