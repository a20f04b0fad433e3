"""`python -m asyncrl ...`: the `asyncrl` command (`asyncrl.cli.main`)."""

import sys

from asyncrl.cli.main import main

sys.exit(main())
