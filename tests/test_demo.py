"""``keyop-messenger demo``: the README's two-instance demo runs from the
package (an installed wheel), and ``examples/demo.py`` runs the same code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parent.parent / "examples" / "demo.py"


def _check(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "$ keyop-messenger keygen ca" in out
    assert out.count("  hub    <- temps: ") == 5
    assert out.count("  sensor <- commands: ") == 1
    assert "event=client_connected peer=demo-sensor" in out
    assert out.rstrip().endswith("demo finished: 5 readings and 1 command crossed the mTLS link")


def test_demo_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "keyop_messenger", "demo"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    _check(result)


def test_example_script_runs_the_packaged_demo() -> None:
    assert "from keyop_messenger.demo import main" in EXAMPLE.read_text()
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120
    )
    _check(result)


def test_the_commands_the_demo_prints_run_as_printed(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "keyop_messenger", "demo"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    commands = [
        line[len("$ keyop-messenger ") :].split()
        for line in result.stdout.splitlines()
        if line.startswith("$ keyop-messenger ")
    ]
    assert len(commands) == 3, result.stdout
    for argv in commands:
        done = subprocess.run(
            [sys.executable, "-m", "keyop_messenger", *argv],
            cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, (argv, done.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ca.crt", "ca.key", "demo-hub.crt", "demo-hub.key", "demo-sensor.crt", "demo-sensor.key"
    ]
