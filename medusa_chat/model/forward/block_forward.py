"""The backbone step in C, for Llama-family models (and Qwen2: Llama with q/k/v biases; Qwen3: with per-head q/k
RMSNorms) whose projections are GGUF blocks (the CPU default).

`NativeForward` has LeanForward's call signature, `(ids [T], positions [T], attend, cache) -> last hidden
states [T, H]`, and runs all layers in one call into csrc/decoder.c: RMSNorms, the block GEMMs of qgemm.c,
rotary, the KV write and attention (csrc/attention.c). Python only looks up the embeddings and the rotary tables.

Why: a step of SmolLM2-135M in 8-bit reads ~140 MB of weights (~13 ms on 2 cores); eager PyTorch added ~10 ms
of per-op dispatch around those reads and ~50 us per SDPA call, and exact tree attention needs one call per node
per layer. Natively a step costs about its weight reads, and a tree's extra nodes cost little: the weights are
read once for all rows and attention of all nodes is one pass over the cached keys.

Exactness is by construction (see decoder.c): every row is computed the same way whatever rows are beside it,
and a tree node attends over exactly the key sequence the plain step at its position has. So tree steps
reproduce the engine's plain loop bit for bit, and a token's K/V are the same whether it was prefilled in a
block or decoded alone (a reply's output does not depend on how its prompt was chunked). This is its own
numeric path (its own attention and norm kernels): outputs are close to, not bitwise, the transformers
forward on the same weights. `attend` is a TreePlan for a verification step; any mask tensor means a causal
block (the engine's prefill). MEDUSA_CHAT_NATIVE=0 turns it off (the lean PyTorch forward is used instead).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import torch

from medusa_chat import envvars
from medusa_chat.kernels import cthreads
from medusa_chat.model.forward.tree_plan import TreePlan

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
STATIC_ROPE = ("default", "linear", "llama3")  # rotary tables that do not depend on the sequence length


class BLin(ctypes.Structure):  # decoder.h BLin: a block linear's kind, shape and buffers
    _fields_ = [("kind", _i), ("N", _i), ("K", _i), ("qs", _p), ("d", _p), ("aux", _p)]


class _DLayer(ctypes.Structure):
    _fields_ = [
        ("norm1", _p),
        ("norm2", _p),
        ("eps1", _f),
        ("eps2", _f),
        ("qkv", BLin),
        ("o", BLin),
        ("gate_up", BLin),
        ("down", BLin),
        ("v", BLin),  # kind -1 when fused into qkv (decoder.h)
        ("up", BLin),  # kind -1 when fused into gate_up
        ("qkv_bias", _p),  # fp32 [q | k | v] biases (Qwen2), NULL when the projections have none
        ("q_norm", _p),  # fp32 [head_dim] per-head norm weights of q and k (Qwen3), NULL when none
        ("k_norm", _p),
        ("qk_eps", _f),
    ]


class _DModel(ctypes.Structure):
    _fields_ = [
        ("n_layers", _i),
        ("hidden", _i),
        ("n_heads", _i),
        ("n_kv", _i),
        ("head_dim", _i),
        ("inter", _i),
        ("scale", _f),
        ("final_eps", _f),
        ("final_norm", _p),
        ("layers", ctypes.POINTER(_DLayer)),
    ]


def blin_struct(module: Any) -> BLin:
    """The C description of a block linear (decoder.h BLin): its kind and buffers. Q4_1 / Q8_0 pass the codes,
    the fp16 scales and their third buffer (minimums / block sums); a K-quant passes its one stream (kquants.c)."""
    buffers = [getattr(module, name).data_ptr() for name in module.buffer_names]
    qs, d, aux = (buffers + [None, None])[:3]
    return BLin(module.c_kind, module.out_features, module.in_features, qs, d, aux)


_ABSENT = BLin(-1, 0, 0, None, None, None)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous()


class NativeForward:
    """All decoder layers of a GGUF-block Llama in one C call per step (module doc). `fused`: per layer
    (qkv, v, gate_up, up, qkv_bias) as native_forward_for makes them; qkv_bias: fp32 [q | k | v], or None."""

    path = "native C step, exact tree attention"

    def __init__(self, causal_lm: Any, lib: ctypes.CDLL, fused: list[tuple[Any, ...]]) -> None:
        body, cfg = causal_lm.model, causal_lm.config
        self.lib = lib
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.hidden = int(cfg.hidden_size)
        layers = body.layers[: cfg.num_hidden_layers]
        # keep every tensor whose address the C structs hold alive for as long as this object
        self._keep: list[Any] = []
        c_layers = (_DLayer * len(layers))()
        # per layer the [q | k | v] bias vector the step adds (None: no biases); the C struct points into these
        self.qkv_biases: list[torch.Tensor | None] = [f[4] for f in fused]
        for i, (layer, (qkv, v, gate_up, up, bias)) in enumerate(zip(layers, fused, strict=True)):
            n1, n2 = _f32(layer.input_layernorm.weight), _f32(layer.post_attention_layernorm.weight)
            qn, kn = (getattr(layer.self_attn, n, None) for n in ("q_norm", "k_norm"))
            qw, kw = (_f32(m.weight) if m is not None else None for m in (qn, kn))
            self._keep += [n1, n2, qkv, gate_up, v, up, bias, qw, kw]
            c_layers[i] = _DLayer(
                n1.data_ptr(),
                n2.data_ptr(),
                float(layer.input_layernorm.variance_epsilon),
                float(layer.post_attention_layernorm.variance_epsilon),
                blin_struct(qkv),
                blin_struct(layer.self_attn.o_proj),
                blin_struct(gate_up),
                blin_struct(layer.mlp.down_proj),
                blin_struct(v) if v is not None else _ABSENT,
                blin_struct(up) if up is not None else _ABSENT,
                bias.data_ptr() if bias is not None else None,
                qw.data_ptr() if qw is not None else None,
                kw.data_ptr() if kw is not None else None,
                float(qn.variance_epsilon) if qn is not None else 0.0,
            )
        final = _f32(body.norm.weight)
        self._keep += [final, c_layers]
        self.model = _DModel(
            len(layers),
            self.hidden,
            int(cfg.num_attention_heads),
            self.kv_heads,
            self.head_dim,
            int(cfg.intermediate_size),
            self.head_dim**-0.5,
            float(body.norm.variance_epsilon),
            final.data_ptr(),
            c_layers,
        )
        self._model_ref = ctypes.byref(self.model)
        self._scratch = torch.empty(0, dtype=torch.uint8)
        # the duet mode's helper may still be in a stale chunk that reads these weights (csrc/duet.c): before
        # they go, wait until it is out (microseconds; it only lags when the scheduler has it parked)
        weakref.finalize(self, cthreads.quiesce)
        self._guarded_kv: weakref.ref[torch.Tensor] | None = None
        # rotary cos/sin per position, computed once for a range of positions and looked up per step: cheaper
        # than the rotary module's few ops per step, and a position's values never depend on the batch it
        # came in (a prefill, a tree, one token)
        self._cos = self._sin = torch.empty(0, self.head_dim)
        # layers whose input hidden states each call leaves in `tapped` (one [T, len(taps) * H] tensor): an
        # EAGLE-3 draft's features (engine/eagle_drafter.py), as LeanForward's taps
        self.taps: tuple[int, ...] = ()
        self.tapped: list[torch.Tensor] = []

    def _rotary_of(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(1, 1, self.hidden, dtype=torch.float32, device=positions.device)
        cos, sin = self.rotary(probe, positions[None])
        return cos[0].to(torch.float32).contiguous(), sin[0].to(torch.float32).contiguous()

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(self.rotary, "rope_type", "default") not in STATIC_ROPE:  # depends on the call's length
            return self._rotary_of(positions)
        need = int(positions.max()) + 1
        if need > self._cos.shape[0]:
            size = max(need, 2 * self._cos.shape[0], 1024)
            self._cos, self._sin = self._rotary_of(torch.arange(size, device=positions.device))
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor | TreePlan, cache: Any
    ) -> torch.Tensor:
        t = ids.shape[0]
        start = cache.length
        x = self.embed(ids).to(torch.float32).contiguous()  # [T, H], overwritten with the output in place
        cos, sin = self._rotary(positions)
        # the cache holds fp16 (decoder.c, store_kv / load_kv)
        kv = cache.reserve(start + t, self.kv_heads, self.head_dim, torch.float16, x.device)
        if isinstance(attend, TreePlan):
            blocks, lens = attend.blocks, attend.block_len
            blk, blen, stride, longest = blocks.data_ptr(), lens.data_ptr(), blocks.shape[1], attend.depth + 1
        else:  # the engine's prefill mask: a causal block after the cached prefix
            blk = blen = None
            stride, longest = 0, t
        need = self.lib.decoder_scratch_bytes(self._model_ref, t, start + longest)
        if self._scratch.numel() < need:
            cthreads.quiesce()  # the duet's helper may still read the old scratch (its attention: csrc/decoder.c)
            self._scratch = torch.empty(need + need // 4, dtype=torch.uint8)
        if self._guarded_kv is None or self._guarded_kv() is not kv:  # ... and the KV cache's, before it is freed
            weakref.finalize(kv, cthreads.quiesce)
            self._guarded_kv = weakref.ref(kv)
        taps = tap_out = None
        if self.taps:
            taps = (ctypes.c_int * len(self.taps))(*self.taps)
            tap_out = torch.empty(t, len(self.taps) * self.hidden)
            self.tapped[:] = [tap_out]
        self.lib.decoder_forward(
            self._model_ref,
            t,
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            kv.data_ptr(),
            kv.shape[-2],
            start,
            blk,
            blen,
            stride,
            self._scratch.data_ptr(),
            taps,
            len(self.taps),
            tap_out.data_ptr() if tap_out is not None else None,
        )
        cache.length = start + t
        return x


def native_forward_for(causal_lm: Any) -> NativeForward | None:
    """The native step when every projection of this (supported, CPU) Llama is a GGUF-block linear of our
    kernel and the shapes suit it; else None (the lean PyTorch forward is used). q/k/v projections with a bias
    (Qwen2: cpu_linears.BlockLinearWithBias around the block linear) pass their biases to the step, which adds
    them after the projection."""
    if not envvars.enabled("MEDUSA_CHAT_NATIVE"):
        return None
    from medusa_chat.kernels.block_linears import BlockLinear, fuse
    from medusa_chat.kernels.cbind import load

    cfg = causal_lm.config
    body = causal_lm.model
    if body.embed_tokens.weight.device.type != "cpu":
        return None  # (checked first: a GPU model never needs the C kernels built)
    lib = load()
    if lib is None:
        return None
    hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    if hd % 8 or hd > 256 or cfg.num_attention_heads % cfg.num_key_value_heads:  # decoder.c: MAX_HD
        return None
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return None  # (Llama's own bias flags; Qwen2's q/k/v biases come with their modules, see below)
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return None  # a sliding window would need its own key ranges
    fused = []
    for layer in body.layers[: cfg.num_hidden_layers]:
        att, mlp = layer.self_attn, layer.mlp
        norms = [getattr(att, n, None) for n in ("q_norm", "k_norm")]
        if any(norms) and not (all(norms) and _head_norms(norms, hd)):
            return None  # q/k norms other than Qwen3's per-head pair (one weight of head_dim each, same eps)
        qkv_mods, biases = zip(*(_bias_split(m) for m in (att.q_proj, att.k_proj, att.v_proj)), strict=True)
        mods = [*qkv_mods, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(isinstance(m, BlockLinear) for m in mods) or getattr(att.o_proj, "bias", None) is not None:
            return None
        qkv, v = _fused_or_split(mods[:3], fuse)
        gate_up, up = _fused_or_split(mods[4:6], fuse)
        if qkv is None or gate_up is None:
            return None
        bias = None
        if any(b is not None for b in biases):  # one fp32 [q | k | v] vector, zeros where one has none
            parts = [
                b if b is not None else torch.zeros(m.out_features)
                for m, b in zip(mods[:3], biases, strict=True)
            ]
            bias = _f32(torch.cat(parts))
        fused.append((qkv, v, gate_up, up, bias))
        trim_heap()  # the unfused buffers just freed: handed back now, not left as holes in the heap
    return NativeForward(causal_lm, lib, fused)


def _head_norms(norms: list[Any], hd: int) -> bool:
    """Whether the q/k norms are the step's kind: RMSNorms over one head (weight [head_dim]) with one eps."""
    eps = {getattr(n, "variance_epsilon", None) for n in norms}
    return len(eps) == 1 and None not in eps and all(tuple(n.weight.shape) == (hd,) for n in norms)


def _bias_split(module: Any) -> tuple[Any, torch.Tensor | None]:
    """(the linear, its bias or None): a BlockLinearWithBias is taken apart, anything else has no bias here."""
    from medusa_chat.kernels.cpu_linears import BlockLinearWithBias

    if isinstance(module, BlockLinearWithBias):
        return module.block, module.bias
    return module, None


def _fused_or_split(mods: list[Any], fuse: Any) -> tuple[Any, Any]:
    """(all fused, None), or, where the last projection's blocks are of another type (a Q4_K_M file's Q6_K
    attn_v in some layers), (the others fused, the last apart); (None, None) if neither fits the step."""
    whole = fuse(mods)
    if whole is not None:
        return whole, None
    head = fuse(mods[:-1]) if len(mods) > 2 else mods[0]
    if head is None or mods[-1].in_features != head.in_features:
        return None, None
    return head, mods[-1]


def trim_heap() -> None:
    """Return freed heap memory to the OS (glibc's malloc_trim; a no-op elsewhere). Loading replaces many
    mid-sized buffers (a layer's projections: a few MB each); glibc serves those from its heap and keeps the
    freed ones resident, ~0.2 GB for a 1B model, unless trimmed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
