import re

import libcst as cst

from ddpify.analysis import names as N
from ddpify.check.context import dotted_name, is_true, kwarg, positional
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import every_rank, library_code

# `> out.txt`, `>> log.txt`, `2> err.txt`; not `2>&1`, nor a comparison inside an inline script
REDIRECT = re.compile(r"(?<![<>=-])\d?>>?\s*(?![&=>])([^\s;|&<>()'\"]+)")


class CommandOutputOnEveryRank(Rule):
    """A shell command that writes a file by redirection, run by every rank.

    ## What it does
    Flags `os.system(...)`, `os.popen(...)` and `subprocess` calls with `shell=True` outside a rank-0 branch whose
    command (given inline, or through a name bound to it once in the same function or the
    module) redirects its
    output into a file (`perl score.pl ... > eval/result.txt`). A file name that reads the rank,
    and `/dev/null`, are left alone.

    ## Why is this bad?
    Every rank truncates and writes the same file at once: a rank that reads it back (a scorer's
    result) may find it empty or half written and crash or report a wrong number.

    ## Example
    ```python
    os.system("perl score.pl answers.txt keys.txt > result.txt")
    result = open("result.txt").read()
    ```

    ## Use instead
    ```python
    if dist.get_rank() == 0:
        os.system("perl score.pl answers.txt keys.txt > result.txt")
    dist.barrier()  # rank 0 has written result.txt
    result = open("result.txt").read()
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/distributed.html#torch.distributed.barrier
    """

    CODE = "DDP152"
    NAME = "command-output-on-every-rank"
    MESSAGE = (
        "every rank runs this command, which writes `{target}` by redirection: the ranks truncate and write "
        "one file at once; run it on rank 0 (`if rank == 0:`) and `dist.barrier()` before reading it"
    )
    VALID = [
        "import os, torch.distributed as dist\nif dist.get_rank() == 0:\n    os.system('perl s.pl > result.txt')\n",
        "import os, torch.distributed as dist\nos.system('make data 2>&1 > /dev/null')\n",
        "import os, torch.distributed as dist\nos.system(f'nvidia-smi > gpu_{dist.get_rank()}.txt')\n",
    ]
    INVALID = [
        Invalid("import os, torch.distributed as dist\ncmd = 'perl s.pl a.txt > {}/result.txt'.format(d)\nos.system(cmd)\n"),
    ]

    def check(self, ctx):
        for ci in ctx.calls_to(*N.COMMANDS):
            if ci.name != "system" and ci.name != "popen" and not is_true(getattr(kwarg(ci.node, "shell"), "value", None)):
                continue  # no shell: nothing redirects
            if not positional(ci.node) or not every_rank(ctx, ci.node) or library_code(ctx, ci.node):
                continue
            command = _command(ctx, ci)
            if command is None or ctx.reads_rank(command):
                continue
            targets = [t for text in _texts(command) for t in REDIRECT.findall(text) if t != "/dev/null"]
            if targets:
                yield Report(ci.node, self.MESSAGE.format(target=targets[0]))


def _command(ctx, ci):
    """The command's expression: the argument, or the one value a name in it is bound to in
    the same function."""
    arg = positional(ci.node)[0].value
    name = dotted_name(arg)
    if name is None or isinstance(arg, cst.SimpleString):
        return arg
    bound = [b for b in ctx.assignments if b.dotted == name and b.func is ci.func]
    if not bound and "." not in name:  # a module constant
        bound = [b for b in ctx.assignments if b.dotted == name and b.func is None and ctx.index.root_of(b.value) is ctx.module]
    return bound[0].value if len(bound) == 1 else None


def _texts(expr) -> list[str]:
    """The literal text of the strings in an expression (an f-string's text parts)."""
    found = []

    class Collect(cst.CSTVisitor):
        def visit_SimpleString(self, node: cst.SimpleString) -> None:
            found.append(node.evaluated_value)

        def visit_FormattedString(self, node: cst.FormattedString) -> bool:
            found.append("".join(p.value if isinstance(p, cst.FormattedStringText) else "{}" for p in node.parts))
            return False

    expr.visit(Collect())
    return found
