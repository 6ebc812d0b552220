"""``python -m ddpify.check check PATH``: the linter without the rest of the CLI."""

from ddpify.check.cli import make_app

make_app()(prog_name="ddpify")
