"""Hardware-aware tree size: `medusa-chat calibrate`, the measurement harness (tree_choice.py holds the runtime
part: the cache of choices and the one tree rule every entry point uses).

A bigger tree accepts more tokens per step but costs more per step, and how much more depends on the device
(on a 2-core CPU a 64-node step costs ~3x a 1-node step; on a big GPU at batch 1 it costs almost nothing
extra, until the step stops being memory-bound). So the right tree is the one that maximises

    expected tokens per second (n) = E[tokens per step](n) / step latency(n)

over the first n nodes of the model's tree. Calibration measures the latency side on this device (the same
tree forward the engine runs: TreeKVCache, additive 4D mask, lm_head over all nodes, heads on one hidden
state, acceptance, commit) and takes the accuracy side from the heads folder's `tree.json`
(`expected_tokens_per_step`) or, when that is missing, from a few short greedy replies on built-in prompts.
The choice is cached per model + device + quantization + dtype, so the UIs can say which tree they use and why.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from medusa_chat.engine.threads import adapts
from medusa_chat.model.forward.runner import BackboneRunner
from medusa_chat.tree import Tree
from medusa_chat.tuning.measure import (
    CALIBRATION_PROMPTS,
    DEFAULT_PREFIX_TOKENS,
    CalibrationCancelled,
    check_cancel,
    measure_reply_rates,
    measure_step_latency,
    measure_tokens_per_step,
    prefilled_engines,
    release_cache,
    timing_prefix,
    tokens_per_step_from_tree_json,
)
from medusa_chat.tuning.tree_choice import (
    CALIBRATION_VERSION,
    device_name,
    heads_stamp,
    model_identity,
)

DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
# The sizes a CPU's first start times on real replies (calibrate_on_replies; first_start.py).
CPU_SIZES = (1, 2, 3, 4, 6, 8)
# Sizes whose estimated rates are this close count as tied, and the smaller tree wins: the estimates carry a few
# percent of noise (acceptance from a few hundred tokens, latencies on a shared machine), a deeper node's
# acceptance rests on fewer events, and a small tree's cost varies less with load and context length. Measured
# on a 2-core EPYC: prefixes of 2, 3 and 4 nodes were estimated within 2% of each other, and in real replies
# the 4-node tree was the slowest of the three (its deep nodes accepted less often than estimated).
NEAR_TIE = 0.03


# ------------------------------------------------------------------------------------------------------------
# The pure decision
# ------------------------------------------------------------------------------------------------------------
def expected_tokens_per_s(
    latency_by_size: dict[int, float], tokens_per_step_by_size: dict[int, float]
) -> dict[int, float]:
    """E[tokens/step](n) / latency(n) for every size present in both maps (and with a positive latency)."""
    return {
        n: tokens_per_step_by_size[n] / latency_by_size[n]
        for n in sorted(set(latency_by_size) & set(tokens_per_step_by_size))
        if latency_by_size[n] > 0
    }


def pick_tree_size(
    latency_by_size: dict[int, float], tokens_per_step_by_size: dict[int, float], near_tie: float = 0.0
) -> int:
    """The tree size with the most expected tokens per second. Ties go to the smaller tree (less memory,
    less variance), and so do near-ties: with `near_tie` = 0.03 the smallest size within 3% of the best rate.
    Only sizes present in both maps are considered."""
    rates = expected_tokens_per_s(latency_by_size, tokens_per_step_by_size)
    if not rates:
        raise ValueError("pick_tree_size needs at least one size with both a latency and a tokens/step value")
    best = max(rates.values())
    return min(n for n, r in rates.items() if r >= best * (1 - max(near_tie, 1e-12)))


def estimated_speedup(
    latency_by_size: dict[int, float], tokens_per_step_by_size: dict[int, float], size: int
) -> float:
    """Speedup of `size` over plain one-token steps: E(size) * latency(1) / latency(size)."""
    return tokens_per_step_by_size[size] * latency_by_size[1] / latency_by_size[size]


def _best_size(latency: dict[int, float], tps: dict[int, float], lookup_only: bool) -> int:
    best = pick_tree_size(latency, tps, NEAR_TIE)
    if lookup_only and best == 1:
        # Without heads the chain only costs where the lookup guesses, and the guesses pay most in long
        # conversations that a few short replies do not show: a chain is kept unless plain steps were clearly
        # faster (by more than the near-tie margin), so the lookup is not switched off on no evidence.
        rates = expected_tokens_per_s(latency, tps)
        chain = pick_tree_size({n: v for n, v in latency.items() if n > 1}, tps, NEAR_TIE)
        best = chain if rates[chain] * (1 + NEAR_TIE) >= rates[1] else 1
    return best


def lookup_only_latency(step_latency: dict[int, float], step_sizes: list[int]) -> dict[int, float]:
    """A model without heads: the mean step latency of each chain length n, from the measured replies' steps.

    Such a step verifies the root plus the lookup's guesses only (a plain step without a guess), so with at most
    n nodes a step whose lookup filled s nodes costs latency(min(n, s)), not latency(n): timing every step at
    latency(n) would charge the chain for nodes it never verifies and favour plain decoding wrongly.
    """
    return {
        n: statistics.fmean(step_latency.get(min(n, s), step_latency[n]) for s in step_sizes) for n in step_latency
    }


# ------------------------------------------------------------------------------------------------------------
# The whole calibration
# ------------------------------------------------------------------------------------------------------------
def heads_tree_json(loaded: Any) -> Path | None:
    """The heads folder's tree.json, if the heads come from a local folder that has one."""
    heads_file = getattr(loaded, "heads_file", "") or ""
    candidates: list[Any] = [
        Path(heads_file).parent if heads_file else None,
        getattr(loaded, "heads_dir", None),
    ]
    spec = getattr(loaded, "spec", None)
    candidates.append(getattr(spec, "heads", None))
    try:
        info = loaded.info()
        heads_info = info.get("heads") if isinstance(info, dict) else None
        if isinstance(heads_info, dict):
            candidates += [heads_info.get(k) for k in ("path", "dir", "folder", "location")]
    except Exception:  # noqa: BLE001 - info() is display-only; calibration must not fail on it
        pass
    for c in candidates:
        if c and isinstance(c, (str, Path)):
            p = Path(c).expanduser()
            if p.is_dir() and (p / "tree.json").is_file():
                return p / "tree.json"
    return None


