"""What calibration measures: a tree step's latency per tree size (the engine's own step, timed), and the tokens
each step accepts per size (from the heads' tree.json, or measured on built-in prompts)."""

from __future__ import annotations

import copy
import gc
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.events import GenerationSettings, ReplySummary, StepEvent
from medusa_chat.tree import Tree

if TYPE_CHECKING:
    from medusa_chat.engine.engine import MedusaEngine


DEFAULT_PREFIX_TOKENS = 256


# Built-in prompts for measuring acceptance when the heads ship no expected_tokens_per_step. Deliberately not
# the benchmark prompts (a tree tuned on the benchmark says nothing about it) and varied in style. The second
# six (opinion, role play, explanation, summary, arithmetic, naming) were added because the first six alone
# are unusually predictable (lists, code, recipes): on the AMX Xeon VM they estimated 1.55 / 1.87 / 2.07
# tokens per step for 2 / 3 / 4 nodes, Vicuna-bench's 20 first prompts measured 1.47 / 1.67 / 1.76, the
# estimate favoured the deeper trees, and the 3-node choice decoded 4% slower than 2 nodes. All twelve:
# 1.41 / 1.62 / 1.74.
CALIBRATION_PROMPTS = (
    "Explain how the gears on a bicycle make it easier to ride up a hill.",
    "Write a short poem about autumn leaves falling in a city park.",
    "List five unusual uses for a paperclip and explain each briefly.",
    "What is the difference between weather and climate? Give an example.",
    "Describe step by step how to make a good cup of tea.",
    "Write a Python function that checks whether a word is a palindrome.",
    "What are the advantages and disadvantages of working from home?",
    "Imagine you are a ship's captain in a storm. Describe what you tell your crew.",
    "Why do leaves change colour in autumn? Answer in a short paragraph.",
    "Summarize the causes of the French Revolution in a few sentences.",
    "If a train travels 60 miles in 1.5 hours, what is its average speed? Explain.",
    "Suggest a name and a slogan for a small bakery, and say why they fit.",
)


def latency_tree(base: Tree, size: int) -> Tree:
    """A tree of exactly `size` nodes for timing: the first `size` nodes of `base`, or, beyond its end, `base`
    widened with more top-k ranks. Only the node count and mask shape matter for latency, not which tokens."""
    if size <= base.size:
        return base.prefix(size)
    paths = list(base.paths)
    seen = set(paths)
    depth = max(base.depth, 1)
    rank = 0
    while len(paths) + 1 < size:
        for d in range(1, depth + 1):
            p = (0,) * (d - 1) + (rank,)
            if p not in seen and len(paths) + 1 < size:
                seen.add(p)
                paths.append(p)
        rank += 1
    return Tree(tuple(paths), name=f"{base.name}+{size - base.size}")


