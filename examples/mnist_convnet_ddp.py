"""A BatchNorm convnet trained on MNIST-sized digits, on one chosen GPU (or the CPU).

The shape of many single-GPU tutorials: a `train(gpu, args)` function that builds the model on
GPU number `gpu`, one DataLoader, a plain epoch/step loop that logs every few steps, the wall
time at the end, and the weights saved to --checkpoint.

By default the digits are synthetic (a bright column whose place is the class), so it runs
offline. --real-data reads the real MNIST already downloaded under --data-dir (default ./data);
nothing is ever downloaded.

    python examples/mnist_convnet.py --epochs 2
    python examples/mnist_convnet.py --real-data --data-dir ./data -b 128
"""
import argparse
import sys
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
import os
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler


def column_digits(count, seed=0):
    """Noise in [0, 0.2) with a column of ones at x = 4 + 2 * label."""
    rng = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (count,), generator=rng)
    pixels = torch.rand(count, 1, 28, 28, generator=rng) / 5
    pixels[torch.arange(count), 0, :, 4 + 2 * labels] = 1.0
    return TensorDataset(pixels, labels)


def training_set(args):
    if not args.real_data:
        return column_digits(args.train_size)
    from torchvision import datasets, transforms

    try:
        return datasets.MNIST(args.data_dir, train=True, transform=transforms.ToTensor(), download=False)
    except RuntimeError as err:
        sys.exit(f"--real-data: found no MNIST under {args.data_dir!r} ({err}); download it there first")


def conv_bn_pool(c_in, c_out):
    """3x3 convolution, batch statistics, ReLU, and 2x2 pooling (halves height and width)."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class ConvNet(nn.Module):
    def __init__(self, classes=10, widths=(16, 32)):
        super().__init__()
        self.blocks = nn.Sequential(conv_bn_pool(1, widths[0]), conv_bn_pool(widths[0], widths[1]))  # 28 -> 7
        self.head = nn.Linear(widths[1] * 7 * 7, classes)

    def forward(self, x):
        return self.head(torch.flatten(self.blocks(x), start_dim=1))


def train(gpu, args):
    torch.manual_seed(0)

    # torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; under plain `python` this is one process.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"  # NCCL for GPU tensors, gloo for CPU ones
    if "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group(backend)
    else:  # plain `python`: a process group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    net = ConvNet().to(device)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr)
    net = DDP(net, device_ids=[local_rank] if next(net.parameters()).is_cuda else None)
    samples = training_set(args)
    sampler = DistributedSampler(samples, shuffle=not args.no_shuffle)
    loader = DataLoader(samples, batch_size=args.batch_size, sampler=sampler, pin_memory=True)

    steps = len(loader)
    began = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        for step, (images, labels) in enumerate(loader, start=1):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = loss_fn(net(images), labels)
            loss.backward()
            optimizer.step()
            if (step % args.log_every == 0 or step == steps) and dist.get_rank() == 0:
                print(f"epoch {epoch}/{args.epochs}  step {step}/{steps}  loss {loss.item():.4f}")
    if dist.get_rank() == 0:
        print(f"trained in {time.perf_counter() - began:.1f} s")
        torch.save(net.module.state_dict(), args.checkpoint)
    dist.barrier()  # every rank is done
    dist.destroy_process_group()


def main():
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("-g", "--gpu", type=int, default=0, help="which GPU to train on (0)")
    cli.add_argument("--epochs", type=int, default=2, metavar="N")
    cli.add_argument("-b", "--batch-size", type=int, default=64)
    cli.add_argument("--lr", type=float, default=0.02)
    cli.add_argument("--no-shuffle", action="store_true", help="read the samples in their stored order")
    cli.add_argument("--log-every", type=int, default=50, metavar="STEPS")
    cli.add_argument("--checkpoint", default="convnet.ckpt", help="where the trained weights go")
    cli.add_argument("--real-data", action="store_true", help="train on the MNIST under --data-dir")
    cli.add_argument("--data-dir", default="./data")
    cli.add_argument("--train-size", type=int, default=1024, help="synthetic training images (1024)")
    args = cli.parse_args()
    train(args.gpu, args)


if __name__ == "__main__":
    main()
