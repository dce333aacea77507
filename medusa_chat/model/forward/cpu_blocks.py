"""A transformers model's linears as row-invariant CPU modules: which projection becomes which kernel module
(kernels/cpu_linears.py, kernels/block_linears.py), the lm_head and a tied embedding, and what the swapped
modules weigh.

Exactness first: a tree step computes many rows at once, the plain loop one, so every projection must give a
row the same bits whether it is computed alone or among others. `prepare_cpu_linears` swaps the decoder's
projections (and the lm_head) for such modules in the model itself, so the transformers forward, HF generate
and the lean forward all run the same kernels, and the original float weight is dropped (no second copy stays
resident). For the embedded model (SmolLM2-135M-Instruct.Q4_1.gguf) the file's own Q4_1 codes are taken as
they are (model/sources/gguf_names.py, `gguf_blocks`), not re-quantized.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from medusa_chat.errors import MedusaChatError
from medusa_chat.kernels.block_linears import BlockEmbedding, Q41Linear, Q80Linear
from medusa_chat.kernels.cbind import available
from medusa_chat.kernels.cpu_linears import (
    GROUP,
    QUANT_MODES,
    Int4Linear,
    Int8Linear,
    PackedLinear,
    can_pack,
    check_row_invariant,
    set_module,
)
from medusa_chat.kernels.known_answers import kernels_agree
from medusa_chat.kernels.quantizers import quantize_int8, quantize_q4_1, quantize_q8_0

if TYPE_CHECKING:  # (a type only: forward/ imports nothing of sources/, which loads models with it)
    from medusa_chat.model.sources.gguf_names import GGUFBlocks


def block_module(mode: str, weight: torch.Tensor | None, blocks: tuple | None, lm_head: bool) -> nn.Module:
    """The block linear for a projection: the file's blocks when given, else quantized here with the file
    format's own rule (Q4_1 for int4 projections, Q8_0 for int8 and for every lm_head)."""
    if blocks is not None:
        return Q41Linear(*blocks[1:]) if blocks[0] == "q4_1" else Q80Linear(*blocks[1:])
    if mode == "int4" and not lm_head:
        return Q41Linear(*quantize_q4_1(weight))
    return Q80Linear(*quantize_q8_0(weight))


