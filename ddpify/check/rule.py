"""The rule base class, findings, and the registry (rules are found by package scan)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, ClassVar, Iterable, Iterator

import libcst as cst

if TYPE_CHECKING:
    from ddpify.check.context import FileContext

SEVERITY_ERROR = "error"
SEVERITY_WARNING = "warning"

# A rule's fix: "safe" keeps what the code means, `--fix` applies it; "unsafe" changes what it
# does (what old checkpoints load, say), only `--fix --unsafe-fixes` applies it.
FIX_SAFE = "safe"
FIX_UNSAFE = "unsafe"

CODE_RE = re.compile(r"^DDP\d{3}$")


@dataclass(frozen=True)
class Invalid:
    """An example a rule must flag; ``fixed`` is the expected source after ``--fix``."""

    code: str
    fixed: str | None = None


@dataclass
class Finding:
    """One problem in one file."""

    path: str
    line: int
    column: int  # 1-based, like ruff
    end_line: int
    end_column: int
    code: str
    message: str
    severity: str = SEVERITY_ERROR
    fixable: bool = False  # --fix (with --unsafe-fixes for an unsafe fix) would fix it
    fix: str | None = None  # the safety of the fix offered: FIX_SAFE, FIX_UNSAFE or None

    def as_dict(self) -> dict:
        return {
            "path": self.path,
            "line": self.line,
            "column": self.column,
            "end_line": self.end_line,
            "end_column": self.end_column,
            "code": self.code,
            "message": self.message,
            "severity": self.severity,
            "fixable": self.fixable,
            "fix": self.fix,
        }


@dataclass
class Report:
    """What a rule yields: the node to point at, and optionally a replacement for a node."""

    node: cst.CSTNode
    message: str | None = None
    # (original node, replacement) pairs applied by --fix
    fixes: list[tuple[cst.CSTNode, cst.CSTNode]] = field(default_factory=list)


class Rule:
    """Base class of every check.

    Subclasses set CODE, NAME, MESSAGE, a ruff-style docstring, VALID and INVALID
    examples, and implement ``check`` over the shared per-file analysis.
    """

    CODE: ClassVar[str] = ""
    NAME: ClassVar[str] = ""
    MESSAGE: ClassVar[str] = ""
    SEVERITY: ClassVar[str] = SEVERITY_ERROR
    # Only run on files that use torch.distributed / DDP.
    DISTRIBUTED_ONLY: ClassVar[bool] = True
    # A report in another module of the project is shown at the checked file's call that leads there.
    FOLLOWS_CALLS: ClassVar[bool] = False
    # Opinionated rules are off unless selected explicitly.
    DEFAULT: ClassVar[bool] = True
    # Its advice is DDP's own (`model.module`, DDP's arguments, "use DDP"): off under
    # `ddpify check --to fsdp2`, where it would mislead.
    DDP_ONLY: ClassVar[bool] = False
    FIX: ClassVar[str | None] = None  # FIX_SAFE or FIX_UNSAFE when it offers a fix
    VALID: ClassVar[list[str]] = []
    INVALID: ClassVar[list[Invalid]] = []

    def check(self, ctx: "FileContext") -> Iterable[Report]:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def doc(cls) -> str:
        return inspect.cleandoc(cls.__doc__ or "")

    @classmethod
    def summary(cls) -> str:
        return cls.doc().split("\n", 1)[0]


def _rule_classes_in(module) -> Iterator[type[Rule]]:
    for obj in vars(module).values():
        if (
            inspect.isclass(obj)
            and issubclass(obj, Rule)
            and obj is not Rule
            and obj.__module__ == module.__name__
        ):
            yield obj


@lru_cache(maxsize=1)
def all_rules() -> tuple[type[Rule], ...]:
    """Every rule class in ``ddpify.check.rules``, sorted by code (package scan, no list to maintain)."""
    from ddpify.check import rules as pkg

    found: list[type[Rule]] = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        found.extend(_rule_classes_in(module))
    return tuple(sorted(found, key=lambda r: r.CODE))


def rules_by_code() -> dict[str, type[Rule]]:
    return {r.CODE: r for r in all_rules()}


def matches(code: str, selector: str) -> bool:
    """A selector is a code, a prefix of one ("DDP1", "DDP12"), or ALL."""
    selector = selector.strip().upper()
    return selector == "ALL" or code.startswith(selector)


def valid_selector(selector: str) -> bool:
    s = selector.strip().upper()
    return s == "ALL" or any(r.CODE.startswith(s) for r in all_rules())


TARGETS = ("ddp", "fsdp2")  # what `ddpify check --to` checks a script against


def select_rules(
    select: Iterable[str] | None,
    ignore: Iterable[str] = (),
    extend_select: Iterable[str] = (),
    target: str = "ddp",
) -> set[str]:
    """Codes enabled by a selection; by default every rule that is not opinionated. With the
    `fsdp2` target, the rules whose advice is DDP's own are off."""
    codes = [r.CODE for r in all_rules()]
    if select is None:
        chosen = {r.CODE for r in all_rules() if r.DEFAULT}
    else:
        select = list(select)
        chosen = {c for c in codes if any(matches(c, s) for s in select)}
    chosen |= {c for c in codes if any(matches(c, s) for s in extend_select)}
    if target == "fsdp2":
        chosen -= {r.CODE for r in all_rules() if r.DDP_ONLY}
    return {c for c in chosen if not any(matches(c, s) for s in ignore)}


