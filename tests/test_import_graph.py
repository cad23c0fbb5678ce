"""looplab's import graph, read from the source with lazy imports included: no circle anywhere in src/, and the
layers STYLE fixes — tables and bench never import each other (what they share lives in looplab.stats,
looplab.runs and looplab.targets)."""

from __future__ import annotations

import ast
from pathlib import Path

import looplab

PKG = Path(looplab.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module → the looplab modules it imports anywhere in its body (inside functions too)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import submodule` needs the submodule, not names defined in pkg/__init__
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                targets = subs + ([node.module] if len(subs) < len(node.names) else [])
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


def test_no_import_circle_in_src():
    graph = import_graph()
    assert {"looplab.models.looped", "looplab.models.generation", "looplab.tables.report",
            "looplab.bench.common"} <= set(graph)
    # the package __init__ re-exports from its modules; a module importing the package itself would close a circle
    cycle = find_cycle(graph)
    assert cycle is None, " → ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _imports_of(graph, prefix):
    return {(m, d) for m, deps in graph.items() if m == prefix or m.startswith(prefix + ".") for d in deps}


def test_tables_and_bench_do_not_import_each_other():
    graph = import_graph()
    crossing = [f"{m} → {d}" for m, d in _imports_of(graph, "looplab.tables") if d.startswith("looplab.bench")]
    crossing += [f"{m} → {d}" for m, d in _imports_of(graph, "looplab.bench") if d.startswith("looplab.tables")]
    assert not crossing, crossing


def test_model_code_imports_no_training_data_or_eval_code():
    graph = import_graph()
    upward = [f"{m} → {d}" for m, d in _imports_of(graph, "looplab.models")
              if d.split(".")[1] in {"training", "data", "eval", "tables", "bench", "train", "checkpoint"}]
    assert not upward, upward
