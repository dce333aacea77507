"""The docs' figures and their result files: every `benchmarks/results/...` file (JSON, log) that README.md,
docs/*.md and assets/README.md name exists; the README's headline table, a few other README figures and the
docs' tables of busy-machine, browser, sampling, drafter and heads runs are recomputed from the files they name;
no result JSON keeps an absolute path of the machine that wrote it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "assets" / "README.md"]

# `results/x.json`, `benchmarks/results/x.json`, `../benchmarks/results/x_{a,b}.json`, `results/h200_*`
NAMED = re.compile(r"(?<![\w/.-])(?:\.\./)?(?:benchmarks/)?results/[\w.{},*/-]*(?:\.json|\.log|\.txt|\*)")
ABSOLUTE = re.compile(r"(?<![\w.~-])/(?:work|root|home|Users)/")
HEADLINE = "benchmarks/results/bench_cpu_xeon_amx_80prompts_heads_ft_run{1,2,3}.json"


def expand(pattern: str) -> list[str]:
    """Shell brace expansion: `a_{1,2}.json` -> `a_1.json`, `a_2.json`."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [q for alt in m.group(1).split(",") for q in expand(pattern[: m.start()] + alt + pattern[m.end() :])]


def named_results(text: str) -> list[str]:
    """The result files a text names, braces expanded, relative to the repository (globs left as globs)."""
    out = []
    for m in NAMED.finditer(text):
        name = m.group(0).removeprefix("../")
        out += expand(name if name.startswith("benchmarks/") else "benchmarks/" + name)
    return out


def load(name: str) -> dict[str, Any]:
    return json.loads((ROOT / name).read_text())


