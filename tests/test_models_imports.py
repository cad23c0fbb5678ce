"""`looplab.models` has no import circle (issue 27, item 6): read from the source, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import looplab.models

PKG = Path(looplab.models.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module → the looplab.models modules it imports anywhere in its body (inside functions too)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        # a package's __init__ is imported by its submodules' imports, but it imports them, not the reverse
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep] if dep in path else path + [dep]
            if dep not in state:
                found = visit(dep, path + [dep])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_models_package_has_no_import_circle():
    graph = import_graph()
    assert {"looplab.models.looped", "looplab.models.generation", "looplab.models.speculative",
            "looplab.models.exit_compute"} <= set(graph)
    # the package __init__ re-exports from its modules; a module importing the package itself would close a circle
    cycle = find_cycle(graph)
    assert cycle is None, " → ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