@torch.inference_mode()
def measure_step_latency(
    loaded: Any,
    sizes: Iterable[int],
    *,
    tree: Tree | None = None,
    prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
    reps: int = 10,
    warmup: int = 2,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    graphs: bool = True,
    threads: int | None = None,
    engines: dict[int, tuple[Any, torch.Tensor, torch.Tensor | None]] | None = None,
    cancel: threading.Event | None = None,
) -> dict[int, dict[str, float]]:
    """Time one decoding step per tree size, with `prefix_tokens` already in the KV cache.

    A step is `MedusaEngine.step` itself (propose, verify, greedy accept, bonus; the lean forward's exact
    per-node attention on a CPU, the heads' draft for the next step) plus the one host sync and the in-place
    KV commit `generate` does after it. After each rep the cache is cropped back to the prefix, so every rep sees
    the same context. Returns {n: {"median_s", "min_s", "mean_s", "event_median_s"?}}; `event_median_s` (CUDA
    events, device time) only on CUDA. The wall-clock median includes launch overhead, which is what a reply
    pays, so it is the number the projections use. (When the host cannot launch kernels as fast as the GPU runs
    them, the event time equals the wall time: the GPU waits for the launches.) `threads`: the native CPU step's
    thread count while timing (None: the engines' own). graphs=False times the eager
    step where an engine would replay CUDA graphs (graph_step.py). `engines`: prefilled_engines' result to time
    (its sizes; `sizes`, `tree` and `prefix_tokens` are then not used), left prefilled for another timing of the
    same engines (the caller resets them); else engines made and prefilled here, reset at the end. `cancel`:
    set from another thread, ends the timing between two steps with CalibrationCancelled (a calibration running
    in the background gives way to a reply).
    """
    from medusa_chat.engine.acceptance import make_acceptor

    sizes = list(dict.fromkeys(sizes))  # iterated twice; duplicates would be timed twice for nothing
    device = torch.device(loaded.device)
    base = tree or Tree.named("mc_sim_7b_63")
    cuda = device.type == "cuda"
    acceptor = make_acceptor(GenerationSettings(temperature=0.0), None, device, 1 << 20)
    if engines is None and cuda and len(sizes) > 1:
        # On a GPU each engine holds its CUDA graphs' whole-window KV cache (graph_step.py): a 7B model's is ~2
        # GB, so the sizes are timed one engine at a time, each freed before the next (a GPU's step time varies
        # too little for round-robin to matter, unlike a shared CPU's).
        by_size: dict[int, dict[str, float]] = {}
        for n in sizes:
            by_size |= measure_step_latency(
                loaded, [n], tree=base, prefix_tokens=prefix_tokens, reps=reps, warmup=warmup, seed=seed,
                progress=progress, graphs=graphs, cancel=cancel,
            )
            gc.collect()  # the engine and its graphs, before the allocator lets go of their memory
            torch.cuda.empty_cache()
        return by_size
    step_args = engines or prefilled_engines(loaded, sizes, base, timing_prefix(loaded, prefix_tokens, seed), graphs)
    if threads is not None:  # the native step's team for this timing (each engine put its own in force)
        from medusa_chat.kernels import cthreads

        cthreads.set_threads(threads)
    try:
        walls, events = _time_round_robin(step_args, acceptor, reps, warmup, cuda, device, cancel)
    finally:  # also when cancelled: the engines and the thread count go back as they were
        for engine, _, _ in step_args.values():
            if engines is None:
                release_cache(engine)
        if threads is not None and engine.threads is not None:
            engine.threads.resume()  # back to the governor's count
    results: dict[int, dict[str, float]] = {}
    for n in step_args:
        w = walls[n]
        results[n] = {"median_s": statistics.median(w), "min_s": min(w), "mean_s": statistics.fmean(w)}
        if events[n]:
            results[n]["event_median_s"] = statistics.median(events[n])
        if progress:
            progress(
                f"  {n:4d} nodes: {results[n]['median_s'] * 1000:8.2f} ms (min {results[n]['min_s'] * 1000:.2f})"
            )
    return results