def calibrate(
    loaded: Any,
    base: Tree | None = None,
    sizes: Iterable[int] = DEFAULT_SIZES,
    prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
    reps: int = 8,
    accuracy_file: Path | None = None,
    measure_replies: int = 4,
    measure_tokens: int = 64,
    progress: Callable[[str], None] | None = None,
    measure_accuracy: bool = False,
    cancel: threading.Event | None = None,
) -> dict[str, Any]:
    """Measure latency per size, get E[tokens/step] per size, pick the best size. Returns the JSON record.

    `cancel` (set from another thread) ends it between two steps with CalibrationCancelled."""
    from medusa_chat.engine.engine import MedusaEngine

    base = base or loaded.default_tree
    sizes = sorted({n for n in sizes if 1 <= n <= base.size} | {base.size, 1})
    lookup_only = getattr(loaded, "heads", None) is None and base.size > 1
    if lookup_only:  # every chain length a step may verify is timed (see lookup_only_latency)
        sizes = list(range(1, base.size + 1))
    step_sizes: list[int] = []
    model_name, device, quant, dtype = model_identity(loaded)

    tps: dict[int, float] | None = None
    source = ""
    # tree.json's expectation comes from the heads' held-out accuracy; measuring on real replies is slower
    # but catches a mismatch (e.g. prompts unlike the training data) - `measure_accuracy` forces it.
    tree_json = None if measure_accuracy else (accuracy_file or heads_tree_json(loaded))
    if tree_json is not None:
        tps = tokens_per_step_from_tree_json(tree_json, base)
        source = f"{tree_json} (expected_tokens_per_step)" if tps else ""
        if tps:
            missing = [n for n in sizes if n not in tps]
            if missing and progress:
                progress(f"tree.json has no value for sizes {missing}: those sizes are skipped")
            sizes = [n for n in sizes if n in tps]
    if not tps:
        if progress:
            progress(
                f"measuring tokens/step with {measure_replies} greedy replies on built-in prompts ({base.name}, {base.size} nodes)"
            )
        # the static tree: accepted_per_size reads every step's tokens in its node layout
        engine = MedusaEngine(loaded, base, shaped=False, adaptive=False)
        engine.lookup_run = 0
        prompts = [
            loaded.build_prompt([{"role": "user", "content": p}])
            for p in CALIBRATION_PROMPTS[:measure_replies]
        ]
        tps = measure_tokens_per_step(engine, prompts, sizes, measure_tokens, progress, step_sizes, cancel)
        source = f"measured: {measure_replies} greedy replies x {measure_tokens} tokens on built-in prompts"
        release_cache(engine)
    tps[1] = 1.0  # a root-only step makes exactly one token

    if progress:
        progress(f"timing tree steps with a {prefix_tokens}-token cached prefix ({reps} reps per size)")
    # On a CPU the default-thread and the one-thread timings below time the same prefilled engines (one prefill)
    check_cancel(cancel)
    shared = (
        prefilled_engines(loaded, sizes, base, timing_prefix(loaded, prefix_tokens)) if device.type == "cpu" else None
    )
    try:
        accuracy = Accuracy(tps, source, step_sizes, lookup_only)
        return _timed_record(loaded, base, sizes, accuracy, StepTiming(prefix_tokens, reps, progress, cancel), shared)
    finally:  # cancelled or not, the prefilled caches go
        for engine, _, _ in (shared or {}).values():
            release_cache(engine)


