"""Copies of the working folder for verification runs: what a script writes stays out of the user's files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# Never copied: version control, environments and caches (a run does not read them).
SKIPPED = frozenset(
    {".git", ".hg", ".svn", ".venv", "venv", ".tox", ".nox", "node_modules", "__pycache__", ".mypy_cache",
     ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", ".idea", ".vscode"}
)  # fmt: skip
LARGE_FILE = 64 << 20  # bytes: a larger file is linked, not copied
LARGE_FOLDER = 512 << 20  # bytes, or
MANY_FILES = 5000  # files: a folder past either is linked whole (a dataset)


def _too_big(folder: Path) -> bool:
    """Whether a folder holds more than LARGE_FOLDER bytes or MANY_FILES files (stops counting early)."""
    size = count = 0
    for base, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d not in SKIPPED]
        for name in files:
            count += 1
            try:
                size += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                continue
            if count > MANY_FILES or size > LARGE_FOLDER:
                return True
    return False


def copy_folder(src: Path, dest: Path, linked: list[Path] | None = None, skip: Path | None = None) -> None:
    """Copy src into dest (created): small files copied, datasets and large files linked (appended to `linked`);
    `skip` (verify's own folder, when `--keep` puts it inside src) is left out."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in sorted(src.iterdir()):
        if entry.name in SKIPPED or (skip is not None and entry.resolve() == skip):
            continue
        target = dest / entry.name
        try:
            if entry.is_symlink():
                os.symlink(os.readlink(entry), target)
            elif entry.is_dir():
                if _too_big(entry):
                    os.symlink(entry.resolve(), target)
                    if linked is not None:
                        linked.append(entry)
                else:
                    copy_folder(entry, target, linked, skip)
            elif entry.is_file():
                if entry.stat().st_size > LARGE_FILE:
                    os.symlink(entry.resolve(), target)
                    if linked is not None:
                        linked.append(entry)
                else:
                    shutil.copy2(entry, target)
        except OSError:
            continue  # unreadable: the run sees it missing, as it would without permission


def stage(
    root: Path, dest: Path, replaced: dict[Path, bytes], linked: list[Path] | None = None, skip: Path | None = None
) -> None:
    """A copy of `root` in `dest` with the files in `replaced` (paths under root) rewritten, `skip` left out."""
    copy_folder(root, dest, linked, skip)
    for path, data in replaced.items():
        target = dest / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            target.unlink()
        target.write_bytes(data)


PARENT_ENTRIES = 200  # a parent folder with more entries is not mirrored
DATA_FOLDERS = frozenset({"data", "dataset", "datasets", "input", "inputs", "raw"})
DATA_SUFFIXES = frozenset({".csv", ".tsv", ".txt", ".json", ".jsonl", ".npy", ".npz", ".pkl", ".h5", ".hdf5",
                           ".parquet", ".mat", ".zip", ".tar", ".gz", ".dat"})  # fmt: skip


def link_parent(root: Path, work: Path, own: set[str]) -> None:
    """The data beside `root` (a script that reads `../data/cora/` or `../ratings.csv`), linked
    into `work`, the folder that holds the runs' copies of root, so a relative path climbing out
    of the copy finds it. Only data folders and files are linked (a run reads them; what it would
    write beside root stays out of the user's files); the runs' own folders (`own`) keep their names."""
    parent = root.parent
    if parent == root:
        return
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return
    if len(entries) > PARENT_ENTRIES:
        return
    for entry in entries:
        target = work / entry.name
        if not (entry.name.lower() in DATA_FOLDERS and entry.is_dir() or entry.suffix.lower() in DATA_SUFFIXES and entry.is_file()):
            continue
        if entry.name in own or entry.name in SKIPPED or entry.resolve() == root or target.exists() or target.is_symlink():
            continue
        try:
            os.symlink(entry.resolve(), target)
        except OSError:
            continue
