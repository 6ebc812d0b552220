"""MNIST classifier in the shape of pytorch/examples mnist/main.py, on one GPU (or the CPU).

By default it trains on a small synthetic MNIST-shaped dataset so it runs offline in seconds.
Pass --data-dir DIR to use the real MNIST files already downloaded under DIR (nothing is
downloaded: fetch them first, e.g. with torchvision.datasets.MNIST(DIR, download=True)).

    python examples/mnist.py --epochs 2 --save-model
    python examples/mnist.py --data-dir ~/datasets --epochs 14
"""
import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import Dataset
import os
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler


def all_reduce_sum(value):
    """Sum a metric over all processes (each one saw its own part of the data)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    total = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    dist.all_reduce(total)
    if isinstance(value, torch.Tensor):
        return total.to(value.device, value.dtype)
    return type(value)(total.item())


class SyntheticMNIST(Dataset):
    """1x28x28 images in 10 classes; each class brightens its own band of rows."""

    def __init__(self, size, seed, transform=None):
        g = torch.Generator().manual_seed(seed)
        self.targets = torch.randint(0, 10, (size,), generator=g)
        self.data = 0.3 * torch.rand(size, 1, 28, 28, generator=g)
        for i, t in enumerate(self.targets.tolist()):
            self.data[i, 0, 2 + 2 * t : 5 + 2 * t, :] += 0.7
        self.transform = transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        img = self.data[index]
        if self.transform is not None:
            img = self.transform(img)
        return img, self.targets[index]


def load_datasets(args):
    normalize = lambda x: (x - 0.1307) / 0.3081  # noqa: E731  (MNIST mean and std)
    if args.data_dir is None:
        return (SyntheticMNIST(args.train_size, seed=0, transform=normalize),
                SyntheticMNIST(args.test_size, seed=1, transform=normalize))

    from torchvision import datasets, transforms
    transform = transforms.Compose([
        transforms.ToTensor(),
        transforms.Normalize((0.1307,), (0.3081,))
    ])
    try:
        train = datasets.MNIST(args.data_dir, train=True, download=False, transform=transform)
        test = datasets.MNIST(args.data_dir, train=False, download=False, transform=transform)
    except RuntimeError as exc:
        sys.exit(f"MNIST not found under {args.data_dir!r} ({exc}). Download it first, "
                 "or leave out --data-dir to train on synthetic data.")
    return train, test


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            if dist.get_rank() == 0:
                print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                    epoch, batch_idx * len(data), len(train_loader.dataset),
                    100. * batch_idx / len(train_loader), loss.item()))
            if args.dry_run:
                break


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction='sum').item()  # sum up batch loss
            pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
            correct += pred.eq(target.view_as(pred)).sum().item()
        test_loss = all_reduce_sum(test_loss)
        correct = all_reduce_sum(correct)

    test_loss /= len(test_loader.dataset)

    if dist.get_rank() == 0:
        print('\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.0f}%)\n'.format(
            test_loss, correct, len(test_loader.dataset),
            100. * correct / len(test_loader.dataset)))
    return correct / len(test_loader.dataset)


def main():
    # Training settings
    parser = argparse.ArgumentParser(description='PyTorch MNIST Example')
    parser.add_argument('--batch-size', type=int, default=64, metavar='N',
                        help='input batch size for training (default: 64)')
    parser.add_argument('--test-batch-size', type=int, default=1000, metavar='N',
                        help='input batch size for testing (default: 1000)')
    parser.add_argument('--epochs', type=int, default=14, metavar='N',
                        help='number of epochs to train (default: 14)')
    parser.add_argument('--lr', type=float, default=1.0, metavar='LR',
                        help='learning rate (default: 1.0)')
    parser.add_argument('--gamma', type=float, default=0.7, metavar='M',
                        help='Learning rate step gamma (default: 0.7)')
    parser.add_argument('--no-cuda', action='store_true', default=False,
                        help='disables CUDA training')
    parser.add_argument('--no-shuffle', action='store_true', default=False,
                        help='iterate the training set in a fixed order')
    parser.add_argument('--dry-run', action='store_true', default=False,
                        help='quickly check a single pass')
    parser.add_argument('--seed', type=int, default=1, metavar='S',
                        help='random seed (default: 1)')
    parser.add_argument('--log-interval', type=int, default=10, metavar='N',
                        help='how many batches to wait before logging training status')
    parser.add_argument('--save-model', action='store_true', default=False,
                        help='For Saving the current Model')
    parser.add_argument('--data-dir', default=None, metavar='DIR',
                        help='train on the real MNIST already downloaded under DIR '
                             '(default: synthetic MNIST-shaped data)')
    parser.add_argument('--train-size', type=int, default=2048, metavar='N',
                        help='number of synthetic training images (default: 2048)')
    parser.add_argument('--test-size', type=int, default=512, metavar='N',
                        help='number of synthetic test images (default: 512)')
    args = parser.parse_args()
    use_cuda = not args.no_cuda and torch.cuda.is_available()

    torch.manual_seed(args.seed)

    # torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; under plain `python` this is one process.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group(backend)
    else:  # plain `python`: a process group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    train_kwargs = {'batch_size': args.batch_size, 'shuffle': not args.no_shuffle}
    test_kwargs = {'batch_size': args.test_batch_size}
    if use_cuda:
        cuda_kwargs = {'num_workers': 1,
                       'pin_memory': True,
                       'shuffle': True}
        train_kwargs.update(cuda_kwargs)
        test_kwargs.update(cuda_kwargs)

    dataset1, dataset2 = load_datasets(args)
    train_sampler = DistributedSampler(dataset1, shuffle=train_kwargs.get("shuffle", False))
    train_loader = torch.utils.data.DataLoader(dataset1, sampler=train_sampler, **{**train_kwargs, "shuffle": False})
    test_loader = torch.utils.data.DataLoader(dataset2, sampler=range(dist.get_rank(), len(dataset2), dist.get_world_size()), **{**test_kwargs, "shuffle": False})

    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        train(args, model, device, train_loader, optimizer, epoch)
        accuracy = test(model, device, test_loader)
        scheduler.step()

    if dist.get_rank() == 0:
        print('Final test accuracy: {:.2f}%'.format(100. * accuracy))
    if args.save_model and dist.get_rank() == 0:
        torch.save(model.module.state_dict(), "mnist_cnn.pt")
    dist.barrier()  # every rank is done
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
