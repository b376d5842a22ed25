"""``python -m keyop_messenger.cli ...``: the ``keyop-messenger`` command."""

import sys

from .app import main

sys.exit(main())
