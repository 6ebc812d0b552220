"""Commands of `ddpify check` (placeholder until the linter lands)."""

import typer


def register(app: typer.Typer) -> None:
    """Add the linter's commands to the main CLI."""
