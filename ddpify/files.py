"""Source files in and out, shared by `convert` and `check`: one reader (PEP 263 cookies, BOM,
CRLF, null bytes, binary files) and one atomic writer (a temporary file beside the target, then a
rename: an interrupted write leaves the old file whole)."""

from __future__ import annotations

import io
import os
import tempfile
import tokenize
from pathlib import Path

from ddpify.results import ConvertError


def read_source(path: Path) -> tuple[str, str]:
    """The text of a script and its encoding (PEP 263 cookie, BOM, or UTF-8); ConvertError otherwise."""
    name = str(path)
    if not path.exists():
        raise ConvertError(name, 0, "no such file" if not path.is_symlink() else "broken symbolic link")
    if not path.is_file():
        raise ConvertError(name, 0, "not a file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConvertError(name, 0, f"cannot read: {exc.strerror or exc}") from None
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(encoding), encoding
    except (SyntaxError, LookupError) as exc:
        raise ConvertError(name, 1, f"unknown encoding: {exc}") from None
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConvertError(name, line, f"cannot decode as {encoding}: not a Python source file?") from None


def write_atomic(target: Path, data: bytes, make_parents: bool = False) -> None:
    """Write `data` to `target` through a temporary file beside it, then rename. An existing target
    keeps its permissions, a new one gets the usual ones (0666 less the umask). OSError on failure,
    with the target untouched."""
    if target.is_symlink():
        target = target.resolve()  # the file the link names is written; the link stays a link
    if make_parents:
        target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_dir():
        raise IsADirectoryError(21, "is a directory", str(target))
    if target.exists() and not target.is_file():  # /dev/null, a FIFO: written to, never replaced
        with open(target, "wb") as handle:
            handle.write(data)
        return
    mode = target.stat().st_mode if target.exists() else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