def calibrate_on_replies(
    loaded: Any,
    base: Tree | None = None,
    sizes: Iterable[int] | None = None,
    replies: int = len(CALIBRATION_PROMPTS),
    reply_tokens: int = 48,
    timing: StepTiming | None = None,
) -> dict[str, Any]:
    """Pick the size whose real greedy replies decode fastest: every size replies to the same built-in prompts
    (measure_reply_rates; `sizes`, default CPU_SIZES), and a size's rate is its decode tokens over its decode time.
    Returns the same record as `calibrate`, with `timing` "replies"; `prefix_tokens` / `reps` of `timing` are for
    the one-thread trial steps (the busy-machine choice, which never exceeds this one).

    This is the CPU's first-start calibration for a model of the embedded one's size with a draft: a reply's steps
    are not the trial step (lookup runs, shaped trees, the per-step host work), and which size decodes fastest
    moved with the machine's state on a 2-core Zen 4 (benchmarks/RESULTS.md). A bigger model's replies take too
    long to time every size, so it keeps the trial-step calibration, as does a model without a draft."""
    base = base or loaded.default_tree
    timing = timing or StepTiming(DEFAULT_PREFIX_TOKENS, 8, None, None)
    sizes = sorted({n for n in (sizes or CPU_SIZES) if 1 <= n <= base.size} | {1})
    lookup_only = getattr(loaded, "heads", None) is None and base.size > 1
    prompts = [loaded.build_prompt([{"role": "user", "content": p}]) for p in CALIBRATION_PROMPTS[:replies]]
    if timing.progress:
        timing.progress(f"timing greedy replies to {len(prompts)} built-in prompts at {sizes} nodes ({base.name})")
    measured = measure_reply_rates(loaded, base, sizes, prompts, reply_tokens, timing.progress, timing.cancel)
    latency = {n: m["decode_s"] / m["steps"] for n, m in measured.items() if m["steps"] and m["decode_s"] > 0}
    if 1 not in latency:
        raise ValueError("calibration replies made no decode steps: a longer reply_tokens is needed")
    tps = {n: measured[n]["tokens"] / measured[n]["steps"] for n in latency} | {1: 1.0}
    source = f"measured: {len(prompts)} greedy replies x {reply_tokens} tokens on built-in prompts, timed per size"
    device = torch.device(loaded.device)
    shared = None
    if device.type == "cpu":  # the one-thread trial steps (busy-machine mode) time these prefilled engines
        check_cancel(timing.cancel)
        shared = prefilled_engines(loaded, list(latency), base, timing_prefix(loaded, timing.prefix_tokens))
    try:
        record = _record(loaded, base, list(latency), Accuracy(tps, source, [], lookup_only), timing, shared,
                         latency, latency, {})
    finally:
        for engine, _, _ in (shared or {}).values():
            release_cache(engine)
    record["timing"] = "replies"
    record["replies_identical"] = all(m["identical"] for m in measured.values())
    return record


@dataclass
class Accuracy:
    """calibrate's accuracy half: E[tokens/step] per size, where it came from, each counted step's verified node
    count (a model without heads verifies only the lookup's guesses), and whether the lookup drafts alone."""

    tps: dict[int, float]
    source: str
    step_sizes: list[int]
    lookup_only: bool


@dataclass
class StepTiming:
    """How calibrate times steps: the cached prefix's length, repetitions per size, progress lines, cancel flag."""

    prefix_tokens: int
    reps: int
    progress: Callable[[str], None] | None
    cancel: threading.Event | None