def test_the_pattern_finds_what_docs_write() -> None:
    text = "see `results/a_{x,y}.json` and [f](../benchmarks/results/b.json), `results/h200_*` (results/), `results/c.log`"
    assert named_results(text) == [
        "benchmarks/results/a_x.json",
        "benchmarks/results/a_y.json",
        "benchmarks/results/b.json",
        "benchmarks/results/h200_*",
        "benchmarks/results/c.log",
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_named_result_file_exists(doc: Path) -> None:
    missing = [n for n in named_results(doc.read_text(encoding="utf-8")) if not list(ROOT.glob(n))]
    assert not missing, f"{doc.name} names result files that are not in benchmarks/results/: {missing}"


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in _strings(k) + _strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return [obj] if isinstance(obj, str) else []


def test_result_jsons_keep_no_absolute_paths() -> None:
    found = {}
    for path in sorted(RESULTS.glob("*.json")):
        bad = [s for s in _strings(json.loads(path.read_text())) if ABSOLUTE.search(s)]
        if bad:
            found[path.name] = bad[:2]
    assert not found, f"absolute paths in result JSONs (keep them relative to the repository): {found}"


def test_the_absolute_path_check_can_fail() -> None:
    assert ABSOLUTE.search("5 x hydra (/work/main/assets/x.safetensors)")
    assert ABSOLUTE.search("/home/me/m.gguf")
    assert not ABSOLUTE.search("assets/smollm2-135m/x.safetensors")
    assert not ABSOLUTE.search("../models/llama-1b/m.gguf")


# ---- the README's figures, recomputed --------------------------------------------------------------------------------
def readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def table_row(text: str, label: str) -> list[str]:
    rows = [line for line in text.splitlines() if line.startswith("|") and label in line.split("|")[1]]
    assert len(rows) == 1, f"one README table row labelled {label!r}, found {len(rows)}"
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


def span(values: list[float], spec: str) -> str:
    lo, hi = min(values), max(values)
    if spec == "d":
        return f"{round(lo)}-{round(hi)}"
    return f"{lo:{spec}}-{hi:{spec}}"


def test_readme_headline_table_matches_its_files() -> None:
    text = readme()
    assert HEADLINE in text, "the headline table names its JSON files"
    runs = [load(n)["summary"] for n in expand(HEADLINE)]

    def col(key: str) -> list[float]:
        return [s[key] for s in runs]

    steps = {f"{s['tokens_per_step']:.2f}" for s in runs}
    assert len(steps) == 1
    medusa = table_row(text, "**Medusa**")
    assert medusa[0] == f"**Medusa** ({steps.pop()} tokens per step)"
    assert medusa[1] == span(col("medusa_tokens_per_s"), "d")
    plain = table_row(text, "own plain loop")
    assert plain[1:] == [span(col("plain_tokens_per_s"), "d"), f"**{span(col('speedup_vs_plain_loop'), '.2f')}x**"]
    llama = table_row(text, "`llama-bench`, same GGUF")
    assert llama[1:] == [span(col("llamacpp_tokens_per_s"), "d"), f"**{span(col('speedup_vs_llamacpp'), '.2f')}x**"]
    hf = table_row(text, "Hugging Face")
    assert hf[1:] == [span(col("hf_tokens_per_s"), "d"), f"{span(col('speedup_vs_hf_generate'), '.1f')}x"]
    identical = {round(s["identical_to_plain_loop_fraction"] * s["prompts"]) for s in runs}
    prompts = {s["prompts"] for s in runs}
    assert len(identical) == 1 and len(prompts) == 1
    assert table_row(text, "greedy reply identical")[2] == f"{identical.pop()}/{prompts.pop()} prompts"


def test_readme_fidelity_table_matches_its_file() -> None:
    name = "benchmarks/results/fidelity_2026-12-05_epyc_embedded.json"
    text = readme()
    assert name in named_results(text)
    paths = load(name)["paths"]
    for label, key in (("default, int4", "medusa-chat int4"), ("int8 (Q8_0", "medusa-chat int8")):
        row = [cell.replace("**", "") for cell in table_row(text, label)]
        tf, greedy = paths[key]["teacher_forced"], paths[key]["greedy"]
        assert row[1] == f"{100 * tf['top1']:.1f}%"
        assert row[2] == f"{tf['mean_kl']:.5f}"
        assert row[3].startswith(f"{greedy['median_chars']:g} ({greedy['identical']}/{load(name)['prompts']}")


def _plain_vs_llamacpp(doc: dict[str, Any]) -> float:
    return doc["summary"]["plain_vs_llamacpp"]


def _eagle3_tokens_per_step(doc: dict[str, Any]) -> float:
    return next(d["tokens_per_step"] for d in doc["drafts"] if d["method"] == "draft:eagle3")


def _int8_over_int4_kl(doc: dict[str, Any]) -> float:
    return doc["paths"]["medusa-chat int8"]["teacher_forced"]["mean_kl"] / doc["paths"]["medusa-chat int4"]["teacher_forced"]["mean_kl"]


# (file, what to read, how the README writes it)
README_FIGURES = [
    ("bench_2026-12-04_xeon_amx_1b_q4km.json", _plain_vs_llamacpp, "{:.2f}x on an Intel Xeon"),
    ("bench_2026-12-03_epyc_zen1_1b_q4km.json", _plain_vs_llamacpp, "{:.2f}x on an AMD EPYC Zen 1"),
    ("bench_2026-12-03_epyc_7b_q4km.json", _plain_vs_llamacpp, "and {:.2f}x on the Xeon, the Zen 1 and the Zen 5"),
    ("bench_2026-12-05_epyc_zen4_1b_q4km.json", _plain_vs_llamacpp, "{:.2f}-1.08x on a Zen 4"),
    ("bench_2026-12-05_epyc_zen4_1b_q4km_run2.json", _plain_vs_llamacpp, "0.94-{:.2f}x on a Zen 4"),
    ("bench_2026-12-05_epyc_zen4_80prompts_sized_run2.json", lambda d: d["summary"]["speedup_vs_plain_loop"],
     "Medusa {:.2f}-1.44x its plain loop"),
    ("bench_2026-12-05_epyc_zen4_80prompts_late.json", lambda d: d["summary"]["speedup_vs_plain_loop"],
     "Medusa 1.27-{:.2f}x its plain loop"),
    ("bench_2026-12-04_xeon_amx_7b_q4km.json", _plain_vs_llamacpp, "(4.18 GB) {:.2f}x"),
    ("bench_2026-12-03_epyc_zen1_7b_q4km.json", _plain_vs_llamacpp, "(4.18 GB) 1.20x, {:.2f}x"),
    ("gguf_memory_2026-12-03_epyc_7b_q4km.json", lambda d: d["after_decode"]["VmHWM"] / 1e9, "peak RSS {:.2f} GB"),
    ("medusa1_step_cost_2026-12-03_epyc_1b.json", lambda d: d["runs"]["block"]["sizes"]["2"]["ratio"],
     "costs {:.2f}x a plain step at 1.17B"),
    ("bench_2026-12-04_xeon_amx_compare_eagle3_fp32_64nodes.json", _eagle3_tokens_per_step,
     "{:.2f} tokens/step at 64 nodes"),
    ("bench_2026-12-04_xeon_amx_compare_eagle3_fp32_64nodes.json", lambda d: d["summary"]["tokens_per_step"],
     "Hydra {:.2f}"),
    ("fidelity_2026-12-05_epyc_embedded.json", _int8_over_int4_kl, "a second time and is {:.1f}x less faithful"),
    ("bench_2026-12-07_epyc_zen4_llamacpp_spec_run1.json",
     lambda d: d["summary"]["medusa_serve_speedup_vs_best_llamacpp"], "is **{:.2f}-"),
    ("bench_2026-12-07_epyc_zen4_llamacpp_spec_run2.json",
     lambda d: d["summary"]["medusa_serve_speedup_vs_best_llamacpp"], "-{:.2f}x** llama-server's best mode"),
    ("bench_2026-12-07_epyc_zen4_llamacpp_spec_run1.json",
     lambda d: d["summary"]["llamacpp_spec"]["llamacpp-eagle3"]["vs_llamacpp_plain"], "our exported EAGLE-3 draft {:.2f}-"),
    ("bench_2026-12-07_epyc_zen4_llamacpp_spec_run2.json",
     lambda d: d["summary"]["llamacpp_spec"]["llamacpp-eagle3"]["vs_llamacpp_plain"], "-{:.2f}x),"),
    ("bench_2026-12-07_epyc_zen4_llamacpp_spec_run2.json",
     lambda d: sum(r["servers"]["medusa-serve"]["identical_to_plain_loop"] for r in d["prompts"]),
     "its replies {}/12 those of our plain loop"),
]


@pytest.mark.parametrize(("name", "read", "written"), README_FIGURES, ids=[f[2][:24] for f in README_FIGURES])
def test_readme_figures_match_their_files(name: str, read: Any, written: str) -> None:
    text = readme()
    assert f"benchmarks/results/{name}" in named_results(text), f"README names {name} next to the figure"
    figure = written.format(read(load(f"benchmarks/results/{name}")))
    assert figure in " ".join(text.split()), f"README should read {figure!r} (from {name})"


def test_bench_writes_paths_relative_to_the_repository(tmp_path: Path) -> None:
    import tempfile

    from medusa_chat.paths import repo_path

    assert repo_path(str(ROOT / "assets" / "smollm2-135m" / "tree.json")) == "assets/smollm2-135m/tree.json"
    tmp = Path(tempfile.gettempdir()).resolve()
    if not ROOT.parent.resolve().is_relative_to(tmp):  # (a checkout under the temp folder: its neighbours are <tmp>)
        assert repo_path(str(ROOT.parent / "models" / "m.gguf")) == "../models/m.gguf"
    inside_tmp = Path(tempfile.gettempdir()) / "medusa-x" / "hf"
    if not inside_tmp.resolve().is_relative_to(ROOT):
        assert repo_path(str(inside_tmp)) == "<tmp>/medusa-x/hf"
    for kept in ("smollm2-135m", "FasterDecoding/medusa-vicuna-7b-v1.3", "llama-1b.gguf", ""):
        assert repo_path(kept) == kept
    assert not ABSOLUTE.search(repo_path(str(tmp_path / "m.gguf")))


# ---- the docs' tables, recomputed -------------------------------------------------------------------------------------
def doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


def rows_naming(text: str, pattern: str) -> list[tuple[str, list[str]]]:
    """(file, cells) of each table row, the file being the first match of `pattern` in its first cell; a row that
    names none ("the same run") takes the previous row's file."""
    out, last = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            last = None  # (a row of another table never takes this one's file)
            continue
        if line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        m = re.search(pattern, cells[0])
        if m:
            last = m.group(0)
        elif not cells[0].startswith("the same") or last is None:
            continue
        out.append((last, cells))
    return out


def test_busy_machine_table_matches_its_files() -> None:
    rows = rows_naming(doc("benchmarks.md"), r"bench_[\w.-]*background_load[\w.-]*\.json")
    assert len(rows) >= 6
    for name, cells in rows:
        side = {m["method"]: m for m in load(f"benchmarks/results/{name}")["side_by_side"]}
        medusa, plain = side["medusa"], side["plain"]
        assert cells[1] == f"{medusa['quiet_tokens_per_s']:.1f} -> {medusa['loaded_tokens_per_s']:.1f}", name
        assert cells[2] == f"{medusa['loaded_over_quiet']:.2f}x", name
        assert cells[3] == f"{plain['quiet_tokens_per_s']:.1f} -> {plain['loaded_tokens_per_s']:.1f}", name
        assert cells[4] == f"{plain['medusa_speedup_quiet']:.2f}x -> {plain['medusa_speedup_loaded']:.2f}x", name
        llama = side.get("llamacpp")
        if llama is None:
            assert cells[5:] == ["", ""], name
        else:
            assert cells[5] == f"{llama['quiet_tokens_per_s']:.1f} -> {llama['loaded_tokens_per_s']:.1f}", name
            assert cells[6] == f"{llama['medusa_speedup_loaded']:.2f}x", name


def browser_summary(name: str) -> dict[str, tuple[float, float]]:
    """A browser_vs_ask log's closing table: variant -> (tok/s, x ask); `ask` for the engine's own line."""
    out = {}
    for line in (RESULTS / name).read_text(encoding="utf-8").splitlines():
        m = re.match(r"\s*(ask \(engine|web UI in Chromium, ([\w-]+))[^\d]*\s([\d.]+)\s+([\d.]+)", line)
        if m:
            out[m.group(2) or "ask"] = (float(m.group(3)), float(m.group(4)))
    return out


def test_browser_table_matches_its_logs() -> None:
    rows = rows_naming(doc("benchmarks.md"), r"browser_vs_ask_[\w.-]+\.log")
    assert len(rows) >= 6
    for name, cells in rows:
        summary = browser_summary(name)
        variant, ask, page, ratio = cells[1:5]
        assert ask == f"{summary['ask'][0]:.1f}", name
        assert page == f"{summary[variant][0]:.1f}", name
        assert ratio == f"{summary[variant][1]:.2f}x", name


def test_sampling_table_matches_its_files() -> None:
    text = doc("sampling.md")
    assert "benchmarks/results/bench_T{0.7,1.0}_{typical,exact}_cpu_avx2.json" in text
    rows = [r for r in (line.strip("|").split("|") for line in text.splitlines() if re.match(r"\| [01]\.\d \|", line))]
    assert len(rows) == 4
    for row in rows:
        temp, mode, per_step, medusa, plain, speedup, same = (c.strip() for c in row)
        s = load(f"benchmarks/results/bench_T{temp}_{mode}_cpu_avx2.json")["summary"]
        assert per_step == f"{s['tokens_per_step']:.2f}"
        assert medusa == f"{s['medusa_tokens_per_s']:.1f}" and plain == f"{s['plain_tokens_per_s']:.1f}"
        assert speedup == f"{s['speedup_vs_plain_loop']:.2f}x"
        if mode == "exact":
            assert same == f"{round(s['exact_identical_to_plain_fraction'] * s['prompts'])}/{s['prompts']}"


def _depths(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}".removeprefix("0") for v in values[:3])


def test_eagle3_table_matches_its_files() -> None:
    text = doc("EAGLE.md")
    assert "benchmarks/results/bench_2026-12-04_xeon_amx_compare_eagle3_{fp32_64nodes,native}.json" in text
    fp32 = load("benchmarks/results/bench_2026-12-04_xeon_amx_compare_eagle3_fp32_64nodes.json")
    native = load("benchmarks/results/bench_2026-12-04_xeon_amx_compare_eagle3_native.json")

    def draft(d: dict[str, Any], method: str) -> dict[str, Any]:
        return next(x for x in d["drafts"] if x["method"] == method)

    def medusa(d: dict[str, Any]) -> dict[str, Any]:
        s = d["summary"]
        return {"tokens_per_step": s["tokens_per_step"], "acceptance_by_depth": s["acceptance_by_depth"],
                "tokens_per_s": s["medusa_tokens_per_s"], "speedup_vs_plain_loop": s["speedup_vs_plain_loop"]}

    expected = {
        "fp32 (`--quant none`), Hydra heads": medusa(fp32),
        "fp32, this EAGLE-3 draft": draft(fp32, "draft:eagle3"),
        "fp32, the EAGLE-1 draft": draft(fp32, "draft:eagle"),
        "int4 default, Hydra heads": medusa(native),
        "int4, this EAGLE-3 draft": draft(native, "draft:eagle3"),
    }
    for label, r in expected.items():
        row = [c.replace("**", "") for c in table_row(text, label)]
        assert row[2] == f"{r['tokens_per_step']:.2f}", label
        assert row[3] == _depths(r["acceptance_by_depth"]), label
        assert row[4] == f"{r['tokens_per_s']:.1f}", label
        assert row[5] == f"{r['speedup_vs_plain_loop']:.2f}x", label


def test_medusa1_heads_table_matches_its_files() -> None:
    text = doc("medusa1_heads.md")
    assert "benchmarks/results/bench_2026-12-03_epyc_avx2_{medusa1,hydra}_heads.json" in text
    for label, kind in (("Medusa-1 (`--heads medusa-1`)", "medusa1"), ("Hydra (default)", "hydra")):
        d = load(f"benchmarks/results/bench_2026-12-03_epyc_avx2_{kind}_heads.json")
        s, big = d["summary"], next(x for x in d["tree_sizes"] if x["size"] == 64)
        row = [c.replace("**", "") for c in table_row(text, label)]
        assert row[1] == f"{big['tokens_per_step']:.2f}"
        assert row[2] == f"{d['tree_size']} node (plain)"
        assert row[3] == f"{s['medusa_tokens_per_s']:.1f}"
        assert row[4] == f"{s['speedup_vs_plain_loop']:.2f}x" and row[5] == f"{s['speedup_vs_llamacpp']:.2f}x"
        assert row[6] == f"{round(s['identical_to_plain_loop_fraction'] * s['prompts'])}/{s['prompts']}"
