from ddpify.cli import app

app()
