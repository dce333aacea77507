"""`medusa-chat ask` (one reply) and `medusa-chat bench` (Medusa side by side with its baselines).

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

import argparse
import json
import math
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.cliargs import int_list, settings_from_args
from medusa_chat.errors import MedusaChatError, PromptError
from medusa_chat.events import GenerationSettings, StepEvent

if TYPE_CHECKING:
    from rich.console import Console

    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.model.loading import LoadedModel
    from medusa_chat.tree import Tree

TIMING_NOTE = (
    "decode wall time: from the first new token to the end of the reply (prefill and first token excluded), "
    "measured the same way for every method; speedups are ratios of decode tokens/s"
)
METHODS = ("hf", "plain", "lookup", "heads", "medusa")
# llamacpp: llama-bench on the same GGUF (peer.py); heads: Medusa without context lookup (an ablation, opt-in)
BASELINES = ("hf", "plain", "lookup", "llamacpp", "heads")
DEFAULT_BASELINES = ("hf", "plain", "lookup", "llamacpp")
LOOKUP_TOKENS = 10
NEAR_TIE = {"float32": 1e-4}  # top-2 logit gap under which a greedy flip counts as a tie (16-bit: 1e-2)
MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}


def tie_tolerance(dtype: str, top_logit: float) -> float:
    """A top-2 gap this small is a tie for arithmetic in `dtype`: the larger of the fixed tolerance and two
    units in the last place of the top logit (a 16-bit GEMM output is rounded to that grid, so two equally
    valid evaluation orders can differ by an ulp or two: at a bf16 logit of 16-32 one ulp is 0.125)."""
    bits = MANTISSA_BITS.get(dtype)
    ulp = 2.0 ** (math.floor(math.log2(abs(top_logit))) - bits) if bits and top_logit else 0.0
    return max(NEAR_TIE.get(dtype, 1e-2), 2 * ulp if dtype != "float32" else 0.0)


# ------------------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------------------
def _baselines(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in BASELINES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown baseline(s) {bad}: choose from {','.join(BASELINES)}")
    return names


def add_accept_arg(parser: argparse.ArgumentParser) -> None:
    """`--accept typical|exact`: the acceptance rule at temperature > 0 (chat, ask, bench)."""
    parser.add_argument(
        "--accept",
        choices=["typical", "exact"],
        default="typical",
        help="rule at temperature > 0: typical (the paper's, default: fast, favours the heads' guesses) or "
        "exact (replies keep the model's own sampling distribution)",
    )


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Options of `medusa-chat bench`."""
    parser.add_argument(
        "--prompts",
        type=Path,
        required=True,
        metavar="FILE.jsonl",
        help="one JSON object a line with `turns` (first turn used) or `prompt`",
    )
    parser.add_argument("--limit", type=int, default=None, metavar="K", help="first K prompts only")
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="reply length limit (default: %(default)s)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy, outputs compared token by token (default); > 0 = speed only",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling at T > 0")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed at T > 0 (default: %(default)s)")
    add_accept_arg(parser)
    parser.add_argument(
        "--json", type=Path, default=None, metavar="OUT", help="write the results as JSON to OUT"
    )
    parser.add_argument(
        "--baselines",
        type=_baselines,
        default=list(DEFAULT_BASELINES),
        metavar="hf,plain,lookup,llamacpp,heads",
        help="baselines to run beside Medusa (default: hf,plain,lookup,llamacpp; llamacpp is skipped with a "
        "note without llama-bench or llama-cpp-python; heads = the same tree without context lookup)",
    )
    parser.add_argument(
        "--no-context-lookup",
        dest="context_lookup",
        action="store_false",
        help="Medusa without context-lookup guesses on the main chain (heads only)",
    )
    parser.add_argument(
        "--llamacpp-bench",
        default=None,
        metavar="PATH",
        help="llama.cpp's llama-bench binary for the llamacpp baseline (default: $MEDUSA_CHAT_LLAMA_BENCH or "
        "PATH; without one, an installed llama-cpp-python decodes the same prompts)",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed warm-up runs of every method (default: 1)"
    )
    parser.add_argument(
        "--tree-sizes",
        type=int_list,
        default=None,
        metavar="8,16,32,64",
        help="also run Medusa with the first N nodes of the tree for each N",
    )
    parser.add_argument("--quiet", action="store_true", help="no per-prompt tables, only the summary")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """cli.py hook: the options of `medusa-chat bench`."""
    add_bench_args(parser)


