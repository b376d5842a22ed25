"""The documentation's own rules: README for a first visit, every code block run, every page
in the site's navigation, a docstring on every public name.

The code blocks themselves run as tests collected from README.md and docs/ by Sybil
(conftest.py at the repository root); this file checks that none is left out.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import keyop_messenger as km

ROOT = Path(__file__).resolve().parent.parent

#: CI also runs tests/ copied next to an installed wheel, without the repository.
needs_repository = pytest.mark.skipif(
    not (ROOT / "rust" / "core" / "src").is_dir(),
    reason="needs the repository's README.md, docs/ and mkdocs.yml "
    "(tests copied out to test an installed wheel)",
)

FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)


def _fences(path: Path) -> list[tuple[str, str, int]]:
    """(language, body, line of the opening fence) of every fenced block."""
    text = path.read_text(encoding="utf-8")
    return [(m[1], m[2], text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _runnable(lang: str, body: str) -> bool:
    """What conftest.py runs: python and yaml blocks, and shell blocks of keygen commands."""
    if lang in ("python", "yaml"):
        return True
    if lang != "sh":
        return False
    commands = [ln.split("#")[0].strip() for ln in body.splitlines()]
    commands = [c for c in commands if c]
    return bool(commands) and all(c.startswith("keyop-messenger keygen ") for c in commands)


@needs_repository
def test_readme_is_a_first_visit() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    sh = [body for lang, body, _ in _fences(ROOT / "README.md") if lang == "sh"]
    # .ci/run runs the second shell block as the test command.
    assert "examples/demo.py" in sh[0]
    assert sh[1].strip().endswith(".venv/bin/python -m pytest")
    assert "pip install -e '.[test]'" in sh[1]
    for heading in ("## Status", "## Guarantees", "## Documentation"):
        assert f"\n{heading}\n" in readme
    assert "docs/guarantees.md" in readme


@needs_repository
def test_every_runnable_code_block_is_collected() -> None:
    """Each python/yaml/keygen block of README.md and docs/*.md is one collected test."""
    expected = {
        f"{path.relative_to(ROOT)}::line:{line},column:1"
        for path in _markdown_files()
        for lang, body, line in _fences(path)
        if _runnable(lang, body)
    }
    assert len(expected) > 20
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "README.md", "docs"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    collected = {ln.strip() for ln in out.stdout.splitlines() if "::line:" in ln}
    assert expected <= collected, f"not collected: {sorted(expected - collected)}\n{out.stderr}"


@needs_repository
def test_site_navigation_lists_every_page() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = {next(iter(entry.values())) for entry in config["nav"]}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert nav == pages
    for page in (
        "quickstart.md", "concepts.md", "guarantees.md", "federation.md", "service.md",
        "asyncio.md", "spark.md", "operations.md", "performance.md", "compatibility.md",
        "troubleshooting.md", "architecture.md", "api.md",
    ):  # fmt: skip
        assert page in nav


@needs_repository
def test_public_package_passes_the_docstring_rules() -> None:
    """pydocstyle (ruff's D rules) is on for the package, and the package passes it."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    select = re.search(r"^\[tool\.ruff\.lint\]\nselect = \[(.*)\]$", pyproject, re.M)
    assert select is not None and '"D"' in select[1]
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise",
         "python/keyop_messenger", "tests/test_docs.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def _public_members(obj: type) -> list[tuple[str, object]]:
    return [
        (name, value)
        for name, value in vars(obj).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
    ]


def _own_doc(name: str, obj: object) -> str:
    """The object's own docstring: not inherited, not the one dataclasses generate."""
    doc = (getattr(obj, "__doc__", None) or "").strip()
    return "" if doc.startswith(f"{name}(") else doc


def test_every_exported_name_has_a_docstring() -> None:
    missing = []
    for name in km.__all__:
        if name == "__version__":
            continue
        obj = getattr(km, name)
        if not _own_doc(name, obj):
            missing.append(name)
        if inspect.isclass(obj):
            for member, value in _public_members(obj):
                if not _own_doc(member, value):
                    missing.append(f"{name}.{member}")
    assert not missing
    assert _own_doc("publish", km.Messenger.publish)


@needs_repository
def test_makefile_has_the_targets_ci_uses() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, re.M))
    assert {"test", "lint", "bench", "docs", "wheels", "fuzz"} <= targets
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for target in ("lint-rust", "lint-python", "docs-deps", "docs", "bench-smoke", "fuzz",
                   "wheels"):  # fmt: skip
        assert re.search(rf"^make {target}\b", ci, re.M), target
        assert target in targets
    # The docs extra and the Makefile name the same documentation packages.
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for dep in re.findall(r'"(mkdocs[^"]*)"', makefile):
        assert f'"{dep}"' in pyproject
    out = subprocess.run(
        ["make", "-n", "test", "lint", "bench", "docs", "wheels"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


@needs_repository
def test_contributing_and_changelog() -> None:
    contributing = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    for heading in ("Layout", "Running the tests", "Benchmarks", "Fuzzing",
                    "Adding a configuration key", "Releasing"):  # fmt: skip
        assert f"\n## {heading}\n" in contributing
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "keepachangelog.com" in changelog and "\n## [Unreleased]\n" in changelog
