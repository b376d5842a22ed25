"""benches/compare.py (the comparison with Redis, NATS and Mosquitto): its
command line, its verdicts and its table, without starting any broker."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benches" / "compare.py"


@pytest.fixture(scope="module")
def compare() -> ModuleType:
    spec = importlib.util.spec_from_file_location("keyop_compare", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_arguments_default_to_every_system(compare: ModuleType) -> None:
    args = compare.parse_args([])
    assert args.only == ["keyop", "redis", "nats", "mosquitto"]
    assert args.seconds == 3.0 and not args.json and not args.no_install
    args = compare.parse_args(["--only", "redis", "nats", "--seconds", "0.5", "--json"])
    assert args.only == ["redis", "nats"] and args.seconds == 0.5 and args.json


@pytest.mark.parametrize("argv", [["--seconds", "0"], ["--only", "kafka"]])
def test_bad_arguments_are_refused(compare: ModuleType, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        compare.parse_args(argv)
    assert exc.value.code == 2


def test_rates_are_judged_against_the_disks_fsync_rate(compare: ModuleType) -> None:
    R = compare.Result
    raw = 1000.0
    assert compare.judge(R("a", "m", 900.0, True, "w"), raw).consistent is True
    assert compare.judge(R("a", "m", 9000.0, True, "w"), raw).consistent is False
    assert compare.judge(R("a", "m", 9000.0, False, "w"), raw).consistent is True
    assert compare.judge(R("a", "m", 900.0, False, "w"), raw).consistent is None


def test_table_and_json_list_every_case(compare: ModuleType) -> None:
    results = [
        compare.judge(compare.Result("Redis streams", "XADD, appendfsync always", 1234.5,
                                     True, "fsync first"), 2000.0),
        compare.judge(compare.Result("Mosquitto", "QoS 1", 50000.0, False, "memory"), 2000.0),
    ]
    table = compare.format_table(results, 2000.0, {"nats": "RuntimeError: no binary"})
    lines = table.splitlines()
    assert lines[0].startswith("| system | mode | msgs/s |")
    assert "| (disk) | write+fdatasync loop, 1 record | 2,000 | yes | |" in lines
    assert "| Redis streams | XADD, appendfsync always | 1,234 | yes: fsync first | yes |" in lines
    assert "| Mosquitto | QoS 1 | 50,000 | no: memory | yes |" in lines
    assert "| nats | skipped | | RuntimeError: no binary | |" in lines
    doc = json.loads(json.dumps(compare.to_json(results, 2000.0, {}, 3.0)))
    assert doc["raw_fdatasync_per_s"] == 2000.0
    assert [r["system"] for r in doc["results"]] == ["Redis streams", "Mosquitto"]
    assert doc["results"][0]["fsync_before_ack"] is True
