"""The repository's layout rules (docs/architecture.md, "Boundaries"), enforced.

(a) No import circle among the modules of ``keyop_messenger``: every import
    statement counts, at the top, under ``if TYPE_CHECKING:`` and inside
    functions. A package's ``__init__`` importing its submodules, and those
    importing their siblings, is fine; a cycle is not.
(b) No module cycle in the engine crate ``rust/core/src``: edges come from
    ``crate::a::b`` paths (in ``use`` or inline) and ``super::`` / ``self::``
    paths; a reference from a module to one of its ancestors (``super::X`` with
    ``X`` defined in ``mod.rs``) is not an edge.
(c) No ``.py`` / ``.rs`` file under python/, rust/, tests/, benches/, examples/
    is over 600 lines unless one of its first 5 lines says
    ``why this file is long: ...``.

The checker functions are tested on small synthetic trees below, so each check is
shown to fail on a bad input.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import keyop_messenger

ROOT = Path(__file__).resolve().parent.parent
#: The package being tested (the source tree's, or an installed wheel's).
PACKAGE = Path(keyop_messenger.__file__).resolve().parent
RUST_SRC = ROOT / "rust" / "core" / "src"
LONG_FILE_ROOTS = ("python", "rust", "tests", "benches", "examples")
MAX_LINES = 600
LONG_FILE_MARK = "why this file is long:"

Graph = Mapping[str, set[str]]


# ---------------------------------------------------------------------------
# Cycles in a directed graph
# ---------------------------------------------------------------------------


def find_cycles(graph: Graph) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component with more
    than one node (Tarjan's algorithm), sorted; self-loops are ignored."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(_a_cycle(graph, set(c), c[0]) for c in components)


def _a_cycle(graph: Graph, members: set[str], start: str) -> list[str]:
    """A shortest path ``start -> ... -> start`` inside ``members`` (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph.get(node, ())):
                if succ not in members:
                    continue
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{start} is in a component without a cycle")


def describe_cycles(cycles: Iterable[list[str]]) -> str:
    return "\n".join("  " + " -> ".join(cycle) for cycle in cycles)


# ---------------------------------------------------------------------------
# (a) Python imports
# ---------------------------------------------------------------------------


