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


class GraphSteps:
    """The CUDA-graph part of MedusaEngine (its base class)."""

    device: torch.device
    dtype: torch.dtype
    cache: TreeKVCache
    context_limit: int
    _graph: GraphStep | None
    graph_note: str

    @property
    def graph(self) -> GraphStep | None:
        """The engine's CUDA graphs of its step, or None where the eager step runs."""
        return self._graph

    def use_graphs(self, capture: bool = True) -> GraphStep:
        """Replay this engine's steps as CUDA graphs (capture=False: run the graphs' code eagerly, as on a CPU)."""
        self._graph = self._new_graph(capture)
        return self._graph

    def _new_graph(self, capture: bool) -> GraphStep:
        """A GraphStep over this engine's cache, which gets its whole buffer now (graphs hold its address)."""
        cfg = self.backbone.config
        lean = self.runner.lean
        capacity = min(self.context_limit, GRAPH_CACHE_LIMIT)
        allocate_cache(
            self.cache, cfg.num_hidden_layers, lean.kv_heads, lean.head_dim, capacity, self.dtype, self.device
        )
        return GraphStep(lean, self.lm_head, self.cache, capacity, capture=capture)

    def _graph_step(
        self, tokens: torch.Tensor, start: int, buf: TreeBuffers
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's (hidden, logits) from its CUDA graph, or (_, None) where graphs cannot serve it (then the
        eager step runs). A newly recorded graph's first replay is checked against the eager step first: one
        that disagrees, or that fails to record, turns graphs off for this engine, with a note."""
        graph = self._graph
        assert graph is not None
        if start + buf.tree.size > graph.capacity:  # past the preallocated cache: the eager step grows it
            self._graphs_off(f"the conversation outgrew the graphs' cache ({graph.capacity} tokens)")
            return tokens, None
        before = graph.captures
        try:
            hidden, logits = graph.run(tokens, start, buf)
        except (RuntimeError, ValueError) as err:  # a kernel that cannot be recorded, out of memory
            self.cache.length = start
            self._graphs_off(f"a CUDA graph could not be recorded ({err})")
            return tokens, None
        if graph.captures != before:  # a new graph: does it compute the eager step, and faster?
            hidden, logits = hidden.clone(), logits.clone()
            replay_s = self._timed(lambda: graph.run(tokens, start, buf))[0] if graph.capture else 0.0
            self.cache.length = start
            attend = self._tree_mask(start, buf)
            eager_s, eager = self._timed(lambda: self._forward(tokens, start + buf.depth, attend))
            scale = float(eager.abs().max()) or 1.0
            if float((eager - hidden).abs().max()) > 1e-2 * scale or not torch.equal(
                greedy_tokens(self.lm_head(eager)), greedy_tokens(logits)
            ):
                self._graphs_off("a recorded CUDA graph did not reproduce the eager step")
                return eager, None
            if graph.capture and replay_s >= eager_s:
                self._graphs_off(f"measured slower ({replay_s * 1e3:.2f} ms vs {eager_s * 1e3:.2f} ms eager)")
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

    def _graphs_off(self, why: str) -> None:
        self._graph = None
        self.graph_note = f"CUDA graphs off: {why}; the eager step goes on"
