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

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.cliargs import int_list
from medusa_chat.errors import MedusaChatError
from medusa_chat.events import GenerationSettings, ReplySummary, StepEvent
from medusa_chat.model.runner import BackboneRunner
from medusa_chat.tree import Tree
from medusa_chat.tuning.tree_choice import (  # the runtime half (what the session needs), re-exported here
    CALIBRATION_VERSION,
    calibrated_source,
    calibration_path,
    choose_tree,
    describe_calibration,
    device_name,
    dtype_name,
    heads_stamp,
    load_calibration,
    model_identity,
    save_calibration,
)

if TYPE_CHECKING:
    from medusa_chat.engine.engine import MedusaEngine

DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
DEFAULT_PREFIX_TOKENS = 256
# Sizes whose estimated rates are this close count as tied, and the smaller tree wins: the estimates carry a few
# percent of noise (acceptance from a few hundred tokens, latencies on a shared machine), a deeper node's
# acceptance rests on fewer events, and a small tree's cost varies less with load and context length. Measured
# on a 2-core EPYC: prefixes of 2, 3 and 4 nodes were estimated within 2% of each other, and in real replies
# the 4-node tree was the slowest of the three (its deep nodes accepted less often than estimated).
NEAR_TIE = 0.03

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


# ------------------------------------------------------------------------------------------------------------
# Latency: the engine's tree step, timed
# ------------------------------------------------------------------------------------------------------------
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


def model_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


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
) -> dict[int, dict[str, float]]:
    """Time one decoding step per tree size, with `prefix_tokens` already in the KV cache.

    A step is `MedusaEngine.step` itself (propose, verify, greedy accept, bonus; the lean forward's exact
    per-node attention on a CPU, the heads' draft for the next step) plus the one host sync and the in-place
    KV commit `generate` does after it. After each rep the cache is cropped back to the prefix, so every rep sees
    the same context. Returns {n: {"median_s", "min_s", "mean_s", "event_median_s"?}}; `event_median_s` (CUDA
    events, device time) only on CUDA. The wall-clock median includes launch overhead, which is what a reply
    pays, so it is the number the projections use. (When the host cannot launch kernels as fast as the GPU runs
    them, the event time equals the wall time: the GPU waits for the launches.) graphs=False times the eager
    step where an engine would replay CUDA graphs (graph_step.py).
    """
    from medusa_chat.engine.acceptance import make_acceptor
    from medusa_chat.engine.engine import MedusaEngine

    sizes = list(dict.fromkeys(sizes))  # iterated twice; duplicates would be timed twice for nothing
    device = torch.device(loaded.device)
    backbone = loaded.backbone
    vocab = int(getattr(backbone.config, "vocab_size", 0) or backbone.get_output_embeddings().out_features)
    base = tree or Tree.named("mc_sim_7b_63")
    cuda = device.type == "cuda"
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (prefix_tokens,), generator=g).to(device)
    acceptor = make_acceptor(GenerationSettings(temperature=0.0), None, device, 1 << 20)
    step_args: dict[int, tuple] = {}
    for n in sizes:
        t = latency_tree(base, n)
        if loaded.heads is not None and n > 1:
            t.check_fits(loaded.heads.num_heads)
        engine = MedusaEngine(
            loaded, t, graphs=graphs
        )  # each size its own cache: key rows are sized per tree
        hidden = engine._forward(
            prefix, torch.arange(prefix_tokens, device=device), engine._prefill_mask(0, prefix_tokens)
        )
        logits, draft = engine._next_logits_and_guesses(hidden[-1:])
        step_args[n] = (engine, logits.argmax(-1, keepdim=True), draft)
        for _ in range(warmup):
            _timed_step(*step_args[n], acceptor)

    # Sizes are timed round-robin (one rep of each size per round), so a slow spell of a shared machine (other
    # processes, clock changes) hits every size alike instead of skewing the sizes measured during it.
    walls: dict[int, list[float]] = {n: [] for n in step_args}
    events: dict[int, list[float]] = {n: [] for n in step_args}
    for _ in range(reps):
        for n, args in step_args.items():
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(device)
                e0.record()
            t0 = time.perf_counter()
            _timed_step(*args, acceptor)
            if cuda:
                e1.record()
                torch.cuda.synchronize(device)
            walls[n].append(time.perf_counter() - t0)
            if cuda:
                events[n].append(e0.elapsed_time(e1) / 1000.0)
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
    for engine, _, _ in step_args.values():
        engine.reset()
    return results


