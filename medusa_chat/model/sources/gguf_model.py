"""A GGUF file as the backbone (`--model PATH.gguf`), built tensor by tensor from the file: no float copy.

`load_gguf_backbone`: the transformers *ForCausalLM made on the meta device (no memory), then every tensor read
from the file (plain reads, no memory map: mapped pages would stay resident until the map is dropped) and put in
place one at a time: norms as parameters; projections and the lm_head as block-kernel linears on the file's own
blocks (`kernels/gguf_linears.block_linear_from_gguf`, the q/k rows of a Llama/Mistral file put back in
transformers' rotary order first; a Qwen2 file's q/k/v biases added in fp32 after the projection); the token
embedding kept as the file's blocks, rows dequantized as they are looked up. Resident memory ends near the
file's size. The file's config and tokenizer (the weightless folder the loader reads first) are gguf_folder.py's.
What `--quant` means for a GGUF file (what the file stores is never rounded a second time, except where no
kernel of ours reads its type):
- auto: every tensor as stored: quantized blocks on the block kernel, F32/F16/BF16 matrices as packed float.
- int4 / int8: the same, and F32/F16/BF16 matrices quantized by the existing rules (cpu_blocks.py: Q4_1
  projections for int4, Q8_0 for int8 and for the lm_head).
- none: every matrix dequantized to a packed float (fp32 unless --dtype says otherwise): the float reference,
  several times the file's size (a note says how big).
A quantized type without a block kernel (IQ/Q2_K/Q3_K types, or any type where the kernel cannot run) is dequantized and quantized as
int8 (Q8_0), or int4 where asked; a note lists those types.
"""

from __future__ import annotations

import gc
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from medusa_chat.errors import DeviceError, ModelNotFoundError
from medusa_chat.model.forward.cpu_blocks import set_tied_lm_head
from medusa_chat.model.sources.gguf_folder import (
    SUPPORTED_ARCHS,
    Progress,
    TensorEntry,
    dequantize_raw,
    read_table,
    read_tensor_bytes,
)
from medusa_chat.model.sources.gguf_names import GGUF_LINEARS, GGUF_NORMS

QK_NORMED = ("qwen3",)  # model types with per-head q/k RMSNorms (blk.N.attn_q_norm / attn_k_norm)
# llama.cpp's converter interleaves the rotary halves of q/k rows for these (LLaMA-style rope in ggml); Qwen2 and
# Qwen3 files keep Hugging Face's row order (NeoX-style rope), so nothing is undone for them
PERMUTED_QK = ("llama", "mistral")
QKV_BIASES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj"}  # GGUF name -> module (Qwen2)
BIASED_QKV = ("qwen2",)  # model types whose q/k/v projections always have biases
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
LINEARS, NORMS = GGUF_LINEARS, GGUF_NORMS  # GGUF tensor name -> transformers module path, per layer


