"""The house rules the layers test (test_layers.py: no cycles, imports point down) does not cover: modules of at
most 600 lines, folders of at most 20 modules, composition instead of classes built from several of the package's
own classes, functions of at most 7 parameters (options travel as one dataclass), no circle among the C files,
and result files that name no machine's paths."""

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


MAX_PARAMETERS = 7
# The package's functions allowed more (GPU kernels, @triton.jit, aside: a kernel's signature is its launch
# grid's arguments). Each entry must still be wide, so the list only shrinks; at most 8 of them.
WIDE_ALLOWED = {
    "kernels/triton_attention.py:path_attention",  # the Triton kernel's launcher: its arguments are the kernel's
    "model/sources/loading.py:load_model",  # the public entry point, its options named as the CLI's flags
    "model/forward/eagle.py:_block",
    "training/distill.py:sample_user_turns",
    "tuning/calibrate.py:calibrate",
    "tuning/calibrate.py:_record",
    "tuning/measure.py:measure_step_latency",
}


def wide_functions(source: str, limit: int = MAX_PARAMETERS) -> dict[str, int]:
    """{function name: its parameter count} for the functions of `source` taking more than `limit` parameters
    (self and cls not counted; *args and **kwargs count one each), @triton.jit kernels left out."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if any("triton.jit" in ast.unparse(d) for d in node.decorator_list):
            continue
        a = node.args
        names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg not in ("self", "cls")]
        n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
        if n > limit:
            found[node.name] = n
    return found


def test_the_parameter_counter() -> None:
    source = (
        "import triton\n"
        "def narrow(a, b, c, d, e, f, g): ...\n"
        "def wide(a, b, c, d, e, f, *, g, h): ...\n"
        "class C:\n"
        "    def method(self, a, b, c, d, e, f, g): ...\n"
        "    def spread(self, a, b, c, d, e, f, *args, **kwargs): ...\n"
        "@triton.jit\n"
        "def kernel(a, b, c, d, e, f, g, h, i): ...\n"
    )
    assert wide_functions(source) == {"wide": 8, "spread": 8}


def test_functions_take_at_most_7_parameters() -> None:
    found = {
        f"{path.relative_to(PACKAGE_DIR).as_posix()}:{name}": n
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        for name, n in wide_functions(path.read_text()).items()
    }
    new = sorted(f"{k} ({n})" for k, n in found.items() if k not in WIDE_ALLOWED)
    assert not new, f"functions with more than {MAX_PARAMETERS} parameters (pass an options dataclass):\n" + "\n".join(
        new
    )
    narrowed = sorted(WIDE_ALLOWED - set(found))
    assert not narrowed, "allowed to be wide but no longer are (take them off WIDE_ALLOWED):\n" + "\n".join(narrowed)
    assert len(WIDE_ALLOWED) <= 8


def c_calls(csrc: Path) -> dict[str, set[str]]:
    """{C file: the other .c files whose functions it calls}: a function defined (not static) in one file and
    named in another's code (comments and strings left out) is a call from that file into the first."""
    code = {p.name: re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"', "", p.read_text(), flags=re.S) for p in sorted(csrc.glob("*.c"))}
    definition = re.compile(r"^(?!static)[A-Za-z_][\w \t\*]*?\b(\w+)\s*\([^;{]*\)\s*\{", re.M)
    owner = {name: f for f, text in code.items() for name in definition.findall(text)}
    return {
        f: {owner[w] for w in set(re.findall(r"\b\w+\b", text)) if owner.get(w, f) != f}
        for f, text in code.items()
    }


def test_the_c_files_call_each_other_without_a_circle() -> None:
    calls = c_calls(PACKAGE_DIR / "kernels" / "csrc")
    assert "team.c" in calls["kquants.c"] and "kquants.c" in calls["qgemm.c"]  # (the reader sees the calls)
    circles = []
    for start in calls:
        seen, todo = set(), list(calls[start])
        while todo:
            f = todo.pop()
            if f == start:
                circles.append(start)
                break
            if f not in seen:
                seen.add(f)
                todo.extend(calls[f])
    assert not circles, f"C files that call back into themselves through others: {sorted(circles)}"
