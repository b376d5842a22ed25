"""Runs the code blocks of README.md and docs/*.md as tests (Sybil).

Each Markdown file is one namespace: its blocks run top to bottom, sharing names. Before the
first block, the working directory becomes a fresh temporary directory holding:

- ``keyop.yaml``: a local messenger named ``sensor-1`` storing under ``data/``;
- ``certs(name)``: a function that makes (once) a CA and a certificate for ``name`` with the
  SANs ``localhost`` and ``127.0.0.1`` through ``keyop-messenger keygen``, and returns the
  ``tls`` section using them (files under ``pki/``).

After the last block, every messenger, subscription and ephemeral client the page left in its
namespace is closed, the directory is removed and the working directory restored.

Which blocks run:

- ```` ```python ```` blocks: executed.
- ```` ```yaml ```` blocks: parsed; a block with a top-level ``name`` is a whole configuration
  and must pass ``Config.from_dict``.
- ```` ```sh ```` blocks whose every command is ``keyop-messenger keygen ...``: run through the
  CLI in the temporary directory (cheap and safe). Other shell blocks are not executed.
- ``<!-- skip: next -->`` before a block skips it (Sybil's skip directive); used only for
  blocks that need something a test run cannot have, and says why next to it.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

LOCAL_CONFIG = "name: sensor-1\nstorage:\n  data_dir: data\n"


def _cli(argv: list[str]) -> None:
    from keyop_messenger import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    if status != 0:
        raise AssertionError(f"keyop-messenger {shlex.join(argv)} failed: {err.getvalue()}")


class _Certs:
    """``certs(name)``: the tls section for an instance certificate made on first use."""

    def __init__(self, pki: Path) -> None:
        self.pki = pki

    def __call__(self, name: str) -> dict[str, str]:
        ca, ca_key = self.pki / "ca.crt", self.pki / "ca.key"
        if not ca.exists():
            self.pki.mkdir(parents=True, exist_ok=True)
            _cli(["keygen", "ca", "--out-cert", str(ca), "--out-key", str(ca_key)])
        cert, key = self.pki / f"{name}.crt", self.pki / f"{name}.key"
        if not cert.exists():
            _cli([
                "keygen", "instance", "--ca", str(ca), "--ca-key", str(ca_key), "--name", name,
                "--san", "localhost", "--san", "127.0.0.1",
                "--out-cert", str(cert), "--out-key", str(key),
            ])  # fmt: skip
        return {"cert": str(cert), "key": str(key), "ca": str(ca)}


def _setup(namespace: dict[str, Any]) -> None:
    work = Path(tempfile.mkdtemp(prefix="keyop-docs-"))
    namespace["__docs_state__"] = (os.getcwd(), work)
    os.chdir(work)
    Path("keyop.yaml").write_text(LOCAL_CONFIG)
    namespace["certs"] = _Certs(work / "pki")


def _teardown(namespace: dict[str, Any]) -> None:
    import keyop_messenger as km
    from keyop_messenger.aio import AsyncMessenger

    closable = (km.Subscription, km.EphemeralMessenger, km.Messenger)
    left = [v for v in namespace.values() if isinstance(v, closable)]
    try:
        for value in namespace.values():  # a page that failed half-way leaves Spark running
            if type(value).__name__ == "SparkSession":
                value.stop()
        for kind in closable:  # subscriptions first, then clients, then messengers
            for value in reversed(left):
                if isinstance(value, kind):
                    value.close()
        for value in namespace.values():
            if isinstance(value, AsyncMessenger) and not value.closed:
                raise AssertionError("a page left an AsyncMessenger open")
    finally:
        cwd, work = namespace.pop("__docs_state__")
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)


def _check_yaml(example: Example) -> None:
    data = yaml.safe_load(example.parsed)
    if isinstance(data, dict) and "name" in data:
        from keyop_messenger import Config

        Config.from_dict(data)


def _keygen_commands(source: str) -> list[list[str]] | None:
    """The argv of each command when every command of the block is a keygen, else None."""
    commands = []
    for line in source.splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        if argv[:2] != ["keyop-messenger", "keygen"]:
            return None
        commands.append(argv[1:])
    return commands or None


class _KeygenShellParser(CodeBlockParser):
    """Shell blocks made only of ``keyop-messenger keygen`` commands, run through the CLI."""

    def __init__(self) -> None:
        super().__init__("sh")

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in super().__call__(document):
            if _keygen_commands(str(region.parsed)) is not None:
                yield region

    def evaluate(self, example: Example) -> None:
        for argv in _keygen_commands(str(example.parsed)) or []:
            _cli(argv)


pytest_collect_file = Sybil(
    parsers=[
        SkipParser(),
        PythonCodeBlockParser(),
        CodeBlockParser("yaml", _check_yaml),
        _KeygenShellParser(),
    ],
    patterns=["README.md", "docs/*.md"],
    setup=_setup,
    teardown=_teardown,
).pytest()
