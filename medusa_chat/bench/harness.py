"""The bench: Medusa side by side with its baselines, over a list of prompts (`medusa-chat bench`, bench/cli.py).

bench runs, for each prompt and in the same process, interleaved (the order rotates from prompt to prompt so
no method always runs on a warmer cache):

    hf      plain HF `generate` (greedy at T=0; the reference output for losslessness)
    plain   this engine's own loop with a root-only tree (one token per step): what the lean loop gains
    lookup  HF prompt-lookup decoding (`prompt_lookup_num_tokens=10`): a speculative baseline with no heads
    medusa  the engine with the Medusa tree: what speculation gains on top of the loop

Timing is the same for all four: **decode wall time**, from the moment the first new token is available (the
prefill and its token excluded) to the end of the reply, over the tokens produced after that first output.
Speedups are ratios of decode tokens per second, so different reply lengths do not distort them.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.bench.loops import loop_fraction
from medusa_chat.bench.report import heads_label, median_of, print_prompt
from medusa_chat.bench.runs import (
    DEFAULT_BASELINES,
    METHODS,
    TIMING_NOTE,
    Run,
    describe,
    first_divergence,
    repo_path,
    run_engine,
    run_hf,
    tie_tolerance,
    top2_gap,
)
from medusa_chat.engine.penalties import PenaltyOptions
from medusa_chat.errors import PromptError
from medusa_chat.events import GenerationSettings
from medusa_chat.settings import ENTRY_OPTIONS, EXACT, GREEDY, PENALTY_OPTIONS, defaults_for

if TYPE_CHECKING:
    from rich.console import Console

    from medusa_chat.bench.server_peers import ServerPeers
    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.tree import Tree


# ------------------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------------------
# One timed run of each method
# ------------------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------------------
# Comparing outputs
# ------------------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------------------
# bench
# ------------------------------------------------------------------------------------------------------------


@dataclass
class _Totals:
    decode_tokens: int = 0
    decode_s: float = 0.0
    steps: int = 0
    steps_known: bool = True
    accepted: list[int] = field(default_factory=list)  # per decoding step, draft tokens accepted

    def add(self, run: Run) -> None:
        self.decode_tokens += run.decode_tokens
        self.decode_s += run.decode_s
        self.accepted.extend(run.accepted_lengths)
        if run.steps is None:
            self.steps_known = False
        else:
            self.steps += run.steps

    @property
    def tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None

    @property
    def tokens_per_step(self) -> float | None:
        return self.decode_tokens / self.steps if self.steps_known and self.steps else None

    def acceptance_by_depth(self) -> list[float] | None:
        """Per tree depth d = 1, 2, ...: the share of steps that accepted a draft token at depth d (at least d
        draft tokens); their sum plus one is the tokens per step. None for methods without trees."""
        if not self.accepted or not any(self.accepted):
            return None
        n = len(self.accepted)
        return [round(sum(1 for a in self.accepted if a >= d) / n, 4) for d in range(1, max(self.accepted) + 1)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return round(x, nd) if x is not None else None


def _bench_settings() -> GenerationSettings:
    """The bench's reply settings when none are given: its own defaults (settings.OPTIONS)."""
    defaults = defaults_for("bench")
    return GenerationSettings(**{name: defaults[name] for name in ENTRY_OPTIONS["bench"]})


@dataclass
class BenchConfig:
    # every method's reply settings (the Medusa run's; a method's own length and context lookup over them)
    settings: GenerationSettings = field(default_factory=_bench_settings)
    baselines: list[str] = field(default_factory=lambda: list(DEFAULT_BASELINES))
    warmup: int = 1
    tree_sizes: list[int] | None = None
    compare_heads: list[str] | None = None  # other heads or drafts on the same backbone, side by side
    llamacpp_bench: str | None = None
    llama_server: str | None = None  # llamacpp-spec: llama-server's path (bench/server_peers.py)
    serve_args: list[str] | None = None  # llamacpp-spec: the model options `medusa-chat serve` is started with

    @property
    def greedy(self) -> bool:
        """Temperature 0: every method's reply is compared token by token with the reference."""
        return self.settings.accept_mode == GREEDY


