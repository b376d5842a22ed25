"""The ``keyop-messenger`` command: version, certificates and operator commands.

The entry point is :func:`main` (module :mod:`.app`); each command group has its
module: :mod:`.keygen`, :mod:`.pubsub` (pub, sub, tail), :mod:`.stats`,
:mod:`.dead_letters`, :mod:`.run`, :mod:`.bench` (which imports :mod:`keyop_messenger.bench`
only when the command runs); :mod:`.common` holds what they share.

Commands (``shared/spec/cli.md`` for ``version`` and ``keygen``)::

    keyop-messenger version
    keyop-messenger keygen ca        [--out-cert F] [--out-key F] [--days N] [--force]
    keyop-messenger keygen instance  --ca F --ca-key F --name NAME
                                     [--out-cert F] [--out-key F] [--days N] [--force]
                                     [--san NAME ...]
    keyop-messenger keygen inspect   FILE

    keyop-messenger pub   --config F [--ephemeral] CHANNEL PAYLOAD_TYPE [JSON]
    keyop-messenger sub   --config F CHANNEL [--id ID | --ephemeral | --from OFFSET]
                          [--count N] [--timeout S]
    keyop-messenger tail  --data-dir D CHANNEL [-n N] [-f]
    keyop-messenger stats --config F [--json]
    keyop-messenger dead-letters [list] --data-dir D CHANNEL [--json]
    keyop-messenger dead-letters replay --config F CHANNEL [--id ID ...] [--force]
    keyop-messenger run   --config F [--check] [-v|-vv|-q] [--log-format text|json]

``run`` (module :mod:`.run`, ``docs/service.md``) serves one instance in the
foreground until SIGTERM or SIGINT: exit status 0 on a clean stop, 2 for a bad
command line or configuration, 1 for a failure at runtime.

Keys are ECDSA P-384, written as SEC 1 ``EC PRIVATE KEY`` PEM files of mode
0600 together with their certificates.

``pub``, ``sub`` and ``dead-letters replay`` open the data directory of the
configuration with federation and the metrics listener off (a running
messenger holds the directory: they then fail with a one-line error naming the
process holding it; ``pub`` and ``sub`` can go through the configuration's
first hub with ``--ephemeral``). ``stats``, ``tail``, ``sub --from`` and
``dead-letters list`` only read the files, so they work next to a running messenger and on data
directories of keyop-messenger 1.4.

Messages are printed as JSON lines with the keys ``id``, ``ts``, ``channel``,
``origin``, ``payload_type``, ``payload``, ``service_name`` and
``correlation_id`` (``tail`` adds ``offset`` first). Errors are printed to
stderr as one line ``Error: <message>``; the exit status is 1 (2 for a usage
error of an operator command; ``keygen`` keeps 1, as in 1.4).
"""

from .app import main

__all__ = ["main"]
