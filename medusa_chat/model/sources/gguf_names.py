"""GGUF tensor names in the transformers Llama layout: which module each of a file's tensors is, the q/k rows in
transformers' rotary order, and the file's own Q4_1 / Q8_0 blocks per module (`gguf_blocks`) or all of it as
a float state dict (`gguf_state_dict`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# GGUF tensor name -> transformers module path (Llama family), per layer
GGUF_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def reverse_permute_rows(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter interleaves the rotary halves of q/k rows; transformers' GGUF loader undoes it
    (`reverse_permute_weights`). The same row permutation applies to codes and per-row block scales."""
    dim = x.shape[0] // n_head // 2
    return x.reshape(n_head, dim, 2, *x.shape[1:]).swapaxes(2, 1).reshape(x.shape)


GGUFBlocks = dict[str, tuple]  # module path -> ("q4_1", codes, d, m) | ("q8_0", codes, d)


def gguf_blocks(path: Path, config: Any) -> GGUFBlocks:
    """The GGUF's own quantized blocks for every projection and the lm_head, as stored.

    Q4_1 projections and a Q8_0 output / token embedding (the lm_head of a tied model) are returned with their
    codes and scales; every other tensor type is left out, and the caller keeps those weights as the float
    model converted from the file has them (faithful, only not packed).
    """
    from medusa_chat.kernels.gguf_file import read_tensors, unpack_q4_1, unpack_q8_0

    tensors = read_tensors(path)
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    out: GGUFBlocks = {}
    for t in tensors.values():
        if len(t.shape) != 2:
            continue
        rows, cols = t.shape
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LINEARS:
            if t.type_name != "Q4_1":
                continue
            codes, d, m = unpack_q4_1(t.data, rows, cols)
            if parts[2] in ("attn_q", "attn_k"):
                n = heads if parts[2] == "attn_q" else kv_heads
                codes, d, m = (reverse_permute_rows(x, n) for x in (codes, d, m))
            out[f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}"] = ("q4_1", codes, d, m)
        elif t.name == "output.weight" or (t.name == "token_embd.weight" and "output.weight" not in tensors):
            if t.type_name == "Q8_0":
                out["lm_head"] = ("q8_0", *unpack_q8_0(t.data, rows, cols))
    return out


GGUF_NORMS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head q/k norms
    "attn_k_norm": "self_attn.k_norm",
}
UNPERMUTED_QK = ("qwen2", "qwen3")  # NeoX-style rope: llama.cpp's converter keeps Hugging Face's q/k row order


def gguf_state_dict(path: Path, config: Any) -> dict[str, torch.Tensor]:
    """The float32 state dict (transformers' Llama names) of a Llama-family GGUF: every tensor dequantized, the
    q/k rows back in transformers' rotary order (Llama/Mistral files; a Qwen2 file keeps transformers' order and
    adds its q/k/v biases, a Qwen3 file its q/k norms); a tied lm_head is left to the embedding."""
    from medusa_chat.kernels.gguf_file import dequantize, read_tensors

    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    permuted = getattr(config, "model_type", "llama") not in UNPERMUTED_QK
    state: dict[str, torch.Tensor] = {}
    for t in read_tensors(path).values():
        w = torch.from_numpy(dequantize(t))
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            state["model.embed_tokens.weight"] = w
        elif t.name == "output_norm.weight":
            state["model.norm.weight"] = w
        elif t.name == "output.weight":
            state["lm_head.weight"] = w
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LINEARS:
            if permuted and parts[2] in ("attn_q", "attn_k"):
                w = reverse_permute_rows(w, heads if parts[2] == "attn_q" else kv_heads)
            state[f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}.{parts[3]}"] = w.contiguous()
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_NORMS:
            state[f"model.layers.{parts[1]}.{GGUF_NORMS[parts[2]]}.weight"] = w
        elif t.name != "rope_freqs.weight":  # (Llama 3.1's rotary factors: the rotary module's, not a weight)
            raise ValueError(f"{path}: tensor {t.name} has no place in a Llama state dict")
    return state
