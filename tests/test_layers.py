"""The package's layers: an import graph without cycles, and imports that point down only.

Every `import` / `from ... import` in a module counts (module level and inside functions, relative and
absolute), except those under `if TYPE_CHECKING:`, which never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "medusa_chat"
PACKAGE = PACKAGE_DIR.name

# Layer rank per subpackage (or top-level module); a module may import only modules of the same or a lower
# rank. Top-level modules not named here are the basics (rank 0).
LAYERS: dict[str, int] = {
    "kernels": 1,
    "model": 2,
    "engine": 3,
    "tuning": 4,
    "chat": 5,
    "bench": 5,
    "training": 5,
    "openai": 6,
    "ui": 7,
    "ask": 8,
    "cli": 8,
    "__main__": 8,
}


def module_names(root: Path) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (file, is a package __init__)} for every .py file under `root`."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_names(source: str, module: str, is_pkg: bool) -> set[str]:
    """Every dotted name `source` imports (for `from a import b`: both `a` and `a.b`), relative ones resolved."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
        visit(node)

    visit(ast.parse(source))
    return found


def import_graph(root: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """{module: the package's modules it imports}."""
    mods = module_names(root)
    graph = {}
    for name, (path, is_pkg) in mods.items():
        edges = set()
        for target in imported_names(path.read_text(), name, is_pkg):
            while target and target not in mods:  # `from a.b import func` -> a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        iters = [iter(sorted(graph.get(start, ())))]
        state[start] = 1
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph.get(nxt, ()))))
    return None


def rank(module: str) -> int:
    parts = module.split(".")
    if len(parts) < 2:
        return 0  # the package's own __init__
    return LAYERS.get(parts[1], 0)


def test_cycle_finder_finds_a_cycle_in_a_synthetic_graph() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_import_reader_counts_function_level_and_relative_imports_but_not_type_checking() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from .. import errors\n"
        "if TYPE_CHECKING:\n"
        "    from medusa_chat.ui import web\n"
        "def f():\n"
        "    import medusa_chat.engine.engine\n"
    )
    names = imported_names(source, "medusa_chat.model.loading", is_pkg=False)
    assert {"medusa_chat.model.sibling", "medusa_chat.errors", "medusa_chat.engine.engine"} <= names
    assert not any(n.startswith("medusa_chat.ui") for n in names)


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_point_down_the_layers() -> None:
    graph = import_graph()
    upward = [
        f"{mod} (rank {rank(mod)}) imports {dep} (rank {rank(dep)})"
        for mod, deps in sorted(graph.items())
        for dep in sorted(deps)
        if dep.startswith(PACKAGE + ".") and rank(dep) > rank(mod)
    ]
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


@pytest.mark.parametrize("sub", sorted(k for k in LAYERS if (PACKAGE_DIR / k).is_dir()))
def test_every_layer_exists(sub: str) -> None:
    assert (PACKAGE_DIR / sub / "__init__.py").is_file()
