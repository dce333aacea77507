"""Row-invariant linears for CPU decoding: oneDNN-packed fp32/bf16, weight-only int8 and int4 (the embedded
GGUF's own 4-bit blocks).

Exactness first: a tree step computes many rows at once, the plain loop one. Tree decoding reproduces the plain
loop bit for bit only if every projection gives a row the same bits whether it is computed alone or among
others. PyTorch's default fp32 GEMM does not (MKL takes another kernel for 1-3 rows); oneDNN's packed GEMM and
the weight-only int kernels do. `prepare_cpu_linears` swaps the decoder's projections (and the lm_head) for
such modules in the model itself, so the transformers forward, HF generate and the lean forward all run the
same kernels, and the original float weight is dropped (no second copy stays resident).

Speed: at batch 1 a decoding step reads every weight once, so bytes per weight set the speed on a CPU. torch
ships weight-only kernels for this (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`): the weight stays
packed in memory and is expanded inside the kernel. Both give each row the same bits whether it is computed
alone or among other rows (batch-invariant), which is what lets a tree step reproduce the plain loop exactly;
`check_row_invariant` verifies that once per layer shape at load, and a layer that fails it is refused.

- int4: groups of 32 input weights share a scale and a minimum, `w = d * q + m`, q in 0..15. That is exactly
  GGUF's Q4_1 block, so for the embedded model (SmolLM2-135M-Instruct.Q4_1.gguf) the codes are taken from the
  file as they are (`gguf_blocks`), not re-quantized. Other models are quantized the same way here.
  The kernel computes `(q - 8) * scale + zero`; scale = d and zero = m + 8 d give the same weight.
- int8: one symmetric scale per output row (`w = s * q`, q in -127..127).

The activations (and the scales, which the kernels take in the activation dtype) are bfloat16: the fp32
variants of these kernels are reference loops, ~10x slower. bf16 rounds the GGUF's fp16 scales d and m to
8 significant bits; the 4-bit codes themselves are the file's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from medusa_chat.errors import MedusaChatError

GROUP = 32  # GGUF's block size, and the int4 kernel's group size
QUANT_MODES = ("int4", "int8")
ACT_DTYPE = torch.bfloat16


class QuantizedLinear(nn.Module):
    """A weight-only quantized `nn.Linear` (no bias): `forward(x [..., K]) -> [..., N]` in x's dtype."""

    mode = ""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features

    def _mm(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self._mm(x.reshape(-1, shape[-1]).to(ACT_DTYPE))
        return out.view(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


class Int4Linear(QuantizedLinear):
    mode = "int4"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> None:
        """codes [N, K] ints in 0..15; scale, minimum [N, K / 32] (w = scale * code + minimum)."""
        n, k = codes.shape
        if k % GROUP:
            raise MedusaChatError(f"int4 needs input features divisible by {GROUP} (got {k})")
        super().__init__(k, n)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        scale32, min32 = scale.float(), minimum.float()
        # [K / group, N, 2]: the kernel's (scale, zero) per group with w = (q - 8) * scale + zero
        sz = torch.stack([scale32, min32 + 8 * scale32], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz.to(ACT_DTYPE))

    def _mm(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.packed, GROUP, self.scales_and_zeros)

    def dequantized(self) -> torch.Tensor:
        """The float weight the kernel computes with (for tests and the quantization error report)."""
        eye = torch.eye(self.in_features, dtype=ACT_DTYPE)
        return self._mm(eye).t().float()


class Int8Linear(QuantizedLinear):
    mode = "int8"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """codes [N, K] int8; scale [N] (w = scale * code)."""
        n, k = codes.shape
        super().__init__(k, n)
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(ACT_DTYPE))

    def _mm(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2d, self.codes, self.scale)


QUANTIZE_CHUNK = 1 << 22  # weights quantized at a time (quantize_q4_1): the float temporaries stay ~16 MB


def quantize_q4_1(
    weight: torch.Tensor,
    codes_dtype: torch.dtype = torch.int32,
    give_back: Callable[[torch.Tensor], object] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of 32 (GGUF Q4_1's rule): codes [N, K], scale and minimum [N, K / 32].

    In chunks of rows (each row's groups are quantized on their own: the same bits), so no fp32 copy of a whole
    weight exists: a 7B draft's 32,000 x 4,096 head in 16 bits would otherwise make ~0.5 GB of fp32 and its
    temporaries several times that. `codes_dtype` torch.uint8 keeps the codes at a byte each (Q41Linear takes
    them so); `give_back` is called with each chunk of `weight` once it is read (mapped_weights.release: a
    file-mapped weight is then never resident whole)."""
    n, k = weight.shape
    rows = max(1, QUANTIZE_CHUNK // max(k, 1))
    codes = torch.empty(n, k, dtype=codes_dtype, device=weight.device)
    scale = torch.empty(n, k // GROUP, device=weight.device)
    low = torch.empty(n, k // GROUP, device=weight.device)
    for r in range(0, n, rows):
        g = weight[r : r + rows].detach().float().view(-1, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        sc = (hi - lo) / 15
        inv = torch.where(sc > 0, 1 / sc, torch.zeros_like(sc))
        codes[r : r + rows] = ((g - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(codes_dtype).view(-1, k)
        scale[r : r + rows], low[r : r + rows] = sc, lo
        if give_back is not None:
            give_back(weight[r : r + rows])
    # the file stores d and m as fp16 (and so does the block kernel, qgemm.py): round them as the file would
    return codes, scale.half().float(), low.half().float()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


# ------------------------------------------------------------------------------------------------------------
# The embedded model's GGUF: Q4_1 blocks as they are
# ------------------------------------------------------------------------------------------------------------
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


def _reverse_permute_rows(x: torch.Tensor, n_head: int) -> torch.Tensor:
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
                codes, d, m = (_reverse_permute_rows(x, n) for x in (codes, d, m))
            out[f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}"] = ("q4_1", codes, d, m)
        elif t.name == "output.weight" or (t.name == "token_embd.weight" and "output.weight" not in tensors):
            if t.type_name == "Q8_0":
                out["lm_head"] = ("q8_0", *unpack_q8_0(t.data, rows, cols))
    return out


GGUF_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def gguf_state_dict(path: Path, config: Any) -> dict[str, torch.Tensor]:
    """The float32 state dict (transformers' Llama names) of a Llama-family GGUF: every tensor dequantized, the
    q/k rows back in transformers' rotary order (Llama/Mistral files; a Qwen2 file keeps transformers' order and
    adds its q/k/v biases); a tied lm_head is left to the embedding."""
    from medusa_chat.kernels.gguf_file import dequantize, read_tensors

    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    permuted = getattr(config, "model_type", "llama") != "qwen2"
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
                w = _reverse_permute_rows(w, heads if parts[2] == "attn_q" else kv_heads)
            state[f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}.{parts[3]}"] = w.contiguous()
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_NORMS:
            state[f"model.layers.{parts[1]}.{GGUF_NORMS[parts[2]]}.weight"] = w
        else:
            raise ValueError(f"{path}: tensor {t.name} has no place in a Llama state dict")
    return state


def gguf_tensor_types(path: Path) -> dict[str, str]:
    from medusa_chat.kernels.gguf_file import read_tensors

    return {t.name: t.type_name for t in read_tensors(path).values()}


# ------------------------------------------------------------------------------------------------------------
# Dense packed linears (fp32 / bf16)
# ------------------------------------------------------------------------------------------------------------
PACK_ROWS = 16  # oneDNN's packing hint (rows per call it optimises for); bitwise results do not depend on it


class PackedLinear(nn.Module):
    """A dense `nn.Linear` as a oneDNN pre-packed GEMM (fp32 or bf16 on CPU). Row-invariant, unlike the default
    fp32 GEMM, and as fast or faster (bf16: ~1.5x on CPUs with native bf16). The float weight is not kept.

    `min_rows`: calls with fewer rows are padded with zero rows to this many. oneDNN may take another kernel
    for a single row (measured on an AMX Xeon: the 1536-wide down projection, 1 row, differs in the last bits
    from the same row among 2-64 rows; 2+ rows agree); padding the plain step's one row to two keeps every
    call on the multi-row kernel at the price of one zero row. `check_row_invariant` picks the smallest
    padding that makes the module row-invariant on this machine (1: none)."""

    mode = "dense"
    min_rows = 1

    def __init__(self, module: nn.Linear) -> None:
        super().__init__()
        w = module.weight.detach()
        self.in_features, self.out_features = module.in_features, module.out_features
        self.dtype = w.dtype
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
        self.bias = None if module.bias is None else module.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows >= self.min_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        flat = torch.cat(
            [x.reshape(rows, self.in_features), x.new_zeros(self.min_rows - rows, self.in_features)]
        )
        out = torch.ops.mkldnn._linear_pointwise(flat, self._packed, self.bias, "none", [], "")
        return out[:rows].reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float weight [out, in] (exact: each entry is 1 * w + 0 * ...)."""
        eye = torch.eye(self.in_features, dtype=self.dtype)
        out = self.forward(eye)
        return (out - self.bias if self.bias is not None else out).t()

    def rows(self, index: torch.Tensor) -> nn.Module:
        """A linear computing only the output rows `index`."""
        lin = nn.Linear(self.in_features, len(index), bias=False, dtype=self.dtype)
        lin.weight.data.copy_(self.dequantized().index_select(0, index))
        out = PackedLinear(lin)
        out.min_rows = self.min_rows
        return out


def can_pack(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    if type(module) is not nn.Linear or w is None or w.device.type != "cpu":
        return False
    if w.dtype == torch.float32:
        return True
    if w.dtype == torch.bfloat16:
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return False


def _quant_rows(self: QuantizedLinear, index: torch.Tensor) -> nn.Module:
    if isinstance(self, Int8Linear):
        return Int8Linear(self.codes.index_select(0, index), self.scale.index_select(0, index).float())
    lin = nn.Linear(self.in_features, len(index), bias=False)
    lin.weight.data.copy_(self.dequantized().index_select(0, index))
    return Int8Linear(*quantize_int8(lin.weight))


QuantizedLinear.rows = _quant_rows  # type: ignore[attr-defined]


def linear_rows(module: nn.Module, index: torch.Tensor) -> nn.Module:
    """A module computing only output rows `index` of `module` (Hydra's draft-vocabulary projection)."""
    if hasattr(module, "rows"):
        return module.rows(index)
    weight = module.weight
    lin = nn.Linear(weight.shape[1], len(index), bias=False, device=weight.device, dtype=weight.dtype)
    lin.weight.data.copy_(weight.detach().index_select(0, index.to(weight.device)))
    lin.requires_grad_(False)
    return lin


# ------------------------------------------------------------------------------------------------------------
# Putting them into a model
# ------------------------------------------------------------------------------------------------------------
def _set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent_path) if parent_path else root, name, module)


def _block_module(mode: str, weight: torch.Tensor | None, blocks: tuple | None, lm_head: bool) -> nn.Module:
    """The block-kernel module (qgemm.py) for a projection: the file's blocks when given, else quantized here
    with the file format's own rule (Q4_1 for int4 projections, Q8_0 for int8 and for every lm_head)."""
    from medusa_chat.kernels.qgemm import Q41Linear, Q80Linear, quantize_q8_0

    if blocks is not None:
        return Q41Linear(*blocks[1:]) if blocks[0] == "q4_1" else Q80Linear(*blocks[1:])
    if mode == "int4" and not lm_head:
        return Q41Linear(*quantize_q4_1(weight))
    return Q80Linear(*quantize_q8_0(weight))


class BlockLinearWithBias(nn.Module):
    """A block-kernel linear plus a float bias (the heads' linears have biases; the kernel has none)."""

    def __init__(self, block: nn.Module, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.block = block
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return y if self.bias is None else y.add_(self.bias)


def block_q4_rows(module: nn.Module) -> nn.Module:
    """A Q4_1 block linear of `module`'s weight (a draft-only projection: 4 bits are enough to rank guesses)."""
    from medusa_chat.kernels.qgemm import QK, BlockLinear, Q41Linear

    if not isinstance(module, BlockLinear) or module.in_features % QK:
        return module
    return Q41Linear(*quantize_q4_1(module.dequantized()))


def block_quantized_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` (the Hydra heads) whose fp32 linears run as Q8_0 blocks on the block kernel.

    Why: drafting a tree depth reads the cell and two ResBlocks (~5 MB in fp32) at batch 1, which on a CPU
    costs about as much as the backbone's extra tree rows; in 8 bits it reads a quarter. Drafts only choose
    which tokens the backbone verifies, so the output is unchanged (exactness never depends on the drafter);
    Q8_0's per-32 scales keep the guesses essentially the fp32 heads'. The original module is left as it is."""
    import copy

    from medusa_chat.kernels.qgemm import QK, Q80Linear, quantize_q8_0

    out = copy.deepcopy(module)
    for path, sub in list(out.named_modules()):
        if type(sub) is nn.Linear and sub.weight.dtype == torch.float32 and sub.in_features % QK == 0:
            _set_module(out, path, BlockLinearWithBias(Q80Linear(*quantize_q8_0(sub.weight)), sub.bias))
    return out


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
    from medusa_chat.kernels.qgemm import available

    block_kernels = available()  # our AVX2 block kernels; else torch's weight-only kernels
    refused = ""
    if block_kernels and mode != "none":
        from medusa_chat.kernels.known_answers import kernels_agree
        from medusa_chat.kernels.qgemm import Q41Linear, Q80Linear

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
            new = _block_module(mode, sub.weight, blocks, path == "lm_head")
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
        _set_module(causal_lm, path, new)
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
    """Look the token embedding up in the lm_head's Q8_0 blocks (qgemm.BlockEmbedding) when the model ties them
    and the float table is exactly those blocks dequantized: the embedded GGUF's one Q8_0 token_embd serves both,
    and its fp32 copy (113 MB) then goes. Checked element for element first, so the lookups give the same bits;
    False (nothing changed) otherwise."""
    from medusa_chat.kernels.qgemm import BlockEmbedding, Q80Linear

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


_INVARIANT: dict[tuple[str, int, int, torch.dtype], int] = {}  # checked (kind, shape, dtype) -> min_rows
PAD_TRIES = (1, 2, 4, 16)  # PackedLinear.min_rows tried in order: the smallest padding that is row-invariant


def check_row_invariant(linear: nn.Module, dtype: torch.dtype, rows: int = 16) -> None:
    """Refuse a kernel whose row results depend on how many rows are computed together (then a tree step
    could not reproduce the plain loop), or a block kernel that misses its known answer (known_answers.py).
    Checked once per (kind, shape, dtype). A PackedLinear first gets the
    smallest zero-row padding (`min_rows`) under which it is row-invariant, if one exists."""
    from medusa_chat.kernels.qgemm import BlockLinear

    if isinstance(linear, BlockLinear):  # and it must compute the right values: its kind's known answer
        from medusa_chat.kernels.known_answers import check_known_answer

        check_known_answer(type(linear))
    key = (type(linear).__name__, linear.in_features, linear.out_features, dtype)
    device = getattr(getattr(linear, "weight", None), "device", torch.device("cpu"))
    if key in _INVARIANT:
        if isinstance(linear, PackedLinear):
            linear.min_rows = _INVARIANT[key]
        return
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, linear.in_features, generator=gen).to(device, dtype)
    first_bad = 0
    for pad in PAD_TRIES if isinstance(linear, PackedLinear) else (1,):
        if isinstance(linear, PackedLinear):
            linear.min_rows = pad
        with torch.inference_mode():
            full = linear(x)
            bad = [n for n in (1, 2, 3, 5) if not torch.equal(linear(x[:n]), full[:n])]
        if not bad:
            _INVARIANT[key] = pad
            return
        first_bad = first_bad or bad[0]
    if isinstance(linear, PackedLinear):
        linear.min_rows = 1
    raise MedusaChatError(
        f"the {type(linear).__name__} kernel on this CPU gives different bits for a row computed "
        f"among {first_bad} rows: tree decoding could not be exact with it; use another --quant"
    )
