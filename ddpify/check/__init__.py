"""ddpify check: a DDP linter."""
