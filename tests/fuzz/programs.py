"""Inputs of the fuzz test (tests/test_fuzz.py) built from real single-GPU training scripts:

- `splice`: a generated program's statements inserted at a statement boundary of a host script
  (module level, a function's body, a loop's body), with libcst so indentation is right;
- `mutant`: a host after 1-3 deterministic edits (seeded random.Random) that CPython still compiles:
  delete / duplicate / swap statements, wrap the training loop in a function or a class method,
  add a decorator, turn an assignment into a walrus, wrap statements in `match 0: case _:` (or
  `if`, `try`, `with`), make a function `async def`, add `*args, **kwargs`, nest a loop, give a
  loop an `else`, hide an assigned value in `(v if True else None)` / `(lambda: v)()`, declare a
  function's name `global`, delete or duplicate a line;
- `invalid_mutant`: a host after line edits that CPython cannot compile (a dropped block
  header, a truncated file, a missing bracket or colon, a bad dedent).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import libcst as cst

from ddpify.results import ConvertOptions

ROOT = Path(__file__).resolve().parents[2]

# Single-GPU training scripts (inputs, never expected outputs): ours, the examples, and a few of
# the golden inputs of different shapes (flat script, argparse main, trainer class, AMP with
# accumulation, step-based loop, hand-made batches, two models, split loaders).
HOSTS = [
    "tests/data/verify/train.py",
    "examples/mnist.py",
    "examples/mnist_convnet.py",
    "fixtures/convert/flat_script.in.py",
    "fixtures/convert/main_argparse.in.py",
    "fixtures/corpus/trainer_class.py",
    "fixtures/corpus/amp_accumulation.py",
    "fixtures/corpus/nanogpt_style.py",
    "fixtures/patterns/step_based.in.py",
    "fixtures/patterns/hand_batches.in.py",
    "fixtures/patterns/gan_two_models.in.py",
    "fixtures/patterns/split_loaders.in.py",
]

# Converted scripts (goldens): statements spliced into them exercise the already-distributed
# path of convert and the rules (and fixes) of check that only run on distributed code.
DDP_HOSTS = [
    "examples/mnist_ddp.py",
    "examples/mnist_convnet_ddp.py",
    "fixtures/convert/flat_script.out.py",
    "fixtures/convert/main_argparse.out.py",
    "tests/data/verify/ddp_train.py",
]

# The conversions a mutant may ask for besides the default one.
OPTIONS = [
    ConvertOptions(),
    ConvertOptions(sync_batchnorm=True),
    ConvertOptions(global_batch=True),
    ConvertOptions(launcher="spawn"),
    ConvertOptions(eval_on_rank0=True),
]


def host_source(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def compiles(source: str) -> bool:
    try:
        compile(source, "<fuzz>", "exec", dont_inherit=True)
        return True
    except (SyntaxError, ValueError):  # ValueError: null bytes
        return False


# --- where statements are -------------------------------------------------------------------

class _Bodies(cst.CSTVisitor):
    """Every statement list of a module: (kind, owner, body node), kind one of module / function /
    loop / block (if, with, try, class, ...). Only indented blocks: `if x: pass` on one line is
    left alone."""

    def __init__(self, module: cst.Module) -> None:
        self.found: list[tuple[str, cst.CSTNode, cst.CSTNode]] = [("module", module, module)]

    def on_visit(self, node: cst.CSTNode) -> bool:
        body = getattr(node, "body", None)
        if isinstance(body, cst.IndentedBlock):
            if isinstance(node, cst.FunctionDef):
                kind = "function"
            elif isinstance(node, (cst.For, cst.While)):
                kind = "loop"
            else:
                kind = "block"
            self.found.append((kind, node, body))
        return True


def bodies(module: cst.Module) -> list[tuple[str, cst.CSTNode, cst.CSTNode]]:
    visitor = _Bodies(module)
    module.visit(visitor)
    return visitor.found


def statements(module: cst.Module) -> list[tuple[cst.CSTNode, int, cst.CSTNode]]:
    """(body node, index, statement) of every statement in an indented block or the module."""
    return [(body, i, stmt) for _, _, body in bodies(module) for i, stmt in enumerate(body.body)]


def with_body(module: cst.Module, body: cst.CSTNode, new: list) -> cst.Module:
    """The module with `body`'s statements replaced (an empty list becomes `pass`)."""
    new = list(new) or [cst.SimpleStatementLine([cst.Pass()])]
    if body is module:
        return module.with_changes(body=new)
    return module.deep_replace(body, body.with_changes(body=new))


# --- splicing -------------------------------------------------------------------------------


