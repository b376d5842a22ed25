"""``python -m keyop_messenger ...``: the ``keyop-messenger`` command."""

import sys

from .cli.app import main

sys.exit(main())