def _timed_step(engine: Any, root: torch.Tensor, draft: torch.Tensor | None, acceptor: Any) -> None:
    """The engine's step, its host sync and commit, then the cache put back (so every rep sees one context)."""
    start = engine.cache.length
    done = engine.step(root, draft, start, acceptor, 0)  # the step and its one host sync
    engine.cache.keep(start, done.accepted, done.path)
    engine.cache.crop(start)


# ------------------------------------------------------------------------------------------------------------
# Accuracy: expected tokens per step for each prefix size of the tree
# ------------------------------------------------------------------------------------------------------------
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
) -> dict[int, float]:
    """E[tokens/step] for each prefix size of `engine.tree`, from greedy replies with the full tree.

    One reply with the full tree gives the estimate for every smaller prefix at once (see
    `accepted_per_size`). Steps whose true continuation is cut off by the end of the reply are skipped, as
    their acceptance cannot be known.
    """
    tree = engine.tree
    sizes = [n for n in sizes if n <= tree.size]
    totals = {n: 0 for n in sizes}
    steps = 0
    for i, prompt in enumerate(prompts):
        events: list[StepEvent] = []
        summary: ReplySummary | None = None
        for item in engine.generate(
            prompt, GenerationSettings(max_new_tokens=max_new_tokens, temperature=0.0)
        ):
            if isinstance(item, StepEvent):
                events.append(item)
            else:
                summary = item
        assert summary is not None
        reply = summary.token_ids
        pos = 0  # index in the reply of the current step's root
        for ev in events:
            if ev.step == 0:
                pos = 0
                continue
            assert ev.tree is not None
            cont = reply[pos + 1 : pos + 1 + tree.depth]
            if len(cont) >= tree.depth:
                for n, a in accepted_per_size(tree, ev.tree.tokens, cont, sizes).items():
                    totals[n] += a
                steps += 1
            pos += len(ev.token_ids)
        if progress:
            progress(
                f"  reply {i + 1}/{len(prompts)}: {summary.new_tokens} tokens, {summary.tokens_per_step:.2f} tokens/step"
            )
    if steps == 0:
        return {n: 1.0 for n in sizes}
    return {n: 1.0 + totals[n] / steps for n in sizes}


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
) -> dict[str, Any]:
    """Measure latency per size, get E[tokens/step] per size, pick the best size. Returns the JSON record."""
    from medusa_chat.engine.engine import MedusaEngine

    base = base or loaded.default_tree
    sizes = sorted({n for n in sizes if 1 <= n <= base.size} | {base.size, 1})
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
        engine = MedusaEngine(loaded, base, shaped=False)
        engine.lookup_run = 0
        prompts = [
            loaded.build_prompt([{"role": "user", "content": p}])
            for p in CALIBRATION_PROMPTS[:measure_replies]
        ]
        tps = measure_tokens_per_step(engine, prompts, sizes, measure_tokens, progress)
        source = f"measured: {measure_replies} greedy replies x {measure_tokens} tokens on built-in prompts"
        engine.reset()
    tps[1] = 1.0  # a root-only step makes exactly one token

    if progress:
        progress(f"timing tree steps with a {prefix_tokens}-token cached prefix ({reps} reps per size)")
    lat = measure_step_latency(
        loaded,
        sizes,
        tree=base,
        prefix_tokens=prefix_tokens,
        reps=reps,
        progress=progress,
    )
    latency = {n: v["median_s"] for n, v in lat.items()}
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
    best = pick_tree_size(latency, tps, NEAR_TIE)
    rates = expected_tokens_per_s(latency, tps)
    return {
        "version": CALIBRATION_VERSION,
        "model": model_name,
        "device": str(device),
        "device_name": device_name(device),
        "quant": quant,
        "dtype": dtype,
        "tree": base.name,
        "forward": BackboneRunner(loaded.backbone).path,
        "tree_size": best,
        # on a GPU: were the CUDA-graph steps faster than the eager ones at the chosen size (graph_step.py)?
        **({"graph_step": latency[best] < eager[best]} if best in eager else {}),
        "heads_stamp": heads_stamp(loaded),
        "speedup_est": round(estimated_speedup(latency, tps, best), 3),
        "tokens_per_s_est": round(rates[best], 2),
        "prefix_tokens": prefix_tokens,
        "accuracy_source": source,
        "sizes": [
            {
                "size": n,
                "latency_s": round(latency[n], 6),
                "tokens_per_step": round(tps[n], 4),
                "tokens_per_s_est": round(rates[n], 2),
                "speedup_est": round(estimated_speedup(latency, tps, n), 3),
                **({"eager_latency_s": round(eager[n], 6)} if n in eager else {}),
            }
            for n in sorted(rates)
        ],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


# ------------------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------------------
def add_calibrate_args(parser: argparse.ArgumentParser) -> None:
    """Options of `medusa-chat calibrate` (model/heads/quant/dtype/device/tree come from the common options)."""
    parser.add_argument(
        "--sizes",
        type=int_list,
        default=list(DEFAULT_SIZES),
        help="tree sizes to time, capped at the tree's size (default: %(default)s)",
    )
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        default=DEFAULT_PREFIX_TOKENS,
        help="tokens already in the KV cache while timing (default: %(default)s)",
    )
    parser.add_argument(
        "--reps", type=int, default=8, help="timed steps per size; the median is used (default: %(default)s)"
    )
    parser.add_argument(
        "--accuracy",
        type=Path,
        default=None,
        metavar="TREE_JSON",
        help="tree.json with expected_tokens_per_step (default: the heads folder's tree.json)",
    )
    parser.add_argument(
        "--measure-replies",
        type=int,
        default=4,
        help="greedy replies used to measure tokens/step when no tree.json has it (default: %(default)s)",
    )
    parser.add_argument(
        "--measure-tokens", type=int, default=64, help="tokens per measuring reply (default: %(default)s)"
    )
    parser.add_argument(
        "--measure-accuracy",
        action="store_true",
        help="measure tokens/step with greedy replies even when tree.json has expected values",
    )
    parser.add_argument("--no-save", action="store_true", help="print the result but do not cache it")
    parser.add_argument("--json", action="store_true", help="print the calibration record as JSON")


