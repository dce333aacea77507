"""EAGLE drafts (EAGLE-1/2 and EAGLE-3) in their published Hub layout: one Llama decoder layer over the backbone's
features fused with the next token's embedding, with its own KV cache over the context.

Read (not copied) from SafeAILab/EAGLE: `eagle/model/cnets1.py` (EAGLE-1/2 `Model`: `embed_tokens`, `fc` Linear(2h
-> h, bias) over cat(embedding, feature), `layers.{i}` LlamaDecoderLayers where layer 0 has no input_layernorm,
no final norm, the target's lm_head; tree positions continue the context's), `eagle/model/cnets.py` (EAGLE-3
`Model`: `fc` Linear(3h -> h, no bias) applied only to the backbone's features (the draft's own outputs are fed
back as they are), `midlayer` with `hidden_norm` on the feature and `input_layernorm` on the embedding,
cat(embedding, feature) (2h) into q/k/v, `norm` then `lm_head` over `draft_vocab_size` tokens, draft index i is
token i + d2t[i], `t2d` marks the full vocabulary's draft tokens) and `eagle/model/modeling_llama_kv.py` (EAGLE-3
features: the hidden states entering layers 2, N // 2 and N - 3 of an N-layer backbone, in that order;
EAGLE-1's feature is the backbone's output after its final norm: the lm_head's input).

Checkpoints: `pytorch_model.bin` (read with weights_only=True) or `model.safetensors`, plus `config.json` (a Llama
config; EAGLE-3 adds `draft_vocab_size`). A checkpoint's `embed_tokens.weight` is the target's frozen embedding:
it is checked against the backbone's shape and then dropped, the backbone's own is shared (no second copy).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from medusa_chat.atomic import read_json
from medusa_chat.errors import HeadsError, MedusaChatError

EAGLE_FILES = ("model.safetensors", "pytorch_model.bin")
# Tree depths an EAGLE draft may fill: it drafts autoregressively, so any depth works; this bounds the trees
# `set_tree` accepts (EAGLE-2 uses depth 6 for 7-8B targets, the paper's trees stay under 10).
MAX_DEPTH = 10


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any], in_dim: int, bias: bool) -> None:
        super().__init__()
        h, heads, kv, hd = cfg["hidden_size"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        self.q_proj = nn.Linear(in_dim, heads * hd, bias=bias)
        self.k_proj = nn.Linear(in_dim, kv * hd, bias=bias)
        self.v_proj = nn.Linear(in_dim, kv * hd, bias=bias)
        self.o_proj = nn.Linear(heads * hd, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, h: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleLayer(nn.Module):
    """A Llama decoder layer as EAGLE uses it. EAGLE-1: layer 0 has no input norm. EAGLE-3 (`fused`): the feature
    goes through `hidden_norm`, the embedding through `input_layernorm`, and q/k/v read both (2h)."""

    def __init__(self, cfg: dict[str, Any], input_norm: bool, fused: bool, bias: bool) -> None:
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["eps"]
        self.fused = fused
        self.self_attn = _Attention(cfg, 2 * h if fused else h, bias)
        self.mlp = _MLP(h, cfg["intermediate_size"])
        if fused:
            self.hidden_norm = RMSNorm(h, eps)
        if input_norm or fused:
            self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)


class DraftKV:
    """The draft layers' own KV cache, [layers, 1, kv_heads, capacity, head_dim]: the context's entries first,
    then (during one step's drafting only) the tree's. Grows by doubling; nothing per step is allocated."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = (layers, 1, kv_heads, 0, head_dim)
        self.keys = torch.zeros(self.shape, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)

    def ensure(self, width: int) -> None:
        cap = self.keys.shape[3]
        if width <= cap:
            return
        new = max(width, 2 * cap, 256)
        shape = (*self.shape[:3], new, self.shape[4])
        keys = self.keys.new_zeros(shape)
        values = self.values.new_zeros(shape)
        keys[:, :, :, :cap] = self.keys
        values[:, :, :, :cap] = self.values
        self.keys, self.values = keys, values


class EagleDraft(nn.Module):
    """An EAGLE-1/2 (`version` 1) or EAGLE-3 (`version` 3) draft; state-dict keys are the published ones.

    Duck-types the heads interface the loader and engine read (`num_heads`: the deepest tree it may fill,
    `num_layers`, `format`, `hidden_size`, `vocab_size`, `own_lm_head`).
    """

    own_lm_head = False
    # EAGLE-1/2: the token ids the C drafter guesses among (heads_files.DRAFT_VOCAB_FILE beside the draft, as
    # train-heads writes it: the most frequent reply tokens); None: native_eagle.py's first-ids default
    draft_vocab_ids: torch.Tensor | None = None

    def __init__(self, cfg: dict[str, Any], version: int, layers: int = 1, fc_bias: bool = True,
                 qkv_bias: bool = False, feature_size: int | None = None) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.cfg = cfg
        self.version = version
        self.hidden_size = h
        self.vocab_size = cfg["vocab_size"]
        self.num_heads = MAX_DEPTH
        self.num_layers = layers
        self.head_dim = cfg["head_dim"]
        self.kv_heads = cfg["kv_heads"]
        self.q_heads = cfg["heads"]
        self.embed_shape: tuple[int, ...] | None = None  # the checkpoint's embedding, checked then dropped
        if version == 3:
            self.feature_size = feature_size or 3 * h
            self.fc = nn.Linear(self.feature_size, h, bias=False)
            self.midlayer = EagleLayer(cfg, input_norm=True, fused=True, bias=qkv_bias)
            self.norm = RMSNorm(h, cfg["eps"])
            dv = cfg["draft_vocab_size"]
            self.lm_head = nn.Linear(h, dv, bias=False)
            self.register_buffer("d2t", torch.zeros(dv, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(self.vocab_size, dtype=torch.bool))
        else:
            self.feature_size = h
            self.fc = nn.Linear(2 * h, h, bias=fc_bias)
            self.layers = nn.ModuleList(
                EagleLayer(cfg, input_norm=i > 0, fused=False, bias=qkv_bias) for i in range(layers)
            )
        # fp32 and not a buffer: `.to(float16)` of the module must not round the rotary frequencies
        self.inv_freq = rotary_inv_freq(cfg, self.head_dim)

    @property
    def format(self) -> str:
        return "eagle3" if self.version == 3 else "eagle"

    @property
    def blocks(self) -> list[EagleLayer]:
        return [self.midlayer] if self.version == 3 else list(self.layers)

    def new_cache(self) -> DraftKV:
        w = self.fc.weight
        return DraftKV(len(self.blocks), self.kv_heads, self.head_dim, w.dtype, w.device)

    def vocab_map(self) -> torch.Tensor | None:
        """Draft index -> token id (EAGLE-3: i + d2t[i]); None where the draft predicts the full vocabulary."""
        if self.version != 3:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def forward(
        self,
        hidden: torch.Tensor,
        emb: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftKV,
        slots: torch.Tensor,
        mask: torch.Tensor,
        from_backbone: bool,
    ) -> torch.Tensor:
        """One draft call over T rows: `hidden` [T, F] (the backbone's features where `from_backbone`, else the
        draft's own previous outputs [T, h]), `emb` [T, h] the next tokens' embeddings, written into `cache` at
        `slots` [T], attending over the cache's first mask.shape[-1] entries with the additive `mask` [T, W].
        Returns the draft's outputs [T, h] (before EAGLE-3's final norm)."""
        dtype = self.fc.weight.dtype
        hidden, emb = hidden.to(dtype), emb.to(dtype)
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(dtype)[None, None], angles.sin().to(dtype)[None, None]
        mask = mask.to(dtype)[None, None]
        if self.version == 3:
            x = self.fc(hidden) if from_backbone else hidden
            layer = self.midlayer
            residual = x
            h = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(x)], dim=-1)
            return self._block(0, layer, h, residual, cos, sin, cache, slots, mask)
        x = self.fc(torch.cat([emb, hidden], dim=-1))
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x) if i > 0 else x
            x = self._block(i, layer, h, x, cos, sin, cache, slots, mask)
        return x

    def _block(self, i: int, layer: EagleLayer, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, cache: DraftKV, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t, hd, attn = h.shape[0], self.head_dim, layer.self_attn
        q = attn.q_proj(h).view(1, t, -1, hd).transpose(1, 2)
        k = attn.k_proj(h).view(1, t, -1, hd).transpose(1, 2)
        v = attn.v_proj(h).view(1, t, -1, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        cache.keys[i].index_copy_(2, slots, k)
        cache.values[i].index_copy_(2, slots, v)
        width = mask.shape[-1]
        keys, values = cache.keys[i][:, :, :width], cache.values[i][:, :, :width]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.q_heads != self.kv_heads)
        x = residual + attn.o_proj(out.transpose(1, 2).reshape(1, t, -1)[0])
        return x + layer.mlp(layer.post_attention_layernorm(x))

    @torch.no_grad()
    def reference_outputs(self, features: torch.Tensor, next_tokens: torch.Tensor, embed: nn.Module) -> torch.Tensor:
        """The draft over a whole context from scratch (causal, a fresh cache): what the engine's incremental
        drafting must reproduce. features [T, F], next_tokens [T] (token t + 1 for feature t) -> outputs [T, h]."""
        t = features.shape[0]
        cache = self.new_cache()
        cache.ensure(t)
        causal = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)
        pos = torch.arange(t, device=features.device)
        return self(features, embed(next_tokens), pos, cache, pos, causal.to(features.device), True)