@torch.inference_mode()
def measure_reply_rates(
    loaded: Any,
    base: Tree,
    sizes: Iterable[int],
    prompts: list[list[int]],
    max_new_tokens: int = 48,
    progress: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
) -> dict[int, dict[str, Any]]:
    """Each size's real greedy replies, timed: the engine's own `generate` on the first n nodes of `base` (the
    draft-shaped trees and context-lookup runs a reply has), every size on every prompt.

    Why not the trial step: a reply's step is not the calibration's trial step (lookup runs, draft-shaped trees, the
    per-step host work), and on a 2-core Zen 4 the two disagreed both ways as the machine's state moved: a 4-node
    trial step at 1.61-1.70x a plain one against ~1.23x in replies, and later 1.24x against 1.77x
    (benchmarks/RESULTS.md). Greedy replies are the same tokens whatever the size, so the sizes' decode times
    compare like for like. The sizes take turns per prompt, in forward then reverse order, so a shared machine's
    slow spells hit them alike. Prefill time is left out (the same for every size). Returns {n: {"decode_s",
    "tokens", "steps", "identical"}}: decode tokens after each reply's first, its steps, and whether every reply
    equalled the first size's.
    """
    from medusa_chat.engine.engine import MedusaEngine

    sizes = list(dict.fromkeys(sizes))
    engines = {n: MedusaEngine(loaded, base.prefix(n), adaptive=False) for n in sizes}
    out: dict[int, dict[str, Any]] = {n: {"decode_s": 0.0, "tokens": 0, "steps": 0, "identical": True} for n in sizes}
    settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=0.0)
    try:
        for i, prompt in enumerate(prompts):
            first: list[int] | None = None
            for n in sizes if i % 2 == 0 else sizes[::-1]:
                summary = _one_reply(engines[n], prompt, settings, cancel)
                first = first if first is not None else summary.token_ids
                row = out[n]
                row["decode_s"] += summary.decode_s
                row["tokens"] += max(summary.new_tokens - 1, 0)
                row["steps"] += summary.steps
                row["identical"] = row["identical"] and summary.token_ids == first
            if progress:
                progress(f"  prompt {i + 1}/{len(prompts)}: every size replied")
    finally:
        for engine in engines.values():
            release_cache(engine)
    return out


def _one_reply(
    engine: Any,
    prompt: list[int],
    settings: GenerationSettings,
    cancel: threading.Event | None,
    events: list[StepEvent] | None = None,
) -> ReplySummary:
    """One reply of `engine` to the end, its StepEvents appended to `events` where given; `cancel` (checked every
    step) ends it with CalibrationCancelled."""
    summary: ReplySummary | None = None
    replying = engine.generate(prompt, settings)
    for item in replying:
        if cancel is not None and cancel.is_set():
            replying.close()  # the engine's own cleanup, then out
            check_cancel(cancel)
        if isinstance(item, ReplySummary):
            summary = item
        elif events is not None:
            events.append(item)
    assert summary is not None
    return summary


class CalibrationCancelled(Exception):
    """A calibration stopped part-way because its `cancel` event was set (nothing was saved)."""


def check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise CalibrationCancelled("calibration cancelled")


def _time_round_robin(
    step_args: dict[int, tuple[Any, torch.Tensor, torch.Tensor | None]],
    acceptor: Any,
    reps: int,
    warmup: int,
    cuda: bool,
    device: torch.device,
    cancel: threading.Event | None,
) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    for args in step_args.values():
        for _ in range(warmup):
            check_cancel(cancel)
            _trial_step(*args, acceptor)

    # Sizes are timed round-robin (one rep of each size per round), so a slow spell of a shared machine (other
    # processes, clock changes) hits every size alike instead of skewing the sizes measured during it.
    walls: dict[int, list[float]] = {n: [] for n in step_args}
    events: dict[int, list[float]] = {n: [] for n in step_args}
    for _ in range(reps):
        for n, args in step_args.items():
            check_cancel(cancel)
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(device)
                e0.record()
            t0 = time.perf_counter()
            _trial_step(*args, acceptor)
            if cuda:
                e1.record()
                torch.cuda.synchronize(device)
            walls[n].append(time.perf_counter() - t0)
            if cuda:
                events[n].append(e0.elapsed_time(e1) / 1000.0)
    return walls, events


def timing_prefix(loaded: Any, prefix_tokens: int, seed: int = 0) -> torch.Tensor:
    """The random token ids [prefix_tokens] the latency timing holds in the cache (seeded: the same every run)."""
    backbone = loaded.backbone
    vocab = int(getattr(backbone.config, "vocab_size", 0) or backbone.get_output_embeddings().out_features)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (prefix_tokens,), generator=g).to(torch.device(loaded.device))


# Slack past the prefix and the tree in a timing engine's KV cache (it grows by doubling where it must).
CAPACITY_SLACK = 16