def run_bench(
    loaded: Any,
    tree: Tree,
    prompts: list[str],
    config: BenchConfig,
    console: Console | None = None,
    tree_source: str = "",
) -> dict[str, Any]:
    """Run every method on every prompt, interleaved; return the JSON document (settings, one row per prompt,
    the summary)."""
    with _Methods(loaded, tree, config) as methods:  # closes the llamacpp-spec servers however the run ends
        ident = describe(loaded)
        load_before = _load_average()
        encoded = [loaded.build_prompt([{"role": "user", "content": p}]) for p in prompts]
        for _ in range(config.warmup):  # first calls pay one-off costs (allocations, kernel selection, caches)
            for m in methods.all:
                methods.run(m, encoded[0], min(16, config.settings.max_new_tokens))
            if methods.servers is not None:
                methods.servers.warm(prompts[0], min(16, config.settings.max_new_tokens))

        tally = _Tally(methods.all, methods.sizes)
        rows: list[dict[str, Any]] = []
        for i, (text, prompt_ids) in enumerate(zip(prompts, encoded, strict=True)):
            try:
                runs, peer_run = outcome = methods.run_prompt(i, prompt_ids, text)
            except PromptError as err:
                if console is not None:
                    console.print(f"[yellow]prompt {i + 1} skipped: {err}[/yellow]")
                continue
            for m, r in runs.items():
                tally.totals[m].add(r)
            row = _prompt_row(methods, text, prompt_ids, outcome, ident["dtype"], tally)
            if methods.servers is not None:
                row["servers"] = methods.servers.end_prompt()
            rows.append(row)
            if console is not None:
                print_prompt(console, i + 1, len(prompts), row, runs)
        return _document(methods, (tree, tree_source), ident, rows, tally, load_before)


class _Methods:
    """The methods under test and how one prompt runs through all of them: the engines (Medusa, its tree-size
    prefixes, the heads-only and plain loops), HF generate and prompt lookup, and llama.cpp where installed."""

    def __init__(self, loaded: Any, tree: Tree, config: BenchConfig) -> None:
        from medusa_chat.engine.engine import MedusaEngine, plain_tree

        self.loaded, self.config = loaded, config
        self.methods = [m for m in METHODS if m == "medusa" or m in config.baselines]
        if PenaltyOptions.of(config.settings).active:  # HF generate has no windowed repeat penalty nor DRY
            self.methods = [m for m in self.methods if m not in ("hf", "lookup")]
        self.peer, self.peer_note, self.peer_runs = None, "", []
        if "llamacpp" in config.baselines:
            from medusa_chat.bench.peer import llama_bench_for

            self.peer, self.peer_note = llama_bench_for(loaded, torch.get_num_threads(), config.llamacpp_bench)
        self.servers: ServerPeers | None = None
        self.servers_note = ""
        if "llamacpp-spec" in config.baselines:
            from medusa_chat.bench.server_peers import start_server_peers

            self.servers, self.servers_note = start_server_peers(
                loaded, torch.get_num_threads(), config.serve_args, config.llama_server, config.llamacpp_bench
            )
        self.engines: dict[str, MedusaEngine] = {"medusa": MedusaEngine(loaded, tree)}
        if "heads" in self.methods:
            self.engines["heads"] = MedusaEngine(loaded, tree)
        if "plain" in self.methods:
            self.engines["plain"] = MedusaEngine(loaded, plain_tree())
        # The ablation's trees are prefixes of the model's whole tree when the run's tree is a prefix of it (a
        # calibrated size), so `--tree-sizes 64` still measures 64 nodes after calibration chose a few.
        default = loaded.default_tree
        whole = default if list(default.paths[: tree.size - 1]) == list(tree.paths) else tree
        self.sizes = sorted({min(n, whole.size) for n in config.tree_sizes}) if config.tree_sizes else []
        for n in self.sizes:
            self.engines[f"medusa@{n}"] = MedusaEngine(loaded, whole.prefix(n), adaptive=False)
        # Other drafters on the same backbone (heads folders, EAGLE drafts), each with its own tree cut to the
        # run's node budget: the same verification cost, so tokens per step and speed compare the drafts.
        self.drafts: dict[str, str] = {}  # method -> heads file
        for location in config.compare_heads or []:
            from medusa_chat.model.sources.loading import with_heads

            other = with_heads(loaded, location)
            method = f"draft:{Path(location.rstrip('/')).name or location}"
            own = other.default_tree
            self.engines[method] = MedusaEngine(other, own.prefix(min(tree.size, own.size)))
            self.drafts[method] = other.heads_file
        self.all = self.methods + [f"medusa@{n}" for n in self.sizes] + list(self.drafts)

    def __enter__(self) -> _Methods:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.servers is not None:
            self.servers.close()

    def settings_for(self, method: str, max_new: int) -> GenerationSettings:
        """The run's settings for one method: its reply length; context lookup off for the heads-only run."""
        settings = self.config.settings
        return dataclasses.replace(
            settings, max_new_tokens=max_new, context_lookup=settings.context_lookup and method != "heads"
        )

    def run(self, method: str, prompt_ids: list[int], max_new: int) -> Run:
        s = self.settings_for(method, max_new)
        if method in ("hf", "lookup"):
            return run_hf(self.loaded, method, prompt_ids, s, seed=s.seed)
        return run_engine(self.engines[method], method, prompt_ids, s)

    def run_peer(self, prompt_ids: list[int]) -> dict[str, Any] | None:
        """One llama-bench run (one repetition), in the same rotation as the other methods: on a shared
        machine whose speed drifts by +-20% over minutes, a peer measured only before and after the prompts
        can land in another phase than the methods it is compared with."""
        if self.peer is None:
            return None
        try:
            self.peer_runs.append(
                self.peer.token_generation(self.config.settings.max_new_tokens, reps=1, prompt_ids=prompt_ids)
            )
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as err:
            self.peer, self.peer_note = None, f"llama.cpp baseline failed: {err}"
            return None
        return self.peer_runs[-1]

    def run_prompt(
        self, i: int, prompt_ids: list[int], text: str = ""
    ) -> tuple[dict[str, Run], dict[str, Any] | None]:
        """Every method on prompt `i`, in an order that rotates from prompt to prompt (the servers of
        llamacpp-spec get the prompt's text and apply their own chat template)."""
        servers = self.servers.methods if self.servers is not None else []
        rotation = self.all + (["llamacpp"] if self.peer is not None else []) + servers
        order = rotation[i % len(rotation) :] + rotation[: i % len(rotation)]
        runs: dict[str, Run] = {}
        peer_run = None
        for m in order:
            if m == "llamacpp":
                peer_run = self.run_peer(prompt_ids)
            elif m in servers:
                assert self.servers is not None
                self.servers.run(m, text, self.config.settings.max_new_tokens)
            else:
                runs[m] = self.run(m, prompt_ids, self.config.settings.max_new_tokens)
        return runs, peer_run


