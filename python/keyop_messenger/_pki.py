"""Writing TLS certificates: what ``keyop-messenger keygen`` and the benchmark suite share.

Thin wrappers over the engine's certificate functions (``rust/core/src/keygen.rs``),
so that :mod:`keyop_messenger.bench` can make its certificates without importing
the CLI (and the CLI imports the bench only inside its ``bench`` command).
"""

from __future__ import annotations

from . import _core

#: Validity of new certificates, in days, when none is given.
DEFAULT_DAYS = 730


def write_ca(
    out_cert: str = "ca.crt", out_key: str = "ca.key", days: int = DEFAULT_DAYS,
    force: bool = False,
) -> str:
    """Writes a self-signed CA certificate and its key; returns the summary ``keygen`` prints."""
    return _core.keygen_ca(out_cert, out_key, days, force)


def write_instance(
    ca: str,
    ca_key: str,
    name: str,
    *,
    out_cert: str | None = None,
    out_key: str | None = None,
    days: int = DEFAULT_DAYS,
    force: bool = False,
    sans: list[str] | None = None,
) -> str:
    """Writes an instance certificate for ``name`` signed by the CA; returns the summary."""
    return _core.keygen_instance(
        ca, ca_key, name, out_cert=out_cert, out_key=out_key, days=days, force=force,
        sans=sans if sans is not None else [],
    )