def timing_capacity(prefix_tokens: int, tree_size: int) -> int:
    """KV cache slots for an engine that holds `prefix_tokens` plus one tree of `tree_size` nodes. The engine's
    default (1024 slots) is 1 GB of fp32 keys and values for a 7B model with 32 KV heads, per engine, and its
    per-node key rows as much again per extra node: the calibration's engines for every size at once held more
    than the weights (peak RSS 7.8 GB on the first start of a 4.18 GB 6.9B GGUF, 5.2 GB on later starts)."""
    return prefix_tokens + tree_size + CAPACITY_SLACK


def release_cache(engine: Any) -> None:
    """Forget a finished measurement engine's prefix and, on a CPU, free its KV cache now rather than when the
    engine is collected: the next size's or step's engines must not stack on it."""
    if engine.device.type == "cpu":
        engine.fresh_cache()  # (allocated lazily: nothing is held until a forward writes)
    else:  # a GPU engine's cache may be its CUDA graphs' buffers
        engine.reset()


def prefilled_engines(
    loaded: Any, sizes: Iterable[int], base: Tree, prefix: torch.Tensor, graphs: bool = True
) -> dict[int, tuple[Any, torch.Tensor, torch.Tensor | None]]:
    """{size: (an engine on the first `size` nodes of `base` with `prefix` in its cache, its root token, its
    draft)}: each size its own engine and cache (key rows are sized per tree).

    On a CPU the prefix is prefilled once and that cache copied to the other sizes' engines (before any tree
    step: only the committed keys and values, no per-node rows yet): a 256-token prefill of a 1B model costs
    as much as ~200 of its steps, once per size otherwise. A GPU engine's cache may be its CUDA graphs' own
    buffers, and an EAGLE draft keeps a cache of its own, so those engines each prefill."""
    from medusa_chat.engine.engine import MedusaEngine

    out: dict[int, tuple[Any, torch.Tensor, torch.Tensor | None]] = {}
    first: tuple[Any, torch.Tensor] | None = None  # (engine, hidden states) of the prefill to share
    for n in sizes:
        t = latency_tree(base, n)
        if n > 1:
            t.check_fits(loaded.heads.num_heads if loaded.heads is not None else None)
        engine = MedusaEngine(loaded, t, graphs=graphs, adaptive=False)
        if engine.device.type == "cpu":  # (a GPU engine's cache may be its graphs' buffers: left as made)
            engine.fresh_cache(timing_capacity(len(prefix), base.size))
        if first is not None:
            engine.cache = copy.deepcopy(first[0].cache)
            engine.cached_ids = list(first[0].cached_ids)
            hidden = first[1]
        else:
            hidden = engine.prefill(prefix)
            if engine.shares_cache:
                first = (engine, hidden)
        logits, draft = engine.next_logits_and_guesses(hidden[-1:])
        out[n] = (engine, logits.argmax(-1, keepdim=True), draft)
    return out


def _trial_step(engine: Any, root: torch.Tensor, draft: torch.Tensor | None, acceptor: Any) -> None:
    """The engine's step, its host sync and commit, then the cache put back (so every rep sees one context)."""
    engine.trial_step(root, draft, acceptor)