# ---- the backbone ----------------------------------------------------------------------------------------------
class GGUFEmbedding(nn.Module):
    """A token embedding that keeps the file's blocks (uint8 [vocab, bytes per row]) and dequantizes only the
    rows looked up. For types without the Q8_0 C lookup (block_linears.BlockEmbedding). `weight` is an empty buffer in
    the compute dtype: it answers the dtype/device questions code asks of an embedding."""

    def __init__(self, raw: np.ndarray, type_id: int, rows: int, cols: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.type_id, self.num_embeddings, self.embedding_dim = type_id, rows, cols
        self.in_features, self.out_features = cols, rows  # weight_accounting counts these weights
        self.register_buffer("raw", torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, -1)))
        self.register_buffer("weight", torch.empty(0, cols, dtype=dtype), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        uniq, inverse = torch.unique(flat, return_inverse=True)
        rows = dequantize_raw(
            self.type_id, self.raw.index_select(0, uniq).numpy(), (len(uniq), self.embedding_dim)
        )
        return rows.index_select(0, inverse).view(*ids.shape, self.embedding_dim).to(self.weight.dtype)

    def dequantized(self) -> torch.Tensor:
        """The whole table in float32 (tests)."""
        return dequantize_raw(self.type_id, self.raw.numpy(), (self.num_embeddings, self.embedding_dim))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, GGML type {self.type_id} blocks"


@dataclass
class _Build:
    """What one load decides and records."""

    mode: str  # "gguf" (as stored), "int4", "int8", "none"
    dtype: torch.dtype
    stored: Counter  # tensor types used as stored
    requantized: Counter  # quantized types with no block kernel here: dequantized and quantized again
    float_bytes: int = 0  # bytes of float matrices made from quantized blocks (--quant none)
    refused: set[str] = field(default_factory=set)  # why a block kernel was not used (one line each)
    # an F16/BF16 token embedding kept as stored, rows widened as looked up (GGUFEmbedding: half the bytes of
    # an fp32 table, the same values); False: an fp32 nn.Embedding (what the C Hydra drafter reads)
    half_embedding: bool = False


def _float_linear(weight: torch.Tensor, mode: str, lm_head: bool, b: _Build) -> nn.Module:
    """A row-invariant CPU module for a float matrix, as prepare_cpu_linears makes them for `mode`."""
    from medusa_chat.kernels.cbind import available
    from medusa_chat.kernels.cpu_linears import GROUP, Int4Linear, Int8Linear, PackedLinear, can_pack
    from medusa_chat.kernels.quantizers import quantize_int8, quantize_q4_1
    from medusa_chat.model.forward.cpu_blocks import block_module

    rows, cols = weight.shape
    if mode in ("int4", "int8") and cols % GROUP == 0 and available():
        return block_module(mode, weight, None, lm_head)
    if mode in ("int4", "int8"):
        if lm_head or mode == "int8" or cols % GROUP:
            return Int8Linear(*quantize_int8(weight))
        return Int4Linear(*quantize_q4_1(weight))
    lin = nn.Linear(cols, rows, bias=False, device="meta")
    lin.weight = nn.Parameter(weight.to(b.dtype), requires_grad=False)
    return PackedLinear(lin) if can_pack(lin) else lin


def _linear(entry: TensorEntry, raw: np.ndarray, lm_head: bool, b: _Build) -> nn.Module:
    """The module for one matrix of the file (raw: its bytes as [rows, bytes per row], rows already in
    transformers' order)."""
    from medusa_chat.kernels.cpu_linears import check_row_invariant
    from medusa_chat.kernels.gguf_linears import block_linear_from_gguf

    rows, cols = entry.shape
    module: nn.Module | None = None
    mode = b.mode
    if entry.type_id in FLOAT_TYPES:
        mode = (
            "none" if mode == "gguf" else mode
        )  # a float matrix stays float unless a quantized path was asked
    elif mode != "none":
        try:
            module = block_linear_from_gguf(entry.type_name, raw, rows, cols)
        except DeviceError as err:  # no block kernel here, or it missed its known answer: float weights
            b.refused.add(str(err))
            module = None
        if module is None:
            b.requantized[entry.type_name] += 1
            mode = "int8" if mode == "gguf" else mode
    if module is None:
        weight = dequantize_raw(entry.type_id, raw, (rows, cols))
        if mode == "none" and entry.type_id not in FLOAT_TYPES:
            b.float_bytes += weight.numel() * torch.finfo(b.dtype).bits // 8
        module = _float_linear(weight, mode, lm_head, b)
    else:
        b.stored[entry.type_name] += 1
    if isinstance(module, nn.Linear):  # no packed kernel here: its own GEMM must be row-invariant
        check_row_invariant(module, module.weight.dtype)
    else:
        check_row_invariant(module, b.dtype)
    return module


def _embedding(entry: TensorEntry, raw: np.ndarray, padding_idx: int | None, b: _Build) -> nn.Module:
    from medusa_chat.kernels.block_linears import BlockEmbedding, Q80Linear
    from medusa_chat.kernels.gguf_linears import block_linear_from_gguf

    rows, cols = entry.shape
    if b.half_embedding and b.mode != "none" and entry.type_name in ("F16", "BF16"):
        return GGUFEmbedding(raw, entry.type_id, rows, cols, b.dtype)
    if b.mode == "none" or entry.type_id in FLOAT_TYPES:
        weight = dequantize_raw(entry.type_id, raw, (rows, cols)).to(b.dtype)
        return nn.Embedding.from_pretrained(weight, freeze=True, padding_idx=padding_idx)
    b.stored[entry.type_name] += 1
    table = block_linear_from_gguf(entry.type_name, raw, rows, cols) if entry.type_name == "Q8_0" else None
    if isinstance(table, Q80Linear):  # the C row lookup (BlockEmbedding) reads these blocks
        lookup = BlockEmbedding(table, padding_idx)
        lookup.add_module("blocks", table)  # owned here (BlockEmbedding leaves its table to a tied lm_head)
        return lookup
    return GGUFEmbedding(raw, entry.type_id, rows, cols, b.dtype)


def _set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


@dataclass
class WeightsOptions:
    """How a backbone's weights are built from a file: the quantization asked, the compute dtype, the list the
    user's notes go to, the progress line, and whether an F16/BF16 token embedding stays as stored (see _Build;
    False for Hydra heads, whose C drafter reads an fp32 table)."""

    quant: str
    dtype: torch.dtype
    notes: list[str]
    progress: Progress | None = None
    half_embedding: bool = False


def load_gguf_backbone(gguf: Path, folder: Path, device: torch.device, options: WeightsOptions) -> tuple[Any, str]:
    """(the *ForCausalLM built from the file's tensors, the quantization label: "gguf" for auto)."""
    quant, dtype, notes, progress = options.quant, options.dtype, options.notes, options.progress
    half_embedding = options.half_embedding
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from medusa_chat.kernels.cpu_linears import check_row_invariant
    from medusa_chat.model.sources.gguf_names import reverse_permute_rows

    if device.type != "cpu":
        raise DeviceError(f"{gguf.name}: GGUF files run on the CPU here; pass --device cpu (or auto)")
    if quant not in ("auto", "none", "int4", "int8"):
        raise DeviceError(
            f"--quant {quant} does not apply to a GGUF file: use auto (its blocks as stored), int4, int8 or none"
        )
    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in SUPPORTED_ARCHS:
        raise ModelNotFoundError(f"{gguf.name}: model type {config.model_type!r} is not supported")
    table = read_table(gguf)
    b = _Build("gguf" if quant == "auto" else quant, dtype, Counter(), Counter(), half_embedding=half_embedding)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with torch.device("meta"):
        model = cls._from_config(config, attn_implementation="sdpa", dtype=dtype)
    body = model.model
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    tied = "output.weight" not in table
    permuted = config.model_type in PERMUTED_QK
    biases: dict[str, torch.Tensor] = {}  # "model.layers.N.self_attn.q_proj" -> its bias (Qwen2)
    rope_freqs: torch.Tensor | None = None
    shared = False  # a tied lm_head whose blocks the embedding looks its rows up in (one copy for both)
    padding_idx = body.embed_tokens.padding_idx
    if progress:
        kinds = Counter(e.type_name for e in table.values())
        progress(
            f"Loading {gguf.name} tensor by tensor: " + ", ".join(f"{n} {k}" for k, n in kinds.most_common())
        )
    with gguf.open("rb") as f:
        for entry in table.values():
            parts = entry.name.split(".")
            rows = entry.shape[0]
            raw = read_tensor_bytes(f, entry)
            if entry.name == "token_embd.weight":
                embed = _embedding(entry, raw.reshape(rows, -1), padding_idx, b)
                model.set_input_embeddings(embed)
                table_blocks = getattr(embed, "blocks", None)
                if tied and table_blocks is not None:  # one Q8_0 table serves both: the lm_head owns it
                    del embed._modules["blocks"]
                    check_row_invariant(table_blocks, dtype)
                    model.lm_head, shared = table_blocks, True
                elif tied:
                    model.lm_head = _linear(entry, raw.reshape(rows, -1), True, b)
            elif entry.name == "output.weight":
                model.lm_head = _linear(entry, raw.reshape(rows, -1), True, b)
            elif entry.name == "output_norm.weight":
                body.norm.weight = _param(entry, raw, dtype)
            elif len(parts) == 4 and parts[0] == "blk" and parts[2] in LINEARS and parts[3] == "weight":
                raw2 = raw.reshape(rows, -1)
                # llama.cpp's rotary row order -> transformers'
                if permuted and parts[2] in ("attn_q", "attn_k"):
                    raw2 = np.ascontiguousarray(
                        reverse_permute_rows(raw2, heads if parts[2] == "attn_q" else kv_heads)
                    )
                _set_module(
                    model, f"model.layers.{parts[1]}.{LINEARS[parts[2]]}", _linear(entry, raw2, False, b)
                )
            elif len(parts) == 4 and parts[0] == "blk" and parts[2] in QKV_BIASES and parts[3] == "bias":
                if permuted:  # no Llama-family file has them (their rows would need the rotary permutation)
                    raise ModelNotFoundError(
                        f"{gguf.name}: tensor {entry.name} has no place in a {config.model_type} model"
                    )
                # fp32 as the step adds it (F32 in llama.cpp's files; a 16-bit one is widened exactly)
                path = f"model.layers.{parts[1]}.self_attn.{QKV_BIASES[parts[2]]}"
                biases[path] = dequantize_raw(entry.type_id, raw, entry.shape).to(torch.float32)
            elif len(parts) == 4 and parts[0] == "blk" and parts[2] in NORMS and parts[3] == "weight":
                if "." in NORMS[parts[2]] and config.model_type not in QK_NORMED:
                    raise ModelNotFoundError(
                        f"{gguf.name}: tensor {entry.name} has no place in a {config.model_type} model"
                    )
                layer = body.layers[int(parts[1])]
                layer.get_submodule(NORMS[parts[2]]).weight = _param(entry, raw, dtype)
            elif entry.name == "rope_freqs.weight":  # Llama 3.1+: the "llama3" scaling as per-pair factors
                rope_freqs = dequantize_raw(entry.type_id, raw, entry.shape).to(torch.float32)
            else:
                raise ModelNotFoundError(
                    f"{gguf.name}: tensor {entry.name} has no place in a {config.model_type} model"
                )
            del raw
    _attach_biases(model, biases, config.model_type in BIASED_QKV, gguf)
    with torch.device("cpu"):  # its buffers were made on meta: computed again, as from_pretrained does
        body.rotary_emb = type(body.rotary_emb)(config=config)
    if rope_freqs is not None:
        _scale_rotary(body.rotary_emb, rope_freqs, gguf, notes)
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ModelNotFoundError(f"{gguf.name} lacks tensors for {', '.join(missing[:4])}: incomplete file?")
    model.eval().requires_grad_(False)
    config.tie_word_embeddings = False  # the lm_head is its own module now
    set_tied_lm_head(model, tied and not shared)  # weight_accounting: count a separate tied copy once
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    _notes(gguf, b, notes)
    _release_memory()
    return model, "gguf" if quant == "auto" else quant


def _attach_biases(model: nn.Module, biases: dict[str, torch.Tensor], expected: bool, gguf: Path) -> None:
    """Put each q/k/v bias on its projection: the projection module becomes a BlockLinearWithBias (the block
    or packed linear, then the bias added in fp32), which every forward calls (the transformers forward, the
    lean one); the native step takes the two apart and adds the bias in C (block_forward.native_forward_for).
    A model whose projections have biases (`expected`: Qwen2's q/k/v) and a file without them is refused: no
    silent zero bias."""
    from medusa_chat.kernels.cpu_linears import BlockLinearWithBias

    for path, sub in list(model.named_modules()):
        if path.rsplit(".", 1)[-1] not in QKV_BIASES.values():
            continue
        bias = biases.pop(path, None)
        if bias is None and expected:
            raise ModelNotFoundError(f"{gguf.name} lacks the tensor for {path}.bias: incomplete file?")
        if bias is None:
            continue
        if bias.shape != (sub.out_features,):
            raise ModelNotFoundError(
                f"{gguf.name}: {path}.bias has {tuple(bias.shape)} values, "
                f"the projection {sub.out_features} rows"
            )
        _set_module(model, path, BlockLinearWithBias(sub, bias))
    if biases:
        names = ", ".join(sorted(biases)[:4])
        raise ModelNotFoundError(f"{gguf.name}: biases for {names} have no projection")


def _scale_rotary(rotary: nn.Module, freqs: torch.Tensor, gguf: Path, notes: list[str]) -> None:
    """A file's rope_freqs (llama.cpp's converter writes Llama 3.1's "llama3" RoPE scaling as one factor per
    rotary pair, and no scaling keys): ggml divides each pair's frequency by its factor, so the rotary module's
    inverse frequencies are divided by it here (the lean forward and the native step both read that module). A
    config that already scales (a checkpoint folder's rope_scaling) keeps its own."""
    if getattr(rotary, "rope_type", "default") != "default":
        notes.append(f"the file's rope_freqs tensor is not used (the config's {rotary.rope_type} scaling applies)")
        return
    inv = rotary.original_inv_freq
    if freqs.shape != inv.shape:
        raise ModelNotFoundError(
            f"{gguf.name}: rope_freqs has {tuple(freqs.shape)} values, the rotary {tuple(inv.shape)} pairs"
        )
    scaled = (inv / freqs).to(inv.dtype)
    rotary.inv_freq = scaled
    rotary.original_inv_freq = scaled.clone()
    notes.append("rotary frequencies scaled by the file's rope_freqs (Llama 3.1-style long-context RoPE)")


def _param(entry: TensorEntry, raw: np.ndarray, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(dequantize_raw(entry.type_id, raw, entry.shape).to(dtype), requires_grad=False)


def _notes(gguf: Path, b: _Build, notes: list[str]) -> None:
    if b.stored:
        kinds = ", ".join(f"{n} {k}" for k, n in b.stored.most_common())
        notes.append(f"{kinds} tensors of {gguf.name} used as stored")
    if b.requantized:
        kinds = ", ".join(f"{n} {k}" for k, n in b.requantized.most_common())
        notes.append(f"no block kernel for {kinds} here: dequantized and quantized again ({b.mode})")
    notes.extend(sorted(b.refused))
    if b.float_bytes:
        notes.append(
            f"--quant none: the file's blocks dequantized to {b.float_bytes / 2**30:.1f} GB of float weights "
            f"({gguf.stat().st_size / 2**30:.1f} GB file); --quant auto uses them as stored"
        )


def _release_memory() -> None:
    """Hand the freed load buffers back to the OS (glibc keeps freed heap memory otherwise)."""
    from medusa_chat.model.forward.block_forward import trim_heap

    gc.collect()
    trim_heap()
