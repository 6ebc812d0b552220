import libcst as cst

from ddpify.check.context import dotted_name
from ddpify.check.rule import Invalid, Report, Rule
from ddpify.check.rules._collectives import runs_collective
from ddpify.check.rules._common import trains

SIZE_CALLS = {"len", "size", "qsize", "__len__"}
FILL_CALLS = {"append", "extend", "put", "push", "add", "store", "insert", "appendleft", "put_nowait", "add_experience"}


class TrainingGatedOnOwnData(Rule):
    """A training step gated on how much data this rank gathered itself.

    ## What it does
    Flags an `if` that trains (a backward, or a call of a function that trains) when its test
    reads the size of a buffer the program fills (`len(memory) > warmup`,
    `memory.size() > 2000`), and the buffer fills at a pace each rank sets itself: with
    `extend(...)` of a batch of unknown length, or inside a `while` loop or a loop left by
    `break` (an episode that ends when the environment says so). A test that reads a
    collective's result (an agreed decision) is not flagged.

    ## Why is this bad?
    Each rank plays its own episodes, so its buffer crosses the threshold at another time: one
    rank runs a DDP backward while the others do not, and the all-reduce waits for ever (a
    hang), or the ranks pair up different steps' gradients.

    ## Example
    ```python
    while not done:
        memory.put(transition)
        ...
    if memory.size() > 2000:
        learn(model, memory, optimizer)
    ```

    ## Use instead
    ```python
    ready = torch.tensor(float(memory.size() > 2000))
    dist.all_reduce(ready, op=dist.ReduceOp.MIN)  # every rank takes the same decision
    if ready.item():
        learn(model, memory, optimizer)
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://pytorch.org/docs/stable/notes/ddp.html
    """

    CODE = "DDP151"
    NAME = "training-gated-on-own-data"
    MESSAGE = (
        "training gated on `{buffer}`, which each rank fills at its own pace: ranks take different numbers "
        "of DDP steps (hang); agree on the decision with an all-reduce (MIN) first"
    )
    VALID = [
        "import torch.distributed as dist\nmemory = []\nfor step in range(100):\n    memory.append(x)\n"
        "    if len(memory) >= 8:\n        loss.backward()\n",
        "import torch.distributed as dist\nwhile not done:\n    memory.append(x)\n"
        "ready = torch.tensor(float(len(memory) > 8))\ndist.all_reduce(ready)\nif ready.item():\n    loss.backward()\n",
    ]
    INVALID = [
        Invalid(
            "import torch.distributed as dist\nfor episode in range(100):\n    while not done:\n"
            "        memory.append(x)\n    if len(memory) > 8:\n        loss.backward()\n"
        ),
    ]

    def check(self, ctx):
        paced = _paced_buffers(ctx)
        if not paced:
            return
        for node in _ifs(ctx.module):
            buffer = next((b for b in _sized(node.test) if b in paced), None)
            if buffer is None or not _gates_training(ctx, node):
                continue
            yield Report(node.test, self.MESSAGE.format(buffer=buffer))


def _ifs(module: cst.Module):
    found = []

    class Collect(cst.CSTVisitor):
        def visit_If(self, node: cst.If) -> None:
            found.append(node)

    module.visit(Collect())
    return found


def _sized(test: cst.BaseExpression) -> list[str]:
    """The buffers whose size the test reads: `len(memory)`, `memory.size()`, `len(self.buffer)`."""
    found = []

    class Collect(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            name = dotted_name(call.func) or ""
            if name == "len" and len(call.args) == 1:
                found.append(dotted_name(call.args[0].value))
            elif isinstance(call.func, cst.Attribute) and call.func.attr.value in SIZE_CALLS and not call.args:
                found.append(dotted_name(call.func.value))

    test.visit(Collect())
    return [b for b in found if b]


def _paced_buffers(ctx) -> set[str]:
    """Buffers filled at a pace each rank sets: `extend`ed, or filled in a `while` loop or a
    loop left by `break`."""
    paced = set()
    for ci in ctx.calls:
        if ci.receiver is None or ci.name not in FILL_CALLS:
            continue
        name = dotted_name(ci.receiver)
        if name and (ci.name == "extend" or _in_open_ended_loop(ctx, ci.node)):
            paced.add(name)
    return paced


def _in_open_ended_loop(ctx, node) -> bool:
    for p in ctx.ancestors(node):
        if isinstance(p, cst.While):
            return True
        if isinstance(p, cst.For) and _breaks(p):
            return True
        if isinstance(p, (cst.FunctionDef, cst.ClassDef)):
            return False
    return False


def _breaks(loop: cst.For) -> bool:
    found = []

    class Collect(cst.CSTVisitor):
        def visit_Break(self, node: cst.Break) -> None:
            found.append(node)

        def visit_For(self, node: cst.For) -> bool:
            return node is loop

        def visit_While(self, node: cst.While) -> bool:
            return False

        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return False

    loop.visit(Collect())
    return bool(found)


def _gates_training(ctx, gate: cst.If) -> bool:
    """Does the body (not the else) train, with no collective in the test (an agreed decision)?"""
    if any(runs_collective(ctx, ci) for ci in ctx.calls if _inside(ctx, ci.node, gate.test)):
        return False
    return any(trains(ctx, ci) for ci in ctx.calls if _inside(ctx, ci.node, gate.body))


def _inside(ctx, node, outer) -> bool:
    return node is outer or any(p is outer for p in ctx.ancestors(node))
