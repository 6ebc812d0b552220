"""``[tool.ddpify]`` in pyproject.toml, found by walking up from the checked path."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

try:  # Python >= 3.11
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - older Pythons, only if tomli is installed
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ModuleNotFoundError:
        _toml = None  # type: ignore[assignment]

DEFAULT_EXCLUDE = (
    ".git",
    ".hg",
    ".svn",
    ".venv",
    "venv",
    ".tox",
    ".nox",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    "__pycache__",
    "build",
    "dist",
    "node_modules",
    "site-packages",
    ".eggs",
)


class ConfigError(Exception):
    """A pyproject.toml that cannot be used."""


@dataclass
class Config:
    root: Optional[Path] = None  # the folder of the pyproject.toml it came from
    select: Optional[list[str]] = None
    extend_select: list[str] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    per_file_ignores: dict[str, list[str]] = field(default_factory=dict)
    exclude: list[str] = field(default_factory=list)

    def ignored_for(self, path: Path) -> list[str]:
        """Codes ignored for one file by per-file-ignores (globs relative to the config's folder)."""
        out: list[str] = []
        rel = _relative(path, self.root)
        for pattern, codes in self.per_file_ignores.items():
            if _glob_match(rel, pattern):
                out.extend(codes)
        return out

    def is_excluded(self, path: Path) -> bool:
        rel = _relative(path, self.root)
        return any(_glob_match(rel, p) for p in self.exclude)


def _relative(path: Path, root: Optional[Path]) -> str:
    path = path.resolve()
    if root is not None:
        try:
            return path.relative_to(root).as_posix()
        except ValueError:
            pass
    return path.as_posix()


def _glob_match(rel: str, pattern: str) -> bool:
    """Match a path or any of its parent folders or its file name against a glob."""
    pattern = pattern.rstrip("/")
    if fnmatch.fnmatch(rel, pattern) or fnmatch.fnmatch(rel.rsplit("/", 1)[-1], pattern):
        return True
    parts = rel.split("/")
    return any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts)))


def _string_list(table: dict, key: str) -> Optional[list[str]]:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"[tool.ddpify] {key} must be a list of strings")
    return value


def load_file(pyproject: Path) -> Optional[Config]:
    """The [tool.ddpify] table of one pyproject.toml, or None when it has none."""
    if _toml is None:
        return None
    try:
        data = _toml.loads(pyproject.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{pyproject}: {exc}") from exc
    table = data.get("tool", {}).get("ddpify")
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ConfigError(f"{pyproject}: [tool.ddpify] must be a table")
    known = {"select", "extend-select", "ignore", "per-file-ignores", "exclude"}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"{pyproject}: unknown [tool.ddpify] keys: {', '.join(sorted(unknown))}")
    pfi = table.get("per-file-ignores", {})
    if not isinstance(pfi, dict):
        raise ConfigError(f"{pyproject}: [tool.ddpify] per-file-ignores must be a table")
    per_file = {}
    for pattern, codes in pfi.items():
        per_file[pattern] = [codes] if isinstance(codes, str) else list(codes)
    return Config(
        root=pyproject.parent.resolve(),
        select=_string_list(table, "select"),
        extend_select=_string_list(table, "extend-select") or [],
        ignore=_string_list(table, "ignore") or [],
        per_file_ignores=per_file,
        exclude=_string_list(table, "exclude") or [],
    )


def discover(start: Path) -> Config:
    """The closest pyproject.toml with a [tool.ddpify] table, from ``start`` upwards."""
    start = start.resolve()
    folder = start if start.is_dir() else start.parent
    for candidate in (folder, *folder.parents):
        pyproject = candidate / "pyproject.toml"
        if pyproject.is_file():
            config = load_file(pyproject)
            if config is not None:
                return config
    return Config()
