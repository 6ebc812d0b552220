"""A digit classifier: the common MNIST training-script shape, for one GPU (or the CPU).

Command-line options, a small convolutional network, one function that trains for an epoch and
one that scores the held-out set, a learning-rate schedule, and an optional checkpoint at the end.

Without --data-dir it draws MNIST-shaped digits of its own (1x28x28, ten classes) and runs
offline in seconds. With --data-dir DIR it reads the real MNIST files already under DIR and
never downloads them (torchvision.datasets.MNIST(DIR, download=True) fetches them once).

    python examples/mnist.py --epochs 2 --save-model
    python examples/mnist.py --data-dir ~/datasets --epochs 8
"""
import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
import os
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler


def all_reduce_sum(value):
    """Sum a metric over all processes (each one saw its own part of the data)."""
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in dist.get_backend() else "cpu"
    total = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    dist.all_reduce(total)
    if isinstance(value, torch.Tensor):
        return total.to(value.device, value.dtype)
    return type(value)(total.item())


PIXEL_MEAN, PIXEL_STD = 0.1307, 0.3081  # of the real MNIST training images
CHECKPOINT = "digit_net.pt"


class StripeDigits(Dataset):
    """Stand-in digits: faint noise with the label drawn as a bright horizontal stripe."""

    def __init__(self, count, seed):
        rng = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(10, (count,), generator=rng)
        canvas = torch.rand(count, 1, 28, 28, generator=rng).mul_(0.3)
        for n, label in enumerate(self.labels.tolist()):
            top = 3 + 2 * label
            canvas[n, :, top:top + 3] += 0.7
        self.images = (canvas - PIXEL_MEAN) / PIXEL_STD

    def __len__(self):
        return self.labels.numel()

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def pick_datasets(args):
    """(training set, held-out set): synthetic by default, the downloaded MNIST with --data-dir."""
    if args.data_dir is None:
        return StripeDigits(args.train_size, seed=11), StripeDigits(args.test_size, seed=12)
    from torchvision import datasets, transforms

    as_input = transforms.Compose([transforms.ToTensor(), transforms.Normalize((PIXEL_MEAN,), (PIXEL_STD,))])
    try:
        return tuple(datasets.MNIST(args.data_dir, train=part, download=False, transform=as_input) for part in (True, False))
    except RuntimeError as err:
        sys.exit(f"no MNIST files under {args.data_dir!r} ({err}); put them there first, "
                 "or leave out --data-dir to train on synthetic digits")


class DigitNet(nn.Module):
    """Two 5x5 convolutions, each halving the image with max pooling, then a two-layer classifier."""

    def __init__(self, width=12, hidden=80):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # 28 -> 14
            nn.Conv2d(width, 2 * width, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2),  # 14 -> 10 -> 5
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * 5 * 5, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )

    def forward(self, images):
        return F.log_softmax(self.classifier(self.features(images)), dim=1)


def parse_args():
    cli = argparse.ArgumentParser(description="Train a small convolutional digit classifier.")
    cli.add_argument("--batch-size", type=int, default=64, help="training images per step (64)")
    cli.add_argument("--test-batch-size", type=int, default=500, help="held-out images per step (500)")
    cli.add_argument("--epochs", type=int, default=8, help="passes over the training set (8)")
    cli.add_argument("--lr", type=float, default=0.02, help="SGD learning rate at the start (0.02)")
    cli.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (0.9)")
    cli.add_argument("--no-cuda", action="store_true", help="stay on the CPU even when a GPU is present")
    cli.add_argument("--no-shuffle", action="store_true", help="read the training set in its stored order")
    cli.add_argument("--dry-run", action="store_true", help="stop every epoch after its first logged step")
    cli.add_argument("--seed", type=int, default=7, help="seed of the weights and of the shuffling (7)")
    cli.add_argument("--log-interval", type=int, default=20, help="steps between two training log lines (20)")
    cli.add_argument("--save-model", action="store_true", help=f"write the trained weights to {CHECKPOINT}")
    cli.add_argument("--data-dir", metavar="DIR", help="read the real MNIST already downloaded under DIR")
    cli.add_argument("--train-size", type=int, default=2048, help="synthetic training images (2048)")
    cli.add_argument("--test-size", type=int, default=512, help="synthetic held-out images (512)")
    return cli.parse_args()


def train(model, loader, optimizer, device, epoch, args):
    """One pass over the training set, logging every --log-interval steps."""
    model.train()
    for step, (images, labels) in enumerate(loader):
        images, labels = images.to(device), labels.to(device)
        loss = F.nll_loss(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.log_interval == 0:
            if dist.get_rank() == 0:
                print(f"[train] epoch {epoch} step {step}/{len(loader)} loss {loss.item():.5f}")
            if args.dry_run:
                break  # a smoke test: one logged step per epoch


def test(model, loader, device, epoch):
    """Mean loss and accuracy over the held-out set; returns the accuracy (0 to 1)."""
    model.eval()
    loss_sum = 0.0
    hits = 0
    with torch.no_grad():
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            log_probs = model(images)
            loss_sum += F.nll_loss(log_probs, labels, reduction="sum").item()
            hits += (log_probs.argmax(dim=1) == labels).sum().item()
        loss_sum = all_reduce_sum(loss_sum)
        hits = all_reduce_sum(hits)
    total = len(loader.dataset)
    if dist.get_rank() == 0:
        print(f"[eval] epoch {epoch}: mean loss {loss_sum / total:.4f}, correct {hits}/{total} ({100.0 * hits / total:.1f}%)")
    return hits / total


def main():
    args = parse_args()
    use_cuda = torch.cuda.is_available() and not args.no_cuda
    torch.manual_seed(args.seed)

    # torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; under plain `python` this is one process.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"  # NCCL for GPU tensors, gloo for CPU ones
    if "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group(backend)
    else:  # plain `python`: a process group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    fit_opts = {"batch_size": args.batch_size, "shuffle": not args.no_shuffle}
    score_opts = {"batch_size": args.test_batch_size}
    if use_cuda:  # page-locked batches, loaded in the background
        fit_opts.update(num_workers=2, pin_memory=True)
        score_opts.update(num_workers=2, pin_memory=True)
    train_set, test_set = pick_datasets(args)
    train_sampler = DistributedSampler(train_set, shuffle=fit_opts.get("shuffle", False))
    train_loader = DataLoader(train_set, sampler=train_sampler, **{**fit_opts, "shuffle": False})
    test_loader = DataLoader(test_set, sampler=range(dist.get_rank(), len(test_set), dist.get_world_size()), **{**score_opts, "shuffle": False})

    model = DigitNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    model = DDP(model, device_ids=[local_rank] if next(model.parameters()).is_cuda else None)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        train(model, train_loader, optimizer, device, epoch, args)
        accuracy = test(model, test_loader, device, epoch)
        schedule.step()

    if dist.get_rank() == 0:
        print(f"Final test accuracy: {100.0 * accuracy:.2f}%")
    if args.save_model and dist.get_rank() == 0:
        torch.save(model.module.state_dict(), CHECKPOINT)
    dist.barrier()  # every rank is done
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
