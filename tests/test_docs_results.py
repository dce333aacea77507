"""The docs' figures and their result files: every `benchmarks/results/...json` that README.md and docs/*.md name
exists, the README's headline table and a few other README figures are recomputed from the files they name, and
no result JSON keeps an absolute path of the machine that wrote it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# `results/x.json`, `benchmarks/results/x.json`, `../benchmarks/results/x_{a,b}.json`, `results/h200_*`
NAMED = re.compile(r"(?<![\w/.-])(?:\.\./)?(?:benchmarks/)?results/[\w.{},*/-]*(?:\.json|\*)")
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
    text = "see `results/a_{x,y}.json` and [f](../benchmarks/results/b.json), `results/h200_*` (results/)"
    assert named_results(text) == [
        "benchmarks/results/a_x.json",
        "benchmarks/results/a_y.json",
        "benchmarks/results/b.json",
        "benchmarks/results/h200_*",
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


# (file, what to read, how the README writes it)
README_FIGURES = [
    ("bench_2026-12-04_xeon_amx_1b_q4km.json", _plain_vs_llamacpp, "{:.2f}x on an Intel Xeon"),
    ("bench_2026-12-03_epyc_zen1_1b_q4km.json", _plain_vs_llamacpp, "{:.2f}x on an AMD EPYC Zen 1"),
    ("bench_2026-12-03_epyc_7b_q4km.json", _plain_vs_llamacpp, "and {:.2f}x on the same three"),
    ("bench_2026-12-04_xeon_amx_7b_q4km.json", _plain_vs_llamacpp, "(4.18 GB) {:.2f}x"),
    ("bench_2026-12-03_epyc_zen1_7b_q4km.json", _plain_vs_llamacpp, "(4.18 GB) 1.20x, {:.2f}x"),
    ("gguf_memory_2026-12-03_epyc_7b_q4km.json", lambda d: d["after_decode"]["VmHWM"] / 1e9, "peak RSS {:.2f} GB"),
    ("medusa1_step_cost_2026-12-03_epyc_1b.json", lambda d: d["runs"]["block"]["sizes"]["2"]["ratio"],
     "costs {:.2f}x a plain step at 1.17B"),
    ("bench_2026-12-04_xeon_amx_compare_eagle3_fp32_64nodes.json", _eagle3_tokens_per_step,
     "{:.2f} tokens/step at 64 nodes"),
    ("bench_2026-12-04_xeon_amx_compare_eagle3_fp32_64nodes.json", lambda d: d["summary"]["tokens_per_step"],
     "Hydra {:.2f}"),
]


@pytest.mark.parametrize(("name", "read", "written"), README_FIGURES, ids=[f[2][:24] for f in README_FIGURES])
def test_readme_figures_match_their_files(name: str, read: Any, written: str) -> None:
    text = readme()
    assert f"benchmarks/results/{name}" in named_results(text), f"README names {name} next to the figure"
    figure = written.format(read(load(f"benchmarks/results/{name}")))
    assert figure in " ".join(text.split()), f"README should read {figure!r} (from {name})"


def test_bench_writes_paths_relative_to_the_repository(tmp_path: Path) -> None:
    import tempfile

    from medusa_chat.bench.runs import repo_path

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
