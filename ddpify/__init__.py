"""ddpify: convert single-GPU PyTorch scripts to DDP, and lint DDP pitfalls."""

__version__ = "0.2.0"