def _timed_record(
    loaded: Any, base: Tree, sizes: list[int], accuracy: Accuracy, timing: StepTiming, shared: dict[int, Any] | None
) -> dict[str, Any]:
    """calibrate's timing half: the step latencies (and on a CPU the one-thread ones) and the record."""
    step_sizes, lookup_only = accuracy.step_sizes, accuracy.lookup_only
    prefix_tokens, reps, progress, cancel = timing.prefix_tokens, timing.reps, timing.progress, timing.cancel
    device = torch.device(loaded.device)
    lat = measure_step_latency(
        loaded,
        sizes,
        tree=base,
        prefix_tokens=prefix_tokens,
        reps=reps,
        progress=progress,
        engines=shared,
        cancel=cancel,
    )
    latency = {n: v["median_s"] for n, v in lat.items()}
    step_latency = dict(latency)
    if lookup_only and step_sizes:
        latency = lookup_only_latency(step_latency, step_sizes)
    eager: dict[int, float] = {}
    if device.type == "cuda":  # the same steps without CUDA graphs, for the record (graph_step.py)
        if progress:
            progress("timing the same steps without CUDA graphs")
        eager = {
            n: v["median_s"]
            for n, v in measure_step_latency(
                loaded, sizes, tree=base, prefix_tokens=prefix_tokens, reps=reps, graphs=False
            ).items()
        }
    return _record(loaded, base, sizes, accuracy, timing, shared, latency, step_latency, eager)


def _record(
    loaded: Any,
    base: Tree,
    sizes: list[int],
    accuracy: Accuracy,
    timing: StepTiming,
    shared: dict[int, Any] | None,
    latency: dict[int, float],
    step_latency: dict[int, float],
    eager: dict[int, float],
) -> dict[str, Any]:
    """The choice and its record, from each size's latency (a trial step's, or a reply's mean step) and tokens per
    step; on a CPU the one-thread trial steps are timed here for the busy-machine choice."""
    tps, source, step_sizes, lookup_only = accuracy.tps, accuracy.source, accuracy.step_sizes, accuracy.lookup_only
    prefix_tokens, reps, progress, cancel = timing.prefix_tokens, timing.reps, timing.progress, timing.cancel
    model_name, device, quant, dtype = model_identity(loaded)
    best = _best_size(latency, tps, lookup_only)
    rates = expected_tokens_per_s(latency, tps)
    # The same steps on one thread, where the thread governor goes on a busy machine (engine/threads.py): a tree
    # row costs a larger share of a one-thread step, so a smaller tree may be faster there. The engine verifies
    # that prefix while it runs on one thread.
    one: dict[int, float] = {}
    if device.type == "cpu" and adapts(BackboneRunner(loaded.backbone)):
        if progress:
            progress("timing the same steps on one thread (the busy-machine mode)")
        one = {
            n: v["median_s"]
            for n, v in measure_step_latency(
                loaded,
                sizes,
                tree=base,
                prefix_tokens=prefix_tokens,
                reps=reps,
                threads=1,
                engines=shared,
                cancel=cancel,
            ).items()
        }
        if lookup_only and step_sizes:
            one = lookup_only_latency(one, step_sizes)
    best_one = min(_best_size(one, tps, lookup_only), best) if one else None
    return {
        "version": CALIBRATION_VERSION,
        "model": model_name,
        "device": str(device),
        "device_name": device_name(device),
        "quant": quant,
        "dtype": dtype,
        "tree": base.name,
        "forward": BackboneRunner(loaded.backbone).path,
        "timing": "steps",  # trial steps (calibrate), or real replies per size (calibrate_on_replies)
        "tree_size": best,
        # on a GPU: were the CUDA-graph steps faster than the eager ones at the chosen size (graph_step.py)?
        **({"graph_step": latency[best] < eager[best]} if best in eager else {}),
        "heads_stamp": heads_stamp(loaded),
        "speedup_est": round(estimated_speedup(latency, tps, best), 3),
        "tokens_per_s_est": round(rates[best], 2),
        "prefix_tokens": prefix_tokens,
        "accuracy_source": source,
        **({"lookup_only": True} if lookup_only else {}),
        **({"tree_size_1_thread": best_one} if best_one is not None else {}),
        "sizes": [
            {
                "size": n,
                "latency_s": round(latency[n], 6),
                "tokens_per_step": round(tps[n], 4),
                "tokens_per_s_est": round(rates[n], 2),
                "speedup_est": round(estimated_speedup(latency, tps, n), 3),
                **({"eager_latency_s": round(eager[n], 6)} if n in eager else {}),
                **({"step_latency_s": round(step_latency[n], 6)} if lookup_only and step_sizes else {}),
                **({"latency_1_thread_s": round(one[n], 6)} if n in one else {}),
            }
            for n in sorted(rates)
        ],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


__all__ = ["CalibrationCancelled", "calibrate", "calibrate_on_replies"]
