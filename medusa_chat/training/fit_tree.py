"""Fit a Medusa tree to measured head accuracies (MEDUSA_FACTS section 5).

A node with path [r1, ..., rd] is accepted under greedy decoding exactly when the true next tokens have ranks
r1..rd in heads 0..d-1, so its *gain* is the probability of that event, and the expected tokens per step of a
tree is 1 (the root / bonus token) + the sum of its nodes' gains. Growing greedily from the root, always adding
the frontier node with the largest gain, gives the best tree of every size at once, in growth order (a child's
gain never exceeds its parent's, and it only enters the frontier once its parent is in the tree).

Two sources of gains:
- joint: the measured frequency of each rank-tuple prefix (`accuracy.json` "joint"). Hits of different heads
  are correlated (a head that is right makes the next one likelier to be right), so this is what to use;
- independent: the product of per-head rank accuracies `acc[d][r]` along the path (what the reference did;
  overestimates when hits correlate, see MEDUSA_FACTS section 14).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from medusa_chat.atomic import atomic_write_json

PathT = tuple[int, ...]
Gain = Callable[[PathT], float]
SIZES = (8, 16, 32, 64)


def independent_gain(acc: Sequence[Sequence[float]]) -> Gain:
    """gain(path) = prod_d acc[d][path[d]] (per-head rank accuracies, assumed independent)."""

    def gain(path: PathT) -> float:
        g = 1.0
        for d, r in enumerate(path):
            if d >= len(acc) or r >= len(acc[d]):
                return 0.0
            g *= float(acc[d][r])
        return g

    return gain


def joint_gain(probs: Mapping[PathT, float], acc: Sequence[Sequence[float]] | None = None) -> Gain:
    """gain(path) = measured P(rank tuple starts with path).

    The table keeps only the most frequent prefixes, so every missing path is at most as likely as the least
    likely stored one; for those, estimate parent x independent accuracy, capped at that bound (0 without acc).
    """
    floor = min(probs.values()) if probs else 0.0

    def gain(path: PathT) -> float:
        if path in probs:
            return float(probs[path])
        if acc is None or not path:
            return 0.0
        d, r = len(path) - 1, path[-1]
        if d >= len(acc) or r >= len(acc[d]):
            return 0.0
        return min(gain(path[:-1]) * float(acc[d][r]), floor)

    return gain


def grow_tree(gain: Gain, num_heads: int, max_rank: int, budget: int) -> tuple[list[PathT], list[float]]:
    """Greedy growth: `budget` nodes in all (root included), so budget - 1 paths. Returns (paths, gains)."""
    paths: list[PathT] = []
    gains: list[float] = []
    # Max-heap on gain; ties broken by shorter path, then lexicographic: deterministic output.
    heap: list[tuple[float, int, PathT]] = [(-gain((r,)), 1, (r,)) for r in range(max_rank)]
    heapq.heapify(heap)
    while heap and len(paths) < budget - 1:
        g, _, p = heapq.heappop(heap)
        if -g <= 0.0:
            break  # nothing left that can ever be accepted
        paths.append(p)
        gains.append(-g)
        if len(p) < num_heads:
            for r in range(max_rank):
                c = p + (r,)
                heapq.heappush(heap, (-gain(c), len(c), c))
    return paths, gains


def _acc_source(acc: Any) -> tuple[Gain, int, int, str]:
    """(gain, num_heads, max_rank, kind) from per-head rank accuracies, a {path: prob} map, or an accuracy report."""
    if isinstance(acc, Mapping) and ("heldout" in acc or "rank_acc" in acc or "joint" in acc):
        report = acc.get("heldout", acc)
        rank_acc = report.get("rank_acc")
        joint = report.get("joint")
        if joint and joint.get("paths"):
            probs = {tuple(p): float(q) for p, q in zip(joint["paths"], joint["probs"], strict=True)}
            k = len(rank_acc) if rank_acc else max(len(p) for p in probs)
            return joint_gain(probs, rank_acc), k, int(joint.get("max_rank", 10)), "joint"
        if rank_acc:
            return independent_gain(rank_acc), len(rank_acc), len(rank_acc[0]), "independent"
        raise ValueError("accuracy report has neither 'joint' nor 'rank_acc'")
    if isinstance(acc, Mapping):
        probs = {tuple(int(x) for x in p): float(q) for p, q in acc.items()}
        k = max((len(p) for p in probs), default=0)
        return joint_gain(probs), k, 1 + max((max(p) for p in probs if p), default=0), "joint"
    return independent_gain(acc), len(acc), (len(acc[0]) if acc else 0), "independent"


def expected_accept_length(paths: Sequence[Sequence[int]], acc: Any) -> float:
    """Expected tokens per greedy decoding step with this tree: 1 (root/bonus) + sum of node acceptance probs.

    `acc` is per-head rank accuracies `acc[d][r]` (independent hits), a `{path tuple: probability}` map of
    measured joint acceptance, or an accuracy report (accuracy.json dict; its joint table is preferred).
    This is the quantity `medusa-chat bench` reports as mean tokens per step.
    """
    gain, _, _, _ = _acc_source(acc)
    return 1.0 + sum(gain(tuple(int(r) for r in p)) for p in paths)


def fit_tree(acc: Any, budget: int = 64, name: str = "fitted", prefer_joint: bool = True) -> dict[str, Any]:
    """Grow a tree of `budget` nodes (root included) and return the tree.json dict.

    `expected_tokens_per_step[i]` = expected tokens per step using the first i paths (tree size i + 1), so
    index 0 is plain decoding (1.0) and the last entry is the whole tree.
    """
    if budget < 1:
        raise ValueError("tree budget must be >= 1 node")
    if not prefer_joint and isinstance(acc, Mapping) and ("heldout" in acc or "rank_acc" in acc):
        report = acc.get("heldout", acc)
        acc = report["rank_acc"]
    gain, num_heads, max_rank, kind = _acc_source(acc)
    paths, gains = grow_tree(gain, num_heads, max_rank, budget)
    curve = [1.0]
    for g in gains:
        curve.append(curve[-1] + g)
    return {
        "name": name,
        "paths": [list(p) for p in paths],
        "expected_tokens_per_step": [round(c, 4) for c in curve],
        "expected_tokens_per_step_index": "i = number of paths used (tree size i + 1, root included)",
        "gains_from": kind,
    }


def size_summary(tree: dict[str, Any], sizes: Sequence[int] = SIZES) -> dict[str, float]:
    """Expected tokens per step at several tree sizes (nodes incl. root) from a fit_tree() result."""
    curve = tree["expected_tokens_per_step"]
    out = {}
    for s in sizes:
        if s - 1 < len(curve):
            out[str(s)] = curve[s - 1]
    out[f"full-{len(curve)}"] = curve[-1]
    return out


def fit_tree_for_heads(heads_dir: str | Path, budget: int = 64, prefer_joint: bool = True) -> dict[str, Any]:
    """Read `accuracy.json` in a heads folder, fit a tree, write `tree.json` there; return the tree dict."""
    heads_dir = Path(heads_dir)
    acc_path = heads_dir / "accuracy.json"
    if not acc_path.is_file():
        raise FileNotFoundError(f"{acc_path} not found: train-heads writes it (held-out rank accuracies)")
    report = json.loads(acc_path.read_text(encoding="utf-8"))
    tree = fit_tree(report, budget=budget, name=f"{heads_dir.name}-fitted", prefer_joint=prefer_joint)
    atomic_write_json(heads_dir / "tree.json", tree)
    return tree
