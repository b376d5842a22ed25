"""``keyop-messenger token create NAME``: a bearer token for the HTTP gateway.

The token is printed once; the configuration keeps only its SHA-256 hash (the
``gateway.tokens`` snippet printed beside it).
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
import sys
from typing import Any

from .common import Parser, UsageError


def token_hash(token: str) -> str:
    """``sha256:`` and the hex SHA-256 of ``token``: what ``gateway.tokens`` stores."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def add_parsers(commands: Any) -> None:
    """Adds ``token create`` to the subcommands ``commands``."""
    token = commands.add_parser("token", help="create bearer tokens for the HTTP gateway")
    token.set_defaults(print_help=token.print_help)
    actions = token.add_subparsers(dest="kind", metavar="ACTION", parser_class=Parser)
    create = actions.add_parser(
        "create", help="print a new token once, and the gateway.tokens entry with its hash"
    )
    create.add_argument("name", metavar="NAME", help="the token's name (logs, rate limit)")
    create.add_argument(
        "--publish", action="append", default=[], metavar="CHANNEL",
        help="a channel the token may publish to (repeatable)",
    )  # fmt: skip
    create.add_argument(
        "--subscribe", action="append", default=[], metavar="CHANNEL",
        help="a channel the token may read (repeatable)",
    )  # fmt: skip
    create.set_defaults(func=_create)


def _quoted(items: list[str]) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


def _create(args: argparse.Namespace) -> int:
    name = args.name.strip()
    if not name:
        raise UsageError("token create: NAME must not be empty")
    from .. import _core
    from ..errors import InvalidNameError

    for flag in ("publish", "subscribe"):
        for channel in getattr(args, flag):
            try:
                _core.validate_channel(channel)
            except InvalidNameError as exc:
                raise UsageError(f"token create: --{flag} {channel!r}: {exc}") from None
    if not args.publish and not args.subscribe:
        print("warning: with no --publish and no --subscribe the token may do nothing",
              file=sys.stderr)
    token = secrets.token_urlsafe(32)
    print(f"token: {token}")
    print("(shown once; keep it secret. Add this entry to the configuration:)")
    print()
    print("gateway:")
    print("  tokens:")
    print(f'    - name: "{name}"')
    print(f'      hash: "{token_hash(token)}"')
    print(f"      publish: {_quoted(args.publish)}")
    print(f"      subscribe: {_quoted(args.subscribe)}")
    return 0
