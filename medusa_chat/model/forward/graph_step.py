"""The verification step as a CUDA graph: the lean forward and the lm_head, recorded once, replayed per step.

Why: at batch 1 a GPU step of the eager forward is bound by kernel launches from Python (README: 43.8 ms per
step for a 7B-shaped Llama on an H200, where reading its fp16 weights takes ~3 ms). A CUDA graph records the
step's few hundred kernels once and replays them with one launch.

What makes a step capturable is static shapes and static storage. One graph per (tree size, cache bucket):
- the KV cache is one buffer as large as the context window, allocated before the first capture; prefill writes
  into it eagerly, the graphs write and read the same storage;
- a step's variable inputs are device tensors written in place before a replay: the tree's tokens and its first
  slot `start`. Positions (start + depth), cache slots (start + node) and the attention mask are computed inside
  the graph from them;
- attention reads the cache's first `bucket` slots (the smallest power of two >= start + N, at least 256) with a
  mask that shows each node the prefix [0, start) and its tree ancestors. One graph serves every step whose
  context fits its bucket; the next bucket is captured once when a conversation outgrows it, so a tree size
  has at most log2(window) graphs and nothing is re-captured as a reply grows (`captures` counts them).
Acceptance, the heads and the KV commit run as before on the graph's outputs (hidden states [N, H], logits
[N, V]).

Exactness: the graph computes what the engine's eager GPU step computes. With row-invariant projections (the
CUDA int4 load) both attend through the Triton path attention (kernels/triton_attention.py), bitwise the plain
loop's; otherwise through one masked SDPA call over the tree block, equal to plain decoding only up to rounding
near-ties; tests run the same static body without
capture on a CPU in float64, where no rounding can flip a token, against the eager engine and the plain loop.
Before a new graph is used, its first replay is checked against the same step run eagerly; a graph that does
not match, or that fails to capture, turns graphs off for the engine (the eager step goes on). CPU engines
never use this: their default is the native C step (block_forward.py), exact bit for bit.

MEDUSA_CHAT_COMPILE=0 turns graphs off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from medusa_chat import envvars
from medusa_chat.kernels.path_tables import tree_paths
from medusa_chat.tree import TreeBuffers

MIN_BUCKET = 256


def graphs_enabled() -> bool:
    return envvars.enabled("MEDUSA_CHAT_COMPILE")


def bucket_for(end: int, capacity: int) -> int:
    """The cache width a step ending at slot `end` attends over: a power of two >= end (>= MIN_BUCKET), capped
    at the cache's capacity."""
    width = MIN_BUCKET
    while width < end:
        width *= 2
    return min(width, capacity)


@dataclass
class _Static:
    """One graph's inputs, constants and outputs: storage that stays put between replays."""

    tokens: torch.Tensor  # [N] long, written before each replay
    start: torch.Tensor  # [] long, written before each replay
    depth: torch.Tensor  # [N] long: the tree's node depths
    nodes: torch.Tensor  # [N] long: 0 .. N - 1
    bias: torch.Tensor  # [N, N] additive tree mask (0: ancestor or self)
    cols: torch.Tensor  # [bucket] long: 0 .. bucket - 1
    paths: torch.Tensor  # [N, max depth + 1] long: each node's ancestors root .. itself (exact path attention)
    hidden: torch.Tensor | None = None  # [N, H] output
    logits: torch.Tensor | None = None  # [N, V] output
    graph: Any = None  # torch.cuda.CUDAGraph, or None when run eagerly


class GraphStep:
    """`run(tokens, start, buf) -> (hidden [N, H], logits [N, V])` for a verification step whose cache is
    `cache` (an model.forward.kv_cache.TreeKVCache whose buffer was allocated at `capacity` slots).

    capture=False runs the very same static-shape body eagerly (what tests exercise on a CPU)."""

    def __init__(self, lean: Any, lm_head: Any, cache: Any, capacity: int, capture: bool = True) -> None:
        self.lean, self.lm_head, self.cache, self.capacity = lean, lm_head, cache, capacity
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._graphs: dict[tuple[int, int], _Static] = {}
        # graphs recorded so far (capture=False: static bodies set up); a growing reply adds one per bucket only
        self.captures = 0

    def run(self, tokens: torch.Tensor, start: int, buf: TreeBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        n = buf.tree.size
        if start + n > self.capacity:
            raise ValueError(
                f"a step at slot {start} with {n} nodes does not fit the cache ({self.capacity})"
            )
        width = bucket_for(start + n, self.capacity)
        st = self._graphs.get((n, width))
        fresh = st is None
        if fresh:
            st = self._static(buf, width, tokens.device)
        st.tokens.copy_(tokens)
        st.start.fill_(start)
        if fresh:
            if self.capture:
                self._record(st, width)
            self._graphs[(n, width)] = st
            self.captures += 1
        if st.graph is not None:
            st.graph.replay()
        else:
            self._body(st, width)
        self.cache.length = start + n  # as the eager step's cache writes leave it; the caller commits (keep)
        assert st.hidden is not None and st.logits is not None
        return st.hidden, st.logits

    def _static(self, buf: TreeBuffers, width: int, device: torch.device) -> _Static:
        n = buf.tree.size
        return _Static(
            tokens=torch.zeros(n, dtype=torch.long, device=device),
            start=torch.zeros((), dtype=torch.long, device=device),
            depth=buf.depth.to(device),
            nodes=torch.arange(n, device=device),
            bias=buf.attn_bias.to(device),
            cols=torch.arange(width, device=device),
            paths=tree_paths(buf.tree.parents)[0].to(device),
        )

    def _body(self, st: _Static, width: int) -> None:
        """The step with shapes fixed by (N, width) and every varying value read from device tensors."""
        n = st.tokens.shape[0]
        rel = st.cols - st.start  # a cache slot relative to the tree's first slot
        in_tree = (rel >= 0) & (rel < n)
        tree_cols = st.bias.index_select(1, rel.clamp(0, n - 1))  # [N, width]
        hidden_mask = torch.full_like(tree_cols, torch.finfo(st.bias.dtype).min)
        mask = torch.where(rel < 0, torch.zeros_like(tree_cols), torch.where(in_tree, tree_cols, hidden_mask))
        buffer = self.cache.buffer
        hidden = self.lean.forward_static(
            st.tokens, st.start + st.depth, st.start + st.nodes, mask[None, None], buffer, width,
            paths=(st.start, st.paths, st.depth),
        )
        logits = self.lm_head(hidden)
        if st.hidden is None or st.logits is None:
            st.hidden, st.logits = hidden, logits
        else:
            st.hidden.copy_(hidden)
            st.logits.copy_(logits)

    def _record(self, st: _Static, width: int) -> None:
        # Warm up on a side stream (allocator and library handles settle outside the graph), then record.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._body(st, width)
        torch.cuda.current_stream().wait_stream(stream)
        st.hidden = st.logits = None  # the graph's own output buffers replace the warm-up's
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._body(st, width)
        st.graph = graph


def allocate_cache(
    cache: Any, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: Any, device: Any
) -> None:
    """Give `cache` (model.forward.kv_cache.TreeKVCache) its whole buffer now, `capacity` slots: graphs hold its address."""
    cache.capacity = capacity
    cache.buffer = torch.zeros((layers, 2, 1, kv_heads, capacity, head_dim), dtype=dtype, device=device)
    cache.rows = None
