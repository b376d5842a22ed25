"""The package's layout: what the CLI loads, and (below) the repository-wide checks."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import keyop_messenger.cli
status = keyop_messenger.cli.main(["version"])
print(sorted(m for m in sys.modules if m.startswith("keyop_messenger.bench")))
"""


def test_cli_does_not_import_the_bench() -> None:
    """The benchmark suite is loaded only by the ``bench`` command."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", done.stdout