def rotary_inv_freq(cfg: dict[str, Any], head_dim: int) -> torch.Tensor:
    """The draft's rotary frequencies (fp32, on the CPU), with the backbone config's scaling."""
    base = float(cfg.get("rope_theta", 10000.0))
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
    return _scaled_inv_freq(inv, cfg.get("rope_scaling"))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _scaled_inv_freq(inv: torch.Tensor, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Llama-3.1's "llama3" RoPE scaling (the EAGLE-3 drafts for LLaMA-3.1 carry it); other kinds are refused."""
    if not scaling:
        return inv
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return inv
    if kind != "llama3":
        raise HeadsError(f"EAGLE draft: RoPE scaling {kind!r} is not supported (only llama3 and none)")
    import math

    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    mid = (1 - smooth) * out / factor + smooth * out
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, mid, out)


# ---- files ----------------------------------------------------------------------------------------------------
def is_eagle_folder(folder: Path) -> bool:
    """An EAGLE checkpoint folder: config.json plus model.safetensors / pytorch_model.bin whose keys are EAGLE's
    (`fc.weight` and `layers.0.*` or `midlayer.*`). Only the config is read here: EAGLE configs are Llama
    configs; the draft-specific hint is `draft_vocab_size` (EAGLE-3) or an `architectures` naming EAGLE, else the
    weight file's keys decide (safetensors header; a pickle by name only)."""
    if not (folder / "config.json").is_file() or not any((folder / f).is_file() for f in EAGLE_FILES):
        return False
    try:
        cfg = read_json(folder / "config.json")
    except MedusaChatError:
        return False
    if "draft_vocab_size" in cfg or any("eagle" in str(a).lower() for a in cfg.get("architectures") or []):
        return True
    st = folder / "model.safetensors"
    if st.is_file():
        try:
            from safetensors import safe_open

            with safe_open(str(st), framework="pt", device="cpu") as f:
                keys = set(f.keys())
        except Exception:  # unreadable: the loader says so (as about an EAGLE draft)
            return True
        return "fc.weight" in keys and not any(k.startswith("model.") for k in keys)
    # a lone pytorch_model.bin (EAGLE-1's published layout): its keys, memory-mapped, weights_only
    try:
        keys = set(torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=True))
    except Exception:  # unreadable: the loader says so (as about an EAGLE draft)
        return True
    return "fc.weight" in keys and not any(k.startswith("model.") for k in keys)