@dataclass
class _Tally:
    """Totals per method and the per-prompt identity flags the summary counts."""

    methods: list[str]
    sizes: list[int]
    totals: dict[str, _Totals] = field(init=False)
    identical: list[bool] = field(default_factory=list)
    plain: list[bool] = field(default_factory=list)
    exact: list[bool] = field(default_factory=list)
    size_identical: dict[int, list[bool]] = field(init=False)
    draft_identical: dict[str, list[bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.totals = {m: _Totals() for m in self.methods}
        self.size_identical = {n: [] for n in self.sizes}


def _prompt_row(
    methods: _Methods,
    text: str,
    prompt_ids: list[int],
    outcome: tuple[dict[str, Run], dict[str, Any] | None],
    dtype: str,
    tally: _Tally,
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
        if m in ("lookup", "heads"):
            row[f"{m}_tokens_per_step"] = _r(r.tokens_per_step)
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


def _summary(rows: list[dict[str, Any]], tally: _Tally, methods: _Methods, greedy: bool) -> dict[str, Any]:
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


def _document(
    methods: _Methods,
    tree_and_source: tuple[Tree, str],
    ident: dict[str, Any],
    rows: list[dict[str, Any]],
    tally: _Tally,
    load_before: float | None,
) -> dict[str, Any]:
    """The JSON document: the run's settings and machine, the rows, the summary, and per tree size."""
    loaded, config, (tree, tree_source) = methods.loaded, methods.config, tree_and_source
    summary = _summary(rows, tally, methods, config.greedy)
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
        "load_average": [load_before, _load_average()],  # 1-minute load before/after: > cpu_count = contended
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
            }
            for m in methods.drafts
        ]
    return doc


def _kquant_scheme() -> str:
    from medusa_chat.kernels.cbind import kquant_scheme

    return kquant_scheme()


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # not on every platform
        return None
