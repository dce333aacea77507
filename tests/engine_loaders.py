"""The serving engines' loading rules for draft folders, transcribed from their code (neither engine installs
here), so tests read an export back the way the engine would: which config keys it reads, which tensor names it
maps to which parameter, the parameter shapes it allocates, and how d2t / token_map turn draft logits into token
ids. Sources (read, not copied): vLLM vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM and its
LlamaModel.load_weights), vllm/transformers_utils/configs/speculators/{base,algos}.py,
vllm/model_executor/models/medusa.py + configs/medusa.py; SGLang python/sglang/srt/models/llama_eagle3.py."""

from __future__ import annotations

from typing import Any

import torch

# (checkpoint name part, fused parameter, shard position): the loaders write each shard at its place, whatever
# order the file lists them in
FUSED = ((".q_proj", ".qkv_proj", 0), (".k_proj", ".qkv_proj", 1), (".v_proj", ".qkv_proj", 2),
         (".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1))  # fmt: skip


def _llama_layer_params(cfg: dict[str, Any], prefix: str, target_hidden: int) -> dict[str, tuple[int, ...]]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    return {
        f"{prefix}.self_attn.qkv_proj.weight": ((heads + 2 * kv) * hd, 2 * h),
        f"{prefix}.self_attn.o_proj.weight": (h, heads * hd),
        f"{prefix}.mlp.gate_up_proj.weight": (2 * inter, h),
        f"{prefix}.mlp.down_proj.weight": (h, inter),
        f"{prefix}.input_layernorm.weight": (h,),
        f"{prefix}.post_attention_layernorm.weight": (h,),
        f"{prefix}.hidden_norm.weight": (h,),
    }


def _fuse(name: str) -> tuple[str, int]:
    for part, fused, shard in FUSED:
        if part in name:
            return name.replace(part, fused), shard
    return name, 0


def _stack(params: dict[str, dict[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([v[i] for i in sorted(v)], dim=0) for k, v in params.items()}


def vllm_speculators_config(config: dict[str, Any]) -> dict[str, Any]:
    """SpeculatorsConfig.extract_transformers_pre_trained_config + update_eagle3: the config vLLM builds the
    drafter from, and the speculative settings it takes from the folder."""
    base = config["speculators_config"]
    method, tokens = config["speculators_model_type"], base["proposal_methods"][0]["speculative_tokens"]
    assert base["verifier"]["name_or_path"] and config["transformer_layer_config"] is not None
    pre = dict(config["transformer_layer_config"])
    pre["draft_vocab_size"] = config.get("draft_vocab_size")
    if config.get("target_hidden_size") is not None:
        pre["target_hidden_size"] = config["target_hidden_size"]
    pre["norm_before_residual"] = config.get("norm_before_residual", True)
    arch = {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}[
        pre.get("model_type", "llama")
    ]
    pre["architectures"] = [arch]
    if config.get("eagle_aux_hidden_state_layer_ids"):
        pre["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
    return {"model": pre, "method": method, "num_speculative_tokens": tokens}


def vllm_eagle3_load(pre: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Eagle3LlamaForCausalLM.load_weights: the parameters the folder's tensors land in (every parameter the
    model allocates must be filled with its shape; a name it does not know raises KeyError, as in vLLM)."""
    h = pre["hidden_size"]
    shapes = _llama_layer_params(pre, "model.layers.0", pre.get("target_hidden_size", h))
    shapes["model.fc.weight"] = (h, 3 * pre.get("target_hidden_size", h))
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (pre["draft_vocab_size"], h)
    shapes["draft_id_to_target_id"] = (pre["draft_vocab_size"],)
    got: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name.replace("midlayer.", "layers.0.")
        if "embed_tokens" in name:
            continue  # loaded where present; the target's embedding is shared otherwise
        name, shard = _fuse(name)
        if name not in shapes:
            raise KeyError(name)
        got.setdefault(name, {})[shard] = t
    params = _stack(got)
    missing = sorted(set(shapes) - set(params))
    assert not missing, f"vLLM would leave {missing} uninitialised"
    for k, shape in shapes.items():
        assert tuple(params[k].shape) == shape, (k, tuple(params[k].shape), shape)
    return params


def sglang_eagle3_load(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LlamaForCausalLMEagle3.load_weights: a name not in its parameters is skipped without a word, so every
    parameter (embed_tokens aside: SGLang sets the target's) must be filled here."""
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert not config.get("tie_word_embeddings", False), "SGLang would make the lm_head the embedding"
    h = config["hidden_size"]
    th = config.get("target_hidden_size", h)
    shapes = _llama_layer_params(config, "model.midlayer", th)
    shapes.update({"model.fc.weight": (h, 3 * th), "model.norm.weight": (h,),
                   "lm_head.weight": (config["draft_vocab_size"], h)})  # fmt: skip
    got: dict[str, dict[int, torch.Tensor]] = {}
    hot = None
    for name, t in tensors.items():
        if "d2t" in name:
            hot = t + torch.arange(t.shape[0])
            continue
        if "t2d" in name:
            continue
        name, shard = _fuse(name)
        key = name if name in shapes else f"model.{name}"
        if key in shapes:
            got.setdefault(key, {})[shard] = t
    params = _stack(got)
    missing = sorted(set(shapes) - set(params))
    assert not missing, f"SGLang would leave {missing} uninitialised (names it skips)"
    for k, shape in shapes.items():
        assert tuple(params[k].shape) == shape, (k, tuple(params[k].shape), shape)
    assert hot is not None, "no d2t: SGLang would draft over the first draft_vocab_size ids"
    params["hot_token_id"] = hot
    return params


def vllm_medusa_config(config: dict[str, Any]) -> dict[str, Any]:
    """MedusaConfig.from_pretrained: keys holding 'num' and 'heads'/'layers' are renamed; defaults filled."""
    cfg = dict(config)
    for k in list(cfg):
        if "num" in k and "heads" in k:
            cfg["num_heads"] = cfg.pop(k)
        elif "num" in k and "layers" in k:
            cfg["num_hidden_layers"] = cfg.pop(k)
    cfg.setdefault("truncated_vocab_size", cfg["vocab_size"])
    assert cfg["model_type"] == "medusa" and cfg.get("architectures") == ["MedusaModel"]
    return cfg


def vllm_medusa_load(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Medusa.load_weights: blocks, one lm_head per head (or the shared one), token_map and the lm_head rows it
    keeps."""
    h, n, layers = cfg["hidden_size"], cfg["num_heads"], cfg["num_hidden_layers"]
    shared = cfg.get("original_lm_head", False)
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(n):
        for j in range(layers):
            shapes[f"blocks.{i}.layers.{j}.weight"] = (h, h)
            if cfg.get("medusa_fc_bias", False):
                shapes[f"blocks.{i}.layers.{j}.bias"] = (h,)
        if not shared:
            shapes[f"lm_heads.{i}.weight"] = (cfg["truncated_vocab_size"], h)
    if shared:
        shapes["lm_head.weight"] = (cfg["truncated_vocab_size"], h)
    token_map = None
    kept: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        name = name.replace("medusa_heads.", "")
        if name == "token_map":
            if cfg["truncated_vocab_size"] < cfg["vocab_size"]:
                token_map = t
        elif name in shapes:
            kept[name] = t
        elif shared and name == "lm_heads.0.weight":
            kept["lm_head.weight"] = t
    for name, t in list(kept.items()):
        if "lm_head" in name and token_map is not None and t.shape[0] > token_map.shape[0]:
            kept[name] = t[token_map]
    assert cfg["truncated_vocab_size"] == cfg["vocab_size"] or token_map is not None
    missing = sorted(set(shapes) - set(kept))
    assert not missing, f"vLLM would leave {missing} uninitialised"
    for k, shape in shapes.items():
        assert tuple(kept[k].shape) == shape, (k, tuple(kept[k].shape), shape)
    if token_map is not None:
        kept["token_map"] = token_map
    return kept


def vllm_medusa_top1(
    cfg: dict[str, Any], params: dict[str, torch.Tensor], hidden: torch.Tensor
) -> torch.Tensor:
    """Medusa.forward + compute_logits + sample: each head's top-1 token id for `hidden` [T, h] -> [heads, T]."""
    out = []
    for i in range(cfg["num_heads"]):
        x = hidden.float()
        for j in range(cfg["num_hidden_layers"]):
            w, b = params[f"blocks.{i}.layers.{j}.weight"].float(), params.get(f"blocks.{i}.layers.{j}.bias")
            x = x + torch.nn.functional.silu(x @ w.T + (b.float() if b is not None else 0))
        head = params["lm_head.weight" if cfg.get("original_lm_head") else f"lm_heads.{i}.weight"].float()
        logits = x @ head.T
        if "token_map" in params:
            full = torch.full((*logits.shape[:-1], cfg["vocab_size"]), -torch.inf)
            full[..., params["token_map"]] = logits
            logits = full
        out.append(logits.argmax(-1))
    return torch.stack(out)
