import libcst as cst

from ddpify.analysis.flow import flow
from ddpify.analysis.index import iter_nodes
from ddpify.analysis.log_levels import LEVELS
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import every_rank, in_worker

_LEVELS = {"info": LEVELS["INFO"], "debug": LEVELS["DEBUG"]}


class LogOnEveryRank(Rule):
    """`logging` info/debug messages from every rank.

    ## What it does
    Flags `logging.info(...)`, `logger.info(...)` and `.debug(...)` in training code outside a
    rank-0-only branch (messages that mention the rank are not flagged), when the program is
    known to show them on every rank: a handler, and a level set plainly by code every rank runs
    (`logging.basicConfig(level=logging.INFO)`, `setLevel("DEBUG")`, a helper's level parameter
    every caller fills with one, Hydra's `@hydra.main`). Without a handler Python drops them; a
    level read from a config or set under a test of the rank is not known, and nothing is flagged. Warnings and errors
    are left alone: they may be rank-specific, and so are messages in an `except` handler or
    right before the function gives up (each failing rank says why). Nothing is flagged when logging is configured on
    rank 0 only (`logging.basicConfig` and `addHandler` behind a rank-0 guard, the other ranks getting at most
    a `NullHandler`; a handler writing to a file named after the rank is per-rank on purpose), filtered
    by the rank (`handler.addFilter(f)` with an `f` that tests the record's or the process's rank), or turned down
    on the other ranks (`logger.setLevel(logging.WARN)` under `if rank > 0:`, a level chosen by
    the rank, `logging.disable(...)`; in the file, a module it imports, or a launcher that
    imports it): their info messages then reach no handler. A message in the branch a run
    without a group takes (the `else:` of `if args.distributed:`) is one process's.

    ## Why is this bad?
    Each message is written N times; with a shared log file the lines interleave.

    ## Example
    ```python
    logger.info("epoch %d loss %.3f", epoch, loss)
    ```

    ## Use instead
    ```python
    if rank == 0:
        logger.info("epoch %d loss %.3f", epoch, loss)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://docs.python.org/3/library/logging.html
    """

    CODE = "DDP303"
    NAME = "log-on-every-rank"
    MESSAGE = "log message written by every rank; guard it with `if rank == 0:` or set the level to WARNING off rank 0"
    SEVERITY = "warning"
    VALID = [
        "import logging, torch.distributed as dist\nlogger = logging.getLogger(__name__)\nlogging.basicConfig(level=logging.INFO)\n"
        "for e in range(3):\n    if rank == 0:\n        logger.info('e %d', e)\n",
        "import logging, torch.distributed as dist\nlogger = logging.getLogger(__name__)\n"
        "for e in range(3):\n    logger.info('e %d', e)\n",  # no handler: Python drops info messages
        "import logging, torch.distributed as dist\nif dist.get_rank() == 0:\n"
        "    logging.basicConfig(level=logging.INFO)\nfor e in range(3):\n    logging.info('e %d', e)\n",
    ]
    INVALID = [
        Invalid("import logging, torch.distributed as dist\nlogger = logging.getLogger(__name__)\n"
                "logging.basicConfig(level=logging.INFO)\nfor e in range(3):\n    logger.info('e %d', e)\n"),
        Invalid("import logging, torch.distributed as dist\nlogging.basicConfig(level='DEBUG')\n"
                "for e in range(3):\n    logging.debug('e %d', e)\n"),
    ]

    def check(self, ctx):
        shown = ctx.log_level_on_every_rank
        if shown is None:
            return  # not proven that any rank shows info messages (no handler, or a level the code does not state)
        if ctx.log_handlers_on_rank0_only:
            return  # handlers attached on rank 0 only (or to each rank's own file): other ranks' info reaches no console
        if ctx.logging_quiet_off_rank0:
            return  # the other ranks log warnings and errors only
        if ctx.logs_tagged_with_rank:
            return  # a filter made from the rank stamps every record with it: per-rank lines on purpose
        if ctx.output_split_by_launcher or ctx.stdout_silenced_off_rank0 and ctx.logs_to_stdout:
            return  # the other processes' output goes to their own file or nowhere (a launcher, `sys.stdout = devnull`)
        loggers: dict[str, set] = {}  # the name bound to `logging.getLogger(...)` -> the classes of its `self.x` bindings
        for b in ctx.assignments:
            if b.value in ctx.call_info and ctx.info(b.value).is_("logging.getLogger"):
                loggers.setdefault(b.dotted, set()).add(_class_of(ctx, b.func))
        for ci in ctx.calls:
            if ci.name not in _LEVELS or ci.receiver is None or _LEVELS[ci.name] < shown:
                continue
            held = ctx.code(ci.receiver)
            if not (ci.is_("logging.info", "logging.debug") or held in loggers and _same_attribute(ctx, ci, loggers[held])):
                continue
            if flow(ctx.index).on_exit_path(ci.node) or flow(ctx.index).in_error_handler(ci.node):
                continue  # a message on the way out (an error, nothing to do): each rank says why
            if every_rank(ctx, ci.node) and in_worker(ctx, ci.node):
                yield Report(ci.node)


def _class_of(ctx, func) -> str | None:
    """The name of the class whose method `func` is (None: a function or the module)."""
    body = ctx.parent(func) if func is not None else None
    owner = ctx.parent(body) if isinstance(body, cst.IndentedBlock) else None
    return owner.name.value if isinstance(owner, cst.ClassDef) else None


def _same_attribute(ctx, ci, classes: set) -> bool:
    """Is `self.logger` at this call the attribute the program bound to a logging logger: one of
    this class's or of a class it derives from, not another class's `self.logger` (a project
    logger object whose own `self.logger` is the logging one)?"""
    if not ctx.code(ci.receiver).startswith("self.") or None in classes:
        return True
    bases = {
        c.name.value: [ctx.code(b.value).rpartition(".")[2] for b in c.bases]
        for root in ctx.index.roots for c in iter_nodes(root) if isinstance(c, cst.ClassDef)
    }  # fmt: skip
    todo, seen = [_class_of(ctx, ci.func)], set()
    while todo:
        name = todo.pop()
        if name is None or name in seen:
            continue
        if name in classes:
            return True
        seen.add(name)
        todo += bases.get(name, [])
    return not seen - {None} or any(name not in bases for name in seen)  # (a base out of sight may bind it)