def splice(host: str, snippet: str, seed: int) -> str:
    """`snippet`'s statements inserted into `host` at one statement boundary chosen by `seed`:
    at module level, in a function's body or in a loop's body (a third of the time each, when
    the host has one), at any position in that body."""
    module = cst.parse_module(host)
    new = cst.parse_module(snippet).body
    rng = random.Random(seed)
    found = bodies(module)
    kind = rng.choice(["module", "function", "loop"])
    _, _, body = rng.choice([b for b in found if b[0] == kind] or found)
    i = rng.randint(0, len(body.body))
    return with_body(module, body, [*body.body[:i], *new, *body.body[i:]]).code


# --- valid mutants --------------------------------------------------------------------------

Mutation = Callable[[cst.Module, random.Random], cst.Module | None]


def _pick(rng: random.Random, items: list, prefer: Callable | None = None):
    """A random item, from those `prefer` likes two times in three when there are any."""
    if not items:
        return None
    liked = [x for x in items if prefer(x)] if prefer else []
    return rng.choice(liked if liked and rng.random() < 0.67 else items)


def _trains(module: cst.Module) -> Callable:
    """Does a statement hold a training step (`.backward(`)?"""
    return lambda site: "backward(" in module.code_for_node(site[2])


def _template(code: str) -> cst.BaseCompoundStatement:
    return cst.parse_statement(code)


def _set_inner(stmt: cst.CSTNode, inner: list) -> cst.CSTNode:
    """A template statement with its innermost `pass` body replaced by `inner`."""
    if isinstance(stmt, cst.Match):
        case = stmt.cases[0]
        return stmt.with_changes(cases=[case.with_changes(body=case.body.with_changes(body=inner))])
    body = stmt.body
    if isinstance(body, cst.IndentedBlock) and len(body.body) == 1 and isinstance(body.body[0], cst.SimpleStatementLine):
        return stmt.with_changes(body=body.with_changes(body=inner))
    return stmt.with_changes(body=body.with_changes(body=[_set_inner(body.body[0], inner)]))


def delete_statement(module, rng):
    site = _pick(rng, statements(module))
    body, i, _ = site
    return with_body(module, body, [*body.body[:i], *body.body[i + 1 :]])


def duplicate_statement(module, rng):
    body, i, stmt = _pick(rng, statements(module))
    return with_body(module, body, [*body.body[: i + 1], stmt, *body.body[i + 1 :]])


def swap_statements(module, rng):
    sites = [s for s in statements(module) if s[1] + 1 < len(s[0].body)]
    if not sites:
        return None
    body, i, _ = rng.choice(sites)
    b = list(body.body)
    b[i], b[i + 1] = b[i + 1], b[i]
    return with_body(module, body, b)


def _loops(module):
    return [s for s in statements(module) if isinstance(s[2], (cst.For, cst.While))]


def _wrap_loop(module, rng, template: str, call: str):
    """The training loop moved into `template`'s innermost body, and `call` in its place."""
    site = _pick(rng, _loops(module), _trains(module))
    if site is None:
        return None
    body, i, loop = site
    wrapper = _set_inner(_template(template), [loop])
    return with_body(module, body, [*body.body[:i], wrapper, cst.parse_statement(call), *body.body[i + 1 :]])


def wrap_loop_in_function(module, rng):
    return _wrap_loop(module, rng, "def _fuzz_loop():\n    pass\n", "_fuzz_loop()\n")


def wrap_loop_in_method(module, rng):
    return _wrap_loop(module, rng, "class _FuzzTrainer:\n    def run(self):\n        pass\n", "_FuzzTrainer().run()\n")


def _functions(module):
    return [s for s in statements(module) if isinstance(s[2], cst.FunctionDef)]


def add_decorator(module, rng):
    site = _pick(rng, _functions(module), _trains(module))
    if site is None:
        return None
    body, i, func = site
    text = rng.choice(["torch.no_grad()", "functools.lru_cache(maxsize=None)", "staticmethod", "_fuzz_decorator", "torch.compile"])
    func = func.with_changes(decorators=[cst.Decorator(cst.parse_expression(text)), *func.decorators])
    return with_body(module, body, [*body.body[:i], func, *body.body[i + 1 :]])


def make_async(module, rng):
    site = _pick(rng, _functions(module), _trains(module))
    if site is None:
        return None
    body, i, func = site
    return with_body(module, body, [*body.body[:i], func.with_changes(asynchronous=cst.Asynchronous()), *body.body[i + 1 :]])


