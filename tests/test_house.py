"""The house rules the layers test (test_layers.py: no cycles, imports point down) does not cover: modules of at
most 600 lines, folders of at most 20 modules, composition instead of classes built from several of the package's
own classes, and result files that name no machine's paths."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.test_layers import PACKAGE, PACKAGE_DIR, module_names

ROOT = PACKAGE_DIR.parent
MAX_LINES = 600
MAX_MODULES_PER_FOLDER = 20
# a path that only exists on the machine that wrote the file: a home, a temporary or a mounted folder
MACHINE_PATH = re.compile(r"(?<![\w.:/~-])/(?:home|root|work|tmp|Users|mnt|opt|scratch|workspace|private)/\S")


def _sources() -> list[Path]:
    """The package's modules, the benchmark scripts and run.py (the tests are not held to the size rule)."""
    return sorted([*PACKAGE_DIR.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"), ROOT / "run.py"])


def test_modules_are_at_most_600_lines() -> None:
    long = [f"{p.relative_to(ROOT)}: {n}" for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(long)


def test_no_folder_of_the_package_holds_more_than_20_modules() -> None:
    counts: dict[Path, int] = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        if path.name != "__init__.py":
            counts[path.parent] = counts.get(path.parent, 0) + 1
    crowded = [f"{d.relative_to(ROOT)}: {n}" for d, n in sorted(counts.items()) if n > MAX_MODULES_PER_FOLDER]
    assert not crowded, f"folders with more than {MAX_MODULES_PER_FOLDER} modules:\n" + "\n".join(crowded)
    assert max(counts.values()) >= 2  # (the count sees the package)


def own_class_bases(source: str, module: str, is_pkg: bool, package_classes: set[str]) -> dict[str, list[str]]:
    """{class defined in `source`: its bases that are the package's own classes}: a base counts where its name is
    a class of the package defined in this module or imported from the package."""
    tree = ast.parse(source)
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                target = ".".join(base[: len(base) - (node.level - 1)] + ([target] if target else []))
            if target.split(".")[0] == PACKAGE:
                imported.update(a.asname or a.name for a in node.names)
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))]
            mine = [n for n in names if n in package_classes and (n in own or n in imported)]
            found[node.name] = mine
    return found


def _package_classes() -> set[str]:
    return {
        n.name
        for path, _ in module_names(PACKAGE_DIR).values()
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.ClassDef)
    }


def test_the_class_reader_counts_own_bases_only() -> None:
    source = (
        "from torch import nn\n"
        "from medusa_chat.chat.history import ConversationHistory\n"
        "from .speed import SpeedMeter\n"
        "class Local: ...\n"
        "class Mixed(ConversationHistory, SpeedMeter, nn.Module): ...\n"
        "class One(Local, nn.Module): ...\n"
    )
    found = own_class_bases(source, "medusa_chat.chat.x", False, {"ConversationHistory", "SpeedMeter", "Local"})
    assert found == {"Local": [], "Mixed": ["ConversationHistory", "SpeedMeter"], "One": ["Local"]}


def test_no_class_is_built_from_two_or_more_of_the_package_classes() -> None:
    classes = _package_classes()
    chained = [
        f"{name}.{cls}({', '.join(bases)})"
        for name, (path, is_pkg) in sorted(module_names(PACKAGE_DIR).items())
        for cls, bases in own_class_bases(path.read_text(), name, is_pkg, classes).items()
        if len(bases) >= 2
    ]
    assert not chained, "classes built from several of the package's classes (hold them instead):\n" + "\n".join(
        chained
    )


def test_the_machine_path_pattern() -> None:
    assert MACHINE_PATH.search("wrote /tmp/gc/bench.json") and MACHINE_PATH.search("/home/me/x.gguf")
    assert not MACHINE_PATH.search("`/usr/bin/time -v`, results/bench.json, https://host/tmp/x")


def test_result_files_name_no_machine_paths() -> None:
    results = ROOT / "benchmarks" / "results"
    files = [p for p in sorted(results.rglob("*")) if p.is_file()]
    assert files
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()[:120]}"
        for p in files
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]
    assert not found, "absolute machine paths in result files (write them relative):\n" + "\n".join(found)


def test_docs_name_every_benchmark_script_as_rerun_or_one_off() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    rerun, _, one_off = text.partition("One-off experiments:")
    assert one_off, "docs/benchmarks.md has no table of one-off experiments"
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    unnamed = [s for s in scripts if f"`{s}`" not in text]
    assert not unnamed, "benchmark scripts docs/benchmarks.md does not name:\n" + "\n".join(unnamed)
    assert "`sampling_ab.py`" in one_off.split("###")[0] and "`sampling_ab.py`" not in rerun
