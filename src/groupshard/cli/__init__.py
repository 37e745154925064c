"""The command line: ``groupshard train`` (and ``python -m groupshard``)."""