def add_star_args(module, rng):
    sites = [s for s in _functions(module) if not isinstance(s[2].params.star_arg, cst.Param) or s[2].params.star_kwarg is None]
    site = _pick(rng, sites, _trains(module))
    if site is None:
        return None
    body, i, func = site
    params = func.params
    names = {p.name.value for p in [*params.posonly_params, *params.params, *params.kwonly_params]}
    changes = {}
    if not isinstance(params.star_arg, cst.Param):
        changes["star_arg"] = cst.Param(cst.Name("args" if "args" not in names else "_fuzz_args"))
    if params.star_kwarg is None:
        changes["star_kwarg"] = cst.Param(cst.Name("kwargs" if "kwargs" not in names else "_fuzz_kwargs"))
    func = func.with_changes(params=params.with_changes(**changes))
    return with_body(module, body, [*body.body[:i], func, *body.body[i + 1 :]])


def to_walrus(module, rng):
    def simple_assign(site):
        stmt = site[2]
        return (
            isinstance(stmt, cst.SimpleStatementLine)
            and len(stmt.body) == 1
            and isinstance(stmt.body[0], cst.Assign)
            and len(stmt.body[0].targets) == 1
            and isinstance(stmt.body[0].targets[0].target, cst.Name)
        )

    site = _pick(rng, [s for s in statements(module) if simple_assign(s)], _trains(module))
    if site is None:
        return None
    body, i, stmt = site
    assign = stmt.body[0]
    walrus = cst.NamedExpr(assign.targets[0].target, assign.value, lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return with_body(module, body, [*body.body[:i], stmt.with_changes(body=[cst.Expr(walrus)]), *body.body[i + 1 :]])


_WRAPPERS = [
    "match 0:\n    case _:\n        pass\n",
    "if True:\n    pass\n",
    'if __name__ == "__main__":\n    pass\n',
    "try:\n    pass\nfinally:\n    pass\n",
    "with torch.no_grad():\n    pass\n",
    "with open('log.txt', 'w') as _fuzz_log:\n    pass\n",
]


def wrap_statements(module, rng, template: str | None = None):
    """1-3 consecutive statements wrapped in `match 0: case _:`, `if`, `try`, `with`."""
    body, i, _ = _pick(rng, statements(module), _trains(module))
    j = min(len(body.body), i + rng.randint(1, 3))
    wrapper = _set_inner(_template(template or rng.choice(_WRAPPERS)), list(body.body[i:j]))
    return with_body(module, body, [*body.body[:i], wrapper, *body.body[j:]])


def wrap_in_match(module, rng):
    return wrap_statements(module, rng, _WRAPPERS[0])


def nest_loop(module, rng):
    """A loop inside `for _fuzz_round in range(1):`, or its body in an inner one."""
    site = _pick(rng, _loops(module), _trains(module))
    if site is None:
        return None
    body, i, loop = site
    if rng.random() < 0.5:
        new = _set_inner(_template("for _fuzz_round in range(1):\n    pass\n"), [loop])
    else:
        inner = _set_inner(_template("for _fuzz_inner in range(1):\n    pass\n"), list(loop.body.body))
        new = loop.with_changes(body=loop.body.with_changes(body=[inner]))
    return with_body(module, body, [*body.body[:i], new, *body.body[i + 1 :]])


def add_loop_else(module, rng):
    site = _pick(rng, [s for s in _loops(module) if s[2].orelse is None], _trains(module))
    if site is None:
        return None
    body, i, loop = site
    orelse = cst.Else(cst.IndentedBlock([cst.parse_statement(rng.choice(["pass\n", "print('no break')\n"]))]))
    return with_body(module, body, [*body.body[:i], loop.with_changes(orelse=orelse), *body.body[i + 1 :]])


def wrap_value(module, rng):
    """An assignment's value behind `(v if True else None)`, `(lambda: v)()` or `[v][0]`."""
    sites = [
        s for s in statements(module)
        if isinstance(s[2], cst.SimpleStatementLine) and len(s[2].body) == 1 and isinstance(s[2].body[0], cst.Assign)
    ]  # fmt: skip
    site = _pick(rng, sites, _trains(module))
    if site is None:
        return None
    body, i, stmt = site
    assign = stmt.body[0]
    value = module.code_for_node(assign.value)
    text = rng.choice(["(({}) if True else None)", "(lambda: ({}))()", "[({})][0]", "(({}))"]).format(value)
    stmt = stmt.with_changes(body=[assign.with_changes(value=cst.parse_expression(text))])
    return with_body(module, body, [*body.body[:i], stmt, *body.body[i + 1 :]])


def add_global(module, rng):
    """`global <name>` at the head of a function, for a name it assigns."""
    site = _pick(rng, _functions(module), _trains(module))
    if site is None:
        return None
    body, i, func = site
    if not isinstance(func.body, cst.IndentedBlock):
        return None
    params = {p.name.value for p in [*func.params.posonly_params, *func.params.params, *func.params.kwonly_params]}
    names = sorted(
        {
            t.target.value
            for stmt in func.body.body
            if isinstance(stmt, cst.SimpleStatementLine)
            for small in stmt.body
            if isinstance(small, cst.Assign)
            for t in small.targets
            if isinstance(t.target, cst.Name)
        }
        - params
    )
    if not names:
        return None
    decl = cst.parse_statement(f"global {rng.choice(names)}\n")
    func = func.with_changes(body=func.body.with_changes(body=[decl, *func.body.body]))
    return with_body(module, body, [*body.body[:i], func, *body.body[i + 1 :]])


def _line_op(module, rng, duplicate: bool):
    lines = module.code.splitlines(keepends=True)
    code = [n for n, line in enumerate(lines) if line.strip() and not line.strip().startswith("#")]
    n = rng.choice(code)
    lines[n : n + 1] = [lines[n]] * 2 if duplicate else []
    source = "".join(lines)
    return cst.parse_module(source) if compiles(source) else None


def delete_line(module, rng):
    return _line_op(module, rng, duplicate=False)


def duplicate_line(module, rng):
    return _line_op(module, rng, duplicate=True)


MUTATIONS: list[Mutation] = [
    delete_statement,
    duplicate_statement,
    swap_statements,
    wrap_loop_in_function,
    wrap_loop_in_method,
    add_decorator,
    make_async,
    add_star_args,
    to_walrus,
    wrap_in_match,
    wrap_statements,
    nest_loop,
    add_loop_else,
    wrap_value,
    add_global,
    delete_line,
    duplicate_line,
]


def mutant(k: int, tries: int = 50) -> tuple[str, str, list[str], ConvertOptions]:
    """Mutant number k: (host, source, the mutations applied, options), deterministic in k. A
    mutation that does not apply, or whose result CPython does not compile, is drawn again."""
    rng = random.Random(k)
    host = rng.choice(HOSTS)
    options = OPTIONS[0] if rng.random() < 0.6 else rng.choice(OPTIONS[1:])
    module = cst.parse_module(host_source(host))
    done: list[str] = []
    want = rng.randint(1, 3)
    for _ in range(tries):
        if len(done) == want:
            break
        mutation = rng.choice(MUTATIONS)
        new = mutation(module, rng)
        if new is None or not compiles(new.code):
            continue
        module = new
        done.append(mutation.__name__)
    assert done, f"mutant {k}: no mutation of {host} applied in {tries} tries"
    return host, module.code, done, options


# --- invalid mutants ------------------------------------------------------------------------


def _drop_header(lines, rng):
    headers = [n for n, line in enumerate(lines) if line.rstrip().endswith(":") and not line.lstrip().startswith("#")]
    del lines[rng.choice(headers)]


def _truncate(lines, rng):
    text = "".join(lines)
    lines[:] = [text[: rng.randint(1, len(text) - 1)]]


def _drop_closing_bracket(lines, rng):
    found = [(n, c) for n, line in enumerate(lines) for c, ch in enumerate(line) if ch in ")]}"]
    n, c = rng.choice(found)
    lines[n] = lines[n][:c] + lines[n][c + 1 :]


def _drop_colon(lines, rng):
    headers = [n for n, line in enumerate(lines) if line.rstrip().endswith(":") and not line.lstrip().startswith("#")]
    n = rng.choice(headers)
    lines[n] = lines[n].rstrip()[:-1] + "\n"


def _bad_dedent(lines, rng):
    indented = [n for n, line in enumerate(lines) if line.startswith("        ") and line.strip()]
    n = rng.choice(indented)
    lines[n] = lines[n][2:]


def _stray_text(lines, rng):
    n = rng.randrange(len(lines))
    lines.insert(n, rng.choice(["    )\n", "def (\n", "x = = 1\n", "else:\n", "return return\n", "\tpass\n"]))


INVALID_EDITS = [_drop_header, _truncate, _drop_closing_bracket, _drop_colon, _bad_dedent, _stray_text]


def invalid_mutant(k: int, tries: int = 50) -> tuple[str, str, str]:
    """Invalid mutant number k: (host, source CPython rejects, the edit), deterministic in k."""
    rng = random.Random(10_000 + k)
    host = rng.choice(HOSTS)
    edit = INVALID_EDITS[k % len(INVALID_EDITS)]
    for _ in range(tries):
        lines = host_source(host).splitlines(keepends=True)
        edit(lines, rng)
        source = "".join(lines)
        if not compiles(source):
            return host, source, edit.__name__.lstrip("_")
    raise AssertionError(f"invalid mutant {k}: {edit.__name__} of {host} kept compiling in {tries} tries")
