"""A lean eager forward for Llama-family decoders (Llama, Vicuna, SmolLM2, Mistral/Zephyr, Qwen2: Llama's layers
with q/k/v biases, which its projection modules add; Qwen3: Llama's layers with an RMSNorm per head on q and k).

Why: at batch 1 on a CPU (and on a GPU without graphs) the transformers forward spends about as long in
Python (kwargs plumbing, output recording, mask/cache dispatch, per-layer hooks) as in the matmuls. For
SmolLM2-135M on 2 cores that is ~17 ms of a ~50 ms step. This module runs the same layers' own weights and
modules with nothing around them: per layer two norms, the projections, rotary, one cache write, SDPA.

It replays transformers' op order exactly (RMSNorm in fp32, `q*cos + rotate_half(q)*sin`, the same SDPA
call with the same GQA handling), so its output is bitwise equal to the model's own forward; tests pin that.
Projections are called through their modules' `forward`, so bitsandbytes 4-bit/8-bit layers work unchanged.
Anything unusual (other architectures, q/k norms outside Qwen3, sliding-window layers, tensor-parallel slicing) returns
None from `lean_forward_for` and the engine uses the transformers forward instead.

Exact tree attention (`TreePlan`): a tree step must give every node the bits the plain loop gives that token.
SDPA over the whole tree block with an ancestor mask does not: the masked keys change the kernel's blocking
and reduction order. So each node attends with the very call the plain step makes for that token: one query
against [prefix, its ancestors root..itself], contiguous, no mask. The root reads the cache itself; the other
nodes read per-node key rows (`TreeKVCache.tree_rows`) that hold a copy of the prefix (synced incrementally:
only tokens committed since the last step are copied) followed by the node's path. Nodes of equal depth
share one call when SDPA is batch-invariant for this dtype on this machine (`sdpa_batch_invariant`), else
each node gets its own batch-1 call. Every projection is a row-invariant module (cpu_linears.py), RMSNorm,
rotary and the MLP's elementwise ops are per-row: so the whole step is exact, and tests pin it.

The projections are the modules' own `forward` (bitsandbytes, packed dense and weight-only int linears work
unchanged). Set MEDUSA_CHAT_LEAN=0 to use the transformers forward instead (for comparisons).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from medusa_chat import envvars
from medusa_chat.model.forward.tree_plan import TreePlan

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}
QK_NORMED = {"qwen3"}  # model types whose q and k heads are RMS-normed after the projection, before rotary


Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _Layer:
    norm1_w: torch.Tensor
    norm1_eps: float
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    norm2_w: torch.Tensor
    norm2_eps: float
    gate: Linear
    up: Linear
    down: Linear
    qkv: Linear | None = None  # q, k, v in one call (block-kernel linears, see block_linears.fuse)
    gate_up: Linear | None = None
    # Qwen3: the per-head RMSNorm weights [head_dim] of q and k (None: no such norm)
    q_norm: tuple[torch.Tensor, float] | None = None
    k_norm: tuple[torch.Tensor, float] | None = None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same ops as LlamaRMSNorm.forward (fp32 statistics, scale in the input dtype).
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


_BATCH_INVARIANT: dict[tuple[torch.dtype, str, int, int, int], bool] = {}


def sdpa_batch_invariant(
    dtype: torch.dtype, device: torch.device, kv_heads: int, groups: int, hd: int
) -> bool:
    """Does SDPA give each batch element the bits it gives that element alone (this dtype, device, threads)?

    Then nodes of equal depth share one call. Measured, not assumed: fp32 on a 2-thread CPU is not (the kernel
    splits the work differently), bf16 there is.
    """
    key = (dtype, str(device), torch.get_num_threads(), kv_heads * groups, hd)
    if key not in _BATCH_INVARIANT:
        gen = torch.Generator().manual_seed(0)
        ok = True
        for length in (7, 64, 65, 300):
            q, k, v = (
                torch.randn(4, kv_heads, rows, hd, generator=gen).to(device, dtype)
                for rows in (groups, length, length)
            )
            together = F.scaled_dot_product_attention(q, k, v)
            ok = ok and all(
                torch.equal(
                    F.scaled_dot_product_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1]),
                    together[b : b + 1],
                )
                for b in range(4)
            )
        _BATCH_INVARIANT[key] = ok
    return _BATCH_INVARIANT[key]


def _row_invariant_head(head: Any) -> bool:
    """Whether the lm_head is the CUDA int4 load's row-invariant Triton linear. Its module is only imported where
    that load ran, so on a CPU this never imports Triton (it would only leave "nanobind: leaked" lines at exit)."""
    module = sys.modules.get("medusa_chat.kernels.triton_linears")
    return module is not None and isinstance(head, module.RowInvariantLinear)


class LeanForward:
    """`forward(ids [T], positions [T], attend, cache) -> last hidden states [T, H]`.

    `attend` is an additive mask [1, 1, T, L] (prefill: any causal block) or a `TreePlan` (a verification
    step, exact against the plain loop; T = 1 with a root-only plan is the plain step itself).
    """

    taps: tuple[int, ...] = ()  # layers whose input hidden states each forward leaves in `tapped`

    def __init__(self, causal_lm: Any) -> None:
        body = causal_lm.model
        cfg = causal_lm.config
        self.embed = body.embed_tokens
        self.tapped: list[torch.Tensor] = []
        self.lm_head = causal_lm.get_output_embeddings().forward
        self.rotary = body.rotary_emb
        self.final_norm_w = body.norm.weight
        self.final_norm_eps = float(body.norm.variance_epsilon)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.layers = [
            _Layer(
                norm1_w=layer.input_layernorm.weight,
                norm1_eps=float(layer.input_layernorm.variance_epsilon),
                q=layer.self_attn.q_proj.forward,
                k=layer.self_attn.k_proj.forward,
                v=layer.self_attn.v_proj.forward,
                o=layer.self_attn.o_proj.forward,
                norm2_w=layer.post_attention_layernorm.weight,
                norm2_eps=float(layer.post_attention_layernorm.variance_epsilon),
                gate=layer.mlp.gate_proj.forward,
                up=layer.mlp.up_proj.forward,
                down=layer.mlp.down_proj.forward,
                qkv=_fused([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                gate_up=_fused([layer.mlp.gate_proj, layer.mlp.up_proj]),
                q_norm=_head_norm(layer.self_attn, "q_norm"),
                k_norm=_head_norm(layer.self_attn, "k_norm"),
            )
            for layer in body.layers[: cfg.num_hidden_layers]
        ]
        self.q_heads = int(cfg.num_attention_heads)
        weight = self.embed.weight
        self.batch_nodes = sdpa_batch_invariant(
            self._act_dtype(causal_lm), weight.device, self.kv_heads, self.groups, self.head_dim
        )
        # Row-invariant projections (the CUDA int4 load, model/forward/cuda_int4.py): attention follows suit with the
        # Triton path attention, which gives each tree node the plain step's bits, eager or in a CUDA graph.
        self.path_attention = _row_invariant_head(causal_lm.get_output_embeddings())
        self._plan_paths: dict[int, tuple[TreePlan, torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def _act_dtype(causal_lm: Any) -> torch.dtype:
        return causal_lm.get_input_embeddings().weight.dtype

    def _attend_tree(
        self,
        i: int,
        start: int,
        q: torch.Tensor,
        k_all: torch.Tensor,
        v_all: torch.Tensor,
        plan: TreePlan,
        cache: Any,
    ) -> torch.Tensor:
        """q [1, Hq, N, hd] -> [1, Hq, N, hd], each node exactly as the plain step would attend for it."""
        n, hd, groups, kvh = plan.size, self.head_dim, self.groups, self.kv_heads
        # queries as the plain step lays them out: one batch element per node, [kv heads, groups, hd]
        qn = q[0].transpose(0, 1).reshape(n, kvh, groups, hd)
        if n > 1:
            qn = qn.index_select(0, plan.order)
        root = F.scaled_dot_product_attention(
            qn[:1], k_all[:, :, : start + 1], v_all[:, :, : start + 1], scale=self.scaling
        )
        outs = [root]
        if n > 1:
            rows_k, rows_v = cache.tree_rows(i, start, plan)
            for a, b, d in plan.groups:
                width = start + d + 1
                if self.batch_nodes:
                    outs.append(
                        F.scaled_dot_product_attention(
                            qn[1 + a : 1 + b],
                            rows_k[a:b, :, :width],
                            rows_v[a:b, :, :width],
                            scale=self.scaling,
                        )
                    )
                else:
                    outs.extend(
                        F.scaled_dot_product_attention(
                            qn[1 + r : 2 + r],
                            rows_k[r : r + 1, :, :width],
                            rows_v[r : r + 1, :, :width],
                            scale=self.scaling,
                        )
                        for r in range(a, b)
                    )
        out = torch.cat(outs) if len(outs) > 1 else root
        if n > 1:
            out = out.index_select(0, plan.inverse)
        return out.reshape(n, kvh * groups, hd).transpose(0, 1)[None]

    def _paths_of(self, plan: TreePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The path attention's (path, depth) device tensors of a plan, built once per plan."""
        hit = self._plan_paths.get(id(plan))
        if hit is None or hit[0] is not plan:
            assert plan.blocks is not None and plan.block_len is not None
            device = self.embed.weight.device
            hit = (plan, plan.blocks.to(device, torch.long), (plan.block_len - 1).to(device, torch.long))
            self._plan_paths[id(plan)] = hit
        return hit[1], hit[2]

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor | TreePlan, cache: Any
    ) -> torch.Tensor:
        return self._run(ids, positions, attend, cache.write, cache)

    def forward_static(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        buffer: torch.Tensor,
        width: int,
        paths: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The same layers with nothing that depends on host state (graph_step.py captures it as a CUDA graph):
        every layer writes its keys and values at the device tensor `slots` of the cache `buffer`
        [layers, 2, 1, kv_heads, capacity, head_dim] and attends over its first `width` slots with the additive
        `mask` [1, 1, T, width]; with `paths` (start [], path [T, D + 1], depth [T]: the tree as device tensors)
        and row-invariant projections, through the exact path attention instead of the mask."""

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = buffer[i, 0], buffer[i, 1]
            keys.index_copy_(2, slots, k)
            values.index_copy_(2, slots, v)
            return keys[:, :, :width], values[:, :, :width]

        exact = (*paths, width) if paths is not None and self.path_attention else None
        return self._run(ids, positions, mask, write, None, exact)

    def _run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attend: torch.Tensor | TreePlan,
        write: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        cache: Any,
        exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        t, hd, groups = ids.shape[0], self.head_dim, self.groups
        tree = isinstance(attend, TreePlan)
        # a tree's first slot (every layer writes its entries from here); only the exact tree path reads it
        start = cache.length if tree else 0
        if tree and self.path_attention:  # the eager step attends as its CUDA graph does
            assert isinstance(attend, TreePlan)
            path, depth = self._paths_of(attend)
            exact = (torch.tensor(start, device=ids.device), path, depth, start + t)
        x = self.embed(ids[None])
        cos, sin = self.rotary(x, positions[None])
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, layer in enumerate(self.layers):
            if i in self.taps:  # an EAGLE-3 draft reads these layers' inputs (engine/eagle_drafter.py)
                self.tapped[:] = [*self.tapped[1 - len(self.taps) :], x[0]] if i != self.taps[0] else [x[0]]
            h = _rms_norm(x, layer.norm1_w, layer.norm1_eps)
            if layer.qkv is not None:
                # one projection and one rotary for q and k together: elementwise, so bitwise the same
                qkv = layer.qkv(h).view(1, t, -1, hd)
                rope = self.q_heads + self.kv_heads
                qk = qkv[:, :, :rope]
                if layer.q_norm is not None:  # Qwen3: q and k heads normed apart (their own weights), joined
                    qn = _head_rms(qk[:, :, : self.q_heads], layer.q_norm)
                    qk = torch.cat((qn, _head_rms(qk[:, :, self.q_heads :], layer.k_norm)), dim=2)
                qk = qk.transpose(1, 2)
                qk = (qk * cos) + (_rotate_half(qk) * sin)
                q, k, v = qk[:, : self.q_heads], qk[:, self.q_heads :], qkv[:, :, rope:].transpose(1, 2)
            else:
                q = _head_rms(layer.q(h).view(1, t, -1, hd), layer.q_norm).transpose(1, 2)
                k = _head_rms(layer.k(h).view(1, t, -1, hd), layer.k_norm).transpose(1, 2)
                v = layer.v(h).view(1, t, -1, hd).transpose(1, 2)
                q = (q * cos) + (_rotate_half(q) * sin)
                k = (k * cos) + (_rotate_half(k) * sin)
            k, v = write(i, k, v)
            if exact is not None:
                start_t, path, depth, width = exact
                from medusa_chat.kernels.triton_attention import path_attention  # Triton: CUDA only

                node_major = q[0].transpose(0, 1)
                out = path_attention(node_major, k[0], v[0], start_t, path, depth, width, self.scaling)
                out = out.transpose(0, 1)[None]
            elif tree:
                out = self._attend_tree(i, start, q, k, v, attend, cache)
            elif groups > 1 and t == 1:
                # one query: attend per key/value head with the query heads as rows (no repeat of the cache)
                out = F.scaled_dot_product_attention(
                    q.reshape(1, -1, groups, hd), k, v, attn_mask=attend, scale=self.scaling
                )
            elif groups > 1:
                # GQA inside SDPA instead of transformers' repeat_kv copy: bitwise the same result (pinned by
                # tests), without copying the whole cache `groups` times per layer per step.
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attend, scale=self.scaling, enable_gqa=True
                )
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=self.scaling)
            out = out.reshape(1, -1, t, hd).transpose(1, 2).reshape(1, t, -1)
            x = x + layer.o(out)
            h = _rms_norm(x, layer.norm2_w, layer.norm2_eps)
            if layer.gate_up is not None:
                gate, up = layer.gate_up(h).chunk(2, dim=-1)
                x = x + layer.down(F.silu(gate) * up)
            else:
                x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        return _rms_norm(x, self.final_norm_w, self.final_norm_eps)[0]


def _head_rms(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None) -> torch.Tensor:
    """Qwen3's q/k norm on [1, T, heads, head_dim] (before the heads move to dim 1, as transformers applies it)."""
    return x if norm is None else _rms_norm(x, norm[0], norm[1])


def _head_norm(attn: Any, name: str) -> tuple[torch.Tensor, float] | None:
    norm = getattr(attn, name, None)
    return None if norm is None else (norm.weight, float(norm.variance_epsilon))


def _fused(modules: list[Any]) -> Linear | None:
    from medusa_chat.kernels.block_linears import fuse

    fused = fuse(modules)
    return fused.forward if fused is not None else None


def lean_forward_for(causal_lm: Any) -> Any:
    """The lean forward when this model is a plain Llama-family decoder, else None (use transformers').

    Where every projection is a GGUF-block linear (int8/int4 on a CPU), the whole step runs natively in C
    instead (block_forward.NativeForward, same call signature). Built once per model object and shared by every
    engine and by the calibration that times it.
    """
    if not envvars.enabled("MEDUSA_CHAT_LEAN") or not _supported(causal_lm):
        return None
    built = getattr(causal_lm, "_medusa_lean_forward", None)
    if built is None:
        from medusa_chat.model.forward.block_forward import native_forward_for

        built = native_forward_for(causal_lm) or LeanForward(causal_lm)
        causal_lm._medusa_lean_forward = built
    return built


def _supported(causal_lm: Any) -> bool:
    cfg = getattr(causal_lm, "config", None)
    body = getattr(causal_lm, "model", None)
    if cfg is None or body is None or getattr(cfg, "model_type", None) not in SUPPORTED:
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return False
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", None):
        return False  # eager/flash attention: keep the model's own numerics
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False  # a sliding-window mask would need the model's own mask logic
    layers = getattr(body, "layers", None)
    if not layers:
        return False
    first = layers[0]
    needed = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
    if not all(hasattr(first, n) for n in needed):
        return False
    normed = [hasattr(first.self_attn, n) for n in ("q_norm", "k_norm")]
    if any(normed) and not (all(normed) and cfg.model_type in QK_NORMED):
        return False  # q/k norms of another kind (OLMo-2's over all heads, ...) than Qwen3's per-head ones
    if not hasattr(body.norm, "variance_epsilon") or not hasattr(body, "rotary_emb"):
        return False
    if any(hasattr(m, "_hf_hook") for m in causal_lm.modules()):
        return False  # accelerate hooks (offloading, multi-device maps) live in __call__, which we skip
    return True
