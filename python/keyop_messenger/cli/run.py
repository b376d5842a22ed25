"""``keyop-messenger run``: one messenger instance as a foreground service.

Builds one :class:`~keyop_messenger.Messenger` from ``--config`` (hub and/or
client as configured), serves ``metrics.listen_addr`` (``/metrics``,
``/healthz``, ``/readyz``, ``/status``) when set, and runs until SIGTERM or
SIGINT; then it flushes, closes its peers and exits 0. With ``NOTIFY_SOCKET``
set (systemd ``Type=notify``) it sends ``READY=1`` once storage is open and the
listeners are bound, ``WATCHDOG=1`` every ``WATCHDOG_USEC``/2 while storage
answers, and ``STOPPING=1`` when shutdown begins.

Exit statuses: 0 clean stop; 2 bad usage or configuration (every problem on
stderr as ``Error: <file>: <key>: <what was expected>``); 1 runtime failure.
``--check`` validates the configuration and the machine (TLS files readable
and within their validity dates, data directory, listen addresses) and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import CONFIG_HELP, load, lock_holder, ops_command

if TYPE_CHECKING:
    from ..config import Config, TLSConfig
    from ..messenger import Messenger

log = logging.getLogger("keyop_messenger.service")

#: Exit status of a bad command line or configuration.
EXIT_CONFIG = 2
#: Exit status of a failure at runtime (cannot bind, data directory held...).
EXIT_RUNTIME = 1


def add_parsers(commands: Any) -> None:
    """Adds ``run`` to the subcommands ``commands``."""
    run = ops_command(
        commands,
        "run",
        _cmd_run,
        help="run one messenger instance in the foreground until SIGTERM",
        description="Runs the hub and/or client of the configuration, and its metrics "
        "listener (/metrics, /healthz, /readyz, /status), until SIGTERM or SIGINT; then "
        "flushes, closes peers and exits 0. Exit status 2: bad usage or configuration; "
        "1: runtime failure. Speaks systemd's notify protocol when NOTIFY_SOCKET is set.",
    )
    run.add_argument("--config", required=True, metavar="F", help=CONFIG_HELP)
    run.add_argument(
        "--check",
        action="store_true",
        help="validate the configuration (certificates readable and valid now, paths, "
        "listen addresses) and exit without starting",
    )
    run.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one key of the file (repeatable; over KEYOP_<SECTION>__<KEY> "
        "environment variables, which are over the file)",
    )  # fmt: skip
    loudness = run.add_mutually_exclusive_group()
    loudness.add_argument(
        "-v", "--verbose", action="count", default=0,
        help="log more: -v debug for keyop_messenger, -vv debug for every library",
    )  # fmt: skip
    loudness.add_argument(
        "-q", "--quiet", action="count", default=0, help="log less: -q warnings, -qq errors"
    )
    run.add_argument(
        "--log-format", choices=("text", "json"), default="text",
        help="log lines on stderr as text (default) or one JSON object per line",
    )  # fmt: skip


def _config_problems(path: str, problems: list[str], log_format: str) -> int:
    """Reports each problem of the configuration at ``path`` on stderr: an
    ``Error:`` line, or with ``--log-format json`` an ERROR log line, so a
    log collector reading JSON sees why the instance did not start."""
    for problem in problems:
        text = problem if problem.startswith(f"{path}:") else f"{path}: {problem}"
        if log_format == "json":
            log.error("configuration: %s", text)
        else:
            print(f"Error: {text}", file=sys.stderr)
    return EXIT_CONFIG




#: Signals ``run`` takes synchronously (blocked, then fetched with sigtimedwait):
#: no Python signal handler runs in the middle of a lock-holding call.
_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def _cmd_run(args: argparse.Namespace) -> int:
    from ..config.checks import check_environment, check_warnings
    from ..errors import ConfigError
    from .logsetup import level_for, set_package_level, setup_logging

    setup_logging(args.verbose, args.quiet, args.log_format)
    try:
        config = load(args.config, args.set)
    except ConfigError as err:
        return _config_problems(args.config, err.problems, args.log_format)
    flags_set_level = bool(args.verbose or args.quiet)
    if not flags_set_level and config.log.level:
        set_package_level(level_for(0, 0, config.log.level))
    log.debug("configuration %s: %s", args.config, json.dumps(config.to_dict()))
    problems = check_environment(config)
    if problems:
        return _config_problems(args.config, problems, args.log_format)
    if args.check:
        for warning in check_warnings(config):
            print(f"Warning: {args.config}: {warning}", file=sys.stderr)
        print(f"{args.config}: configuration OK")
        return 0
    return serve(
        config,
        lambda: load(args.config, args.set),
        None if flags_set_level else lambda name: set_package_level(level_for(0, 0, name)),
    )


def serve(
    config: Config,
    reload: Callable[[], Config] | None = None,
    set_level: Callable[[str], None] | None = None,
) -> int:
    """Runs ``config`` until SIGTERM/SIGINT (main thread only); returns the exit
    status. On SIGHUP ``reload()`` gives the configuration again; its
    ``hub.allowed_peers`` are applied, its ``tls`` files are loaded again when
    their paths or contents changed, and its ``log.level`` is applied through
    ``set_level`` (None: ``-v``/``-q`` fixed the level); other changed keys
    need a restart."""
    from .._sdnotify import Notifier
    from ..errors import DataDirLockedError, KeyopError
    from ..health import Health
    from ..messenger import Messenger
    from ..metrics import MetricsServer

    # Block the signals before any thread starts (threads inherit the mask),
    # so they stay pending until _wait fetches them, also during startup.
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    notifier = Notifier()
    health = Health()
    server: MetricsServer | None = None
    messenger: Messenger | None = None
    own = dataclasses.replace(config, metrics=dataclasses.replace(config.metrics, listen_addr=""))
    # Taken before the messenger loads the files: a change in between is
    # picked up (reloaded once more) by the next SIGHUP, never missed.
    tls_seen = [_tls_digest(config.tls)]
    try:
        if config.metrics.listen_addr:
            server = MetricsServer(None, config.metrics.listen_addr, health=health).start()
            host, port = server.address
            log.info("metrics, health and status on http://%s:%d/", host, port)
        messenger = Messenger(own)
        health.mark_ready(messenger)
        hub = messenger.hub_address
        if hub is not None:
            log.info("hub %r listening on %s:%d", config.name, hub[0], hub[1])
        for link in config.client.hubs if config.client.enabled else []:
            log.info("client %r dialing %s", config.name, link.addr)
        log.info("%r ready (data_dir %s)", config.name, config.storage.data_dir)
        notifier.notify("READY=1", f"STATUS=serving {config.name}")
        current = [config]

        def on_hup() -> None:
            if reload is None or messenger is None:
                log.warning("SIGHUP: nothing to reload")
                return
            _reload(messenger, current, reload, set_level, tls_seen)

        signum = _wait(notifier, health, on_hup)
        log.info("%s: stopping", signal.Signals(signum).name)
        return 0
    except (KeyopError, OSError) as err:
        held = ""
        if isinstance(err, DataDirLockedError):
            pid = lock_holder(config.storage.data_dir)
            held = f" (held by process {pid})" if pid is not None else ""
        log.error("%s%s", " ".join(str(err).split()) or type(err).__name__, held)
        return EXIT_RUNTIME
    finally:
        notifier.notify("STOPPING=1")
        health.mark_stopping()
        if messenger is not None:
            messenger.close()
        if server is not None:
            server.close()
        log.info("stopped")


def _wait(notifier: Any, health: Any, on_hup: Callable[[], None]) -> int:
    """Waits for SIGTERM or SIGINT (returned), pinging the systemd watchdog
    while storage answers; SIGHUP calls ``on_hup``."""
    interval = notifier.watchdog_s / 2 if notifier.watchdog_s else 3600.0
    while True:
        info = signal.sigtimedwait(_SIGNALS, interval)
        if info is None:
            if notifier.watchdog_s:
                ready, reason = health.readiness()
                if ready:
                    notifier.notify("WATCHDOG=1")
                else:
                    log.warning("not ready (%s): watchdog ping withheld", reason)
            continue
        if info.si_signo == signal.SIGHUP:
            on_hup()
            continue
        return int(info.si_signo)


def _changed_keys(old: Config, new: Config) -> list[str]:
    """Dotted keys whose values differ between ``old`` and ``new``."""
    a, b = old.to_dict(), new.to_dict()
    keys = []
    for section in b:
        if isinstance(b[section], dict):
            keys += [
                f"{section}.{k}" for k in b[section] if b[section][k] != a[section].get(k)
            ]
        elif b[section] != a[section]:
            keys.append(section)
    return keys


def _tls_digest(tls: TLSConfig) -> str:
    """Fingerprint of the ``tls`` paths and of the files' contents (a file
    that cannot be read counts by its error), to notice certificates rotated
    in place."""
    digest = hashlib.sha256()
    for path in (tls.cert, tls.key, tls.ca):
        digest.update(path.encode() + b"\0")
        try:
            digest.update(Path(path).read_bytes() if path else b"")
        except OSError as err:
            digest.update(f"unreadable: {err}".encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _reload(
    messenger: Messenger,
    current: list[Config],
    reload: Callable[[], Config],
    set_level: Callable[[str], None] | None,
    tls_seen: list[str] | None = None,
) -> None:
    """SIGHUP: reads the configuration again and applies ``hub.allowed_peers``,
    ``log.level`` and the ``tls`` files (when their paths or, per
    ``tls_seen[0]``, their contents changed); a bad configuration or
    certificate is logged and the running one kept."""
    from ..errors import ConfigError, KeyopError

    try:
        new = reload()
    except ConfigError as err:
        log.error(
            "SIGHUP: configuration %s not reloaded: %s", err.path, "; ".join(err.problems)
        )
        return
    old = current[0]
    changed = _changed_keys(old, new)
    applied = False
    if "log.level" in changed:
        changed.remove("log.level")
        if set_level is None:
            log.info("SIGHUP: log.level changed; -v/-q on the command line keep the level")
        else:
            set_level(new.log.level)
            log.info("SIGHUP: log level now %s", new.log.level or "info")
        old = current[0] = dataclasses.replace(old, log=new.log)
        applied = True
    tls_keys = [k for k in changed if k.startswith("tls.")]
    digest = _tls_digest(new.tls)
    federating = old.hub.enabled or old.client.enabled
    if federating and (tls_keys or (tls_seen is not None and digest != tls_seen[0])):
        changed = [k for k in changed if not k.startswith("tls.")]
        try:
            messenger.reload_tls(new.tls)
        except KeyopError as err:
            log.error("SIGHUP: TLS not reloaded, the running certificates stay: %s", err)
            applied = True  # handled: not "unchanged"
        else:
            if tls_seen is not None:
                tls_seen[0] = digest
            old = current[0] = dataclasses.replace(old, tls=new.tls)
            applied = True
            log.info(
                "SIGHUP: TLS reloaded (cert %s, key %s, ca %s); new connections use it",
                new.tls.cert, new.tls.key, new.tls.ca,
            )  # fmt: skip
    old, gateway_applied = _reload_gateway_access(messenger, current, old, new, changed)
    applied = applied or gateway_applied
    if "hub.allowed_peers" in changed:
        changed.remove("hub.allowed_peers")
        if not old.hub.enabled:
            if not old.gateway.enabled:
                log.warning("SIGHUP: hub.allowed_peers changed but the hub is not enabled")
        else:
            try:
                dropped = messenger.set_allowed_peers(new.hub.allowed_peers)
            except KeyopError as err:
                log.error("SIGHUP: hub.allowed_peers not applied: %s", err)
                return
            current[0] = dataclasses.replace(
                old, hub=dataclasses.replace(old.hub, allowed_peers=new.hub.allowed_peers)
            )
            applied = True
            log.info(
                "SIGHUP: hub.allowed_peers reloaded (%d peers); disconnected: %s",
                len(new.hub.allowed_peers), ", ".join(dropped) or "none",
            )  # fmt: skip
    if changed:
        log.warning("SIGHUP: %s changed: restart to apply", ", ".join(changed))
    elif not applied:
        log.info("SIGHUP: configuration unchanged")


def _reload_gateway_access(
    messenger: Messenger, current: list[Config], old: Config, new: Config, changed: list[str]
) -> tuple[Config, bool]:
    """SIGHUP: gives a running gateway the new ``hub.allowed_peers`` and
    ``gateway.tokens``; returns the configuration now current and whether
    something was applied (``gateway.tokens`` is taken off ``changed``)."""
    from ..errors import KeyopError

    wanted = {"hub.allowed_peers", "gateway.tokens"} & set(changed)
    if not wanted or not old.gateway.enabled:
        return old, False
    try:
        messenger.set_gateway_access(new.hub.allowed_peers, new.gateway.tokens)
    except KeyopError as err:
        log.error("SIGHUP: gateway access not applied: %s", err)
        return old, False
    if "gateway.tokens" in changed:
        changed.remove("gateway.tokens")
    old = current[0] = dataclasses.replace(
        old, gateway=dataclasses.replace(old.gateway, tokens=new.gateway.tokens)
    )
    if not old.hub.enabled and "hub.allowed_peers" in changed:
        changed.remove("hub.allowed_peers")
        old = current[0] = dataclasses.replace(
            old, hub=dataclasses.replace(old.hub, allowed_peers=new.hub.allowed_peers)
        )
    log.info(
        "SIGHUP: gateway access reloaded (%d peers, %d tokens)",
        len(new.hub.allowed_peers), len(new.gateway.tokens),
    )  # fmt: skip
    return old, True
