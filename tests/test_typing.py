"""The package's public types as the README and docs use them: every ```python block of
README.md and docs/*.md, and the targets of ``with``/``async with``, pass basedpyright
--strict and mypy --strict (tests/typecheck_docs.py; also ``make typecheck``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("typecheck_docs.py")


def test_docs_and_context_managers_pass_strict_type_checkers() -> None:
    beside = Path(sys.executable).parent / "basedpyright"
    assert beside.exists() or shutil.which("basedpyright"), (
        "basedpyright is not installed: it is in the test extra (pip install -e '.[test]'); "
        "this test needs it and is not skipped without it"
    )
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"type check failed:\n{done.stdout}\n{done.stderr}"
    assert "basedpyright --strict" in done.stdout and "mypy --strict" in done.stdout


def test_the_package_is_marked_typed_and_the_marker_is_shipped() -> None:
    root = Path(__file__).resolve().parent.parent
    marker = "python/keyop_messenger/py.typed"
    assert (root / marker).is_file(), f"{marker} is missing: type checkers would ignore the hints"
    pyproject = (root / "pyproject.toml").read_text()  # no tomllib on 3.10
    assert f'{{ path = "{marker}", format = "wheel" }}' in pyproject, (
        f"pyproject.toml [tool.maturin] include must list {marker} so wheels carry it"
    )
