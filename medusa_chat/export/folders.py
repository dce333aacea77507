"""Drafts as the folders vLLM and SGLang load (config.json + model.safetensors), each checked against the engine's
own loading code (read in their repositories, not imported: neither engine is a dependency):

- vLLM, EAGLE-3: the speculators layout (vllm/transformers_utils/configs/speculators/: `speculators_model_type`
  "eagle3", the Llama layer under `transformer_layer_config`, `speculators_config` with the proposal's
  `speculative_tokens` and the `verifier`; top-level `draft_vocab_size`, `norm_before_residual`,
  `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`). Tensors as speculators' Eagle3Speculator names them
  (`layers.0.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`); vLLM's llama_eagle3.py loads them
  under `model.` (d2t becomes draft_id_to_target_id, t2d is skipped, q/k/v and gate/up are fused on load).
  `norm_before_residual` is written false: this project's drafts (like SafeAILab's) keep the un-normed feature
  as the residual, and the speculators config reader defaults it to true.
- SGLang, EAGLE-3: SpecForge's layout, which is SafeAILab's (`architectures` ["LlamaForCausalLMEagle3"], a Llama
  config with `num_hidden_layers` 1 and `draft_vocab_size`; tensors `midlayer.*`, `fc.weight`, `norm.weight`,
  `lm_head.weight`, `d2t`, `t2d`). sglang's llama_eagle3.py skips names it does not know without a word, so
  `layers.0.*` would load nothing: the names matter. `tie_word_embeddings` is written false (true would make
  its lm_head the embedding).
- vLLM, Medusa: vllm/model_executor/models/medusa.py with its MedusaConfig (`model_type` "medusa",
  `architectures` ["MedusaModel"], `num_heads`, `num_hidden_layers` = ResBlocks per head, `medusa_fc_bias`,
  `truncated_vocab_size`, `original_lm_head`); tensors `blocks.{i}.layers.{j}.weight/bias`, `lm_heads.{i}.weight`
  (shared-lm_head heads: `original_lm_head` true and the target's lm_head as `lm_heads.0.weight`), and a draft
  vocabulary as `token_map` with `truncated_vocab_size` its length (vLLM then keeps those rows of the lm_head
  and scatters the heads' logits back to those ids: the same restriction this project drafts with).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from medusa_chat.errors import MedusaChatError
from medusa_chat.export.llamacpp import check_vocab_maps, target_layers
from medusa_chat.export.source import Draft, Target, target_lm_head

SPECULATIVE_TOKENS = (
    3  # the proposal length written for vLLM (num_speculative_tokens); the server may override
)
LLAMA_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size", "attention_bias",
    "mlp_bias", "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip


def _layer_config(draft: Draft, target: Target) -> dict[str, Any]:
    """The draft's one Llama decoder layer as a Llama config (the draft config's keys, the target's where it
    has none)."""
    cfg: dict[str, Any] = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    for key in LLAMA_KEYS:
        value = draft.config.get(key, target.config.get(key))
        if value is not None:
            cfg[key] = value
    cfg.setdefault("hidden_act", "silu")
    cfg["num_hidden_layers"] = 1
    cfg["tie_word_embeddings"] = False
    return cfg


def _layer_tensors(draft: Draft, prefix: str) -> dict[str, torch.Tensor]:
    """The draft's tensors with its decoder layer under `prefix` (`midlayer.` or `layers.0.`)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in draft.state.items():
        for old in ("midlayer.", "layers.0."):
            if name.startswith(old):
                name = prefix + name[len(old) :]
                break
        out[name] = t.contiguous()
    out["d2t"] = draft.state["d2t"].to(torch.int64)
    out["t2d"] = draft.state["t2d"].to(torch.bool)
    return out


def _save(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def vllm_eagle3(draft: Draft, target: Target, out: Path) -> Path:
    """The speculators EAGLE-3 folder vLLM serves with `--speculative-config '{"model": OUT, ...}'`."""
    check_vocab_maps(draft, target.vocab_size)
    layer = _layer_config(draft, target)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": int(draft.state["lm_head.weight"].shape[0]),
        "norm_before_residual": bool(draft.config.get("norm_before_residual", False)),
        "target_hidden_size": int(draft.config.get("target_hidden_size") or target.hidden_size),
        "eagle_aux_hidden_state_layer_ids": target_layers(draft, target),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": SPECULATIVE_TOKENS,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],  # fmt: skip
            "verifier": {"name_or_path": target.name, "architectures": target.architectures},
        },
        "torch_dtype": _dtype_name(draft.state["fc.weight"].dtype),
    }
    return _save(out, config, _layer_tensors(draft, "layers.0."))