add_arguments = add_calibrate_args  # the hook cli.py looks for in a sub-command's module


def calibrate_main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from medusa_chat.model.loading import load_from_args  # not bench's wrapper: bench imports this module

    err = Console(stderr=True)
    out = Console()
    try:
        loaded = load_from_args(args, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
        base = Tree.named(args.tree) if getattr(args, "tree", None) else loaded.default_tree
        if getattr(args, "tree_size", None):
            base = base.prefix(min(args.tree_size, base.size))
        result = calibrate(
            loaded,
            base,
            sizes=args.sizes,
            prefix_tokens=args.prefix_tokens,
            reps=args.reps,
            accuracy_file=args.accuracy,
            measure_replies=args.measure_replies,
            measure_tokens=args.measure_tokens,
            progress=lambda m: err.print(f"[dim]{m}[/dim]"),
            measure_accuracy=args.measure_accuracy,
        )
    except MedusaChatError as e:
        err.print(f"[red]error:[/red] {e}")
        return 1
    if not args.no_save:
        path = save_calibration(result, result["model"], loaded.device, result["quant"], result["dtype"])
        result["saved_to"] = str(path)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
        return 0
    table = Table(
        title=f"{result['model']} on {result['device_name']} ({result['quant']}, {result['dtype']}), "
        f"{result['prefix_tokens']}-token context"
    )
    for col in ("nodes", "step ms", "tokens/step", "est. tokens/s", "est. speedup"):
        table.add_column(col, justify="right")
    for row in result["sizes"]:
        mark = " <" if row["size"] == result["tree_size"] else ""
        table.add_row(
            str(row["size"]) + mark,
            f"{row['latency_s'] * 1000:.1f}",
            f"{row['tokens_per_step']:.2f}",
            f"{row['tokens_per_s_est']:.1f}",
            f"{row['speedup_est']:.2f}x",
        )
    out.print(table)
    out.print(f"tokens/step from {result['accuracy_source']}")
    out.print(
        f"chosen: {describe_calibration(result)} - first {result['tree_size']} nodes of {result['tree']}"
    )
    if "saved_to" in result:
        out.print(f"saved to {result['saved_to']}")
    if not math.isfinite(result["speedup_est"]) or result["speedup_est"] <= 1.0:
        out.print("[yellow]no tree beats plain decoding on this device by the estimate[/yellow]")
    return 0


__all__ = [  # the runtime names imported from tree_choice stay importable from here
    "CALIBRATION_VERSION",
    "CPU_MAX_TREE",
    "CPU_SIZES",
    "add_arguments",
    "calibrated_source",
    "calibration_path",
    "device_name",
    "dtype_name",
    "heads_stamp",
    "model_identity",
    "resolve_tree",
    "add_calibrate_args",
    "calibrate",
    "calibrate_main",
    "choose_tree",
    "describe_calibration",
    "load_calibration",
    "measure_step_latency",
    "measure_tokens_per_step",
    "pick_tree_size",
    "save_calibration",
]


# On a CPU a tree step's cost grows with every node (the exact per-node attention, the projections' extra
# rows): measured on a 2-core AVX2 EPYC, 8 nodes cost ~3x a plain step and 16 ~9x, so the first-start
# calibration looks at prefixes up to 8 nodes (and stays short: ~10 s).
CPU_MAX_TREE = 8


CPU_SIZES = (1, 2, 3, 4, 6, 8)


def resolve_tree(
    loaded: Any,
    tree_name: str | None = None,
    tree_size: int | None = None,
    progress: Callable[[str], None] | None = None,
    auto_calibrate: bool | None = None,
) -> tuple[Tree, str]:
    """The tree every entry point uses (chat, web, ask, bench, info, serve), and why.

    --tree / --tree-size win; else this machine's cached calibration; else, on a CPU, calibrate once now
    (about 10 s; cached for every later start and command); else the model's default tree.
    """
    if auto_calibrate is None:  # MEDUSA_CHAT_AUTO_CALIBRATE=0 turns it off (the test suite does)
        auto_calibrate = os.environ.get("MEDUSA_CHAT_AUTO_CALIBRATE", "1") != "0"
    tree, source = choose_tree(loaded, tree_name, tree_size)
    if source != "default" or not auto_calibrate or loaded.device.type != "cpu" or tree.size <= 1:
        return tree, source
    base = tree.prefix(min(tree.size, CPU_MAX_TREE))
    if progress is not None:
        progress(f"calibrating the tree size for this CPU once ({loaded.quant}; cached for next time)")
    record = calibrate(
        loaded,
        base=base,
        sizes=CPU_SIZES,
        reps=30,  # round-robin over the sizes, ~1 s in all: medians that a noisy VM does not flip
        measure_accuracy=True,
        measure_replies=len(CALIBRATION_PROMPTS),  # ~600 tokens: a reply costs well under a second here
        measure_tokens=48,
        progress=progress,
    )
    record["tree"] = tree.name  # the default tree: its prefixes are what the record chooses among
    model_name, device, quant, dtype = model_identity(loaded)
    save_calibration(record, model_name, device, quant, dtype)
    return tree.prefix(record["tree_size"]), calibrated_source(record)
