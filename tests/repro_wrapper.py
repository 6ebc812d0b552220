"""Run one repro script as a torchrun worker, recording what tests/test_check_repros.py needs.

Usage: torchrun ... tests/repro_wrapper.py SCRIPT [ARGS...]

Every stdout/stderr line the script writes is prefixed with ``[R<rank>] `` so the harness can
tell which rank said what, and every file the script opens for writing is announced as
``WRITE <rank> <absolute path>`` (an audit hook on ``open``): a checkpoint saved by every rank
shows up as the same path written by two ranks. The script runs as ``__main__``; when it
returns, the process leaves at once (``os._exit(0)``), skipping an interpreter teardown that
gloo can abort.
"""

from __future__ import annotations

import io
import os
import runpy
import sys

RANK = os.environ.get("RANK", "?")


class Prefixed(io.TextIOBase):
    """A text stream that prefixes each line with the rank and forwards it."""

    def __init__(self, inner):
        self.inner = inner
        self.pending = ""

    def writable(self):
        return True

    def write(self, text):
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.inner.write(f"[R{RANK}] {line}\n")
        self.inner.flush()
        return len(text)

    def flush(self):
        self.inner.flush()

    def isatty(self):
        return False

    def fileno(self):
        return self.inner.fileno()


def _audit(event, args):
    if event == "open" and len(args) >= 2:
        path, mode = args[0], args[1]
        if isinstance(path, (str, bytes, os.PathLike)) and isinstance(mode, str) and any(c in mode for c in "wax+"):
            sys.__stderr__.write(f"WRITE {RANK} {os.path.abspath(os.fsdecode(path))}\n")
            sys.__stderr__.flush()


def _announce_torch_save():
    """torch.save writes through its C++ zip writer, which the audit hook does not see."""
    import torch

    save = torch.save

    def announcing_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            sys.__stderr__.write(f"WRITE {RANK} {os.path.abspath(os.fsdecode(f))}\n")
            sys.__stderr__.flush()
        return save(obj, f, *args, **kwargs)

    torch.save = announcing_save


def main():
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(script))
    sys.stdout = Prefixed(sys.__stdout__)
    sys.stderr = Prefixed(sys.__stderr__)
    sys.addaudithook(_audit)
    _announce_torch_save()
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    # The script returned: leave without the interpreter's teardown, where torch 2.15's gloo
    # threads can abort a finished process ("terminate called without an active exception",
    # seen on controls that had printed their last line). An exception or sys.exit() above
    # still ends the run with its own status.
    sys.__stdout__.flush()
    sys.__stderr__.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
