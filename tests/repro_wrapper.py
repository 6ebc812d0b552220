"""Run one repro script as a torchrun worker, recording what tests/test_check_repros.py needs.

Usage: torchrun ... tests/repro_wrapper.py SCRIPT [ARGS...]
       torchrun ... tests/repro_wrapper.py --plan PLAN.json

Every stdout/stderr line the script writes is prefixed with ``[R<rank>] `` so the harness can
tell which rank said what, and every file the script opens for writing is announced as
``WRITE <rank> <absolute path>`` (an audit hook on ``open``, ``os.remove``, ``os.rename`` and
``shutil.rmtree``): a checkpoint saved, or a folder removed, by every rank shows up as the same
path written by two ranks. The script runs as ``__main__``; when it returns, the process leaves
at once (``os._exit(0)``), skipping an interpreter teardown that gloo can abort.

With ``--plan`` (a JSON list of ``{"name", "script", "cwd", "timeout"}``), the scripts run one
after the other in the same processes, to pay for torchrun's start-up once; each between the
unprefixed lines ``@@begin <rank> <name>`` and ``@@end <rank> <name> <status>``, in a process
put back as a fresh one would have it: its own working folder, argv, sys.path and environment,
a rendezvous of its own (rank 0 picks a free port and publishes it in torchrun's store, as
ddpify/verify/tracer.py does), torch's random state as at start-up, logging and warnings
unconfigured, no process group, none of the modules of the script's folder. A script that
does not end with status 0, or runs past its timeout (then its process exits), ends the plan:
the harness runs the scripts without an ``@@end`` on every rank again, each in a launch of its
own.
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


_REMOVALS = ("os.remove", "os.rename", "shutil.rmtree")  # a file or folder changed as a whole (`shutil.move` renames)


def _audit(event, args):
    if event in _REMOVALS and isinstance(args[0], (str, bytes, os.PathLike)) and args[-1] is None:  # not an entry of a dir_fd
        sys.__stderr__.write(f"WRITE {RANK} {os.path.abspath(os.fsdecode(args[0]))}\n")
        sys.__stderr__.flush()
    elif event == "open" and len(args) >= 2:
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


def run_plan(path: str) -> None:
    import faulthandler
    import json
    import logging
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    sys.stdout = Prefixed(sys.__stdout__)
    sys.stderr = Prefixed(sys.__stderr__)
    sys.addaudithook(_audit)
    _announce_torch_save()
    with open(path) as fh:
        plan = json.load(fh)
    fresh_env, fresh_path, fresh_rng = dict(os.environ), list(sys.path), torch.get_rng_state()
    fresh_filters = list(warnings.filters)
    fresh_loggers = {
        logger: (logger.level, list(logger.handlers), logger.propagate, logger.disabled)
        for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        if isinstance(logger, logging.Logger)
    }
    addr, agent_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = dist.TCPStore(addr, agent_port, is_master=False, timeout=timedelta(seconds=120))
    for index, run in enumerate(plan):
        key = f"ddpify_repro_run/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{index}/master_port"
        if RANK == "0":
            import socket

            with socket.socket() as probe:
                probe.bind((addr, 0))
                agent_store.set(key, str(probe.getsockname()[1]))
        os.environ.clear()
        os.environ.update(fresh_env, MASTER_PORT=agent_store.get(key).decode(), TORCHELASTIC_USE_AGENT_STORE="False")
        script = os.path.abspath(run["script"])
        sys.argv, sys.path[:] = [script], [os.path.dirname(script), *fresh_path]  # as main() has it
        os.chdir(run["cwd"])
        torch.set_rng_state(fresh_rng)
        warnings.filters[:] = fresh_filters
        for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
            if isinstance(logger, logging.Logger):  # as at start-up (torch's loggers keep their levels)
                level, handlers, propagate, disabled = fresh_loggers.get(logger, (logging.NOTSET, [], True, False))
                logger.setLevel(level)
                logger.handlers[:] = handlers
                logger.propagate, logger.disabled = propagate, disabled
        logging.disable(logging.NOTSET)
        sys.__stdout__.write(f"@@begin {RANK} {run['name']}\n")
        sys.__stdout__.flush()
        faulthandler.dump_traceback_later(float(run["timeout"]), exit=True, file=sys.__stderr__)
        status = 0
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported as Python reports an uncaught exception
            import traceback

            traceback.print_exc()
            status = 1
        faulthandler.cancel_dump_traceback_later()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            stream.pending = ""  # a last line without its newline is dropped, as when the process exits
        if dist.is_initialized():
            dist.destroy_process_group()
        folder = os.path.dirname(script) + os.sep
        for name, module in list(sys.modules.items()):
            if (getattr(module, "__file__", None) or "").startswith(folder):
                del sys.modules[name]
        sys.__stdout__.write(f"@@end {RANK} {run['name']} {status}\n")
        sys.__stdout__.flush()
        if status:
            sys.__stderr__.flush()
            os._exit(status)
    sys.__stdout__.flush()
    sys.__stderr__.flush()
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "--plan":
        run_plan(sys.argv[2])
    else:
        main()
