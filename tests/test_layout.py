"""The tree's shape, kept by tests: no import cycle among the project's modules (counting imports inside
functions and type-only ones: a cycle there still means a type or a helper lives on the wrong floor), and
the size budget (files <= 400 lines, functions <= 60, the training loop's file <= 350) outside tests/ and
bench/."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("agentrl", "sandbox", "retriever")
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_TRAINER_LINES = 400, 60, 350


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports, anywhere in it (`from a.b import c` counts a.b.c where c is a
    module, a.b otherwise; relative imports resolved against `name`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in `graph`, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle_and_only_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_imports_back_into_its_own_importers() -> None:
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    assert len(graph) > 100 and graph["agentrl.trainer"]  # the walk did find the project
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def _over_budget() -> list[str]:
    out = []
    for path in _modules().values():
        lines = path.read_text().count("\n")
        limit = MAX_TRAINER_LINES if path == REPO / "agentrl" / "trainer.py" else MAX_FILE_LINES
        if lines > limit:
            out.append(f"{path.relative_to(REPO)}: {lines} lines (at most {limit})")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines "
                               f"(at most {MAX_FUNCTION_LINES})")
    return out


def test_every_file_and_function_keeps_to_the_size_budget() -> None:
    assert _over_budget() == []
