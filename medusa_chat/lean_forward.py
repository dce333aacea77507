"""A lean eager forward for Llama-family decoders (Llama, Vicuna, SmolLM2, Mistral/Zephyr).

Why: at batch 1 on a CPU (and on a GPU without graphs) the transformers forward spends about as long in
Python (kwargs plumbing, output recording, mask/cache dispatch, per-layer hooks) as in the matmuls. For
SmolLM2-135M on 2 cores that is ~17 ms of a ~50 ms step. This module runs the same layers' own weights and
modules with nothing around them: per layer two norms, the projections, rotary, one cache write, SDPA.

It replays transformers' op order exactly (RMSNorm in fp32, `q*cos + rotate_half(q)*sin`, the same SDPA
call with the same GQA handling), so its output is bitwise equal to the model's own forward; tests pin that.
Projections are called through their modules' `forward`, so bitsandbytes 4-bit/8-bit layers work unchanged.
Anything unusual (other architectures, q/k norms, sliding-window layers, tensor-parallel slicing) returns
None from `lean_forward_for` and the engine uses the transformers forward instead.

bf16 on a CPU: the projections run on weights pre-packed once for oneDNN (`packed_linear`). PyTorch's default
bf16 GEMV streams the weights at ~9 GB/s on this 2-core Xeon; the packed kernel at ~14 GB/s, and it costs the
same for 1 to 16 rows, which is what makes a 16-node tree step about as cheap as a 1-token step. Its results
are bitwise equal to `F.linear` (checked once per model at pack time; on a mismatch nothing is packed).
Set MEDUSA_CHAT_LEAN=0 to use the transformers forward instead (for comparisons).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED = {"llama", "mistral"}


class KVWriter(Protocol):
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


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


PACK_ROWS = 16  # oneDNN's packing hint: measured bitwise equal to F.linear for 1..64 rows, fastest at 1..16


def packed_linear(module: nn.Module) -> Linear | None:
    """A bf16 CPU `nn.Linear` as a oneDNN pre-packed GEMM, or None where that does not apply."""
    w = getattr(module, "weight", None)
    if type(module) is not nn.Linear or w is None or w.dtype != torch.bfloat16 or w.device.type != "cpu":
        return None
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS)
    except (AttributeError, RuntimeError):
        return None
    bias = None if module.bias is None else module.bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward


def _same_as_module(module: nn.Module, fast: Linear) -> bool:
    """Bitwise check of a packed GEMM against the module on 1, 3 and 16 rows."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 3, 16):
            x = torch.randn(1, rows, module.in_features, generator=gen).to(module.weight.dtype)
            if not torch.equal(fast(x), module(x)):
                return False
    return True


def fast_linear(module: nn.Module, pack: bool) -> Linear:
    """The cheapest exact way to call this projection: packed when allowed, else its `forward` directly
    (skipping nn.Module's hook dispatch). bitsandbytes layers keep their own forward."""
    if pack:
        fast = packed_linear(module)
        if fast is not None and _same_as_module(module, fast):
            return fast
    return module.forward


def want_packing() -> bool:
    return os.environ.get("MEDUSA_CHAT_PACK", "1") != "0"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same ops as LlamaRMSNorm.forward (fp32 statistics, scale in the input dtype).
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanForward:
    """`forward(ids [T], positions [T], mask [1, 1, T, L] additive, cache) -> last hidden states [T, H]`."""

    def __init__(self, causal_lm: Any, pack: bool | None = None) -> None:
        body = causal_lm.model
        pack = want_packing() if pack is None else pack
        self.packed = pack
        cfg = causal_lm.config
        self.embed = body.embed_tokens
        self.lm_head = fast_linear(causal_lm.get_output_embeddings(), pack)
        self.rotary = body.rotary_emb
        self.final_norm_w = body.norm.weight
        self.final_norm_eps = float(body.norm.variance_epsilon)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.layers = [
            _Layer(
                norm1_w=layer.input_layernorm.weight,
                norm1_eps=float(layer.input_layernorm.variance_epsilon),
                q=fast_linear(layer.self_attn.q_proj, pack),
                k=fast_linear(layer.self_attn.k_proj, pack),
                v=fast_linear(layer.self_attn.v_proj, pack),
                o=fast_linear(layer.self_attn.o_proj, pack),
                norm2_w=layer.post_attention_layernorm.weight,
                norm2_eps=float(layer.post_attention_layernorm.variance_epsilon),
                gate=fast_linear(layer.mlp.gate_proj, pack),
                up=fast_linear(layer.mlp.up_proj, pack),
                down=fast_linear(layer.mlp.down_proj, pack),
            )
            for layer in body.layers[: cfg.num_hidden_layers]
        ]

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: KVWriter
    ) -> torch.Tensor:
        t, hd, groups = ids.shape[0], self.head_dim, self.groups
        x = self.embed(ids[None])
        cos, sin = self.rotary(x, positions[None])
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.norm1_w, layer.norm1_eps)
            q = layer.q(h).view(1, t, -1, hd).transpose(1, 2)
            k = layer.k(h).view(1, t, -1, hd).transpose(1, 2)
            v = layer.v(h).view(1, t, -1, hd).transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            k, v = cache.write(i, k, v)
            if groups > 1 and t == 1:
                # one query: attend per key/value head with the query heads as rows (no repeat of the cache)
                out = F.scaled_dot_product_attention(
                    q.reshape(1, -1, groups, hd), k, v, attn_mask=mask, scale=self.scaling
                )
            else:
                # GQA inside SDPA instead of transformers' repeat_kv copy: bitwise the same result (pinned by
                # tests), without copying the whole cache `groups` times per layer per step.
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=groups > 1
                )
            out = out.reshape(1, -1, t, hd).transpose(1, 2).reshape(1, t, -1)
            x = x + layer.o(out)
            h = _rms_norm(x, layer.norm2_w, layer.norm2_eps)
            x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        return _rms_norm(x, self.final_norm_w, self.final_norm_eps)[0]

    @property
    def packed_any(self) -> bool:
        return any(not hasattr(f, "__self__") for f in (self.lm_head, self.layers[0].q, self.layers[0].gate))


def lean_forward_for(causal_lm: Any) -> LeanForward | None:
    """The lean forward when this model is a plain Llama-family decoder, else None (use transformers').

    Built once per model object (packing copies the bf16 weights once) and shared by every engine and by the
    calibration that times it.
    """
    if os.environ.get("MEDUSA_CHAT_LEAN", "1") == "0" or not _supported(causal_lm):
        return None
    pack = want_packing()
    built = getattr(causal_lm, "_medusa_lean_forward", None)
    if not isinstance(built, LeanForward) or built.packed != pack:
        built = LeanForward(causal_lm, pack)
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
    if any(hasattr(first.self_attn, n) for n in ("q_norm", "k_norm")):
        return False
    if not hasattr(body.norm, "variance_epsilon") or not hasattr(body, "rotary_emb"):
        return False
    if any(hasattr(m, "_hf_hook") for m in causal_lm.modules()):
        return False  # accelerate hooks (offloading, multi-device maps) live in __call__, which we skip
    return True
