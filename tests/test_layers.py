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
    "export": 3,  # drafts written for serving engines: reads model files, used by bench
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


# model/ in two: how a model computes (forward/) below where a model comes from (sources/), which loads it with
# the forwards; model/'s own modules (mapped_weights) serve both.
SUBLAYERS: dict[str, float] = {"model.forward": 2.0, "model.sources": 2.5}


def rank(module: str) -> float:
    parts = module.split(".")
    if len(parts) < 2:
        return 0  # the package's own __init__
    return SUBLAYERS.get(".".join(parts[1:3]), LAYERS.get(parts[1], 0))


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


@pytest.mark.parametrize("sub", sorted([*(k for k in LAYERS if (PACKAGE_DIR / k).is_dir()), *SUBLAYERS]))
def test_every_layer_exists(sub: str) -> None:
    assert (PACKAGE_DIR / sub.replace(".", "/") / "__init__.py").is_file()


def test_rank_orders_the_model_halves() -> None:
    assert rank("medusa_chat.kernels.cbind") < rank("medusa_chat.model.forward.runner")
    assert rank("medusa_chat.model.forward.runner") < rank("medusa_chat.model.sources.loading")
    assert rank("medusa_chat.model.sources.loading") < rank("medusa_chat.engine.engine")
    assert rank("medusa_chat.model.mapped_weights") == rank("medusa_chat.model.forward.heads")


# ---- private names stay in their module ------------------------------------------------------------------------
# A name that starts with "_" (not a dunder) belongs to the module that defines it: no other module imports it,
# reads it as an attribute, or sets it on an object.


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _from_target(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_imports(source: str, module: str, is_pkg: bool) -> list[str]:
    """`from X import _name` in `source` (absolute or relative, anywhere: functions and TYPE_CHECKING blocks too)
    where X is another module of the package: "X._name" for each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            target = _from_target(node, module, is_pkg)
            if target.split(".")[0] != PACKAGE or target == module:
                continue
            found += [f"{target}.{a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == PACKAGE and any(
                _private(part) for part in a.name.split(".")[1:])]
    return found


def _attribute_uses(tree: ast.AST) -> tuple[set[str], set[str], set[str]]:
    """(private names this module defines: self._x = ..., class-level _x, def _x, module-level _x; private
    attributes it sets on other objects: obj._x = ..., setattr(obj, "_x", ...), obj.__dict__["_x"] = ...;
    private attributes it reads on other objects: obj._x, getattr / hasattr(obj, "_x"))."""
    defined: set[str] = set()
    set_on: set[str] = set()
    read_on: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
            defined.add(node.id)
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            mine = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if mine and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif not mine:
                (set_on if isinstance(node.ctx, ast.Store) else read_on).add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1:
            key = node.args[1]
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and _private(key.value):
                if node.func.id == "setattr":
                    set_on.add(key.value)
                elif node.func.id in ("getattr", "hasattr"):
                    read_on.add(key.value)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            key = node.slice
            is_dict = isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__"
            if is_dict and isinstance(key, ast.Constant) and isinstance(key.value, str) and _private(key.value):
                set_on.add(key.value)
    return defined, set_on, read_on


def private_attribute_uses(root: Path = PACKAGE_DIR) -> list[str]:
    """Where a module reads a private attribute that only other modules of the package define, and private
    attributes that more than one module sets on objects not their own. (Private names the package never
    defines, e.g. torch's `_C`, are not its business.)"""
    uses = {}
    for name, (path, _) in module_names(root).items():
        uses[name] = _attribute_uses(ast.parse(path.read_text()))
    owners: dict[str, set[str]] = {}
    setters: dict[str, set[str]] = {}
    for name, (defined, set_on, _) in uses.items():
        for attr in defined | set_on:
            owners.setdefault(attr, set()).add(name)
        for attr in set_on:
            setters.setdefault(attr, set()).add(name)
    found = [
        f"{name} reads {attr}, which {', '.join(sorted(owners[attr]))} define(s)"
        for name, (defined, set_on, read_on) in sorted(uses.items())
        for attr in sorted(read_on - defined - set_on)
        if attr in owners
    ]
    found += [f"{attr} is set on objects by {', '.join(sorted(mods))}" for attr, mods in sorted(setters.items())
              if len(mods) > 1]
    return found


def test_private_name_reader_sees_relative_function_level_and_type_checking_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from .block_forward import _BLin, embed_struct\n"
        "from medusa_chat.model.loading import load_model as _load\n"
        "from medusa_chat.model.native_eagle import __doc__\n"
        "from ._own import x\n"
        "if TYPE_CHECKING:\n"
        "    from medusa_chat.engine.engine import _Hidden\n"
        "def f():\n"
        "    from ..kernels.qgemm import _bind\n"
        "    from medusa_chat.model.native_eagle import _helper\n"
    )
    found = private_imports(source, "medusa_chat.model.native_eagle", is_pkg=False)
    assert found == ["medusa_chat.model.block_forward._BLin", "medusa_chat.engine.engine._Hidden",
                     "medusa_chat.kernels.qgemm._bind"]
    defined, set_on, read_on = _attribute_uses(ast.parse(
        "class A:\n    _x = 1\n    def f(self, e):\n        self._y = e._graph\n        e._flag = True\n"
        "        getattr(e, '_eagle', None)\n        e.__dict__['_kept'] = 1\n"
    ))
    assert defined == {"_x", "_y"} and set_on == {"_flag", "_kept"} and read_on == {"_graph", "_eagle"}


def test_no_module_imports_another_modules_private_names() -> None:
    found = [
        f"{name}: {target}"
        for name, (path, is_pkg) in sorted(module_names(PACKAGE_DIR).items())
        for target in private_imports(path.read_text(), name, is_pkg)
    ]
    assert not found, "private names imported from other modules:\n" + "\n".join(found)


def test_no_module_reads_or_sets_another_modules_private_attributes() -> None:
    found = private_attribute_uses()
    assert not found, "private attributes used across modules:\n" + "\n".join(found)
