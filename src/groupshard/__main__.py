"""``python -m groupshard``: the same as the ``groupshard`` command."""

from groupshard.cli.main import run

run()
