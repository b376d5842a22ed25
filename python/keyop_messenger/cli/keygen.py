"""``keyop-messenger keygen ca|instance|inspect``: TLS certificates (shared/spec/cli.md).

Usage errors exit with status 1, as in 1.4.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._pki import DEFAULT_DAYS, write_ca, write_instance
from .common import Out, Parser, UsageError


def _add_output_flags(parser: argparse.ArgumentParser, cert: str, key: str) -> None:
    parser.add_argument("--out-cert", metavar="FILE", help=f"certificate output (default {cert})")
    parser.add_argument("--out-key", metavar="FILE", help=f"private key output (default {key})")
    parser.add_argument(
        "--days",
        type=int,
        default=DEFAULT_DAYS,
        metavar="N",
        help=f"validity period in days (default {DEFAULT_DAYS})",
    )
    parser.add_argument(
        "--force", action="store_true", help="allow overwriting existing output files"
    )


def add_parsers(commands: Any) -> None:
    """Adds ``keygen`` and its kinds to the subcommands ``commands``."""
    keygen = commands.add_parser("keygen", help="create or inspect TLS certificates")
    keygen.set_defaults(print_help=keygen.print_help)
    kinds = keygen.add_subparsers(dest="kind", metavar="KIND", parser_class=Parser)

    ca = kinds.add_parser("ca", help="create a self-signed certificate authority")
    _add_output_flags(ca, "ca.crt", "ca.key")

    inst = kinds.add_parser("instance", help="create an instance certificate signed by a CA")
    inst.add_argument("--ca", metavar="FILE", help="CA certificate PEM (required)")
    inst.add_argument("--ca-key", metavar="FILE", help="CA private key PEM (required)")
    inst.add_argument(
        "--name", help="instance name: the subject CN and the first DNS SAN (required)"
    )
    _add_output_flags(inst, "<name>.crt", "<name>.key")
    inst.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="NAME",
        help="extra subject alternative name: a DNS name or an IP address, optionally "
        "prefixed DNS: or IP:; repeatable. An IP SAN is added by itself when the name "
        "is an IP address (or the host of a host:port name)",
    )

    inspect = kinds.add_parser("inspect", help="describe the certificates in a file")
    inspect.add_argument("file", metavar="FILE", help="certificate file (PEM or DER)")


def _missing_required(args: argparse.Namespace) -> None:
    """Fails as cobra does when required flags of ``keygen instance`` are absent."""
    missing = [flag for flag in ("ca", "ca_key", "name") if getattr(args, flag) is None]
    if missing:
        names = ", ".join(f'"{flag.replace("_", "-")}"' for flag in missing)
        raise UsageError(f"required flag(s) {names} not set")


def run(args: argparse.Namespace) -> int:
    """Runs ``keygen ca``, ``keygen instance`` or ``keygen inspect``."""
    if args.kind == "ca":
        summary = write_ca(
            args.out_cert or "ca.crt", args.out_key or "ca.key", args.days, args.force
        )
    elif args.kind == "instance":
        _missing_required(args)
        summary = write_instance(
            args.ca,
            args.ca_key,
            args.name,
            out_cert=args.out_cert,
            out_key=args.out_key,
            days=args.days,
            force=args.force,
            sans=args.san,
        )
        _warn_if_not_a_peer_name(args.name)
    else:
        from .. import _core

        summary = _core.inspect_cert(args.file)
    Out().line(summary)
    return 0


def _warn_if_not_a_peer_name(name: str) -> None:
    """1.4 accepts any ``--name`` (shared/spec/cli.md), and so does this
    command; but a hub identifies a peer by its certificate's CN and can list
    only valid peer names in ``hub.allowed_peers``: say so at once."""
    from .. import _core
    from ..errors import InvalidNameError

    try:
        _core.validate_peer_name(name)
    except InvalidNameError as err:
        print(
            f"warning: {err}; a hub cannot list this certificate's name in "
            "hub.allowed_peers, so it can only be a hub's own certificate",
            file=sys.stderr,
        )