def load_from_args(args: argparse.Namespace, console: Console | None = None) -> LoadedModel:
    from medusa_chat.model.loading import load_from_args as _load

    return _load(args, progress=(lambda m: console.print(f"[dim]{m}[/dim]")) if console is not None else None)


def _progress(console: Console, quiet: bool) -> Callable[[str], None] | None:
    return None if quiet else (lambda m: console.print(f"[dim]{m}[/dim]"))


def describe(loaded: Any) -> dict[str, Any]:
    from medusa_chat.tuning.tree_choice import dtype_name

    spec = getattr(loaded, "spec", None)
    return {
        "model": getattr(spec, "name", None) or "model",
        "device": str(loaded.device),
        "dtype": dtype_name(getattr(loaded, "dtype", loaded.backbone.get_input_embeddings().weight.dtype)),
        "quant": getattr(loaded, "quant", "none"),
    }


# ------------------------------------------------------------------------------------------------------------
# One timed run of each method
# ------------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One reply by one method, timed as described in TIMING_NOTE."""

    method: str
    token_ids: list[int]
    decode_tokens: int  # tokens produced after the first output
    decode_s: float
    ttft_s: float  # time to the first output (prefill)
    steps: int | None  # forward passes after the first output (None: not known)
    stop_reason: str = ""
    lookup_accepted: int = 0  # accepted tree nodes whose token came from context lookup

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_step(self) -> float | None:
        return self.decode_tokens / self.steps if self.steps else None


def run_engine(engine: MedusaEngine, method: str, prompt_ids: list[int], settings: GenerationSettings) -> Run:
    engine.reset()  # every run pays a full prefill, like the HF baselines (no prefix reuse between methods)
    t0 = time.perf_counter()
    t_first, first_tokens, summary, lookup_accepted = t0, 1, None, 0
    for item in engine.generate(prompt_ids, settings):
        if isinstance(item, StepEvent):
            if item.step == 0:
                t_first, first_tokens = time.perf_counter(), len(item.token_ids)
            elif item.tree is not None and item.tree.lookup_nodes:
                lookup_accepted += len(set(item.tree.lookup_nodes) & set(item.accepted_nodes))
        else:
            summary = item
    t_end = time.perf_counter()
    assert summary is not None
    return Run(
        method=method,
        token_ids=summary.token_ids,
        decode_tokens=max(len(summary.token_ids) - first_tokens, 0),
        decode_s=t_end - t_first,
        ttft_s=t_first - t0,
        steps=summary.steps,
        stop_reason=summary.stop_reason,
        lookup_accepted=lookup_accepted,
    )


class _Clock:
    """A transformers streamer that only notes when tokens arrive. generate() first puts the prompt, then
    each step's new token(s): one put per forward pass, for greedy and for prompt lookup alike."""

    def __init__(self) -> None:
        self.puts: list[tuple[float, int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


def run_hf(
    loaded: Any, method: str, prompt_ids: list[int], settings: GenerationSettings, seed: int | None = None
) -> Run:
    """HF `generate` (method "hf") or prompt-lookup decoding ("lookup"), same dtype/device as the engine."""
    backbone = loaded.backbone
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=loaded.device)
    eos = list(loaded.eos_token_ids)
    pad = getattr(loaded.tokenizer, "pad_token_id", None)
    kw: dict[str, Any] = {
        "max_new_tokens": settings.max_new_tokens,
        "eos_token_id": eos or None,
        "pad_token_id": pad if pad is not None else (eos[0] if eos else 0),
        "do_sample": settings.temperature > 0,
        "repetition_penalty": 1.0,  # a model's generation_config must not change what plain greedy means
    }
    if settings.temperature > 0:
        kw.update(temperature=settings.temperature, top_p=settings.top_p, top_k=0)
        if seed is not None:
            torch.manual_seed(seed)
    if method == "lookup":
        kw["prompt_lookup_num_tokens"] = LOOKUP_TOKENS
    clock = _Clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = backbone.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=clock, **kw)
    t_end = time.perf_counter()
    tokens = out[0, len(prompt_ids) :].tolist()
    outputs = clock.puts[1:]  # the first put is the prompt
    t_first, first_tokens = outputs[0] if outputs else (t_end, len(tokens))
    stop = "eos" if tokens and tokens[-1] in eos else "max_new_tokens"
    return Run(
        method=method,
        token_ids=tokens,
        decode_tokens=max(len(tokens) - first_tokens, 0),
        decode_s=t_end - t_first,
        ttft_s=t_first - t0,
        steps=len(outputs) - 1 if outputs else 0,
        stop_reason=stop,
    )


