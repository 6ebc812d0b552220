"""Run `ddpify ...` inside the test process: the same entry point as the `ddpify` command
(ddpify.cli.main), without the second or so a new interpreter spends importing libcst.

Tests that need a real process (signals, resource limits, hash seeds, the bytes of stdout in
a source's own encoding) start one themselves.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path

from ddpify.cli import main


def ddpify(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`ddpify ARGS` run in this process, in `cwd`: its exit status, stdout and stderr."""
    out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    code = 0
    with contextlib.chdir(cwd or os.getcwd()), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return subprocess.CompletedProcess(["ddpify", *args], code, _text(out), _text(err))


def _text(stream: io.TextIOWrapper) -> str:
    stream.flush()
    return stream.buffer.getvalue().decode("utf-8", errors="replace")
