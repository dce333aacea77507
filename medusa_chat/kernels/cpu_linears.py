"""Row-invariant linears for CPU decoding: oneDNN-packed fp32/bf16, weight-only int8 and int4 (torch's kernels),
a block linear with a float bias, and the row-invariance check every CPU linear passes before it is used.

Exactness first: a tree step computes many rows at once, the plain loop one. Tree decoding reproduces the plain
loop bit for bit only if every projection gives a row the same bits whether it is computed alone or among
others. PyTorch's default fp32 GEMM does not (MKL takes another kernel for 1-3 rows); oneDNN's packed GEMM and
the weight-only int kernels do. Which of a model's linears become which of these modules is the model layer's
choice (model/forward/cpu_blocks.py: `prepare_cpu_linears`).

Speed: at batch 1 a decoding step reads every weight once, so bytes per weight set the speed on a CPU. torch
ships weight-only kernels for this (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`): the weight stays
packed in memory and is expanded inside the kernel. Both give each row the same bits whether it is computed
alone or among other rows (batch-invariant), which is what lets a tree step reproduce the plain loop exactly;
`check_row_invariant` verifies that once per layer shape at load, and a layer that fails it is refused.

- int4: groups of 32 input weights share a scale and a minimum, `w = d * q + m`, q in 0..15. That is exactly
  GGUF's Q4_1 block, so a file's Q4_1 codes are taken as they are, not re-quantized; float weights are
  quantized by the same rule (quantizers.quantize_q4_1).
  The kernel computes `(q - 8) * scale + zero`; scale = d and zero = m + 8 d give the same weight.
- int8: one symmetric scale per output row (`w = s * q`, q in -127..127).

The activations (and the scales, which the kernels take in the activation dtype) are bfloat16: the fp32
variants of these kernels are reference loops, ~10x slower. bf16 rounds the GGUF's fp16 scales d and m to
8 significant bits; the 4-bit codes themselves are the file's.
"""

from __future__ import annotations

import torch
from torch import nn

from medusa_chat.errors import MedusaChatError
from medusa_chat.kernels.quantizers import QK, quantize_int8, quantize_q4_1, quantize_q8_0

GROUP = QK  # GGUF's block size, and the int4 kernel's group size
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


def set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put `module` at the dotted `path` inside `root`, in place of what was there."""
    parent_path, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent_path) if parent_path else root, name, module)


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
    from medusa_chat.kernels.block_linears import BlockLinear, Q41Linear

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

    from medusa_chat.kernels.block_linears import Q80Linear

    out = copy.deepcopy(module)
    for path, sub in list(out.named_modules()):
        if type(sub) is nn.Linear and sub.weight.dtype == torch.float32 and sub.in_features % QK == 0:
            set_module(out, path, BlockLinearWithBias(Q80Linear(*quantize_q8_0(sub.weight)), sub.bias))
    return out



_INVARIANT: dict[tuple[str, int, int, torch.dtype], int] = {}  # checked (kind, shape, dtype) -> min_rows
PAD_TRIES = (1, 2, 4, 16)  # PackedLinear.min_rows tried in order: the smallest padding that is row-invariant


def check_row_invariant(linear: nn.Module, dtype: torch.dtype, rows: int = 16) -> None:
    """Refuse a kernel whose row results depend on how many rows are computed together (then a tree step
    could not reproduce the plain loop), or a block kernel that misses its known answer (known_answers.py).
    Checked once per (kind, shape, dtype). A PackedLinear first gets the
    smallest zero-row padding (`min_rows`) under which it is row-invariant, if one exists."""
    from medusa_chat.kernels.block_linears import BlockLinear

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
