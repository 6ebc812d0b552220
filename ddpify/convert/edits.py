"""Edits that passes request against the original tree, applied together in one traversal.

Passes never rebuild the tree themselves: they say "replace this node", "insert these
statements before/after that one", "guard this statement with that condition". The
applier composes nested edits bottom-up, so a `.cuda()` rewritten inside a print that
is also guarded keeps both changes. Untouched code stays byte-identical.
"""

from __future__ import annotations

import builtins
from collections import defaultdict
from collections.abc import Callable, Sequence

import libcst as cst

from ddpify.analysis.index import dotted_name, iter_nodes
from ddpify.results import Note

Rewrite = Callable[[cst.CSTNode], cst.CSTNode]
_STATEMENTS: dict[tuple[str, str, str], list[cst.BaseStatement]] = {}  # (code, indent, newline) -> parsed


class Edits:
    """The plan all passes add to, plus the summary notes they produce."""

    def __init__(self, config: cst.Module) -> None:
        self.config = config
        self.rewrites: dict[cst.CSTNode, list[Rewrite]] = defaultdict(list)
        self.before: dict[cst.CSTNode, list[cst.BaseStatement]] = defaultdict(list)
        self.after: dict[cst.CSTNode, list[cst.BaseStatement]] = defaultdict(list)
        self.guards: dict[cst.CSTNode, str] = {}
        self.removed: set[cst.CSTNode] = set()
        self.enclosures: dict[cst.CSTNode, tuple[cst.CSTNode, str]] = {}
        self.dissolved: set[cst.CSTNode] = set()
        # Notes keep the node they are about; its line is looked up once, when they are read
        # (a conversion that plans nothing, like the verification's, never computes positions).
        self._changes: list[tuple[cst.CSTNode | int, str]] = []
        self._todos: list[tuple[cst.CSTNode | int, str]] = []
        self._notes: list[tuple[cst.CSTNode | int, str]] = []  # advice: nothing changed there
        self.imports: list[tuple[str, str | None, str | None]] = []
        self.unused_imports: list[tuple[str, str | None, str | None]] = []
        # Every edit that changes the code, as (pass, line, what): converting a converted script
        # must plan none (engine._verify), and names the pass and line when one does.
        self.current_pass = ""
        self.changed_by: set[str] = set()  # the passes that said they changed something
        self.line_of: Callable[[cst.CSTNode], int] = lambda node: 0
        self.end_line_of: Callable[[cst.CSTNode], int] = lambda node: 0
        self._planned: list[tuple[str, cst.CSTNode, bool, str]] = []
        self._expressions: dict[str, cst.BaseExpression] = {}
        self._comments: set[str] | None = None  # the module's own TODO(ddpify) lines, once asked for

    def _log(self, node: cst.CSTNode, what: str, end: bool = False) -> None:
        self._planned.append((self.current_pass, node, end, what))

    def _line(self, where: cst.CSTNode | int) -> int:
        return where if isinstance(where, int) else self.line_of(where)

    @property
    def planned(self) -> list[tuple[str, int, str]]:
        """(pass, line, what) of every planned code change."""
        return [(name, self.end_line_of(node) if end else self.line_of(node), what) for name, node, end, what in self._planned]

    @property
    def changes(self) -> list[Note]:
        return self.changes_where(lambda where: True)

    @property
    def todos(self) -> list[Note]:
        return self.todos_where(lambda where: True)

    def changes_where(self, keep: Callable[[cst.CSTNode | int], bool]) -> list[Note]:
        """The notes about the code `keep` accepts (a project's module)."""
        return [Note(self._line(where), message) for where, message in self._changes if keep(where)]

    def todos_where(self, keep: Callable[[cst.CSTNode | int], bool]) -> list[Note]:
        return [Note(self._line(where), message) for where, message in self._todos if keep(where)]

    @property
    def notes(self) -> list[Note]:
        """Advice about code the passes left as it is (printed as `note:`)."""
        return self.notes_where(lambda where: True)

    def notes_where(self, keep: Callable[[cst.CSTNode | int], bool]) -> list[Note]:
        return [Note(self._line(where), message) for where, message in self._notes if keep(where)]


    # -- requests --------------------------------------------------------
    def rewrite(self, node: cst.CSTNode, fn: Rewrite) -> None:
        if _unchanged(node, fn):
            return  # already what the pass wants (e.g. a converted script converted again)
        self.rewrites[node].append(fn)
        self._log(node, f"rewrites `{_short(node)}`")

    def replace(self, node: cst.CSTNode, new: cst.CSTNode) -> None:
        self.rewrite(node, lambda _updated: new)

    def insert_before(self, stmt: cst.CSTNode, code: str | Sequence[cst.BaseStatement]) -> None:
        new = self.statements(code)
        self.before[stmt].extend(new)
        self._log(stmt, f"inserts `{_short(new[0])}` before")

    def insert_above(self, stmt: cst.CSTNode, code: str) -> None:
        """Insert before `stmt`, taking over the blank lines that separate it from what precedes."""
        new = self.statements(code)
        blank = []
        for line in stmt.leading_lines:
            if line.comment is not None:
                break
            blank.append(line)
        if blank:
            own = list(new[0].leading_lines)
            while own and own[0].comment is None:
                own.pop(0)
            new[0] = new[0].with_changes(leading_lines=[*blank, *own])
            keep = list(stmt.leading_lines[len(blank):])
            self.rewrite(stmt, lambda updated: updated.with_changes(leading_lines=keep + list(updated.leading_lines[len(blank) + len(keep):])))
        self.before[stmt].extend(new)
        self._log(stmt, f"inserts `{_short(new[0])}` above")

    def insert_after(self, stmt: cst.CSTNode, code: str | Sequence[cst.BaseStatement]) -> None:
        new = self.statements(code)
        self.after[stmt].extend(new)
        self._log(stmt, f"inserts `{_short(new[0])}` after", end=True)

    def guard(self, stmt: cst.CSTNode, condition: str) -> None:
        """Run `stmt` only when `condition` holds (adjacent guards share one `if`)."""
        self.guards.setdefault(stmt, condition)
        self._log(stmt, f"guards it with `if {condition}:`")

    def enclose(self, first: cst.CSTNode, last: cst.CSTNode, header: str) -> None:
        """Put the statements from `first` to `last` (one block) under `header` (e.g. a `with`)."""
        self.enclosures[first] = (last, header)
        self._log(first, f"encloses it in `{header}`")

    def dissolve(self, stmt: cst.With) -> None:
        """Put the body of a `with` (whose context is no longer needed) in its place."""
        self.dissolved.add(stmt)
        self._log(stmt, f"replaces `{_short(stmt)}` by its body")

    def remove(self, stmt: cst.CSTNode) -> None:
        self.removed.add(stmt)
        self._log(stmt, f"removes `{_short(stmt)}`")

    def need_import(self, module: str, obj: str | None = None, asname: str | None = None) -> None:
        if (module, obj, asname) not in self.imports:
            self.imports.append((module, obj, asname))

    def drop_import_if_unused(self, module: str, obj: str | None = None, asname: str | None = None) -> None:
        self.unused_imports.append((module, obj, asname))

    def change(self, where: cst.CSTNode | int, message: str) -> None:
        """A summary note about the code at `where` (a node of the script, or a line)."""
        self._changes.append((where, message))
        self.changed_by.add(self.current_pass)

    def note(self, where: cst.CSTNode | int, message: str) -> None:
        """A summary note of advice about the code at `where`, which no edit changes."""
        self._notes.append((where, message))

    def todo(self, stmt: cst.CSTNode, where: cst.CSTNode | int, message: str) -> None:
        """Leave `# TODO(ddpify): message` above `stmt` and list it in the summary at `where`'s
        line (a TODO already left there by an earlier conversion is listed, not written twice)."""
        self._todos.append((where, message))
        text = f"# TODO(ddpify): {message}"
        if any(getattr(lead.comment, "value", None) == text for lead in getattr(stmt, "leading_lines", ())):
            return
        if self._comments is None:  # (a guard an earlier conversion put around `stmt` holds its TODO)
            self._comments = {line.strip() for line in self.config.code.splitlines() if line.strip().startswith("# TODO(ddpify)")}
        if text in self._comments:
            return
        comment = cst.EmptyLine(comment=cst.Comment(text))
        self.rewrite(stmt, lambda updated: updated.with_changes(leading_lines=[*updated.leading_lines, comment]))

    def forget(self, unrun: Callable[[cst.CSTNode], bool]) -> None:
        """Drop every edit and note about code the program never runs (`unrun(node)`): a
        project's module imported for one function is not converted in the others."""
        for table in (self.rewrites, self.before, self.after, self.guards):
            for node in [n for n in table if unrun(n)]:
                del table[node]
        for first in [n for n in self.enclosures if unrun(n)]:
            del self.enclosures[first]
        self.removed = {n for n in self.removed if not unrun(n)}
        self.dissolved = {n for n in self.dissolved if not unrun(n)}
        for notes in (self._changes, self._todos, self._notes):
            notes[:] = [(where, message) for where, message in notes if isinstance(where, int) or not unrun(where)]
        self._planned = [entry for entry in self._planned if not unrun(entry[1])]

    # -- building blocks -------------------------------------------------
    def statements(self, code: str | Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
        """`code` parsed as statements in the script's indentation and newlines (the same
        setup code recurs from script to script: a copy of an earlier parse is reused)."""
        if not isinstance(code, str):
            return list(code)
        config = self.config.config_for_parsing
        key = (code, config.default_indent, config.default_newline)
        body = _STATEMENTS.get(key)
        if body is None:
            parsed = cst.parse_module(code, config=config)
            body = list(parsed.body)
            if parsed.header and body:  # a leading comment belongs to the first statement
                body[0] = body[0].with_changes(leading_lines=[*parsed.header, *body[0].leading_lines])
            body = [_without_blank_indent(stmt) for stmt in body]
            if len(_STATEMENTS) > 1024:
                _STATEMENTS.clear()
            _STATEMENTS[key] = body
        return list(body)  # immutable nodes: shared, as libcst's own transforms share them

    def expression(self, code: str) -> cst.BaseExpression:
        """`code` parsed (once per text: a copy of the first parse after that)."""
        parsed = self._expressions.get(code)
        if parsed is None:
            parsed = self._expressions[code] = cst.parse_expression(code, config=self.config.config_for_parsing)
        return parsed.deep_clone()


def _unchanged(node: cst.CSTNode, fn: Rewrite) -> bool:
    """Would the rewrite leave `node` as it is?"""
    try:
        return fn(node).deep_equals(node)
    except Exception:  # a rewrite made for the updated node: assume it changes something
        return False


def _short(node: cst.CSTNode) -> str:
    try:
        code = cst.Module([]).code_for_node(node).strip()
    except Exception:
        return type(node).__name__
    first = next((line for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")), code)
    return first if len(first) <= 70 else first[:67] + "..."


def keyword_arg(name: str, value: cst.BaseExpression) -> cst.Arg:
    """`name=value`, spaced as PEP 8 wants."""
    no_space = cst.SimpleWhitespace("")
    return cst.Arg(keyword=cst.Name(name), value=value, equal=cst.AssignEqual(whitespace_before=no_space, whitespace_after=no_space))


def append_arg(call: cst.Call, arg: cst.Arg) -> cst.Call:
    """Add a keyword argument after the last plain argument, keeping the call's layout."""
    args = list(call.args)
    if not args:
        return call.with_changes(args=[arg])
    index = next((i for i, a in enumerate(args) if a.star == "**"), len(args))
    if index == 0:
        return call.with_changes(args=[arg.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), *args])
    previous = args[index - 1]
    if index == len(args):
        # Append: the old last argument takes its neighbour's separator, the new one its ending.
        before = args[index - 2].comma if index > 1 else None
        sep = before if isinstance(before, cst.Comma) else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        # the space before `)` (a newline in a call laid out over lines) moves to the new last one
        args[index - 1] = previous.with_changes(comma=sep, whitespace_after_arg=cst.SimpleWhitespace(""))
        arg = arg.with_changes(whitespace_after_arg=previous.whitespace_after_arg)
    args.insert(index, arg.with_changes(comma=previous.comma))
    return call.with_changes(args=args)


def _without_blank_indent(stmt: cst.BaseStatement) -> cst.BaseStatement:
    """Blank lines of inserted code carry no indentation (no trailing whitespace)."""
    lines = [line.with_changes(indent=False) if line.comment is None else line for line in stmt.leading_lines]
    return stmt.with_changes(leading_lines=lines)


class _Applier(cst.CSTTransformer):
    def __init__(self, edits: Edits, touched: set[cst.CSTNode]) -> None:
        self.edits = edits
        self.touched = touched  # the edited nodes and their ancestors: nothing else is rebuilt

    def on_visit(self, node: cst.CSTNode) -> bool:
        return node in self.touched

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode):
        if original not in self.touched:
            return updated
        for fn in self.edits.rewrites.get(original, ()):
            updated = fn(updated)
        if isinstance(original, (cst.Module, cst.IndentedBlock)):
            updated = updated.with_changes(body=self._body(original.body, updated.body))
        return updated

    def _body(
        self, originals: Sequence[cst.CSTNode], updated: Sequence[cst.CSTNode], enclosing: bool = True
    ) -> list[cst.CSTNode]:
        """A block's new statements: insertions, removals, guards and enclosures applied."""
        edits = self.edits
        out: list[cst.CSTNode] = []
        run: list[cst.CSTNode] = []
        run_condition: str | None = None

        def flush() -> None:
            nonlocal run, run_condition
            if run:
                out.append(self._guarded(run, run_condition))
            run, run_condition = [], None

        pairs = list(zip(originals, updated))
        index = 0
        spacing: list[cst.EmptyLine] = []  # the blank lines above a removed statement, for the next one
        while index < len(pairs):
            orig, upd = pairs[index]
            index += 1
            if enclosing and orig in edits.enclosures:
                last, header = edits.enclosures[orig]
                end = next(i for i, (o, _) in enumerate(pairs) if o is last)
                chunk = pairs[index - 1 : end + 1]
                index = end + 1
                inner = self._body([o for o, _ in chunk], [u for _, u in chunk], enclosing=False)
                out.append(self._enclosed(header, inner))
                continue
            condition = edits.guards.get(orig)
            if edits.before.get(orig) or condition != run_condition:
                flush()
            inserted = list(edits.before.get(orig, ()))
            if inserted:
                spacing = []
                upd, inserted[0] = _blank_lines_move_up(upd, inserted[0])
            out.extend(inserted)
            if orig in edits.removed:
                spacing = spacing or _leading_blank_lines(orig)  # the blank lines above it stay
            else:
                news = _dissolved(upd) if orig in edits.dissolved else [upd]
                if spacing and not inserted:
                    news[0], spacing = _with_blank_lines(news[0], spacing), []
                if condition is None:
                    out.extend(news)
                else:
                    run.extend(news)
                    run_condition = condition
            if edits.after.get(orig):
                flush()
                out.extend(edits.after[orig])
        flush()
        return out

    def _enclosed(self, header: str, stmts: list[cst.CSTNode]) -> cst.CSTNode:
        compound = self.edits.statements(f"{header}\n    pass\n")[0]
        first = stmts[0]
        body = [first.with_changes(leading_lines=()), *stmts[1:]]
        return compound.with_changes(body=compound.body.with_changes(body=body), leading_lines=first.leading_lines)

    def _guarded(self, stmts: list[cst.CSTNode], condition: str) -> cst.If:
        first = stmts[0]
        leading = getattr(first, "leading_lines", ())
        body = [first.with_changes(leading_lines=()), *(_without_blank_indent(s) for s in stmts[1:])]
        return cst.If(
            test=self.edits.expression(condition),
            body=cst.IndentedBlock(body=body),
            leading_lines=leading,
        )


def _dissolved(stmt: cst.With) -> list[cst.BaseStatement]:
    """A `with`'s body statements, the first with the `with`'s own leading lines."""
    body = list(stmt.body.body)
    return [body[0].with_changes(leading_lines=[*stmt.leading_lines, *body[0].leading_lines]), *body[1:]]


def _blank_lines_move_up(stmt: cst.CSTNode, inserted: cst.CSTNode) -> tuple[cst.CSTNode, cst.CSTNode]:
    """Code inserted before `stmt` goes below the blank lines that separate it from what precedes
    (unless it brings blank lines of its own, like a helper function)."""
    lines = list(getattr(stmt, "leading_lines", ()))
    blank = 0
    while blank < len(lines) and lines[blank].comment is None:
        blank += 1
    if not blank or getattr(inserted, "leading_lines", True):  # it brings its own spacing
        return stmt, inserted
    return stmt.with_changes(leading_lines=lines[blank:]), inserted.with_changes(
        leading_lines=[*lines[:blank], *inserted.leading_lines]
    )


def edited_nodes(edits: Edits) -> list[cst.CSTNode]:
    """Every node an edit is attached to."""
    edited = [*edits.rewrites, *edits.before, *edits.after, *edits.guards, *edits.removed, *edits.enclosures, *edits.dissolved]
    return edited + [last for last, _ in edits.enclosures.values()]


def apply(module: cst.Module, edits: Edits, parent: Callable[[cst.CSTNode], cst.CSTNode | None]) -> cst.Module:
    """Apply every requested edit to the original module in one traversal that enters only the
    subtrees holding an edit (`parent` walks up the original tree)."""
    edited = edited_nodes(edits)
    touched: set[cst.CSTNode] = {module}
    for node in edited:
        while node is not None and node not in touched:
            touched.add(node)
            node = parent(node)
    return module.visit(_Applier(edits, touched))


def missing_imports(module: cst.Module, needed) -> list[tuple[str, str | None, str | None]]:
    """The imports of `needed` that the module does not have at its top level."""
    return list(dict.fromkeys(item for item in needed if not _imported(module, *item)))


def add_imports(module: cst.Module, needed) -> cst.Module:
    """The module with the imports the passes asked for, after its leading block of imports
    (`import x` lines first, then `from x import y`, as libcst's AddImportsVisitor orders them).
    Imports the module already has at its top level are not added again; a `from` import of a
    module the script already imports from goes through AddImportsVisitor, which merges it
    (over the import block only: over the whole module it rebuilds the tree)."""
    needed = missing_imports(module, needed)
    if not needed:
        return module
    body = list(module.body)
    count = 0
    while count < len(body) and _is_header(body[count]):
        count += 1
    if any(obj is not None and _imports_from(module, name) for name, obj, _ in needed):
        from libcst.codemod import CodemodContext  # libcst.codemod costs as much to import as libcst
        from libcst.codemod.visitors import AddImportsVisitor

        context = CodemodContext()
        for module_name, obj, asname in needed:
            AddImportsVisitor.add_needed_import(context, module_name, obj, asname)
        head = AddImportsVisitor(context).transform_module(module.with_changes(body=body[:count], footer=()))
        return module.with_changes(header=head.header, body=[*head.body, *body[count:]])
    plain = sorted((name, asname) for name, obj, asname in needed if obj is None)
    froms = sorted((name, obj, asname) for name, obj, asname in needed if obj is not None)
    lines = [f"import {name}" + (f" as {asname}" if asname else "") for name, asname in plain]
    grouped: dict[str, list[str]] = {}
    for name, obj, asname in froms:  # `from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard`
        grouped.setdefault(name, []).append(obj + (f" as {asname}" if asname else ""))
    for name, objs in grouped.items():
        line = f"from {name} import {', '.join(objs)}"
        lines.append(line if len(line) <= 99 else f"from {name} import (\n" + "".join(f"    {o},\n" for o in objs) + ")")
    at = count
    while at > 0 and not _has_import(body[at - 1]):
        at -= 1  # after the last import (a docstring alone: after it)
    if at == 0 and count and not _has_import(body[0]):
        at = count
    added = list(cst.parse_module("\n".join(lines) + "\n").body)
    return module.with_changes(body=[*body[:at], *added, *body[at:]])


def _has_import(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and any(isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body)


def _imports_from(module: cst.Module, name: str) -> bool:
    """Does a top-level `from name import ...` exist?"""
    return any(
        isinstance(small, cst.ImportFrom) and small.module is not None and not small.relative and dotted_name(small.module) == name
        for stmt in module.body if isinstance(stmt, cst.SimpleStatementLine) for small in stmt.body
    )


def _is_header(stmt: cst.CSTNode) -> bool:
    """An import line, or the docstring."""
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(small, (cst.Import, cst.ImportFrom)) or (isinstance(small, cst.Expr) and isinstance(small.value, cst.SimpleString))
        for small in stmt.body
    )


def _imported(module: cst.Module, module_name: str, obj: str | None, asname: str | None) -> bool:
    """Does a top-level statement import exactly this already, before any top-level code reads
    the name it binds? (`import os` below a rank check inserted above it binds it too late.)"""
    name = bound_name((module_name, obj, asname))
    for at, stmt in enumerate(module.body):
        for small in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
            if obj is None and isinstance(small, cst.Import):
                if any(dotted_name(a.name) == module_name and _alias(a) == asname for a in small.names):
                    return not _read_before(module, at, name)
            elif obj is not None and isinstance(small, cst.ImportFrom) and small.module is not None and not small.relative:
                if dotted_name(small.module) == module_name and not isinstance(small.names, cst.ImportStar) and any(
                    dotted_name(a.name) == obj and _alias(a) == asname for a in small.names
                ):
                    return not _read_before(module, at, name)
    return False


def _read_before(module: cst.Module, at: int, name: str) -> bool:
    """Does the code the module runs before its statement `at` read `name`: its top-level
    statements (a function's decorators and defaults, not its body), and the bodies of its
    functions they call?"""
    functions = {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef)}
    todo: list[cst.CSTNode] = list(module.body[:at])
    seen: set[str] = set()
    while todo:
        node = todo.pop()
        if isinstance(node, cst.FunctionDef):
            todo += [*node.decorators, node.params]  # what runs when the def runs
            continue
        if isinstance(node, cst.ClassDef):
            todo += [*node.decorators, *node.bases, *node.keywords, *node.body.body]
            continue
        for found in iter_nodes(node):
            if isinstance(found, cst.Name) and found.value == name:
                return True
            if isinstance(found, cst.Call) and isinstance(found.func, cst.Name) and found.func.value in functions:
                if found.func.value not in seen:
                    seen.add(found.func.value)
                    todo.append(functions[found.func.value].body)
    return False


