"""The house rules: imports run one way, no cycles, and ``m2r2 --help`` stays light (issue 12)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

SRC = REPO_ROOT / "src" / "m2r2"


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Module -> the m2r2 modules it imports anywhere (module level, functions, TYPE_CHECKING)."""
    out: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("m2r2"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)  # from m2r2.decoding import costs
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("m2r2"))
        out[_module(path)] = found
    modules = set(out)
    return {m: {i for i in deps if i in modules and i != m} for m, deps in out.items()}


def _top(module: str) -> str:
    """The room a module lives in: ``m2r2.decoding.exits`` -> ``decoding``, ``m2r2.loading`` -> ``loading``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "m2r2"


#: Room -> rooms it must never import (LAYOUT.md: cli -> bench -> engine -> strategies -> model & co).
ABOVE_MODEL = {"decoding", "engine", "bench", "cli", "training", "moe", "multirate"}
LOW = ("model", "kernels", "cache", "config", "errors", "files", "machine", "paths", "tokenizer", "loading")
LOW += ("weightfile",)
FORBIDDEN = {
    **dict.fromkeys(LOW, ABOVE_MODEL),
    "multirate": {"decoding", "engine", "bench", "cli", "training", "moe"},
    "decoding": {"engine", "bench", "cli", "training"},
    "moe": {"engine", "bench", "cli", "training"},
    "training": {"engine", "bench", "cli"},
    "engine": {"bench", "cli"},
    "bench": {"cli"},
}


def test_imports_run_one_way() -> None:
    bad = [
        f"{m} imports {d}"
        for m, deps in imports().items()
        for d in deps
        if _top(d) in FORBIDDEN.get(_top(m), set()) or (_top(d) == "cli" and m != "m2r2.__main__")
    ]
    assert not bad, "\n".join(sorted(bad))


def test_bench_suites_do_not_import_the_harness() -> None:
    graph = imports()
    for suite in ("m2r2.bench.dynamic_suite", "m2r2.bench.moe_suite"):
        assert "m2r2.bench.harness" not in graph[suite], suite


def test_no_import_cycles() -> None:
    """Between modules (a package's own ``__init__`` and its members aside: members import its registry)."""
    graph = imports()
    for m in graph:
        graph[m] = {d for d in graph[m] if not (d == m.rsplit(".", 1)[0] or m == d.rsplit(".", 1)[0])}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path[path.index(d) :], d]))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["generate", "--help"], ["bench", "--help"]])
def test_help_does_not_import_torch(argv: list[str]) -> None:
    code = (
        "import sys\nfrom m2r2.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'm2r2.engine', 'm2r2.decoding.base') if m in sys.modules]\n"
        "print('HEAVY', heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout[-300:]


def test_help_lists_exactly_the_registered_methods() -> None:
    from m2r2.decoding import _REGISTRY, method_help, method_names

    declared = method_help()
    method_names()  # imports every strategy module
    assert declared == {k: v[1] for k, v in _REGISTRY.items()}
