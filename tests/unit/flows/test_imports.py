"""The package's import graph: no module imports a module that imports it back (directly or
through others), counting imports inside functions too (not those under ``if TYPE_CHECKING:``,
which never run)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests import ROOT

PACKAGES = ("flows", "tasks", "resources")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking_block(block)
                       for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_module_imports_a_module_that_imports_it_back():
    graph = import_graph()
    assert "resources.lambda_client" in graph["resources.reward_backends"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_reference_loop_and_the_pure_modules_need_no_dask():
    import subprocess
    import sys

    code = ("import sys, flows.reference, flows.training.orchestration, flows.training.lifecycle, flows.training.episode; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('distributed', "
            "'aws_lambda_powertools')); assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