def prepare_cpu_linears(
    causal_lm: nn.Module,
    mode: str,
    prebuilt: GGUFBlocks | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Swap the decoder layers' projections and the lm_head for row-invariant CPU modules, in place.

    mode "none": oneDNN-packed dense (fp32, or bf16 where the CPU has oneDNN bf16); "int8" / "int4":
    weight-only quantized, `prebuilt` ({module path: linear}, the GGUF's own Q4_1 blocks) first, the rest
    quantized here. With int4/int8 the lm_head becomes int8 per row (its argmax decides every token, so it keeps
    8 bits), a module of its own; a tied embedding whose float table is exactly the lm_head's Q8_0 blocks (the
    embedded GGUF) is then looked up in those blocks (`share_tied_embedding`), else it keeps its float table.
    Returns a summary {mode, replaced, from_file, kept_float, refused}; kept_float lists projections left as
    they were whose GEMM is not row-invariant here (tree steps then equal the plain loop only up to rounding);
    refused: why the block kernels were not used ("" when they were, or were not needed), see known_answers.py.
    """
    if mode not in ("none", *QUANT_MODES):
        raise MedusaChatError(f"unknown CPU quantization {mode!r} (use none, int4 or int8)")
    prebuilt = prebuilt or {}
    block_kernels = available()  # our AVX2 block kernels; else torch's weight-only kernels
    refused = ""
    if block_kernels and mode != "none":
        # a block kernel that misses its known answer on this CPU is not used: torch's kernels instead
        refused = kernels_agree((Q41Linear, Q80Linear) if mode == "int4" else (Q80Linear,))
        block_kernels = not refused
        if refused and progress:
            progress(f"  {refused}")
    layers = causal_lm.get_submodule("model.layers")
    done, from_file, kept = 0, 0, []
    targets = [
        (f"model.layers.{i}.{n}", m) for i, layer in enumerate(layers) for n, m in layer.named_modules()
    ]
    targets.append(("lm_head", causal_lm.get_output_embeddings()))
    for path, sub in targets:
        if type(sub) is not nn.Linear:
            continue
        blocks = prebuilt.get(path)
        new: nn.Module | None = None
        if blocks is not None and tuple(blocks[1].shape) != tuple(sub.weight.shape):
            raise MedusaChatError(
                f"{path}: the GGUF's weight is {tuple(blocks[1].shape)}, the model's {tuple(sub.weight.shape)}"
            )
        if mode != "none" and sub.bias is None and sub.in_features % GROUP == 0 and block_kernels:
            new = block_module(mode, sub.weight, blocks, path == "lm_head")
            from_file += blocks is not None
        elif mode == "none" or sub.bias is not None:
            new = PackedLinear(sub) if can_pack(sub) else None
        elif path == "lm_head" or mode == "int8":
            new = Int8Linear(*quantize_int8(sub.weight))
        elif sub.in_features % GROUP == 0:
            new = Int4Linear(*quantize_q4_1(sub.weight))
        if new is None:  # no kernel of ours: keep the module if its own GEMM is row-invariant here
            try:
                check_row_invariant(sub, sub.weight.dtype)
            except MedusaChatError:
                kept.append(path)  # tree steps with it are exact only up to rounding
            continue
        check_row_invariant(new, sub.weight.dtype)
        set_module(causal_lm, path, new)
        done += 1
    tied = bool(getattr(causal_lm.config, "tie_word_embeddings", False))
    if mode != "none" and hasattr(causal_lm.config, "tie_word_embeddings"):
        causal_lm.config.tie_word_embeddings = False  # the lm_head is its own (quantized) module now
    # (the lm_head's blocks are the only copy where they serve the embedding too: counted once, there)
    set_tied_lm_head(causal_lm, tied and not share_tied_embedding(causal_lm))
    if progress:
        progress(
            f"  {done} projections as {mode if mode != 'none' else 'packed dense'} ({from_file} from the file)"
        )
    return {"mode": mode, "replaced": done, "from_file": from_file, "kept_float": kept, "refused": refused}


def share_tied_embedding(causal_lm: nn.Module) -> bool:
    """Look the token embedding up in the lm_head's Q8_0 blocks (block_linears.BlockEmbedding) when the model ties them
    and the float table is exactly those blocks dequantized: the embedded GGUF's one Q8_0 token_embd serves both,
    and its fp32 copy (113 MB) then goes. Checked element for element first, so the lookups give the same bits;
    False (nothing changed) otherwise."""
    head, embed = causal_lm.get_output_embeddings(), causal_lm.get_input_embeddings()
    if not isinstance(head, Q80Linear) or type(embed) is not nn.Embedding:
        return False
    weight = embed.weight
    same_shape = tuple(weight.shape) == (head.out_features, head.in_features)
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not same_shape:
        return False
    lookup = BlockEmbedding(head, embed.padding_idx)
    with torch.no_grad():
        for r in range(0, head.out_features, 8192):  # the dequantized rows in slices: no second full table
            if not torch.equal(
                lookup(torch.arange(r, min(r + 8192, head.out_features))), weight[r : r + 8192]
            ):
                return False
    causal_lm.set_input_embeddings(lookup)
    return True


def set_tied_lm_head(model: nn.Module, tied: bool) -> None:
    """Record that `model`'s lm_head is a separate copy of its tied token embedding (True), which
    `weight_accounting` counts once, as the embedding's weight."""
    model._medusa_tied_lm_head = tied


def weight_accounting(model: nn.Module) -> tuple[int, int]:
    """(weights, bytes) that nn.Module's own counters miss in the swapped projections: their logical weight
    count (none of them holds a Parameter) and a packed dense weight's bytes (held outside the buffers)."""
    weights = extra = 0
    # a tied lm_head is the embedding's weight: counted once as a parameter (its packed copy still costs bytes)
    tied_head = model.get_output_embeddings() if getattr(model, "_medusa_tied_lm_head", False) else None
    for m in model.modules():
        logical = m.in_features * m.out_features if hasattr(m, "in_features") else 0
        if isinstance(m, PackedLinear):
            extra += logical * torch.finfo(m.dtype).bits // 8
        elif not (hasattr(m, "dequantized") and not list(m.parameters(recurse=False))):
            continue  # not a swapped projection
        weights += 0 if m is tied_head else logical  # quantized buffers are already in the footprint
    return weights, extra
