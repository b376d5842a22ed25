"""The ``keyop-messenger`` command: version and federation certificates.

Commands (``shared/spec/cli.md``)::

    keyop-messenger version
    keyop-messenger keygen ca        [--out-cert F] [--out-key F] [--days N] [--force]
    keyop-messenger keygen instance  --ca F --ca-key F --name NAME
                                     [--out-cert F] [--out-key F] [--days N] [--force]
                                     [--san NAME ...]
    keyop-messenger keygen inspect   FILE

Keys are ECDSA P-384, written as SEC 1 ``EC PRIVATE KEY`` PEM files of mode
0600 together with their certificates. Errors are printed to stderr as
``Error: <message>`` and the exit status is 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["main"]

DEFAULT_DAYS = 730


class _UsageError(Exception):
    """A command-line error: printed as ``Error: <message>``, exit status 1."""


class _Parser(argparse.ArgumentParser):
    """An argument parser that reports errors the way the 1.4 command does."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


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


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="keyop-messenger",
        description="keyop-messenger: version and federation certificates.",
    )
    parser.set_defaults(print_help=parser.print_help, kind=None)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.add_parser("version", help="print the version")

    keygen = commands.add_parser("keygen", help="create or inspect TLS certificates")
    keygen.set_defaults(print_help=keygen.print_help)
    kinds = keygen.add_subparsers(dest="kind", metavar="KIND", parser_class=_Parser)

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
    return parser


def _missing_required(args: argparse.Namespace) -> None:
    """Fails as cobra does when required flags of ``keygen instance`` are absent."""
    missing = [flag for flag in ("ca", "ca_key", "name") if getattr(args, flag) is None]
    if missing:
        names = ", ".join(f'"{flag.replace("_", "-")}"' for flag in missing)
        raise _UsageError(f"required flag(s) {names} not set")


def _run(args: argparse.Namespace) -> int:
    if args.command == "version":
        from . import __version__

        print(f"version: {__version__}")
        return 0
    if args.command is None or args.kind is None:
        args.print_help()
        return 0

    from . import _core

    if args.kind == "ca":
        summary = _core.keygen_ca(
            args.out_cert or "ca.crt", args.out_key or "ca.key", args.days, args.force
        )
    elif args.kind == "instance":
        _missing_required(args)
        summary = _core.keygen_instance(
            args.ca,
            args.ca_key,
            args.name,
            out_cert=args.out_cert,
            out_key=args.out_key,
            days=args.days,
            force=args.force,
            sans=args.san,
        )
    else:
        summary = _core.inspect_cert(args.file)
    print(summary)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    from .errors import KeyopError

    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        return _run(args)
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except (_UsageError, KeyopError, OSError) as err:
        print(f"Error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