# ------------------------------------------------------------------------------------------------------------
# Comparing outputs
# ------------------------------------------------------------------------------------------------------------
def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where the two replies differ, comparing up to the shorter one (EOS tokens included, so a
    reply that ended where the other went on counts as a difference). None when they agree."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


@torch.inference_mode()
def top2_gap(loaded: Any, prompt_ids: list[int], reference: list[int], index: int) -> tuple[float, float]:
    """The reference model's top-2 logit gap where its token `index` was chosen, and the top logit: a tiny
    gap is a near-tie, where different (but equally valid) arithmetic may pick the other token."""
    ids = torch.tensor([prompt_ids + reference[:index]], dtype=torch.long, device=loaded.device)
    logits = loaded.backbone(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1]), float(top[0])


# ------------------------------------------------------------------------------------------------------------
# bench
# ------------------------------------------------------------------------------------------------------------
def read_prompts(path: Path, limit: int | None = None) -> list[str]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise MedusaChatError(f"cannot read prompts file {path}: {err.strerror or err}") from err
    prompts: list[str] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise MedusaChatError(f"{path}:{n}: not JSON ({err.msg})") from err
        text = None
        if isinstance(obj, dict):
            turns = obj.get("turns")
            text = turns[0] if isinstance(turns, list) and turns else obj.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise MedusaChatError(
                f"{path}:{n}: expected an object with `turns` (list of strings) or `prompt`"
            )
        prompts.append(text)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise MedusaChatError(f"{path} holds no prompts")
    return prompts


@dataclass
class _Totals:
    decode_tokens: int = 0
    decode_s: float = 0.0
    steps: int = 0
    steps_known: bool = True

    def add(self, run: Run) -> None:
        self.decode_tokens += run.decode_tokens
        self.decode_s += run.decode_s
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


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return round(x, nd) if x is not None else None


@dataclass
class BenchConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    accept: str = "typical"  # acceptance rule at temperature > 0: typical | exact
    baselines: list[str] = field(default_factory=lambda: list(DEFAULT_BASELINES))
    warmup: int = 1
    tree_sizes: list[int] | None = None
    llamacpp_bench: str | None = None
    context_lookup: bool = True  # Medusa with context-lookup guesses on the main chain (lookup.py)