def _alias(alias: cst.ImportAlias) -> str | None:
    return alias.asname.name.value if alias.asname is not None and isinstance(alias.asname.name, cst.Name) else None


def imports_module(module: cst.Module, name: str) -> bool:
    """Does any import statement, at any depth, import `name` or import from it?"""
    for node in iter_nodes(module):
        if isinstance(node, cst.ImportFrom) and node.module is not None and not node.relative:
            if dotted_name(node.module) == name:
                return True
        elif isinstance(node, cst.Import) and any(dotted_name(a.name) == name for a in node.names):
            return True
    return False


def bound_name(item: tuple[str, str | None, str | None]) -> str:
    """The name an import of `edits.imports` binds: `dist` for `import torch.distributed as dist`."""
    module_name, obj, asname = item
    return asname or obj or module_name.partition(".")[0]


def names_read(module: cst.Module) -> set[str]:
    """Every plain name in the module, but attribute names (`x.dist`) and keywords (`f(dist=1)`)."""
    skip = set()
    for node in iter_nodes(module):
        if isinstance(node, cst.Attribute):
            skip.add(id(node.attr))
        elif isinstance(node, cst.Arg) and node.keyword is not None:
            skip.add(id(node.keyword))
    return {node.value for node in iter_nodes(module) if isinstance(node, cst.Name) and id(node) not in skip}


