"""Synthetic EAGLE drafts written in the published Hub layout (SafeAILab/EAGLE: config.json + pytorch_model.bin or
model.safetensors, the published state-dict keys), and a planted backbone deep enough for EAGLE-3.

`planted_eagle1_state`: an EAGLE-1 draft that is right on the planted backbone (tests/tinymodels.py: lm_head maps
a hidden state ~ emb[i] to succ[i]): fc passes the next token's embedding through, so the draft's output ~ the
embedding of the token it read and the backbone's lm_head guesses that token's successor; the attention and MLP
add small random terms (so the draft's KV cache matters and a wrong cache changes its outputs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.tinymodels import HIDDEN, LAYER_SCALE, N_SPECIAL, VOCAB, planted_successor, tiny_config

HEADS, KV_HEADS, HEAD_DIM, INTER = 4, 2, 16, 96


def draft_config(hidden: int = HIDDEN, vocab: int = VOCAB, draft_vocab: int | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "torch_dtype": "float16",
    }
    if draft_vocab is not None:
        cfg["draft_vocab_size"] = draft_vocab
        cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    return cfg


def _layer(prefix: str, in_dim: int, hidden: int, g: torch.Generator, scale: float) -> dict[str, torch.Tensor]:
    def r(*shape: int, s: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * s / shape[-1] ** 0.5

    return {
        f"{prefix}self_attn.q_proj.weight": r(HEADS * HEAD_DIM, in_dim),
        f"{prefix}self_attn.k_proj.weight": r(KV_HEADS * HEAD_DIM, in_dim),
        f"{prefix}self_attn.v_proj.weight": r(KV_HEADS * HEAD_DIM, in_dim),
        f"{prefix}self_attn.o_proj.weight": r(hidden, HEADS * HEAD_DIM, s=scale),
        f"{prefix}mlp.gate_proj.weight": r(INTER, hidden),
        f"{prefix}mlp.up_proj.weight": r(INTER, hidden),
        f"{prefix}mlp.down_proj.weight": r(hidden, INTER, s=scale),
        f"{prefix}post_attention_layernorm.weight": torch.ones(hidden),
    }


def planted_eagle1_state(embed: torch.Tensor, seed: int = 0, scale: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = embed.shape[1]
    fc = torch.zeros(hidden, 2 * hidden)
    fc[:, :hidden] = torch.eye(hidden) * 4.0  # cat(embedding, feature): the embedding passes through
    fc[:, hidden:] = torch.randn(hidden, hidden, generator=g) * 0.05 / hidden**0.5
    state = {"fc.weight": fc, "fc.bias": torch.zeros(hidden), "embed_tokens.weight": embed.clone()}
    state.update(_layer("layers.0.", hidden, hidden, g, scale))
    return state


def random_eagle3_state(hidden: int, vocab: int, draft_vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random EAGLE-3 draft over a draft vocabulary of every other token from N_SPECIAL on (d2t offsets)."""
    g = torch.Generator().manual_seed(seed)
    draft_ids = torch.arange(N_SPECIAL, N_SPECIAL + 2 * draft_vocab, 2)
    assert int(draft_ids.max()) < vocab
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    state = {
        "fc.weight": torch.randn(hidden, 3 * hidden, generator=g) / (3 * hidden) ** 0.5,
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": torch.randn(draft_vocab, hidden, generator=g) * 3 / hidden**0.5,
        "d2t": draft_ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    state.update(_layer("midlayer.", 2 * hidden, hidden, g, 1.0))
    return state


def write_eagle(folder: Path, state: dict[str, torch.Tensor], config: dict[str, Any], fmt: str = "bin") -> Path:
    """The published layout: config.json + pytorch_model.bin (torch.save, fp16 floats) or model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    half = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    if fmt == "bin":
        torch.save(half, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in half.items()}, str(folder / "model.safetensors"))
    return folder


def deep_planted_backbone(folder: Path, layers: int = 8, seed: int = 3) -> Path:
    """A planted Llama like tests/tinymodels.build_tiny_backbone with `layers` layers (EAGLE-3 reads layers 2, N/2,
    N - 3), saved with the planted models' ChatML tokenizer."""
    from transformers import LlamaForCausalLM

    from tests.tinymodels import SPECIALS, build_tokenizer, save_backbone

    if (folder / "config.json").is_file():
        return folder
    ids = {"bos_token_id": SPECIALS.index("<|im_start|>"), "eos_token_id": SPECIALS.index("<|im_end|>")}
    config = tiny_config(
        "llama", num_hidden_layers=layers, max_position_embeddings=512, tie_word_embeddings=False, **ids
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 100)
    emb = torch.randn(VOCAB, HIDDEN, generator=g)
    emb /= emb.norm(dim=1, keepdim=True)
    succ = planted_successor(seed)
    out = torch.empty(VOCAB, HIDDEN)
    out[succ[N_SPECIAL:]] = emb[N_SPECIAL:]
    out[:N_SPECIAL] = -emb[:N_SPECIAL]
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(emb)
        model.get_output_embeddings().weight.copy_(out)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(LAYER_SCALE)
            layer.mlp.down_proj.weight.mul_(LAYER_SCALE)
    return save_backbone(model, build_tokenizer("chatml"), folder, succ)


def write_random_eagle(folder: Path, cfg: dict[str, Any], version: int = 1, draft_vocab: int = 32000,
                       seed: int = 0) -> Path:  # fmt: skip
    """A random EAGLE-1 (or `version` 3: EAGLE-3 over a `draft_vocab`-token draft vocabulary, every other token
    id) draft for a Llama of config `cfg`, in SafeAILab's published layout (fp16 safetensors)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads, kv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or h // heads)

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).half()

    def ones() -> torch.Tensor:
        return torch.ones(h, dtype=torch.float16)

    layer, width = ("midlayer.", 2 * h) if version == 3 else ("layers.0.", h)  # q/k/v read cat(emb, x) in EAGLE-3
    state = {
        f"{layer}self_attn.q_proj.weight": r(heads * hd, width),
        f"{layer}self_attn.k_proj.weight": r(kv * hd, width),
        f"{layer}self_attn.v_proj.weight": r(kv * hd, width),
        f"{layer}self_attn.o_proj.weight": r(h, heads * hd),
        f"{layer}mlp.gate_proj.weight": r(inter, h),
        f"{layer}mlp.up_proj.weight": r(inter, h),
        f"{layer}mlp.down_proj.weight": r(h, inter),
        f"{layer}post_attention_layernorm.weight": ones(),
    }
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "vocab_size", "rope_theta", "max_position_embeddings")  # fmt: skip
    draft_cfg: dict[str, Any] = {k: cfg[k] for k in keep if k in cfg}
    draft_cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1)
    if version == 3:
        vocab = int(cfg["vocab_size"])
        dv = min(draft_vocab, vocab // 2)
        ids = torch.arange(0, 2 * dv, 2)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        state.update({
            "fc.weight": r(h, 3 * h), f"{layer}hidden_norm.weight": ones(), f"{layer}input_layernorm.weight": ones(),
            "norm.weight": ones(), "lm_head.weight": r(dv, h), "d2t": ids - torch.arange(dv), "t2d": t2d,
        })  # fmt: skip
        draft_cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=dv)
    else:
        state.update({"fc.weight": r(h, 2 * h), "fc.bias": torch.zeros(h, dtype=torch.float16)})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(draft_cfg, indent=1))
    save_file(state, str(folder / "model.safetensors"))
    return folder


def c_draft_agreement(drafter: Any, roots: range, within: int = 0) -> int:
    """For how many roots the C drafter's depth-1 top-4 is the PyTorch draft's (same order; with `within`: its
    top-1 is among the PyTorch draft's top `within`), each run over the drafter's whole context from scratch
    (native_eagle.py against model/forward/eagle.py)."""
    native, agree, p = drafter.native, 0, drafter.known
    with torch.inference_mode():
        for r in roots:
            root = torch.tensor([r])
            drafter.seen = 0
            cands = native.draft_pairs(*drafter.pairs(root), 1, 4, 2)[2]
            nxt = torch.cat([drafter.ids[1:p], root])
            out = drafter.draft.reference_outputs(drafter.feats[:p], nxt, drafter.embed)[-1:]
            top = drafter._tokens(drafter._logits(out).topk(within or 4, dim=-1).indices)[0].tolist()
            agree += int(cands[0]) in top if within else cands.tolist() == top
    return agree