def run_bench(
    loaded: Any,
    tree: Tree,
    prompts: list[str],
    config: BenchConfig,
    console: Console | None = None,
    tree_source: str = "",
) -> dict[str, Any]:
    """Run every method on every prompt, interleaved; return the JSON document described in issue 3/7."""
    from medusa_chat.engine.engine import MedusaEngine, plain_tree

    greedy = config.temperature <= 0
    methods = [m for m in METHODS if m == "medusa" or m in config.baselines]
    peer, peer_note, peer_runs = None, "", []
    if "llamacpp" in config.baselines:
        from medusa_chat.bench.peer import llama_bench_for

        peer, peer_note = llama_bench_for(loaded, torch.get_num_threads(), config.llamacpp_bench)

    def run_peer(prompt_ids: list[int]) -> dict[str, Any] | None:
        """One llama-bench run (one repetition), in the same rotation as the other methods: on a shared
        machine whose speed drifts by +-20% over minutes, a peer measured only before and after the prompts
        can land in another phase than the methods it is compared with."""
        nonlocal peer, peer_note
        if peer is None:
            return None
        try:
            peer_runs.append(peer.token_generation(config.max_new_tokens, reps=1, prompt_ids=prompt_ids))
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as err:
            peer, peer_note = None, f"llama.cpp baseline failed: {err}"
            return None
        return peer_runs[-1]

    engines: dict[str, MedusaEngine] = {"medusa": MedusaEngine(loaded, tree)}
    if "heads" in methods:
        engines["heads"] = MedusaEngine(loaded, tree)
    if "plain" in methods:
        engines["plain"] = MedusaEngine(loaded, plain_tree())
    sizes = sorted({min(n, tree.size) for n in config.tree_sizes}) if config.tree_sizes else []
    for n in sizes:
        engines[f"medusa@{n}"] = MedusaEngine(loaded, tree.prefix(n))
    ident = describe(loaded)

    def settings_for(max_new: int, context_lookup: bool = config.context_lookup) -> GenerationSettings:
        return GenerationSettings(
            max_new_tokens=max_new,
            temperature=config.temperature,
            top_p=config.top_p,
            seed=config.seed,
            accept=config.accept,
            context_lookup=context_lookup,
        )

    def run(method: str, prompt_ids: list[int], max_new: int) -> Run:
        s = settings_for(max_new, config.context_lookup and method != "heads")
        if method in ("hf", "lookup"):
            return run_hf(loaded, method, prompt_ids, s, seed=config.seed)
        return run_engine(engines[method], method, prompt_ids, s)

    load_before = _load_average()
    encoded = [loaded.build_prompt([{"role": "user", "content": p}]) for p in prompts]
    all_methods = methods + [f"medusa@{n}" for n in sizes]
    for _ in range(config.warmup):  # first calls pay one-off costs (allocations, kernel selection, caches)
        for m in all_methods:
            run(m, encoded[0], min(16, config.max_new_tokens))

    totals = {m: _Totals() for m in all_methods}
    rows: list[dict[str, Any]] = []
    identical_flags: list[bool] = []
    plain_flags: list[bool] = []
    exact_flags: list[bool] = []
    exact = not greedy and config.accept == "exact"
    size_identical: dict[int, list[bool]] = {n: [] for n in sizes}
    for i, (text, prompt_ids) in enumerate(zip(prompts, encoded, strict=True)):
        rotation = all_methods + (["llamacpp"] if peer is not None else [])
        order = rotation[i % len(rotation) :] + rotation[: i % len(rotation)]
        runs: dict[str, Run] = {}
        peer_run = None
        try:
            for m in order:
                if m == "llamacpp":
                    peer_run = run_peer(prompt_ids)
                else:
                    runs[m] = run(m, prompt_ids, config.max_new_tokens)
        except PromptError as err:
            if console is not None:
                console.print(f"[yellow]prompt {i + 1} skipped: {err}[/yellow]")
            continue
        for m, r in runs.items():
            totals[m].add(r)
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
            plain_flags.append(row["identical_to_plain_loop"])
        if greedy and ref is not None:
            div = first_divergence(med.token_ids, ref.token_ids)
            row["identical"] = div is None
            row["first_divergence"] = div
            row["reference"] = ref_method
            if div is not None:
                gap, top = top2_gap(loaded, prompt_ids, ref.token_ids, div)
                row["divergence_top2_gap"] = round(gap, 6)
                row["near_tie"] = gap <= tie_tolerance(ident["dtype"], top)
            identical_flags.append(div is None)
            for other in ("plain", "lookup", "heads"):
                if other in runs and other != ref_method:
                    row[f"{other}_identical"] = first_divergence(runs[other].token_ids, ref.token_ids) is None
            for n in sizes:
                size_identical[n].append(
                    first_divergence(runs[f"medusa@{n}"].token_ids, ref.token_ids) is None
                )
        if exact and "plain" in runs:
            # exact mode couples Medusa to the plain loop: same seed, same reply (acceptance.py)
            row["identical_to_plain"] = first_divergence(med.token_ids, runs["plain"].token_ids) is None
            exact_flags.append(row["identical_to_plain"])
        if sizes:
            row["by_tree_size"] = {
                str(n): {
                    "tokens_per_step": _r(runs[f"medusa@{n}"].tokens_per_step),
                    "decode_s": _r(runs[f"medusa@{n}"].decode_s, 5),
                    "tokens_per_s": _r(runs[f"medusa@{n}"].tokens_per_s, 3),
                }
                for n in sizes
            }
        rows.append(row)
        if console is not None:
            _print_prompt(console, i + 1, len(prompts), row, runs)

    t = totals
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
        "speedup_vs_hf_generate_median": _median(r["speedup_vs_hf_generate"] for r in rows),
        "speedup_vs_plain_loop_median": _median(r["speedup_vs_plain_loop"] for r in rows),
        "speedup_vs_prompt_lookup_median": _median(r["speedup_vs_prompt_lookup"] for r in rows),
        "speedup_vs_heads_only_median": _median(r["speedup_vs_heads_only"] for r in rows),
        "speedup_vs_llamacpp_median": _median(r.get("speedup_vs_llamacpp") for r in rows),
        "timing": TIMING_NOTE,
    }
    doc: dict[str, Any] = {
        **ident,
        "tree": tree.name,
        "tree_size": tree.size,
        "tree_source": tree_source + engines["medusa"].tree_note,
        "draft_shaped": engines["medusa"].draft_shaped,
        "lookup_run": engines["medusa"].lookup_run,
        "heads": _heads_label(loaded),
        "max_new_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "accept_mode": settings_for(1).accept_mode,
        "context_lookup": config.context_lookup,
        "top_p": config.top_p,
        "baselines": [m for m in methods if m != "medusa"] + (["llamacpp"] if peer_tps else []),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
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
    return doc


def _busy(doc: dict[str, Any]) -> bool:
    """Did other processes compete for the CPUs? The load after the run includes this run's own threads."""
    loads, cpus = doc.get("load_average") or [None, None], doc.get("cpu_count")
    if doc.get("device") != "cpu" or not cpus or None in loads:
        return False
    before, after = loads
    # The 1-minute average decays slowly: a run that just ended (this tool's own) still shows up "before".
    return before > 0.9 * cpus or after - doc.get("threads", 1) > cpus / 2


def _median(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # not on every platform
        return None


def _heads_label(loaded: Any) -> str | None:
    heads = getattr(loaded, "heads", None)
    if heads is None:
        return None
    src = getattr(loaded, "heads_file", "") or ""
    return f"{heads.num_heads} x {heads.format}" + (f" ({src})" if src else "")


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _print_prompt(console: Console, i: int, n: int, row: dict[str, Any], runs: dict[str, Run]) -> None:
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
            _fmt(r.tokens_per_step),
            _fmt(r.tokens_per_s, ".1f"),
            _fmt(r.tokens_per_s / hf.tokens_per_s if hf and hf.tokens_per_s else None, ".2f", "x"),
            same,
        )
    console.print(table)


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
    table.add_row("medusa", _fmt(s["medusa_tokens_per_s"], ".1f"), _fmt(s["tokens_per_step"]), "")
    for m, label, key in (
        ("hf", "HF generate", "speedup_vs_hf_generate"),
        ("plain", "plain loop (root-only tree)", "speedup_vs_plain_loop"),
        ("lookup", f"HF prompt lookup ({LOOKUP_TOKENS})", "speedup_vs_prompt_lookup"),
        ("heads", "Medusa heads only (no context lookup)", "speedup_vs_heads_only"),
    ):
        if m in doc["baselines"]:
            tps_step = s[f"{m}_tokens_per_step"] if m in ("lookup", "heads") else 1.0
            table.add_row(
                label, _fmt(s[f"{m}_tokens_per_s"], ".1f"), _fmt(tps_step), _fmt(s[key], ".2f", "x")
            )
    if s.get("llamacpp_tokens_per_s"):
        table.add_row(
            "llama.cpp (llama-cpp-python, same GGUF, same prompts)"
            if s.get("llamacpp_runner") == "LlamaCppPython"
            else "llama.cpp (llama-bench tg, same GGUF)",
            _fmt(s["llamacpp_tokens_per_s"], ".1f"),
            "1.00",
            _fmt(s["speedup_vs_llamacpp"], ".2f", "x"),
        )
    console.print(table)
    if doc.get("context_lookup") and s.get("context_lookup_share") is not None:
        console.print(
            f"context lookup guessed {s['context_lookup_share'] * 100:.0f}% of the draft tokens Medusa accepted "
            "(--no-context-lookup: heads only)"
        )
    if s.get("llamacpp_note"):
        console.print(f"[yellow]{s['llamacpp_note']}[/yellow]")
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
                _fmt(r["tokens_per_step"]),
                _fmt(r["tokens_per_s"], ".1f"),
                _fmt(r["speedup_vs_hf_generate"], ".2f", "x"),
                _fmt(r["speedup_vs_plain_loop"], ".2f", "x"),
                _fmt(
                    r["identical_fraction"] * 100 if r["identical_fraction"] is not None else None, ".0f", "%"
                ),
            )
        console.print(t)
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


def bench_main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from medusa_chat.tuning.calibrate import resolve_tree

    out = Console()
    err = Console(stderr=True)
    prompts = read_prompts(args.prompts, args.limit)
    settings_from_args(args)  # validates the options before the (slow) load
    loaded = load_from_args(args, err)
    tree, source = resolve_tree(
        loaded, getattr(args, "tree", None), getattr(args, "tree_size", None), _progress(err, False)
    )
    config = BenchConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        accept=getattr(args, "accept", "typical"),
        baselines=args.baselines,
        warmup=args.warmup,
        tree_sizes=args.tree_sizes,
        llamacpp_bench=args.llamacpp_bench,
        context_lookup=getattr(args, "context_lookup", True),
    )
    doc = run_bench(loaded, tree, prompts, config, None if args.quiet else out, tree_source=source)
    print_summary(out, doc)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, ensure_ascii=False))
        err.print(f"[dim]results written to {args.json}[/dim]")
    return 0


__all__ = [
    "Run",
    "add_accept_arg",
    "add_arguments",
    "add_bench_args",
    "bench_main",
    "first_divergence",
    "read_prompts",
    "run_bench",
    "run_engine",
    "run_hf",
]