def tokens_per_step_from_tree_json(path: Path, tree: Tree) -> dict[int, float] | None:
    """Read `expected_tokens_per_step` from a heads folder's tree.json, if it describes `tree`.

    Accepted forms: a list whose entry i is the expected tokens per step of the first i+1 nodes (root
    included, so entry 0 is 1.0), or a dict {size: value}. The file's paths must start with `tree`'s paths
    (the values are only valid for the tree they were computed for).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    values = data.get("expected_tokens_per_step")
    paths = data.get("paths")
    if values is None:
        return None
    if isinstance(paths, list):
        file_paths = tuple(tuple(int(r) for r in p) for p in paths if p)
        n = min(len(file_paths), len(tree.paths))
        if file_paths[:n] != tree.paths[:n]:
            return None
    out: dict[int, float] = {}
    if isinstance(values, list):
        out = {i + 1: float(v) for i, v in enumerate(values) if v is not None}
    elif isinstance(values, dict):
        out = {int(k): float(v) for k, v in values.items() if v is not None}
    return {n: v for n, v in out.items() if n <= tree.size} or None


def accepted_per_size(
    tree: Tree, tree_tokens: list[int], continuation: list[int], sizes: Iterable[int]
) -> dict[int, int]:
    """How many candidates the first n nodes of `tree` would have accepted this step, for each n.

    Greedy acceptance of a node depends only on its own token and its parent's logits, and tree attention
    lets a node see only its ancestors, so a smaller prefix of the tree accepts exactly the longest of its
    own paths that matches the true greedy continuation (the reply's next tokens after this step's root).
    """
    depth_ok = [True] + [False] * (tree.size - 1)  # node i's whole path matches the continuation
    longest_within: list[int] = [0] * tree.size  # best accepted depth among nodes 0..i
    best = 0
    for i in range(1, tree.size):
        d = tree.depths[i]
        parent = tree.parents[i]
        depth_ok[i] = depth_ok[parent] and d <= len(continuation) and tree_tokens[i] == continuation[d - 1]
        if depth_ok[i]:
            best = max(best, d)
        longest_within[i] = best
    return {n: longest_within[min(n, tree.size) - 1] for n in sizes}


def measure_tokens_per_step(
    engine: MedusaEngine,
    prompts: list[list[int]],
    sizes: Iterable[int],
    max_new_tokens: int = 64,
    progress: Callable[[str], None] | None = None,
    step_sizes: list[int] | None = None,
    cancel: threading.Event | None = None,
) -> dict[int, float]:
    """E[tokens/step] for each prefix size of `engine.tree`, from greedy replies with the full tree.

    One reply with the full tree gives the estimate for every smaller prefix at once (see
    `accepted_per_size`). Steps whose true continuation is cut off by the end of the reply are skipped, as
    their acceptance cannot be known. `step_sizes`, if given, gets each counted step's verified node count
    (a model without heads verifies only the lookup's guesses: fewer nodes than the tree has). `cancel`: as
    measure_step_latency's, checked every step.
    """
    tree = engine.tree
    if engine.device.type == "cpu" and prompts:  # room for the longest reply, not the default 1024 slots
        engine.fresh_cache(timing_capacity(max(map(len, prompts)) + max_new_tokens, tree.size))
    sizes = [n for n in sizes if n <= tree.size]
    totals = {n: 0 for n in sizes}
    steps = 0
    for i, prompt in enumerate(prompts):
        events: list[StepEvent] = []
        settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=0.0)
        summary = _one_reply(engine, prompt, settings, cancel, events)
        reply = summary.token_ids
        pos = 0  # index in the reply of the current step's root
        for ev in events:
            if ev.step == 0:
                pos = 0
                continue
            assert ev.tree is not None
            cont = reply[pos + 1 : pos + 1 + tree.depth]
            if len(cont) >= tree.depth:
                # a step that verified a prefix of the tree (no heads: the root + the lookup's guesses) accepted
                # nothing past it: -1 is no token
                tokens = ev.tree.tokens + [-1] * (tree.size - len(ev.tree.tokens))
                for n, a in accepted_per_size(tree, tokens, cont, sizes).items():
                    totals[n] += a
                if step_sizes is not None:
                    step_sizes.append(len(ev.tree.tokens))
                steps += 1
            pos += len(ev.token_ids)
        if progress:
            progress(
                f"  reply {i + 1}/{len(prompts)}: {summary.new_tokens} tokens, {summary.tokens_per_step:.2f} tokens/step"
            )
    if steps == 0:
        return {n: 1.0 for n in sizes}
    return {n: 1.0 + totals[n] / steps for n in sizes}
