from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._common import every_rank, library_code


class FigureOnEveryRank(Rule):
    """Figure or image file written by every rank.

    ## What it does
    Flags `plt.savefig(...)`, `fig.savefig(...)` and `torchvision.utils.save_image(...)` outside
    a rank-0-only branch in a distributed script (paths that mention the rank are not flagged).

    A figure saved by a helper module's function that nothing in the file calls is left
    alone: the training script decides on which rank it runs.

    ## Why is this bad?
    N processes write the same file at once: wasted time and possibly corrupt images.

    ## Example
    ```python
    plt.savefig("loss.png")
    ```

    ## Use instead
    ```python
    if rank == 0:
        plt.savefig("loss.png")
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://matplotlib.org/stable/api/_as_gen/matplotlib.pyplot.savefig.html
    """

    CODE = "DDP306"
    NAME = "figure-on-every-rank"
    MESSAGE = "figure/image saved by every rank; guard it with `if rank == 0:`"
    SEVERITY = "warning"
    VALID = ["import torch.distributed as dist\nimport matplotlib.pyplot as plt\nif rank == 0:\n    plt.savefig('a.png')\n"]
    INVALID = [Invalid("import torch.distributed as dist\nimport matplotlib.pyplot as plt\nplt.savefig('a.png')\n"),
               Invalid("import torch.distributed as dist\nfrom torchvision.utils import save_image\nsave_image(x, 'a.png')\n")]

    def check(self, ctx):
        for ci in ctx.calls:
            if (ci.name == "savefig" and ci.receiver is not None) or ci.is_("torchvision.utils.save_image"):
                if every_rank(ctx, ci.node) and not library_code(ctx, ci.node):
                    yield Report(ci.node)
