"""The EAGLE draft as it is trained: built from its config.json (EAGLE-1, or EAGLE-3 with its own draft
vocabulary), warm-started from a trained one, and its forward unrolled over training-time-test steps.

The draft is model/forward/eagle.py's `EagleDraft` (version 1): `fc` Linear(2h -> h) over cat(embedding of token t + 1,
feature t), one Llama decoder layer without input_layernorm, the backbone's lm_head (frozen, shared, not saved).
The feature is the backbone's last hidden state after its final norm: what the engine's drafter reads.

Training-time test (`unroll` > 1): at decode time depth d + 1 reads the draft's own output of depth d, not a
backbone feature. Step j of the unroll feeds every position s the previous step's output at s - 1 (with the
true token s + 1: a tree path is only extended past accepted tokens) and attends to the backbone-fed entries of
positions <= s - j plus its own chain's earlier unrolled entries (one per step, a diagonal in each block), which
is exactly what the drafter's KV cache holds at depth j + 1.

EAGLE-3 (`draft_vocab_size` in the config): `fc` Linear(3h -> h) reads the hidden states entering layers 2, N/2
and N-3, the draft's own outputs are fed back without it, and it predicts over its own vocabulary (the most
frequent reply tokens, d2t/t2d maps; its head starts from the backbone's rows of them).

One module for the forward that both the training loop (train_eagle.py) and the evaluation (eagle_pipeline.py)
run, so that what is evaluated is what was trained.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from medusa_chat.model.forward.eagle import EagleDraft, rotate_half


def draft_config(
    backbone_config: Any, base_model: str = "", draft_vocab: int | None = None
) -> dict[str, Any]:
    """The draft's config.json: a one-layer Llama config with the backbone's shapes (SafeAILab's layout; EAGLE-3
    adds `draft_vocab_size`)."""
    cfg = getattr(backbone_config, "text_config", None) or backbone_config
    h, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
    rope = getattr(cfg, "rope_theta", None)
    if rope is None:  # transformers 5 keeps it in rope_parameters
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": int(cfg.intermediate_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(cfg, "head_dim", None) or h // heads),
        "num_hidden_layers": 1,
        "rms_norm_eps": float(getattr(cfg, "rms_norm_eps", 1e-6)),
        "rope_theta": float(rope),
        "vocab_size": int(cfg.vocab_size),
        "max_position_embeddings": int(getattr(cfg, "max_position_embeddings", 2048)),
        "torch_dtype": "float16",
        "base_model_name_or_path": base_model,
        **(
            {"draft_vocab_size": int(draft_vocab), "architectures": ["LlamaForCausalLMEagle3"]}
            if draft_vocab
            else {}
        ),
    }


def new_draft(
    config: dict[str, Any],
    seed: int = 0,
    lm_weight: torch.Tensor | None = None,
    draft_ids: torch.Tensor | None = None,
) -> EagleDraft:
    """A fresh draft from its config.json dict (the loader's own parsing: what is trained is what loads). With
    `draft_vocab_size` an EAGLE-3 draft over the tokens `draft_ids`: its maps d2t/t2d, its lm_head started from
    the backbone's rows of those tokens (`lm_weight`); else EAGLE-1."""
    from medusa_chat.model.forward.eagle import eagle_config

    torch.manual_seed(seed)
    cfg = eagle_config(config, "draft config")
    if "draft_vocab_size" not in cfg:
        return EagleDraft(cfg, 1, layers=1).float().train()
    if draft_ids is None or lm_weight is None or len(draft_ids) != cfg["draft_vocab_size"]:
        raise ValueError("an EAGLE-3 draft needs its draft vocabulary and the backbone's lm_head")
    draft = EagleDraft(cfg, 3, feature_size=3 * cfg["hidden_size"]).float()
    ids = draft_ids.sort().values  # draft index i is token i + d2t[i]: ascending ids, as SafeAILab's maps
    with torch.no_grad():
        draft.d2t.copy_(ids - torch.arange(len(ids)))
        draft.t2d.zero_()
        draft.t2d[ids] = True
        draft.lm_head.weight.copy_(lm_weight.detach().float()[ids])
    return draft.train()


def warm_start_eagle(draft: EagleDraft, init: EagleDraft) -> None:
    """Copy a trained draft's weights into the fresh `draft` (fp32): to go on training it, on more data or for
    more epochs. A ValueError naming the first difference when the two are not the same kind and shape (another
    backbone's draft, EAGLE-1 for EAGLE-3, another draft vocabulary)."""
    if init.version != draft.version:
        raise ValueError(f"cannot warm-start an EAGLE-{draft.version} draft from an EAGLE-{init.version} draft")
    own, given = draft.state_dict(), init.state_dict()
    if set(own) != set(given):
        raise ValueError(f"the trained draft's layout differs: keys {sorted(set(own) ^ set(given))[:4]}")
    for key, value in own.items():
        if tuple(given[key].shape) != tuple(value.shape):
            raise ValueError(
                f"the trained draft does not fit this backbone: {key} is {list(given[key].shape)}, "
                f"this draft's is {list(value.shape)}"
            )
    draft.load_state_dict({k: v.to(own[k].dtype) for k, v in given.items()})


def draft_index(draft: EagleDraft) -> torch.Tensor:
    """EAGLE-3: token id -> draft index (-1 outside the draft vocabulary)."""
    t2d = draft.t2d
    return torch.where(t2d, torch.cumsum(t2d.long(), 0) - 1, -1)


def draft_logits(draft: EagleDraft, out: torch.Tensor, lm_weight: torch.Tensor) -> torch.Tensor:
    """The draft's logits over its vocabulary: EAGLE-1 the backbone's lm_head, EAGLE-3 its norm and own head."""
    if draft.version == 3:
        return draft.lm_head(draft.norm(out))
    return F.linear(out.to(lm_weight.dtype), lm_weight)


def _attend(
    draft: EagleDraft,
    x: torch.Tensor,
    emb: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    past: list[tuple[torch.Tensor, torch.Tensor]],
    mask: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The draft's one layer over a batch [B, L, h] (EAGLE-1: the fused input `x`, no input norm; EAGLE-3: `x`
    through hidden_norm beside the embedding through input_layernorm, 2h into q/k/v), attending to the keys of
    `past` steps and its own under the additive `mask` [L, (len(past) + 1) L]. Returns (output, keys, values)."""
    layer = draft.blocks[0]
    attn, hd = layer.self_attn, draft.head_dim
    b, n, _ = x.shape
    h = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(x)], dim=-1) if draft.version == 3 else x
    q = attn.q_proj(h).view(b, n, -1, hd).transpose(1, 2)
    k = attn.k_proj(h).view(b, n, -1, hd).transpose(1, 2)
    v = attn.v_proj(h).view(b, n, -1, hd).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    keys = torch.cat([p[0] for p in past] + [k], dim=2)
    values = torch.cat([p[1] for p in past] + [v], dim=2)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask.to(q.dtype), enable_gqa=draft.q_heads != draft.kv_heads
    )
    x = x + attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x)), k, v


def unroll_mask(n: int, step: int, device: torch.device) -> torch.Tensor:
    """Additive mask [n, (step + 1) n] of unroll step `step`: query s sees the backbone-fed keys u <= s - step and,
    in block i (1 <= i <= step), its own chain's key s - step + i (the drafter's cache at depth step + 1)."""
    s = torch.arange(n, device=device)[:, None]
    u = torch.arange(n, device=device)[None, :]
    blocks = [u <= s - step] + [u == s - step + i for i in range(1, step + 1)]
    vis = torch.cat(blocks, dim=1)
    return torch.where(vis, 0.0, torch.finfo(torch.float32).min)


def unrolled_outputs(
    draft: EagleDraft,
    feats: torch.Tensor,
    emb: torch.Tensor,
    steps: int,
    noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """The draft's outputs [B, L, h] for unroll steps 0 .. steps - 1 (see the module docstring). Step j's row s is
    the depth-(j + 1) prediction of the chain whose root pair is s - j; rows s < j are meaningless. `noise`:
    EAGLE's uniform feature noise (the drafter reads a quantized backbone's features and its own inexact ones),
    drawn from `generator` on the host so that a resumed run draws the same."""
    b, n, _ = feats.shape
    pos = torch.arange(n, device=feats.device, dtype=torch.float32)
    angles = pos[:, None] * draft.inv_freq.to(feats.device)[None]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos()[None, None], angles.sin()[None, None]
    if noise > 0:
        u = torch.rand(feats.shape, generator=generator).to(feats.device, feats.dtype)
        feats = feats + (u - 0.5) * (2 * noise)
    hidden, past, outs = feats, [], []
    for j in range(steps):
        if (
            draft.version == 3
        ):  # fc reads the backbone's three features; the draft's own are fed back as they are
            x = draft.fc(hidden) if j == 0 else hidden
        else:
            x = draft.fc(torch.cat([emb, hidden], dim=-1))
        out, k, v = _attend(draft, x, emb, cos, sin, past, unroll_mask(n, j, feats.device))
        outs.append(out)
        past.append((k, v))
        hidden = torch.cat([out[:, :1], out[:, :-1]], dim=1)  # row s reads step j's output at s - 1
    return outs


def step_rows(use: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
    """[B, L] rows of unroll step `step` that count: the chain's root pair (s - step) is one a decoding step uses
    and the token to predict exists."""
    valid = torch.zeros_like(use)
    if step < use.shape[1]:
        valid[:, step:] = use[:, : use.shape[1] - step]
    return valid & (targets[..., 0] >= 0)
