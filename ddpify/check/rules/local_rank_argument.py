import libcst as cst

from ddpify.check.context import int_value, kwarg, positional, string_value
from ddpify.check.rule import Invalid, Report, Rule


class LocalRankArgument(Rule):
    """`--local_rank` command-line argument left over from `torch.distributed.launch`.

    ## What it does
    Flags `parser.add_argument("--local_rank")` / `"--local-rank"`, unless its default reads
    `LOCAL_RANK`, it is added only under a test of the torch version (for the old launcher), or
    the program sets `args.local_rank` itself from a computed value before use.

    ## Why is this bad?
    `torch.distributed.launch` is deprecated; `torchrun` does not pass `--local_rank`, it sets
    the `LOCAL_RANK` environment variable. The argument keeps its default (often 0 or -1) and
    every process picks the same GPU, or the script thinks it is not distributed.

    ## Example
    ```python
    parser.add_argument("--local_rank", type=int, default=0)
    ```

    ## Use instead
    ```python
    local_rank = int(os.environ["LOCAL_RANK"])
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/elastic/run.html (torchrun, "Transitioning from torch.distributed.launch")
    """

    CODE = "DDP104"
    NAME = "local-rank-argument"
    MESSAGE = "`--local_rank` argument is for the deprecated `torch.distributed.launch`; read `os.environ['LOCAL_RANK']` (torchrun)"
    DISTRIBUTED_ONLY = False
    VALID = [
        "import os\nlocal_rank = int(os.environ['LOCAL_RANK'])\n",
        "parser.add_argument('--rank', type=int)\n",
        # kept for the old launcher, but defaulting to torchrun's LOCAL_RANK: fine
        "import os\nparser.add_argument('--local_rank', type=int, default=int(os.environ.get('LOCAL_RANK', 0)))\n",
        # overwritten by the program before use: the launcher's value never counts
        "import os\nparser.add_argument('--local_rank', type=int, default=0)\nargs = parser.parse_args()\nargs.local_rank = int(os.environ['LOCAL_RANK'])\n",
        "parser.add_argument('--local_rank', type=int, default=0)\nargs = parser.parse_args()\nfor rank in range(n):\n    args.local_rank = rank\n    Process(target=run, args=(args,)).start()\n",
    ]
    INVALID = [Invalid("parser.add_argument('--local_rank', type=int, default=0)\n"),
               Invalid("parser.add_argument('--local-rank', type=int, default=-1)\n")]

    def check(self, ctx):
        for ci in ctx.method_calls("add_argument"):
            default = kwarg(ci.node, "default")
            if default is not None and "LOCAL_RANK" in ctx.code(default.value):
                continue  # defaults to torchrun's LOCAL_RANK
            if _for_old_torch(ctx, ci.node):
                continue  # `if torch.__version__ < "2": parser.add_argument("--local_rank")`: the old launcher's, kept for it
            for arg in positional(ci.node):
                if string_value(arg.value) in ("--local_rank", "--local-rank"):
                    if not _set_by_program(ctx):
                        yield Report(ci.node)
                    break


def _set_by_program(ctx) -> bool:
    """The program sets `args.local_rank` itself from a computed value (`args.local_rank =
    int(os.environ["LOCAL_RANK"])`, or per worker in its own `Process`/`mp.spawn` loop): the
    option's value is overwritten before use, whatever the launcher passes."""
    return any(b.dotted.endswith(".local_rank") and int_value(b.value) is None for b in ctx.assignments)


def _for_old_torch(ctx, call) -> bool:
    """Under a test of the torch version (`if torch.__version__.startswith("1.")`,
    `if version.parse(torch.__version__) < ...`): added for the old launcher only."""
    return any(
        isinstance(p, (cst.If, cst.IfExp)) and "__version__" in ctx.code(p.test) for p in ctx.ancestors(call)
    )