class NameUse:
    """The plain names a module's code reads and the names it binds, from one walk: reads skip
    attribute names (`x.dist`), keywords (`f(dist=1)`) and what import statements spell;
    bindings are imports, assignments, definitions, parameters, loop, `with`, `except` and
    comprehension targets, `global`. `star`: a `from m import *` may bind anything."""

    def __init__(self, module: cst.Module) -> None:
        self.read: set[str] = set()
        self.bound: set[str] = set()
        self.star = False
        skip: set[int] = set()
        for node in iter_nodes(module):  # node classes compared by identity: this walk is hot
            cls = node.__class__
            if cls is cst.Name:
                if id(node) not in skip:
                    self.read.add(node.value)
            elif cls is cst.Attribute:
                skip.add(id(node.attr))
            elif cls is cst.Arg:
                if node.keyword is not None:
                    skip.add(id(node.keyword))
            elif cls in _BINDS_TARGET:
                self.bound.update(n.value for n in iter_nodes(getattr(node, _BINDS_TARGET[cls])) if n.__class__ is cst.Name)
            elif cls in _DEFINES:
                self.bound.add(node.name.value)
            elif cls is cst.Import or cls is cst.ImportFrom:
                skip.update(id(n) for n in iter_nodes(node))
                self._imports(node)
            elif cls is cst.Global or cls is cst.Nonlocal:
                self.bound.update(n.name.value for n in node.names)

    def _imports(self, node: cst.Import | cst.ImportFrom) -> None:
        if isinstance(node.names, cst.ImportStar):
            self.star = True
            return
        for alias in node.names:
            full = dotted_name(alias.name) or ""
            self.bound.add(_alias(alias) or (full.partition(".")[0] if isinstance(node, cst.Import) else full))

    def unbound(self, original: NameUse, added: set[str] = frozenset()) -> list[str]:
        """Names this module reads anew (not read in `original`) that nothing binds, the
        imports `added` aside: a NameError when the code runs."""
        if self.star:
            return []
        new = self.read - original.read - self.bound - added
        return sorted(new - set(dir(builtins)) - {"__name__", "__file__"})


# Nodes that bind the names in one of their fields (`x` of `x = ...`, `for x in`, `as x`), and
# the nodes that bind their `name`.
_BINDS_TARGET = {
    cst.AssignTarget: "target", cst.AnnAssign: "target", cst.AugAssign: "target", cst.NamedExpr: "target",
    cst.For: "target", cst.CompFor: "target", cst.AsName: "name",
}  # fmt: skip
_DEFINES = frozenset({cst.FunctionDef, cst.ClassDef, cst.Param})


def _leading_blank_lines(stmt: cst.CSTNode) -> list[cst.EmptyLine]:
    """The blank lines (no comment) that open `stmt`'s leading lines."""
    lines = list(getattr(stmt, "leading_lines", ()))
    return lines[: next((i for i, line in enumerate(lines) if line.comment is not None), len(lines))]


def _with_blank_lines(stmt: cst.CSTNode, blank: list[cst.EmptyLine]) -> cst.CSTNode:
    """`stmt` opened by `blank` unless it already opens with a blank line of its own."""
    lines = list(getattr(stmt, "leading_lines", ()))
    if not hasattr(stmt, "leading_lines") or (lines and lines[0].comment is None):
        return stmt
    return stmt.with_changes(leading_lines=[*blank, *lines])
