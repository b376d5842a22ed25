"""The entry point of the ``keyop-messenger`` command: the parser of every command
group, dispatch, and how errors become exit statuses."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import bench, dead_letters, demo, keygen, pubsub, run, stats, token
from .common import OPS_COMMANDS, CommandError, OpsUsageError, Parser, PipeClosed, UsageError
from .logsetup import setup_command_logging


def _build_parser() -> Parser:
    parser = Parser(
        prog="keyop-messenger",
        description="keyop-messenger: run an instance, certificates and operator commands.",
    )
    parser.set_defaults(print_help=parser.print_help, kind=None, func=None)
    from .. import __version__

    parser.add_argument(
        "--version", action="version", version=f"keyop-messenger {__version__}",
        help="print the version and exit",
    )  # fmt: skip
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    commands.add_parser("version", help="print the version")
    bench.add_parsers(commands)
    keygen.add_parsers(commands)
    pubsub.add_parsers(commands)
    stats.add_parsers(commands)
    dead_letters.add_parsers(commands)
    run.add_parsers(commands)
    token.add_parsers(commands)
    demo.add_parsers(commands)
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "version":
        from .. import __version__

        print(f"version: {__version__}")
        return 0
    if args.func is not None:
        return int(args.func(args))
    if args.command is None or args.kind is None:
        args.print_help()
        return 0
    return keygen.run(args)


def _normalise(argv: list[str]) -> list[str]:
    """``dead-letters --data-dir D CHANNEL`` means ``dead-letters list ...``."""
    if argv[:1] == ["dead-letters"] and len(argv) > 1:
        if argv[1] not in ("list", "replay", "-h", "--help"):
            return ["dead-letters", "list", *argv[1:]]
    return argv


def _one_line(err: BaseException) -> str:
    from ..errors import ConfigError

    if isinstance(err, ConfigError) and len(err.problems) > 1:
        where = f" in {err.path}" if err.path is not None else ""
        return f"invalid configuration{where}: " + "; ".join(err.problems)
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    from ..errors import (
        ChannelNotFoundError,
        ConfigError,
        DataDirNotFoundError,
        InvalidNameError,
        KeyopError,
    )

    parser = _build_parser()
    args_list = _normalise(list(sys.argv[1:] if argv is None else argv))
    if args_list[:1] == ["bench"]:
        return bench.run(args_list[1:])
    if args_list[:1] != ["run"]:
        setup_command_logging()
    try:
        try:
            args = parser.parse_args(args_list)
        except UsageError as err:
            # Arguments no subcommand took are reported by the top parser:
            # still a usage error of the operator command they were given to.
            ops = bool(args_list) and args_list[0] in OPS_COMMANDS
            if ops and not isinstance(err, OpsUsageError):
                raise OpsUsageError(
                    f"keyop-messenger {args_list[0]}: {err} (see keyop-messenger "
                    f"{args_list[0]} --help)"
                ) from None
            raise
        return _run(args)
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except PipeClosed:
        # The reader went away (``| head``): not an error; stop writing to the pipe.
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), sys.stdout.fileno())
        return 0
    except OpsUsageError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 2
    except (DataDirNotFoundError, ChannelNotFoundError) as err:
        # A path that does not exist: a usage error, and nothing was created.
        print(f"Error: {_one_line(err)}", file=sys.stderr)
        return 2
    except (ConfigError, InvalidNameError) as err:
        # The configuration file or an argument (an offset, a position, a
        # channel's name) is wrong: a usage error, as ``run`` reports it.
        print(f"Error: {_one_line(err)}", file=sys.stderr)
        return 2
    except (UsageError, CommandError, KeyopError, OSError) as err:
        print(f"Error: {_one_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        return 130
