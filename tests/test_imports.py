"""The package's import graph: no cycles, and layers only import downwards (docs/ARCHITECTURE.md).

Every `import` statement counts, also those inside functions: a lazy import hides a cycle, it does not
remove it.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = "moejax"

# Module prefix -> prefixes it must never import (the layering config -> presets -> model -> parallel ->
# train -> cli; data, checkpoint and the tools sit beside train).
FORBIDDEN = {
    "moejax.config": ("moejax.",),
    "moejax.fsio": ("moejax.",),
    "moejax.diffs": ("moejax.",),
    "moejax.roofline": ("moejax.",),
    "moejax.accounting": ("moejax.model", "moejax.parallel", "moejax.train", "moejax.data", "moejax.cli"),
    "moejax.presets": ("moejax.model", "moejax.parallel", "moejax.train", "moejax.data", "moejax.cli"),
    "moejax.model": ("moejax.parallel", "moejax.train", "moejax.data", "moejax.cli", "moejax.presets",
                     "moejax.checkpoint", "moejax.ladder", "moejax.plan"),
    "moejax.parallel": ("moejax.train", "moejax.data", "moejax.cli", "moejax.presets", "moejax.checkpoint",
                        "moejax.ladder", "moejax.plan"),
    "moejax.data": ("moejax.model", "moejax.parallel", "moejax.train", "moejax.cli"),
    "moejax.train": ("moejax.cli", "moejax.ladder", "moejax.plan", "moejax.presets"),
    # imported by the CLI before any backend starts: nothing above checkpoint (its collective, lazily)
    "moejax.preemption": ("moejax.model", "moejax.parallel", "moejax.train", "moejax.data", "moejax.cli"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """moejax modules imported anywhere in `path` (`from a import b` counts a.b when that is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith(PKG)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PKG) and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, modules) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules, or [] (depth-first search with an explicit path)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep] if dep in path else [node, dep]
            if dep not in state and (cycle := visit(dep, path + [dep])):
                return cycle
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return []


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():  # the checker itself can fail
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_downwards(layer):
    graph = import_graph()
    bad = sorted(f"{mod} imports {dep}" for mod, deps in graph.items()
                 if mod == layer or mod.startswith(layer + ".")
                 for dep in deps if any(dep == f or dep.startswith(f) for f in FORBIDDEN[layer]))
    assert not bad, "; ".join(bad)