def python_modules(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at
    ``package_dir`` (``__init__.py`` names the package; a ``.pyi`` stands for
    an extension module that has no ``.py``)."""
    root = package_dir.parent
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py*")):
        if path.suffix not in (".py", ".pyi") or "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if path.suffix == ".py" or name not in modules:
            modules[name] = path
    return modules


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement in ``module`` may refer to,
    most specific first for each imported name."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base_parts = module.split(".") if is_package else module.split(".")[:-1]
        if node.level > 1:
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules``."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def python_import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> modules of the same package it imports, from every import
    statement anywhere in the module (top level, ``TYPE_CHECKING``, functions).
    ``from pkg import name`` is an edge to ``pkg.name`` if that is a module,
    otherwise to ``pkg``."""
    modules = python_modules(package_dir)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.stem == "__init__"
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = _imported(node, name, is_package)
            if isinstance(node, ast.ImportFrom):
                specific, base = names[:-1], names[-1]
                targets = [_resolve(n, modules) if n in modules else _resolve(base, modules)
                           for n in specific]
            else:
                targets = [_resolve(n, modules) for n in names]
            for target in targets:
                if target is not None and target != name:
                    graph[name].add(target)
    return graph


# ---------------------------------------------------------------------------
# (b) Rust modules
# ---------------------------------------------------------------------------

_COMMENT_OR_STRING = re.compile(
    r'//[^\n]*|/\*.*?\*/|r(#*)".*?"\1|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])\'',
    re.DOTALL,
)
_USE = re.compile(r"\buse\s+([^;]*);")
_CHILD_MOD = re.compile(r"\bmod\s+(\w+)\s*;")


def _path_re(roots: Iterable[str]) -> re.Pattern[str]:
    """Paths starting with one of ``roots``: ``root::a::b``."""
    names = "|".join(sorted(map(re.escape, roots)))
    return re.compile(rf"(?<![\w:])((?:{names})(?:\s*::\s*\w+)+)")
_INLINE_MOD = re.compile(r"\bmod\s+(\w+)\s*\{")


def rust_modules(src: Path) -> dict[tuple[str, ...], Path]:
    """Module path (``()`` for the crate root) -> file, for ``lib.rs``,
    ``a.rs``, ``a/mod.rs`` and ``a/b.rs`` under ``src``."""
    modules: dict[tuple[str, ...], Path] = {}
    for path in sorted(src.rglob("*.rs")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts in (["lib"], ["main"]):
            parts = []
        elif parts[-1] == "mod":
            parts.pop()
        modules[tuple(parts)] = path
    return modules


def _strip(text: str) -> str:
    """``text`` with comments, strings and char literals blanked (lengths kept)."""
    return _COMMENT_OR_STRING.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _expand_use(tree: str) -> list[str]:
    """``a::{b, c::{d, e}}`` -> ``["a::b", "a::c::d", "a::c::e"]``."""
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+\w+", "", tree))
    start = tree.find("{")
    if start < 0:
        return [tree]
    prefix, inner = tree[:start], tree[start + 1 : tree.rfind("}")]
    items, depth, current = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
            continue
        depth += (ch == "{") - (ch == "}")
        current += ch
    items.append(current)
    return [path for item in items if item for path in _expand_use(prefix + item)]


def _inline_scopes(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, name)`` of every inline ``mod name { ... }`` block."""
    scopes = []
    for match in _INLINE_MOD.finditer(text):
        depth, pos = 1, match.end()
        while depth and pos < len(text):
            depth += (text[pos] == "{") - (text[pos] == "}")
            pos += 1
        scopes.append((match.start(), pos, match.group(1)))
    return scopes


def _rust_target(
    path: str, here: tuple[str, ...], modules: Mapping[tuple[str, ...], Path]
) -> tuple[str, ...] | None:
    """The module a ``crate::`` / ``super::`` / ``self::`` path written in
    module ``here`` refers to (its longest module prefix)."""
    segments = [s for s in re.sub(r"\s+", "", path).split("::") if s]
    if segments[0] not in ("crate", "super", "self"):
        segments = ["self", *segments]  # a child module declared in this file
    if segments[0] == "crate":
        resolved: list[str] = []
        segments = segments[1:]
    else:
        resolved = list(here)
        while segments and segments[0] in ("super", "self"):
            if segments.pop(0) == "super":
                if not resolved:
                    return None
                resolved.pop()
    segments = [s for s in segments if s not in ("self", "*")]
    best = None
    for end in range(len(segments) + 1):
        candidate = (*resolved, *segments[:end])
        if candidate in modules:
            best = candidate
    return best


def rust_module_graph(src: Path) -> dict[str, set[str]]:
    """Module -> modules it refers to (``crate::a::b``, ``super::``/``self::``
    paths and paths through a child declared with ``mod child;`` in the file,
    also inside ``use`` groups), without references to the module's own
    ancestors. Inline ``mod x { ... }`` blocks (tests) count as their file."""
    modules = rust_modules(src)

    def label(m: tuple[str, ...]) -> str:
        return "::".join(("crate", *m))

    graph: dict[str, set[str]] = {label(m): set() for m in modules}
    for module, file in modules.items():
        text = _strip(file.read_text(encoding="utf-8"))
        scopes = _inline_scopes(text)
        roots = {"crate", "super", "self", *_CHILD_MOD.findall(text)}
        refs: list[tuple[int, str]] = []
        for match in _USE.finditer(text):
            refs += [
                (match.start(), p)
                for p in _expand_use(match.group(1))
                if p.split("::")[0] in roots
            ]
        blanked = _USE.sub(lambda m: " " * len(m.group(0)), text)
        refs += [(m.start(), m.group(1)) for m in _path_re(roots).finditer(blanked)]
        for pos, path in refs:
            inner = tuple(name for start, end, name in scopes if start <= pos < end)
            here = (*module, *inner)
            target = _rust_target(path, here, modules)
            if target is None or target == module or module[: len(target)] == target:
                continue  # itself, or an ancestor (child -> parent is not a cycle)
            graph[label(module)].add(label(target))
    return graph


# ---------------------------------------------------------------------------
# (c) Long files
# ---------------------------------------------------------------------------


def long_files(root: Path, dirs: Iterable[str], limit: int = MAX_LINES) -> list[str]:
    """``path (N lines)`` of every ``.py`` / ``.rs`` file under ``root/dir``
    over ``limit`` lines whose first 5 lines lack ``why this file is long:``
    (``target/`` and hidden directories are skipped)."""
    offenders = []
    for top in dirs:
        for path in sorted((root / top).rglob("*")):
            rel = path.relative_to(root)
            if path.suffix not in (".py", ".rs") or not path.is_file():
                continue
            if any(part == "target" or part.startswith(".") for part in rel.parts):
                continue
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
            if len(lines) > limit and not any(LONG_FILE_MARK in line for line in lines[:5]):
                offenders.append(f"{rel} ({len(lines)} lines)")
    return offenders


# ---------------------------------------------------------------------------
# The checks on this repository
# ---------------------------------------------------------------------------


def test_no_python_import_cycle() -> None:
    graph = python_import_graph(PACKAGE)
    assert "keyop_messenger.cli.app" in graph and "keyop_messenger._core" in graph
    cycles = find_cycles(graph)
    assert not cycles, (
        "import circles among keyop_messenger's modules (move what both sides need "
        "into a module both may import):\n" + describe_cycles(cycles)
    )


#: CI also runs tests/ copied next to an installed wheel, without the repository.
needs_repository = pytest.mark.skipif(
    not (ROOT / "rust" / "core" / "src").is_dir(),
    reason="repository check: rust/ and python/ are not next to tests/ here "
    "(tests copied out to test an installed wheel)",
)


@needs_repository
def test_no_rust_module_cycle() -> None:
    graph = rust_module_graph(RUST_SRC)
    assert "crate::storage::writer" in graph
    cycles = find_cycles(graph)
    assert not cycles, (
        "module cycles in rust/core/src (move what both sides need into a module "
        "both may use):\n" + describe_cycles(cycles)
    )


@needs_repository
def test_long_files_say_why() -> None:
    offenders = long_files(ROOT, LONG_FILE_ROOTS)
    assert not offenders, (
        f"files over {MAX_LINES} lines without \"{LONG_FILE_MARK} ...\" in their first "
        "5 lines (split them, or say why they are long):\n  " + "\n  ".join(offenders)
    )


# ---------------------------------------------------------------------------
# The checkers on synthetic input
# ---------------------------------------------------------------------------


def write_tree(root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_find_cycles_on_small_graphs() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"a"}}) == []
    assert find_cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    cycles = find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "x": {"y"}, "y": {"x", "a"}})
    assert cycles == [["a", "b", "c", "a"], ["x", "y", "x"]]
    assert "a -> b -> c -> a" in describe_cycles(cycles)


@pytest.mark.parametrize(
    "files",
    [
        # top level, both ways
        {"m/a.py": "from . import b\n", "m/b.py": "from .a import x\n"},
        # under TYPE_CHECKING
        {
            "m/a.py": "from .b import y\n",
            "m/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n",
        },
        # inside a function, absolute import, through a subpackage
        {
            "m/a.py": "from .sub.c import z\n",
            "m/sub/__init__.py": "",
            "m/sub/c.py": "def f():\n    import m.a\n",
        },
        # a submodule importing a name of its package's __init__, which imports it
        {"m/__init__.py": "from .a import x\nVERSION = 1\n", "m/a.py": "from . import VERSION\n"},
        # two levels up
        {
            "m/a.py": "from .sub import c\n",
            "m/sub/__init__.py": "",
            "m/sub/c.py": "from ..a import q\n",
        },
    ],
)
def test_python_checker_finds_circles(tmp_path: Path, files: dict[str, str]) -> None:
    write_tree(tmp_path, {"m/__init__.py": "", **files})
    cycles = find_cycles(python_import_graph(tmp_path / "m"))
    assert cycles, python_import_graph(tmp_path / "m")


def test_python_checker_accepts_a_package_and_its_submodules(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "m/__init__.py": "from .a import x\nfrom .sub import c\nfrom . import _ext\n",
            "m/_ext.pyi": "def f() -> None: ...\n",
            "m/a.py": "from . import _ext\nfrom .b import y\nimport os\n",
            "m/b.py": "def g():\n    from . import _ext\n",
            "m/sub/__init__.py": "from .c import z\n",
            "m/sub/c.py": "from ..a import x\nfrom . import d\n",
            "m/sub/d.py": "from ..b import y\n",
        },
    )
    graph = python_import_graph(tmp_path / "m")
    assert graph["m"] == {"m.a", "m.sub.c", "m._ext"}
    assert graph["m.sub.c"] == {"m.a", "m.sub.d"}
    assert find_cycles(graph) == []


def test_rust_checker_finds_cycles(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "lib.rs": "pub mod fed;\npub mod store;\n",
            "fed/mod.rs": "pub mod client;\npub mod link;\npub struct Shared;\n",
            "fed/client.rs": "use super::link::{self, Inbound};\nuse super::Shared;\n",
            "fed/link.rs": "pub fn f(x: Option<super::client::Status>) {}\n",
            "store/mod.rs": "pub mod writer;\npub mod reader;\n",
            "store/writer.rs": "use crate::{envelope, store::reader::Reader};\n",
            "store/reader.rs": "fn g() { crate::store::writer::flush(); }\n",
        },
    )
    graph = rust_module_graph(tmp_path)
    assert graph["crate::fed::client"] == {"crate::fed::link"}
    assert find_cycles(graph) == [
        ["crate::fed::client", "crate::fed::link", "crate::fed::client"],
        ["crate::store::reader", "crate::store::writer", "crate::store::reader"],
    ]


def test_rust_checker_follows_bare_child_paths(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "lib.rs": "pub mod engine;\npub mod fed;\n",
            "engine.rs": "use crate::fed::Hub;\n",
            "fed/mod.rs": "mod hub;\npub use hub::Hub;\n",
            "fed/hub.rs": "pub struct Hub(crate::engine::Engine);\n",
        },
    )
    graph = rust_module_graph(tmp_path)
    assert graph["crate::fed"] == {"crate::fed::hub"}
    assert find_cycles(graph) == [
        ["crate::engine", "crate::fed", "crate::fed::hub", "crate::engine"]
    ]


def test_rust_checker_accepts_parents_tests_and_comments(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "lib.rs": "pub mod fed;\npub mod util;\nuse fed::hub;\n",
            "util.rs": "pub fn now() {}\n",
            "fed/mod.rs": (
                "pub mod hub;\npub mod wire;\nuse self::wire::Frame;\npub const T: u8 = 1;\n"
            ),
            "fed/hub.rs": (
                "use super::{wire::Frame, T};\nuse crate::fed::T as U;\nuse crate::util;\n"
                "// crate::fed::wire::back() in a comment\n"
                "const S: &str = \"super::wire and crate::fed::wire in a string\";\n"
                "#[cfg(test)]\nmod tests {\n    use super::*;\n    use super::super::T;\n}\n"
            ),
            "fed/wire.rs": (
                "pub struct Frame;\n/// Sent by [`crate::fed::hub`] (a doc comment).\n"
                "#[cfg(test)]\nmod tests {\n    use super::Frame;\n}\n"
            ),
        },
    )
    graph = rust_module_graph(tmp_path)
    assert graph["crate::fed::hub"] == {"crate::fed::wire", "crate::util"}
    assert graph["crate::fed::wire"] == set()
    assert graph["crate::fed"] == {"crate::fed::wire"}
    assert find_cycles(graph) == []


def test_long_file_checker(tmp_path: Path) -> None:
    body = "x = 1\n" * 601
    write_tree(
        tmp_path,
        {
            "python/long.py": body,
            "python/ok.py": "x = 1\n" * 600,
            "rust/src/long.rs": "// a\n" * 700,
            "rust/src/said.rs": "//! x\n//! y\n//! z\n//! w\n//! why this file is long: tests\n"
            + "// a\n" * 700,
            "rust/src/late.rs": "//! x\n" * 5
            + "//! why this file is long: too late\n"
            + "// a\n" * 700,
            "rust/target/debug/gen.rs": "// a\n" * 700,
            "tests/notes.txt": "a\n" * 700,
            "examples/long.py": '"""Demo.\n\nwhy this file is long: one story."""\n' + body,
        },
    )
    offenders = long_files(tmp_path, LONG_FILE_ROOTS)
    assert offenders == [
        "python/long.py (601 lines)",
        "rust/src/late.rs (706 lines)",
        "rust/src/long.rs (700 lines)",
    ]


# ---------------------------------------------------------------------------
# What the CLI loads
# ---------------------------------------------------------------------------

PROBE = """
import sys
import keyop_messenger.cli
status = keyop_messenger.cli.main(["version"])
print(sorted(m for m in sys.modules if m.startswith("keyop_messenger.bench")))
"""


def test_cli_does_not_import_the_bench() -> None:
    """The benchmark suite is loaded only by the ``bench`` command."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", done.stdout
