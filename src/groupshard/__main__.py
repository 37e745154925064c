"""``python -m groupshard``: the same as the ``groupshard`` command."""

import sys

from groupshard.cli.main import main

sys.exit(main())
