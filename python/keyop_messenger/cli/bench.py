"""``keyop-messenger bench``: the benchmark suite of :mod:`keyop_messenger.bench`.

The suite is imported only when the command runs, so the other commands do not
load it; the suite parses its own options (``bench --help``).
"""

from __future__ import annotations

from typing import Any


def add_parsers(commands: Any) -> None:
    """Lists ``bench`` among the subcommands ``commands`` (for ``--help``)."""
    commands.add_parser(
        "bench",
        help="run the benchmark suite (options: --quick, --json, --one-core; see bench --help)",
    )


def run(argv: list[str]) -> int:
    """Runs the benchmark suite with the arguments after ``bench``."""
    from .. import bench

    return bench.main(argv)
