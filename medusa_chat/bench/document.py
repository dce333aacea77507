"""The bench's JSON document (bench/harness.py runs the methods): one row per prompt (speeds, speedups, whether
the replies are identical, where they first differ), the summary over the prompts, the run's settings and
machine, and the figures per tree size and per other draft."""

from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.bench.loops import loop_fraction
from medusa_chat.bench.report import heads_label, median_of
from medusa_chat.bench.runs import TIMING_NOTE, Run, first_divergence, repo_path, tie_tolerance, top2_gap
from medusa_chat.settings import EXACT, PENALTY_OPTIONS

if TYPE_CHECKING:
    from medusa_chat.bench.harness import BenchMethods, Tally
    from medusa_chat.tree import Tree


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return round(x, nd) if x is not None else None


def prompt_row(
    methods: BenchMethods,
    text: str,
    prompt_ids: list[int],
    outcome: tuple[dict[str, Run], dict[str, Any] | None],
    dtype: str,
    tally: Tally,
) -> dict[str, Any]:
    """One prompt's row of the document: speeds, speedups and whether the replies are identical. `outcome`: the
    prompt's runs per method and llama.cpp's run (methods.run_prompt)."""
    loaded, config, sizes = methods.loaded, methods.config, tally.sizes
    runs, peer_run = outcome
    greedy = config.greedy
    exact = config.settings.accept_mode == EXACT
    med = runs["medusa"]
    ref_method = "hf" if "hf" in runs else ("plain" if "plain" in runs else None)
    ref = runs[ref_method] if ref_method else None
    row: dict[str, Any] = {
        "prompt": text,
        "prompt_tokens": len(prompt_ids),
        "token_ids": med.token_ids,
        "baseline_token_ids": ref.token_ids if ref else None,
        "identical": None,
        "new_tokens": len(med.token_ids),
        "steps": med.steps,
        **({"sized_steps": {str(k): v for k, v in med.sized_steps.items()}} if med.sized_steps else {}),
        "tokens_per_step": _r(med.tokens_per_step),
        "medusa_s": _r(med.decode_s, 5),
        "baseline_s": _r(runs["hf"].decode_s, 5) if "hf" in runs else None,
        "plain_s": _r(runs["plain"].decode_s, 5) if "plain" in runs else None,
        "lookup_s": _r(runs["lookup"].decode_s, 5) if "lookup" in runs else None,
        "stop_reason": med.stop_reason,
        "time_to_first_token_s": _r(med.ttft_s, 5),
        "context_lookup_accepted": med.lookup_accepted,
    }
    for m, r in runs.items():
        key = m.replace("@", "_at_")
        row[f"{key}_decode_tokens"] = r.decode_tokens
        row[f"{key}_tokens_per_s"] = _r(r.tokens_per_s, 3)
        if m in ("lookup", "heads") or m in methods.drafts:
            row[f"{key}_tokens_per_step"] = _r(r.tokens_per_step)
    for b, key in (
        ("hf", "speedup_vs_hf_generate"),
        ("plain", "speedup_vs_plain_loop"),
        ("lookup", "speedup_vs_prompt_lookup"),
        ("heads", "speedup_vs_heads_only"),
    ):
        row[key] = _ratio(med.tokens_per_s, runs[b].tokens_per_s) if b in runs else None
    if peer_run is not None:
        row["llamacpp_tokens_per_s"] = _r(peer_run["tokens_per_s"], 3)
        row["speedup_vs_llamacpp"] = _ratio(med.tokens_per_s, peer_run["tokens_per_s"])
    if greedy and "plain" in runs:
        row["identical_to_plain_loop"] = runs["plain"].token_ids == med.token_ids
        tally.plain.append(row["identical_to_plain_loop"])
    if greedy and ref is not None:
        div = first_divergence(med.token_ids, ref.token_ids)
        row["identical"] = div is None
        row["first_divergence"] = div
        row["reference"] = ref_method
        if div is not None:
            gap, top = top2_gap(loaded, prompt_ids, ref.token_ids, div)
            row["divergence_top2_gap"] = round(gap, 6)
            row["near_tie"] = gap <= tie_tolerance(dtype, top)
        tally.identical.append(div is None)
        for other in ("plain", "lookup", "heads"):
            if other in runs and other != ref_method:
                row[f"{other}_identical"] = first_divergence(runs[other].token_ids, ref.token_ids) is None
        for n in sizes:
            tally.size_identical[n].append(
                first_divergence(runs[f"medusa@{n}"].token_ids, ref.token_ids) is None
            )
        for m in (m for m in runs if m.startswith("draft:")):
            tally.draft_identical.setdefault(m, []).append(
                first_divergence(runs[m].token_ids, ref.token_ids) is None
            )
    if exact and "plain" in runs:
        # exact mode couples Medusa to the plain loop: same seed, same reply (acceptance.py)
        row["identical_to_plain"] = first_divergence(med.token_ids, runs["plain"].token_ids) is None
        tally.exact.append(row["identical_to_plain"])
    if sizes:
        row["by_tree_size"] = {
            str(n): {
                "tokens_per_step": _r(runs[f"medusa@{n}"].tokens_per_step),
                "decode_s": _r(runs[f"medusa@{n}"].decode_s, 5),
                "tokens_per_s": _r(runs[f"medusa@{n}"].tokens_per_s, 3),
            }
            for n in sizes
        }
    return row