def eagle_config(raw: dict[str, Any], where: str) -> dict[str, Any]:
    try:
        h = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        cfg = {
            "hidden_size": h,
            "intermediate_size": int(raw["intermediate_size"]),
            "heads": heads,
            "kv_heads": int(raw.get("num_key_value_heads") or heads),
            "head_dim": int(raw.get("head_dim") or h // heads),
            "eps": float(raw.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(raw.get("rope_theta", 10000.0)),
            "rope_scaling": raw.get("rope_scaling"),
            "vocab_size": int(raw["vocab_size"]),
        }
    except (KeyError, TypeError, ValueError) as err:
        raise HeadsError(f"{where}: not an EAGLE draft config (missing or bad {err})") from err
    if raw.get("draft_vocab_size") is not None:
        cfg["draft_vocab_size"] = int(raw["draft_vocab_size"])
    return cfg


def eagle_file(folder: Path) -> Path | None:
    """The weight file of an EAGLE draft folder (config.json beside it), or None."""
    if not (folder / "config.json").is_file():
        return None
    return next((folder / f for f in EAGLE_FILES if (folder / f).is_file()), None)


def load_eagle(folder: Path, path: Path, state: dict[str, torch.Tensor]) -> EagleDraft:
    """The draft of `folder`'s config.json and the tensors `state` read from `path`, shapes checked against the
    config; a clear HeadsError for unknown or missing keys or a shape the config does not give."""
    cfg = eagle_config(read_json(folder / "config.json"), str(folder / "config.json"))
    state = dict(state)
    version = 3 if any(k.startswith("midlayer.") for k in state) else 1
    if "fc.weight" not in state or (version == 1 and not any(k.startswith("layers.0.") for k in state)):
        raise HeadsError(f"{path} does not hold an EAGLE draft: no fc.weight and layers.0.* / midlayer.* keys")
    embed = state.pop("embed_tokens.weight", None)
    if version == 3:
        for key in ("lm_head.weight", "d2t", "t2d", "norm.weight"):
            if key not in state:
                raise HeadsError(f"{path}: an EAGLE-3 draft needs {key}, which the file lacks")
        cfg.setdefault("draft_vocab_size", int(state["lm_head.weight"].shape[0]))
        layers = 1
    else:
        layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers."))
    qkv_bias = any(k.endswith("q_proj.bias") for k in state)
    # built without weights (the meta device) and given the file's own tensors (`assign` below): no random
    # initialisation, and the draft keeps the file's 16 bits (loading.py widens it where a device needs that), so
    # loading never holds more than the file's size twice
    with torch.device("meta"):
        draft = EagleDraft(cfg, version, layers, fc_bias="fc.bias" in state, qkv_bias=qkv_bias,
                           feature_size=int(state["fc.weight"].shape[1]) if version == 3 else None)
    draft.inv_freq = rotary_inv_freq(cfg, draft.head_dim)
    if version == 3:
        state["d2t"] = state["d2t"].long()
        state["t2d"] = state["t2d"].bool()
    own = draft.state_dict()
    unknown = sorted(set(state) - set(own))
    missing = sorted(set(own) - set(state))
    if unknown or missing:
        raise HeadsError(
            f"{path}: not the EAGLE-{version} layout this loader knows "
            f"(unexpected keys {unknown[:4]}, missing keys {missing[:4]})"
        )
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[key].shape):
            raise HeadsError(
                f"{path}: {key} has shape {list(tensor.shape)} but config.json (hidden {cfg['hidden_size']}, "
                f"{cfg['heads']} heads x {cfg['head_dim']}, {cfg['kv_heads']} KV heads) gives {list(own[key].shape)}"
            )
    floats = {v.dtype for v in state.values() if v.is_floating_point()}
    dtype = floats.pop() if len(floats) == 1 else torch.float32  # (a file mixing float types: fp32 throughout)
    draft.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}, assign=True)
    draft.embed_shape = tuple(embed.shape) if embed is not None else None
    return draft.eval().requires_grad_(False)


