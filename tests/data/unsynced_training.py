"""A deliberately wrong 2-process training script, for tests/test_replicas.py.

It joins a process group but trains a plain, unwrapped model (no DistributedDataParallel, so no
gradient sync). The first SHARED_STEPS batches are the same on every rank, later ones depend on
the rank: the ranks' parameters are identical after steps 1..SHARED_STEPS and differ from step
SHARED_STEPS + 1 on. `--ddp` wraps the model in DDP: the same rank-dependent data, but the
gradients are averaged, so the ranks stay identical (the control).

`--ddp --manual` updates the parameters by hand (no torch optimizer, like pytorch/examples'
word_language_model) and, with `--rank0-update-from N`, only rank 0 applies the updates from
step N on (a rank guard around the update): the ranks part before training forward N + 1.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

SHARED_STEPS = 2

parser = argparse.ArgumentParser()
parser.add_argument("--ddp", action="store_true")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--manual", action="store_true")
parser.add_argument("--rank0-update-from", type=int, default=None)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = None if args.manual else torch.optim.SGD(model.parameters(), lr=0.05)
if args.ddp:
    model = DDP(model)
for step in range(1, args.steps + 1):
    seed = step if step <= SHARED_STEPS else 1000 * step + rank
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))
    y = x.sum(dim=1, keepdim=True)
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    if optimizer is not None:
        optimizer.step()
    elif args.rank0_update_from is None or step < args.rank0_update_from or rank == 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.05)
if rank == 0:
    print(f"unsynced training done ({args.steps} steps, ddp={args.ddp})")
dist.barrier()
dist.destroy_process_group()
