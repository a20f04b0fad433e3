"""`python -m asyncrl ...`: the `asyncrl` command (`asyncrl.cli.main`)."""

from asyncrl.cli.main import entry

entry()
