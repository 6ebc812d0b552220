"""A hand-written DDP version of train.py; BREAK=<name> in the environment breaks one invariant.

BREAK: group (each rank its own process group), late_wrap (wrapped after training started),
sampler (no DistributedSampler), set_epoch (no set_epoch), no_sync (every step inside
no_sync()), summed (gradients scaled by the world size), save_all (every rank saves),
prefix (saves the DDP wrapper's state_dict), shard_eval (metrics of one shard), hang (a
rank-0-only collective), env (needs torchrun's RANK).
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

BREAK = os.environ.get("BREAK", "")


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return TensorDataset(x, y)


def evaluate(model, loader, device):
    model.eval()
    sums = torch.zeros(3, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            out = model(x)
            sums[0] += nn.functional.cross_entropy(out, y, reduction="sum")
            sums[1] += (out.argmax(1) == y).sum()
            sums[2] += y.numel()
    if BREAK != "shard_eval":
        dist.all_reduce(sums)
    model.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    if BREAK == "env":
        rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if BREAK == "group":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif "RANK" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    train_set, val_set = make_data(256, 1), make_data(96, 2)
    sampler = None if BREAK == "sampler" else DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None)
    val_loader = DataLoader(val_set, batch_size=32, sampler=DistributedSampler(val_set, shuffle=False))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = [local_rank] if device.type == "cuda" else None
    if BREAK != "late_wrap":
        model = DDP(model, device_ids=ids)
    for epoch in range(args.epochs):
        if sampler is not None and BREAK != "set_epoch":
            sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(train_loader):
            if BREAK == "late_wrap" and epoch == 0 and step == 1:
                model = DDP(model, device_ids=ids)
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            skip = model.no_sync() if BREAK == "no_sync" else contextlib.nullcontext()
            with skip:
                loss = nn.functional.cross_entropy(model(x), y)
                (loss * world if BREAK == "summed" else loss).backward()
            optimizer.step()
        val_loss, val_acc = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.5f} val_acc {val_acc:.4f}")
        if BREAK == "hang" and rank == 0:
            dist.barrier()  # a collective only rank 0 reaches
        if rank == 0 or BREAK == "save_all":
            state = model.state_dict() if BREAK == "prefix" else model.module.state_dict()
            torch.save(state, "model.pt")
    if rank == 0:
        print("done")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
