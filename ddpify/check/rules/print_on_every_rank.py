from ddpify.analysis.flow import flow
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import every_rank, in_worker


class PrintOnEveryRank(Rule):
    """`print` in the training code runs on every rank.

    ## What it does
    Flags `print(...)` in training code (loops, training functions, code after
    `init_process_group`) outside a rank-0-only branch. Prints that mention the rank (or the
    process id, `os.getpid()`) are per-rank on purpose and are not flagged, and so are all
    prints of a program that replaces `print` with one that prints on the master only
    (`builtins.print = ...`, the `setup_for_distributed(is_master)` helper, in the file or a
    module it imports; its `print(..., force=True)` prints on every rank on purpose). An error
    message right before the program gives up (`exit(1)`, `sys.exit(...)`, `raise`) or in an
    `except` handler is left alone: every failing rank says why; so is a print in the branch a
    run without a group takes (the `else:` of `if args.distributed:`), and nothing is flagged in
    a script started by a launcher of the project beside it that sends each process but the
    first to its own file (`subprocess.Popen([sys.executable] + args, stdout=open(f"logs/{i}.log",
    "w"))`), or that points `sys.stdout` somewhere itself (`sys.stdout = Logger(path)`,
    `redirect_stdout`, `os.dup2`: where each rank's prints go is that code's doing, not known
    here). Training code includes the top level of a script after
    the group is started, also by a helper (`utils.init_distributed()`).

    ## Why is this bad?
    Every line appears N times, interleaved: logs become unreadable and slow.

    ## Example
    ```python
    print(f"epoch {epoch} loss {loss.item():.3f}")
    ```

    ## Use instead
    ```python
    if rank == 0:
        print(f"epoch {epoch} loss {loss.item():.3f}")
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://github.com/pytorch/examples/blob/main/distributed/ddp-tutorial-series/multigpu_torchrun.py
    """

    CODE = "DDP302"
    NAME = "print-on-every-rank"
    MESSAGE = "`print` runs on every rank (N copies of each line); guard it with `if rank == 0:` or tag it with the rank"
    SEVERITY = "warning"
    VALID = [
        "import torch.distributed as dist\nfor epoch in range(3):\n    if rank == 0:\n        print(epoch)\n",
        "import torch.distributed as dist\nfor epoch in range(3):\n    print(f'[GPU{gpu_id}] epoch {epoch}')\n",
        "import os\nimport torch.distributed as dist\nfor epoch in range(3):\n    print(os.getpid(), 'epoch', epoch)\n",
        "import torch.distributed as dist\nfor epoch in range(3):\n    with open(f'log_{rank}.txt', 'a') as log:\n        print(epoch, file=log)\n",
    ]
    INVALID = [Invalid("import torch.distributed as dist\nfor epoch in range(3):\n    print(epoch)\n")]

    def check(self, ctx):
        if ctx.prints_replaced:
            return  # `builtins.print = print_on_master` somewhere in the program: every print is the master's
        if ctx.output_split_by_launcher or ctx.stdout_redirected:
            return  # the processes' stdout goes where the program sends it (a launcher's files, `sys.stdout = ...`)
        for ci in ctx.calls_to("builtins.print"):
            if _to_own_file(ci.node) or any(a.keyword is not None and a.keyword.value == "force" for a in ci.node.args):
                continue  # `print(..., file=log)`: a file write (each rank's own file, or DDP301's); `force=True`: on purpose
            if flow(ctx.index).on_exit_path(ci.node) or flow(ctx.index).in_error_handler(ci.node):
                continue  # an error or no-work message right before the function gives up: each rank says why
            if every_rank(ctx, ci.node) and in_worker(ctx, ci.node):
                yield Report(ci.node)


def _to_own_file(call) -> bool:
    """`print(..., file=handle)` to something other than sys.stdout / sys.stderr."""
    import libcst as cst

    arg = next((a for a in call.args if a.keyword is not None and a.keyword.value == "file"), None)
    if arg is None:
        return False
    value = arg.value
    return not (isinstance(value, cst.Attribute) and isinstance(value.value, cst.Name) and value.value.value == "sys")
