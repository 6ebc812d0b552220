"""The ConvNet MNIST trainer (two conv+BatchNorm+ReLU+MaxPool blocks and a linear head) on one GPU.

Trains on synthetic MNIST-shaped data unless --real-data is given, in which case it reads the
real MNIST already downloaded under --data-dir (default ./data); it never downloads.

    python examples/mnist_convnet.py --epochs 2
    python examples/mnist_convnet.py --real-data --data-dir ./data -b 100
"""
import argparse
import sys
from datetime import datetime

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
import os
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler


def synthetic_mnist(size, seed=0):
    """1x28x28 tensors in [0, 1]; the class is written as a bright column at 2 * label + 4."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (size,), generator=g)
    images = 0.2 * torch.rand(size, 1, 28, 28, generator=g)
    images[torch.arange(size), 0, :, 2 * labels + 4] = 1.0
    return TensorDataset(images, labels)


def mnist_train_set(args):
    if not args.real_data:
        return synthetic_mnist(args.train_size)
    import torchvision
    import torchvision.transforms as transforms
    try:
        return torchvision.datasets.MNIST(root=args.data_dir,
                                          train=True,
                                          transform=transforms.ToTensor(),
                                          download=False)
    except RuntimeError as exc:
        sys.exit(f"--real-data: MNIST is not under {args.data_dir!r} ({exc}); download it there first.")


class ConvNet(nn.Module):
    def __init__(self, num_classes=10):
        super(ConvNet, self).__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2))
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2))
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x):
        out = self.layer1(x)
        out = self.layer2(out)
        out = out.reshape(out.size(0), -1)
        out = self.fc(out)
        return out


def train(gpu, args):
    torch.manual_seed(0)
    model = ConvNet()

    # torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; under plain `python` this is one process.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group(backend)
    else:  # plain `python`: a process group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    model.to(device)
    batch_size = args.batch_size
    # define loss function (criterion) and optimizer
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    # Data loading code
    train_dataset = mnist_train_set(args)
    train_sampler = DistributedSampler(train_dataset, shuffle=not args.no_shuffle)
    train_loader = torch.utils.data.DataLoader(dataset=train_dataset,
                                               batch_size=batch_size,
                                               sampler=train_sampler,
                                               num_workers=0,
                                               pin_memory=True)

    start = datetime.now()
    total_step = len(train_loader)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for i, (images, labels) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            # Forward pass
            outputs = model(images)
            loss = criterion(outputs, labels)

            # Backward and optimize
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if ((i + 1) % args.log_every == 0 or i + 1 == total_step) and dist.get_rank() == 0:
                print('Epoch [{}/{}], Step [{}/{}], Loss: {:.4f}'.format(
                    epoch + 1, args.epochs, i + 1, total_step, loss.item()))
    if dist.get_rank() == 0:
        print("Training complete in: " + str(datetime.now() - start))
        torch.save(model.module.state_dict(), args.checkpoint)
    dist.barrier()  # every rank is done
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('-g', '--gpu', default=0, type=int,
                        help='index of the GPU to train on')
    parser.add_argument('--epochs', default=2, type=int, metavar='N',
                        help='number of total epochs to run')
    parser.add_argument('-b', '--batch-size', default=100, type=int)
    parser.add_argument('--lr', default=1e-2, type=float)
    parser.add_argument('--no-shuffle', action='store_true',
                        help='keep the dataset order')
    parser.add_argument('--log-every', default=100, type=int, metavar='STEPS')
    parser.add_argument('--checkpoint', default='convnet.ckpt')
    parser.add_argument('--real-data', action='store_true',
                        help='use the real MNIST under --data-dir instead of synthetic data')
    parser.add_argument('--data-dir', default='./data')
    parser.add_argument('--train-size', default=1024, type=int,
                        help='number of synthetic training images')
    args = parser.parse_args()
    train(args.gpu, args)


if __name__ == '__main__':
    main()