def eagle_taps(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's feature layers of an N-layer backbone: the inputs of layers 2, N // 2 and N - 3."""
    return (2, num_layers // 2, num_layers - 3)


def tap_features(backbone: Any, lean: Any) -> list[torch.Tensor]:
    """Have every backbone forward leave the inputs of EAGLE-3's three layers (`eagle_taps`) in a list, and return
    that list: the lean forward's or the native step's own (`lean.taps`), else forward pre-hooks on the
    transformers model's layers (registered once per model and shared by every engine on it: only the last
    forward's three are kept). HeadsError where the backbone's step cannot give them."""
    layers = backbone.base_model.layers
    taps = eagle_taps(len(layers))
    if lean is None:
        tapped = _HOOKED.get(backbone)
        if tapped is None:
            tapped = _HOOKED[backbone] = []
            for i in taps:
                layers[i].register_forward_pre_hook(_tap_hook(tapped, i == taps[0]), with_kwargs=True)
        return tapped
    if hasattr(lean, "tapped"):
        lean.taps = taps
        return lean.tapped
    raise HeadsError(
        "EAGLE-3 drafts read the backbone's layers 2, N/2 and N-3; the native C step (--quant int8/int4 "
        "on a CPU) does not give them yet: load the backbone with --quant none"
    )


_HOOKED: weakref.WeakKeyDictionary[Any, list[torch.Tensor]] = weakref.WeakKeyDictionary()  # hooked backbones' lists


def _tap_hook(tapped: list[torch.Tensor], first: bool) -> Any:
    """A forward pre-hook keeping a decoder layer's input hidden state (the first tap starts a new forward)."""

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        if first:
            tapped.clear()
        tapped.append(hidden[0])

    return hook


def check_eagle_fits(draft: EagleDraft, config: dict[str, Any], where: str, backbone: str) -> None:
    """The draft against the backbone's config: hidden size, vocabulary (and EAGLE-3's maps), layer count."""
    cfg = config.get("text_config") or config
    hidden, vocab = int(cfg.get("hidden_size") or 0), int(cfg.get("vocab_size") or 0)
    n_layers = int(cfg.get("num_hidden_layers") or 0)
    want = 3 * hidden if draft.version == 3 else hidden
    if hidden and (draft.feature_size != want or draft.hidden_size != hidden):
        raise HeadsError(
            f"the EAGLE draft in {where} reads features of size {draft.feature_size} (hidden {draft.hidden_size})"
            f" but the backbone {backbone} has hidden size {hidden}: it was trained for another model"
        )
    if vocab and draft.vocab_size != vocab:
        raise HeadsError(
            f"the EAGLE draft in {where} has a vocabulary of {draft.vocab_size} but the backbone {backbone} has "
            f"{vocab}: it was trained for another model"
        )
    shape = getattr(draft, "embed_shape", None)
    if shape is not None and vocab and hidden and shape != (vocab, hidden):
        raise HeadsError(f"the EAGLE draft in {where} embeds {list(shape)} but the backbone {backbone} has "
                         f"[{vocab}, {hidden}]: it was trained for another model")
    if draft.version == 3:
        top = int(draft.vocab_map().max()) if draft.d2t.numel() else -1
        if vocab and top >= vocab:
            raise HeadsError(f"the EAGLE-3 draft in {where} maps draft tokens to ids up to {top} (d2t) but the "
                             f"backbone {backbone} has a vocabulary of {vocab}")
        taps = eagle_taps(n_layers)
        if n_layers and not 0 <= taps[0] < taps[1] < taps[2] < n_layers:
            raise HeadsError(f"EAGLE-3 reads the backbone's layers 2, N/2 and N-3, but {backbone} has only "
                             f"{n_layers} layers (at least 7 needed)")