def _sized_total(rows: list[dict[str, Any]]) -> dict[str, int] | None:
    total: dict[int, int] = {}
    for r in rows:
        for k, v in r.get("sized_steps", {}).items():
            total[int(k)] = total.get(int(k), 0) + v
    return {str(k): v for k, v in sorted(total.items())} or None


def bench_summary(rows: list[dict[str, Any]], tally: Tally, methods: BenchMethods, greedy: bool) -> dict[str, Any]:
    """The document's summary: totals over all prompts (harmonic: total tokens / total time) and medians."""
    t = tally.totals
    peer, peer_runs, peer_note = methods.peer, methods.peer_runs, methods.peer_note
    identical_flags, plain_flags, exact_flags = tally.identical, tally.plain, tally.exact
    med_tps = t["medusa"].tokens_per_s
    # every run decodes the same number of tokens: the harmonic mean is total tokens / total time, as for the
    # other methods' totals
    peer_tps = (
        statistics.harmonic_mean([r["tokens_per_s"] for r in peer_runs]) if peer_runs and peer else None
    )
    summary: dict[str, Any] = {
        "prompts": len(rows),
        "identical_fraction": _r(sum(identical_flags) / len(identical_flags)) if identical_flags else None,
        "identical_to_plain_loop_fraction": _r(sum(plain_flags) / len(plain_flags)) if plain_flags else None,
        "llamacpp_tokens_per_s": _r(peer_tps, 3),
        "llamacpp_runs": peer_runs,
        "llamacpp_note": peer_note or None,
        "hf_note": methods.hf_note or None,
        "llamacpp_runner": type(peer).__name__ if peer_tps else None,  # LlamaBench | LlamaCppPython
        "speedup_vs_llamacpp": _ratio(med_tps, peer_tps),
        "plain_vs_llamacpp": _ratio(t["plain"].tokens_per_s, peer_tps) if "plain" in t else None,
        "tokens_per_step": _r(t["medusa"].tokens_per_step),
        # the share of replies that ran to the cap inside a repeating cycle (loops.py): beside tokens per step,
        # because a loop is what context lookup accepts best
        "loop_fraction": loop_fraction(rows),
        # Medusa's steps per tree prefix size, where the size was chosen as replies ran (engine/tree_sizer.py)
        "sized_steps": _sized_total(rows),
        "acceptance_by_depth": t["medusa"].acceptance_by_depth(),
        # of the draft tokens Medusa's steps accepted, the share that context lookup guessed
        "context_lookup_share": _r(
            sum(r["context_lookup_accepted"] for r in rows)
            / max(sum(r["medusa_decode_tokens"] - (r["steps"] or 0) for r in rows), 1)
        )
        if rows
        else None,
        "speedup_vs_heads_only": _ratio(med_tps, t["heads"].tokens_per_s) if "heads" in t else None,
        "heads_tokens_per_s": _r(t["heads"].tokens_per_s, 3) if "heads" in t else None,
        "heads_tokens_per_step": _r(t["heads"].tokens_per_step) if "heads" in t else None,
        "speedup_vs_hf_generate": _ratio(med_tps, t["hf"].tokens_per_s) if "hf" in t else None,
        "speedup_vs_plain_loop": _ratio(med_tps, t["plain"].tokens_per_s) if "plain" in t else None,
        "speedup_vs_prompt_lookup": _ratio(med_tps, t["lookup"].tokens_per_s) if "lookup" in t else None,
        "medusa_tokens_per_s": _r(med_tps, 3),
        "hf_tokens_per_s": _r(t["hf"].tokens_per_s, 3) if "hf" in t else None,
        "plain_tokens_per_s": _r(t["plain"].tokens_per_s, 3) if "plain" in t else None,
        "lookup_tokens_per_s": _r(t["lookup"].tokens_per_s, 3) if "lookup" in t else None,
        "lookup_tokens_per_step": _r(t["lookup"].tokens_per_step) if "lookup" in t else None,
        "plain_speedup_vs_hf_generate": _ratio(t["plain"].tokens_per_s, t["hf"].tokens_per_s)
        if "plain" in t and "hf" in t
        else None,
        "medusa_s": _r(t["medusa"].decode_s, 4),
        "baseline_s": _r(t["hf"].decode_s, 4) if "hf" in t else None,
        "plain_s": _r(t["plain"].decode_s, 4) if "plain" in t else None,
        "lookup_s": _r(t["lookup"].decode_s, 4) if "lookup" in t else None,
        "near_ties": sum(1 for r in rows if r.get("near_tie")) if greedy else None,
        "exact_identical_to_plain_fraction": _r(sum(exact_flags) / len(exact_flags)) if exact_flags else None,
        # Per-prompt medians resist a slow spell of a shared machine better than the totals do.
        "speedup_vs_hf_generate_median": median_of(r["speedup_vs_hf_generate"] for r in rows),
        "speedup_vs_plain_loop_median": median_of(r["speedup_vs_plain_loop"] for r in rows),
        "speedup_vs_prompt_lookup_median": median_of(r["speedup_vs_prompt_lookup"] for r in rows),
        "speedup_vs_heads_only_median": median_of(r["speedup_vs_heads_only"] for r in rows),
        "speedup_vs_llamacpp_median": median_of(r.get("speedup_vs_llamacpp") for r in rows),
        "timing": TIMING_NOTE,
    }
    if methods.servers is not None:
        summary.update(methods.servers.summary(med_tps))
    elif methods.servers_note:
        summary["llamacpp_spec_notes"] = [methods.servers_note]
    return summary


