"""``keyop-messenger demo``: the README's two-instance mutual-TLS demo
(:mod:`keyop_messenger.demo`), runnable from an installed wheel."""

from __future__ import annotations

import argparse
from typing import Any

from .common import CommandError, ops_command


def add_parsers(commands: Any) -> None:
    """Adds ``demo`` to the subcommands ``commands``."""
    ops_command(
        commands,
        "demo",
        _cmd_demo,
        help="run the two-instance mutual-TLS demo on localhost",
        description="Makes a CA and two certificates, starts a hub and a client on "
        "127.0.0.1 in a temporary directory, publishes readings and a command across "
        "the link, prints what arrived and the hub's audit log, then removes everything.",
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import DemoFailed, main

    try:
        main()
    except DemoFailed as err:
        raise CommandError(str(err)) from err
    return 0