def sglang_eagle3(draft: Draft, target: Target, out: Path) -> Path:
    """SpecForge's EAGLE-3 folder, which SGLang serves with `--speculative-algorithm EAGLE3`."""
    check_vocab_maps(draft, target.vocab_size)
    config = _layer_config(draft, target)
    config["architectures"] = ["LlamaForCausalLMEagle3"]
    config["draft_vocab_size"] = int(draft.state["lm_head.weight"].shape[0])
    config["torch_dtype"] = _dtype_name(draft.state["fc.weight"].dtype)
    if draft.config.get("target_hidden_size"):
        config["target_hidden_size"] = int(draft.config["target_hidden_size"])
    return _save(out, config, _layer_tensors(draft, "midlayer."))


def vllm_medusa(draft: Draft, target: Target, out: Path) -> Path:
    """Medusa heads as vLLM's Medusa proposer loads them (`--speculative-config '{"method": "medusa", ...}'`)."""
    state, n, layers = draft.state, draft.num_heads, draft.num_layers
    tensors: dict[str, torch.Tensor] = {}
    for i in range(n):
        for j in range(layers):
            tensors[f"blocks.{i}.layers.{j}.weight"] = state[f"{i}.{j}.linear.weight"].contiguous()
            tensors[f"blocks.{i}.layers.{j}.bias"] = state[f"{i}.{j}.linear.bias"].contiguous()
        if draft.own_lm_head:
            tensors[f"lm_heads.{i}.weight"] = state[f"{i}.{layers}.weight"].contiguous()
    dtype = state["0.0.linear.weight"].dtype
    if not draft.own_lm_head:  # vLLM maps lm_heads.0.weight onto its one shared head (original_lm_head)
        tensors["lm_heads.0.weight"] = target_lm_head(target).to(dtype).contiguous()
    vocab = target.vocab_size
    truncated = vocab
    if draft.draft_vocab is not None and draft.draft_vocab.numel() < vocab:
        tensors["token_map"] = draft.draft_vocab.to(torch.int64).contiguous()
        truncated = int(draft.draft_vocab.numel())
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": int(state["0.0.linear.weight"].shape[1]),
        "vocab_size": vocab,
        "num_heads": n,
        "num_hidden_layers": layers,
        "medusa_fc_bias": True,
        "original_lm_head": not draft.own_lm_head,
        "truncated_vocab_size": truncated,
        "base_model_name_or_path": target.name,
        "torch_dtype": _dtype_name(dtype),
    }
    return _save(out, config, tensors)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}.get(
        dtype, "float32"
    )


FORMATS = {"vllm": {"eagle3": vllm_eagle3, "medusa": vllm_medusa}, "sglang": {"eagle3": sglang_eagle3}}


def write_folder(fmt: str, draft: Draft, target: Target, out: Path) -> Path:
    writer = FORMATS[fmt].get(draft.kind)
    if writer is None:
        raise MedusaChatError(
            f"{fmt} has no loader for {draft.kind} drafts here: SGLang serves EAGLE-3 drafts (--heads eagle3); "
            "vLLM serves EAGLE-3 drafts and Medusa heads"
        )
    return writer(draft, target, out)


def recipe(fmt: str, draft: Draft, target: Target, out: Path) -> str:
    if fmt == "sglang":
        return (
            f"python -m sglang.launch_server --model {target.name} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {out} --speculative-num-steps 3 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 4"
        )
    method = "eagle3" if draft.kind == "eagle3" else "medusa"
    tokens = SPECULATIVE_TOKENS if draft.kind == "eagle3" else draft.num_heads
    spec = json.dumps({"method": method, "model": str(out), "num_speculative_tokens": tokens})
    return f"vllm serve {target.name} --speculative-config '{spec}'"
