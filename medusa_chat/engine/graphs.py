"""CUDA graphs for the engine's verification step (graph_step.py records and replays them): when an engine
uses them, and the check of each newly recorded graph against the eager step."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.engine.acceptance import greedy_tokens
from medusa_chat.model.forward.graph_step import GraphStep, allocate_cache, graphs_enabled
from medusa_chat.model.forward.lean_forward import LeanForward
from medusa_chat.model.forward.runner import BackboneRunner
from medusa_chat.tree import TreeBuffers

if TYPE_CHECKING:
    from medusa_chat.model.forward.kv_cache import TreeKVCache

# The graphs' cache is allocated whole for the context window, up to this many tokens (Llama-2-7B in fp16: 0.5 GB
# per 1k tokens); a longer conversation continues on the eager step, whose cache grows as needed.
GRAPH_CACHE_LIMIT = 4096



def wants_graphs(model: Any, runner: BackboneRunner) -> bool:
    """Should this engine replay its steps as CUDA graphs: a lean forward to record (not the transformers one,
    whose cache and mask logic run on the host), not turned off (MEDUSA_CHAT_COMPILE=0), and not measured
    slower by the calibration (`model.graph_step` False)."""
    return (
        isinstance(runner.lean, LeanForward)
        and graphs_enabled()
        and getattr(model, "graph_step", None) is not False
    )


class GraphRecorder:
    """The engine's CUDA graphs of its verification step; MedusaEngine holds one (`engine.graphs`). `mask(start,
    buf)` and `forward(ids, positions, attend)` are the engine's eager step, which a newly recorded graph is checked
    against."""

    def __init__(
        self,
        runner: BackboneRunner,
        dtype: torch.dtype,
        device: torch.device,
        context_limit: int,
        mask: Callable[[int, TreeBuffers], torch.Tensor],
        forward: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor],
    ) -> None:
        self.runner, self.lm_head = runner, runner.lm_head
        self.dtype, self.device, self.context_limit = dtype, device, context_limit
        self.mask, self.forward = mask, forward
        self.graph: GraphStep | None = None  # None: the eager step runs
        self.note = ""  # why graphs went off, where they did

    def record(self, cache: TreeKVCache, capture: bool = True) -> GraphStep:
        """Replay the steps as CUDA graphs over `cache`, which gets its whole buffer now (graphs hold its address);
        capture=False: run the graphs' code eagerly, as on a CPU."""
        cfg = self.runner.model.config
        lean = self.runner.lean
        capacity = min(self.context_limit, GRAPH_CACHE_LIMIT)
        allocate_cache(cache, cfg.num_hidden_layers, lean.kv_heads, lean.head_dim, capacity, self.dtype, self.device)
        self.graph = GraphStep(lean, self.lm_head, cache, capacity, capture=capture)
        return self.graph

    def step(
        self, tokens: torch.Tensor, start: int, buf: TreeBuffers, cache: TreeKVCache
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's (hidden, logits) from its CUDA graph, or (_, None) where graphs cannot serve it (then the
        eager step runs). A newly recorded graph's first replay is checked against the eager step first: one
        that disagrees, or that fails to record, turns graphs off for this engine, with a note."""
        graph = self.graph
        assert graph is not None
        if start + buf.tree.size > graph.capacity:  # past the preallocated cache: the eager step grows it
            self.off(f"the conversation outgrew the graphs' cache ({graph.capacity} tokens)")
            return tokens, None
        before = graph.captures
        try:
            hidden, logits = graph.run(tokens, start, buf)
        except (RuntimeError, ValueError) as err:  # a kernel that cannot be recorded, out of memory
            cache.length = start
            self.off(f"a CUDA graph could not be recorded ({err})")
            return tokens, None
        if graph.captures != before:  # a new graph: does it compute the eager step, and faster?
            hidden, logits = hidden.clone(), logits.clone()
            replay_s = self._timed(lambda: graph.run(tokens, start, buf))[0] if graph.capture else 0.0
            cache.length = start
            attend = self.mask(start, buf)
            eager_s, eager = self._timed(lambda: self.forward(tokens, start + buf.depth, attend))
            scale = float(eager.abs().max()) or 1.0
            if float((eager - hidden).abs().max()) > 1e-2 * scale or not torch.equal(
                greedy_tokens(self.lm_head(eager)), greedy_tokens(logits)
            ):
                self.off("a recorded CUDA graph did not reproduce the eager step")
                return eager, None
            if graph.capture and replay_s >= eager_s:
                self.off(f"measured slower ({replay_s * 1e3:.2f} ms vs {eager_s * 1e3:.2f} ms eager)")
                return eager, None
        return hidden, logits

    def _timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """(wall time, result) of fn() on this engine's device (synchronized before and after on a GPU)."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0, out

    def off(self, why: str) -> None:
        self.graph = None
        self.note = f"CUDA graphs off: {why}; the eager step goes on"