def document(
    methods: BenchMethods,
    tree_and_source: tuple[Tree, str],
    ident: dict[str, Any],
    rows: list[dict[str, Any]],
    tally: Tally,
    load_before: float | None,
) -> dict[str, Any]:
    """The JSON document: the run's settings and machine, the rows, the summary, and per tree size."""
    loaded, config, (tree, tree_source) = methods.loaded, methods.config, tree_and_source
    summary = bench_summary(rows, tally, methods, config.greedy)
    t, sizes, size_identical = tally.totals, methods.sizes, tally.size_identical
    engines = methods.engines
    peer_runs, peer = methods.peer_runs, methods.peer
    peer_tps = (
        statistics.harmonic_mean([r["tokens_per_s"] for r in peer_runs]) if peer_runs and peer else None
    )
    settings = config.settings
    lookup = "+lookup" if settings.context_lookup and tree.size > 1 else ""
    doc: dict[str, Any] = {
        **ident,
        "tree": tree.name,
        "tree_size": tree.size,
        "tree_source": tree_source + engines["medusa"].tree_note,
        "draft_shaped": engines["medusa"].draft_shaped,
        # which drafter filled the trees: hydra | medusa-1 | medusa-2 (| none), "+lookup" with context lookup
        "drafter": engines["medusa"].drafter_name + lookup,
        "lookup_run": engines["medusa"].lookup_run,
        "heads": heads_label(loaded),
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "accept_mode": settings.accept_mode,
        "context_lookup": settings.context_lookup,
        "top_p": settings.top_p,
        "penalties": {name: getattr(settings, name) for name in PENALTY_OPTIONS},
        "baselines": [m for m in methods.methods if m != "medusa"]
        + (["llamacpp"] if peer_tps else [])
        + (["llamacpp-spec"] if methods.servers is not None else []),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        # how a GGUF's K-quant products quantize their activations on a CPU (csrc/kquants.c): a run's numbers and
        # speed depend on it
        "kquant_activations": _kquant_scheme() if loaded.device.type == "cpu" else None,
        "load_average": [load_before, load_average()],  # 1-minute load before/after: > cpu_count = contended
        "torch": torch.__version__,
        "timing": TIMING_NOTE,
        "prompts": rows,
        "summary": summary,
    }
    if sizes:
        doc["tree_sizes"] = [
            {
                "size": n,
                "tokens_per_step": _r(t[f"medusa@{n}"].tokens_per_step),
                "tokens_per_s": _r(t[f"medusa@{n}"].tokens_per_s, 3),
                "speedup_vs_hf_generate": _ratio(t[f"medusa@{n}"].tokens_per_s, t["hf"].tokens_per_s)
                if "hf" in t
                else None,
                "speedup_vs_plain_loop": _ratio(t[f"medusa@{n}"].tokens_per_s, t["plain"].tokens_per_s)
                if "plain" in t
                else None,
                "identical_fraction": _r(sum(size_identical[n]) / len(size_identical[n]))
                if size_identical[n]
                else None,
            }
            for n in sizes
        ]
    if methods.drafts:
        doc["drafts"] = [
            {
                "method": m,
                "heads_file": repo_path(methods.drafts[m]) if methods.drafts[m] else methods.drafts[m],
                "drafter": engines[m].drafter_name + lookup,
                "tree_size": engines[m].tree.size,
                "tokens_per_step": _r(t[m].tokens_per_step),
                "acceptance_by_depth": t[m].acceptance_by_depth(),
                "tokens_per_s": _r(t[m].tokens_per_s, 3),
                "speedup_vs_plain_loop": _ratio(t[m].tokens_per_s, t["plain"].tokens_per_s) if "plain" in t else None,
                "speedup_vs_medusa": _ratio(t[m].tokens_per_s, t["medusa"].tokens_per_s),
                "identical_fraction": _r(sum(flags) / len(flags)) if (flags := tally.draft_identical.get(m)) else None,
                "tokens_per_step_vs_medusa": paired_difference(rows, f"{m}_tokens_per_step", "tokens_per_step"),
            }
            for m in methods.drafts
        ]
    return doc


def paired_difference(rows: list[dict[str, Any]], key: str, base: str) -> dict[str, Any] | None:
    """Per-prompt `key` minus `base`, paired on the same prompts (the replies being the same, a draft's tokens per
    step differ only by its guesses): mean, standard error and how many prompts went up / down. Two drafts
    whose gap is within ~2 standard errors are not told apart by the run."""
    pairs = [(r[key], r[base]) for r in rows if r.get(key) is not None and r.get(base) is not None]
    if len(pairs) < 2:
        return None
    diffs = [a - b for a, b in pairs]
    return {
        "mean": _r(statistics.fmean(diffs)),
        "standard_error": _r(statistics.stdev(diffs) / len(diffs) ** 0.5),
        "prompts_up": sum(d > 0 for d in diffs),
        "prompts_down": sum(d < 0 for d in diffs),
    }


def _kquant_scheme() -> str:
    from medusa_chat.kernels.cbind import kquant_scheme

    return kquant_scheme()


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # not on every platform
        return None
