"""The bench on the terminal: a table per prompt and the summary."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from medusa_chat.bench.runs import LOOKUP_TOKENS, METHODS, TIMING_NOTE, Run, repo_path

if TYPE_CHECKING:
    from rich.console import Console



def _busy(doc: dict[str, Any]) -> bool:
    """Did other processes compete for the CPUs? The load after the run includes this run's own threads."""
    loads, cpus = doc.get("load_average") or [None, None], doc.get("cpu_count")
    if doc.get("device") != "cpu" or not cpus or None in loads:
        return False
    before, after = loads
    # The 1-minute average decays slowly: a run that just ended (this tool's own) still shows up "before".
    return before > 0.9 * cpus or after - doc.get("threads", 1) > cpus / 2


def median_of(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


def heads_label(loaded: Any) -> str | None:
    heads = getattr(loaded, "heads", None)
    if heads is None:  # a model without heads says so: "none (context lookup only)"
        return getattr(loaded, "heads_source", "") or None
    src = repo_path(getattr(loaded, "heads_file", "") or "")
    return f"{heads.num_heads} x {heads.format}" + (f" ({src})" if src else "")


def fmt_value(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def print_prompt(console: Console, i: int, n: int, row: dict[str, Any], runs: dict[str, Run]) -> None:
    from rich.table import Table

    short = row["prompt"].replace("\n", " ")
    table = Table(
        title=f"[{i}/{n}] {short[:90]}{'...' if len(short) > 90 else ''}", title_justify="left", box=None
    )
    for col in ("method", "tokens", "tokens/step", "decode tok/s", "vs HF", "identical"):
        table.add_column(col, justify="right" if col not in ("method",) else "left")
    hf = runs.get("hf")
    for m in [x for x in METHODS if x in runs] + [x for x in runs if x.startswith("medusa@")]:
        r = runs[m]
        same = "-"
        if row.get("identical") is not None and row.get("reference") != m:
            if m == "medusa":
                same = (
                    "yes"
                    if row["identical"]
                    else f"no @{row['first_divergence']}" + (" (near-tie)" if row.get("near_tie") else "")
                )
            elif f"{m}_identical" in row:
                same = "yes" if row[f"{m}_identical"] else "no"
        table.add_row(
            m,
            str(len(r.token_ids)),
            fmt_value(r.tokens_per_step),
            fmt_value(r.tokens_per_s, ".1f"),
            fmt_value(r.tokens_per_s / hf.tokens_per_s if hf and hf.tokens_per_s else None, ".2f", "x"),
            same,
        )
    console.print(table)


def _main_drafter_row(doc: dict[str, Any]) -> dict[str, Any]:
    s = doc["summary"]
    return {
        "method": "medusa",
        "drafter": doc["drafter"],
        "tree_size": doc["tree_size"],
        "tokens_per_step": s["tokens_per_step"],
        "acceptance_by_depth": s["acceptance_by_depth"],
        "tokens_per_s": s["medusa_tokens_per_s"],
        "speedup_vs_plain_loop": s["speedup_vs_plain_loop"],
    }


def print_summary(console: Console, doc: dict[str, Any]) -> None:
    from rich.table import Table

    s = doc["summary"]
    title = (
        f"{doc['model']} ({doc['device']}, {doc['dtype']}, quant {doc['quant']}), tree {doc['tree']} "
        f"({doc['tree_size']} nodes, {doc['tree_source'] or 'given'}), {s['prompts']} prompts x <= "
        f"{doc['max_new_tokens']} tokens, {doc['accept_mode']}"
    )
    table = Table(title=title, title_justify="left")
    for col in ("method", "decode tok/s", "tokens/step", "Medusa speedup vs it"):
        table.add_column(col, justify="left" if col == "method" else "right")
    table.add_row("medusa", fmt_value(s["medusa_tokens_per_s"], ".1f"), fmt_value(s["tokens_per_step"]), "")
    for m, label, key in (
        ("hf", "HF generate", "speedup_vs_hf_generate"),
        ("plain", "plain loop (root-only tree)", "speedup_vs_plain_loop"),
        ("lookup", f"HF prompt lookup ({LOOKUP_TOKENS})", "speedup_vs_prompt_lookup"),
        ("heads", "Medusa heads only (no context lookup)", "speedup_vs_heads_only"),
    ):
        if m in doc["baselines"]:
            tps_step = s[f"{m}_tokens_per_step"] if m in ("lookup", "heads") else 1.0
            table.add_row(
                label, fmt_value(s[f"{m}_tokens_per_s"], ".1f"), fmt_value(tps_step), fmt_value(s[key], ".2f", "x")
            )
    if s.get("llamacpp_tokens_per_s"):
        table.add_row(
            "llama.cpp (llama-cpp-python, same GGUF, same prompts)"
            if s.get("llamacpp_runner") == "LlamaCppPython"
            else "llama.cpp (llama-bench tg, same GGUF)",
            fmt_value(s["llamacpp_tokens_per_s"], ".1f"),
            "1.00",
            fmt_value(s["speedup_vs_llamacpp"], ".2f", "x"),
        )
    console.print(table)
    if "llamacpp_spec_notes" in s:
        print_servers(console, s)
    if doc.get("context_lookup") and s.get("context_lookup_share") is not None:
        console.print(
            f"context lookup guessed {s['context_lookup_share'] * 100:.0f}% of the draft tokens Medusa accepted "
            "(--no-context-lookup: heads only)"
        )
    if s.get("sized_steps"):
        steps = s["sized_steps"]
        total = sum(steps.values()) or 1
        shares = ", ".join(f"{n} nodes {v / total * 100:.0f}%" for n, v in steps.items())
        console.print(f"Medusa's steps by tree size, chosen as the replies ran: {shares}")
    for key in ("llamacpp_note", "hf_note"):
        if s.get(key):
            console.print(f"[yellow]{s[key]}[/yellow]")
    if s.get("identical_to_plain_loop_fraction") is not None:
        console.print(
            f"greedy output identical to the engine's plain loop: {s['identical_to_plain_loop_fraction'] * 100:.0f}%"
            " of prompts"
        )
    if s["identical_fraction"] is not None:
        ties = f", {s['near_ties']} divergence(s) at near-ties" if s.get("near_ties") else ""
        console.print(
            f"greedy output identical to {'HF generate' if 'hf' in doc['baselines'] else 'the plain loop'}: "
            f"{s['identical_fraction'] * 100:.0f}% of prompts{ties}"
        )
    if s.get("exact_identical_to_plain_fraction") is not None:
        console.print(
            "exact sampling, same seed: reply identical to the plain loop's in "
            f"{s['exact_identical_to_plain_fraction'] * 100:.0f}% of prompts"
        )
    if doc.get("tree_sizes"):
        t = Table(title="Medusa by tree size (first N nodes)", title_justify="left")
        for col in ("nodes", "tokens/step", "decode tok/s", "vs HF", "vs plain", "identical"):
            t.add_column(col, justify="right")
        for r in doc["tree_sizes"]:
            t.add_row(
                str(r["size"]),
                fmt_value(r["tokens_per_step"]),
                fmt_value(r["tokens_per_s"], ".1f"),
                fmt_value(r["speedup_vs_hf_generate"], ".2f", "x"),
                fmt_value(r["speedup_vs_plain_loop"], ".2f", "x"),
                fmt_value(
                    r["identical_fraction"] * 100 if r["identical_fraction"] is not None else None, ".0f", "%"
                ),
            )
        console.print(t)
    if doc.get("drafts"):
        t = Table(title="Drafters side by side (same backbone, same node budget)", title_justify="left")
        for col in ("drafter", "nodes", "tokens/step", "accepted at depth 1, 2, 3", "decode tok/s", "vs plain"):
            t.add_column(col, justify="right")
        for r in [_main_drafter_row(doc), *doc["drafts"]]:
            depths = r["acceptance_by_depth"] or []
            t.add_row(
                f"{r['method']} ({r['drafter']})",
                str(r["tree_size"]),
                fmt_value(r["tokens_per_step"]),
                " / ".join(f"{a:.2f}" for a in depths[:3]) or "-",
                fmt_value(r["tokens_per_s"], ".1f"),
                fmt_value(r["speedup_vs_plain_loop"], ".2f", "x"),
            )
        console.print(t)
        for r in doc["drafts"]:
            if (d := r.get("tokens_per_step_vs_medusa")) is not None:
                console.print(
                    f"{r['method']} against medusa, paired by prompt: {d['mean']:+.3f} tokens/step "
                    f"(standard error {d['standard_error']:.3f}; {d['prompts_up']} prompts up, "
                    f"{d['prompts_down']} down)"
                )
    if s.get("speedup_vs_hf_generate_median") is not None:
        console.print(
            "per-prompt median speedup: "
            + ", ".join(
                f"vs {label} {s[key]:.2f}x"
                for label, key in (
                    ("HF generate", "speedup_vs_hf_generate_median"),
                    ("plain loop", "speedup_vs_plain_loop_median"),
                    ("prompt lookup", "speedup_vs_prompt_lookup_median"),
                    ("heads only", "speedup_vs_heads_only_median"),
                    ("llama.cpp", "speedup_vs_llamacpp_median"),
                )
                if s.get(key) is not None
            )
        )
    if _busy(doc):
        before, after = doc["load_average"]
        console.print(
            f"[yellow]other work was running (1-minute load {before:.1f} before, {after:.1f} after, on "
            f"{doc['cpu_count']} CPUs): absolute speeds are unreliable, ratios of side-by-side runs less so[/yellow]"
        )
    console.print(f"[dim]{TIMING_NOTE}[/dim]")


SERVER_LABELS = {
    "llamacpp-server": "llama-server, plain",
    "llamacpp-ngram": "llama-server --spec-type ngram-mod",
    "llamacpp-eagle3": "llama-server --spec-type draft-eagle3",
    "medusa-serve": "medusa-chat serve (no flags)",
}


def print_servers(console: Any, summary: dict[str, Any]) -> None:
    """The llamacpp-spec table: each server through the same client, and its notes."""
    from rich.table import Table

    for note in summary.get("llamacpp_spec_notes") or []:
        console.print(f"[yellow]{note}[/yellow]")
    servers = summary.get("llamacpp_spec") or {}
    if not servers:
        return
    table = Table(title="Servers through the same OpenAI client (streamed, greedy)", title_justify="left")
    for col in (
        "server",
        "decode tok/s",
        "vs llama.cpp plain",
        "tokens/step",
        "draft accepted",
        "= its plain decode",
    ):
        table.add_column(col, justify="left" if col == "server" else "right")
    for method, r in servers.items():
        d = r["drafting"] or {}
        # lossless against its own engine's plain decode: llama-server's, or the bench's plain loop for serve
        same = r.get("identical_to_plain_loop_fraction", r["identical_to_llamacpp_plain_fraction"])
        table.add_row(
            SERVER_LABELS.get(method, method),
            fmt_value(r["tokens_per_s"], ".1f"),
            fmt_value(r["vs_llamacpp_plain"], ".2f", "x"),
            fmt_value(d.get("tokens_per_step")),
            fmt_value(d["acceptance_rate"] * 100 if d else None, ".0f", "%"),
            fmt_value(same * 100 if same is not None else None, ".0f", "%"),
        )
    console.print(table)
    serve = servers.get("medusa-serve") or {}
    if serve.get("identical_to_llamacpp_plain_fraction") is not None:
        console.print(
            "= its plain decode: llama.cpp's modes against llama-server's plain replies, medusa-chat serve against "
            "the bench's plain loop (another numeric path than llama.cpp's: "
            f"{serve['identical_to_llamacpp_plain_fraction'] * 100:.0f}% of its replies equal llama-server's)"
        )
    if summary.get("medusa_serve_speedup_vs_best_llamacpp") is not None:
        console.print(
            f"medusa-chat serve vs the best llama.cpp mode: {summary['medusa_serve_speedup_vs_best_llamacpp']:.2f}x "
            f"(in-process Medusa vs it: {fmt_value(summary.get('speedup_vs_best_llamacpp_mode'), '.2f', 'x')})"
        )
