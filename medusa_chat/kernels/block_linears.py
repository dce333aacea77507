"""GGUF-block linears (Q4_1, Q8_0) on the CPU with a small AVX2 kernel of our own (csrc/qgemm.c), and token
embeddings looked up in such blocks.

Why a kernel: see csrc/qgemm.c. In short, a tree step reads each weight block once for all its rows, and the
weights are the file's own blocks (Q4_1 for the projections, Q8_0 for the embedding / lm_head), dequantized
exactly as the float model converted from the file has them. The modules keep their weights in the kernel's
interleaved layout (`interleave_q4_1`, `interleave_q8_0`); `fuse` lays several of one kind end to end.
"""

from __future__ import annotations

import torch
from torch import nn

from medusa_chat.kernels.cbind import load, unavailable_reason
from medusa_chat.kernels.quantizers import QK, QUANTIZE_CHUNK


class BlockLinear(nn.Module):
    """A bias-free linear whose weight is stored as GGUF blocks; fp32 in, fp32 out (other dtypes converted)."""

    kind = ""
    c_kind = -1  # decoder.h BLin.kind: how the native C step calls this kind
    buffer_names: tuple[str, ...] = ()  # the weight buffers, rows first (`fuse` concatenates them)

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        if in_features % QK:
            raise ValueError(f"{self.kind} needs in_features divisible by {QK} (got {in_features})")
        lib = load()
        if lib is None:
            raise RuntimeError(f"the qgemm kernel cannot run here: {unavailable_reason()}")
        self._fn = getattr(lib, f"{self.kind}_gemm")
        # rows per interleaved group, the layout of this build's kernel (qgemm.c GW: 16 with 512-bit tiles, else
        # 8); each module records the width its weights were laid out for
        self.group = int(lib.qgemm_group())
        self.in_features, self.out_features = in_features, out_features

    def _call(self, x: int, m: int, y: int) -> None:
        self._fn(x, m, *self._args, y, *self._scratch)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as contiguous fp32 rows [M, K], with activation scratch for M rows."""
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        if x2.shape[0] > self._scratch_rows:
            self._grow_scratch(x2.shape[0])
        return x2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The hot path of a decoding step (7 calls per layer): no per-call allocation but the output.
        shape = x.shape
        x2 = self._rows(x)
        m = x2.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        self._call(x2.data_ptr(), m, y.data_ptr())  # type: ignore[attr-defined]
        return (
            y.view(*shape[:-1], self.out_features)
            if x.dtype == torch.float32
            else y.view(*shape[:-1], self.out_features).to(x.dtype)
        )

    _scratch_rows = 0

    def bind_buffers(self) -> None:
        # (K, the buffers' addresses, N) as plain ints in __dict__: the kernels take them in this order, and
        # reading buffers through nn.Module.__getattr__ costs microseconds per call
        buffers = (getattr(self, name).data_ptr() for name in self.buffer_names)
        self._args = (self.in_features, *buffers, self.out_features)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - nn.Module's signature
        out = super()._apply(fn, recurse)
        self.bind_buffers()  # buffers may have moved: refresh the raw pointers
        return out

    def _grow_scratch(self, rows: int) -> None:
        """Scratch for the 8-bit activation blocks (codes, block scales, scaled sums), kept between calls."""
        rows = max(rows, 16)
        self._qx = torch.empty(2 * rows * self.in_features, dtype=torch.int8)  # codes, and codes + 128 (Q8_0)
        self._dx = torch.empty(2, rows * self.in_features // QK, dtype=torch.float32)
        self._scratch = (self._qx.data_ptr(), self._dx[0].data_ptr(), self._dx[1].data_ptr())
        self._scratch_rows = rows

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


class Q41Linear(BlockLinear):
    """GGUF Q4_1: per 32 weights a scale d and a minimum m, w = d * q + m.

    Stored as the kernel reads it (csrc/qgemm.c, q4_1_tile): output rows in groups (`group`: 16 rows for
    512-bit builds, else 8), each group's blocks interleaved so that one vector load holds 4 codes of every row
    of the group. The buffers keep the shapes of the plain layout (qs [N, K / 2], d and m [N, K / 32])
    and a group occupies the same bytes as its rows, so slicing or concatenating at multiples of the group
    (`fuse`) still works. N is padded to a multiple of the group with
    zero weights, never read back (`out_features` is the true N). d and m are fp16 as in the file: a block costs
    the file's 20 bytes, so a step streams no more bytes than llama.cpp's does (the step is memory-bound).
    """

    kind = "q4_1"
    c_kind = 1
    buffer_names = ("qs", "d", "m")

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        """codes [N, K] in 0..15 (block element order), d and m [N, K / 32]."""
        n, k = codes.shape
        super().__init__(n, k)
        pad = -n % self.group
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, k)])
            d, m = torch.cat([d, d.new_zeros(pad, k // QK)]), torch.cat([m, m.new_zeros(pad, k // QK)])
        # d, m stored as fp16, as in the file
        qs, d8, m8 = interleave_q4_1(codes, d.float(), m.float(), self.group)
        self.register_buffer("qs", qs)
        self.register_buffer("d", d8)
        self.register_buffer("m", m8)
        self.bind_buffers()

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes [N, K], d, m [N, K / 32]) in the plain layout."""
        codes, d, m = deinterleave_q4_1(self.qs, self.d, self.m, self.group)
        n = self.out_features
        return codes[:n], d[:n], m[:n]

    def dequantized(self) -> torch.Tensor:
        codes, d, m = self.blocks()
        w = d[..., None] * codes.float().reshape(self.out_features, -1, QK) + m[..., None]
        return w.reshape(self.out_features, self.in_features)

    def rows(self, index: torch.Tensor) -> Q41Linear:
        codes, d, m = self.blocks()
        return Q41Linear(codes.index_select(0, index), d.index_select(0, index), m.index_select(0, index))


def interleave_q4_1(
    codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain Q4_1 blocks (codes [N, K], N % group == 0; d, m [N, K / 32]) -> the kernel's interleaved layout.

    Within a group of `group` rows and a block b: byte (j, c, t) = code of block element 4j + t of row c (low nibble)
    and of element 16 + 4j + t (high nibble), j, t in 0..3; then the group's d, then their m."""
    n, k = codes.shape
    g, nb = n // group, k // QK
    c = codes.to(torch.uint8).view(g, group, nb, 2, 4, 4)  # [group, row, block, half, j, t]
    packed = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # [group, row, block, j, t]
    qs = packed.permute(0, 2, 3, 1, 4).contiguous().view(n, k // 2)
    d8 = d.view(g, group, nb).transpose(1, 2).to(torch.float16).contiguous().view(n, nb)
    m8 = m.view(g, group, nb).transpose(1, 2).to(torch.float16).contiguous().view(n, nb)
    return qs, d8, m8


def deinterleave_q4_1(
    qs: torch.Tensor, d8: torch.Tensor, m8: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `interleave_q4_1`."""
    n, nb = d8.shape
    g = n // group
    p = qs.reshape(g, nb, 4, group, 4).permute(0, 3, 1, 2, 4)  # [group, row, block, j, t]
    codes = torch.stack([p & 0x0F, p >> 4], dim=3).reshape(n, nb * QK)  # [group, row, block, half, j, t]
    d = d8.reshape(g, nb, group).transpose(1, 2).reshape(n, nb).float()
    m = m8.reshape(g, nb, group).transpose(1, 2).reshape(n, nb).float()
    return codes, d, m


class Q80Linear(BlockLinear):
    """GGUF Q8_0: per 32 weights a scale d, w = d * q, q in -127..127.

    Interleaved in groups of output rows like Q41Linear (qs [N, K], d [N, K / 32] fp16 in the kernel's order),
    plus `s` [N, K / 32] int16: each block's sum of codes (the VNNI product's correction term, qgemm.c)."""

    kind = "q8_0"
    c_kind = 0
    buffer_names = ("qs", "d", "s")

    def __init__(self, codes: torch.Tensor, d: torch.Tensor) -> None:
        n, k = codes.shape
        super().__init__(n, k)
        pad = -n % self.group
        if pad:
            codes, d = torch.cat([codes, codes.new_zeros(pad, k)]), torch.cat([d, d.new_zeros(pad, k // QK)])
        qs, d8, s8 = interleave_q8_0(codes.to(torch.int8), d.float(), self.group)
        self.register_buffer("qs", qs)
        self.register_buffer("d", d8)
        self.register_buffer("s", s8)
        self._argmax = load().q8_0_gemm_argmax  # type: ignore[union-attr]  # BlockLinear checked the kernel
        self.bind_buffers()

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """greedy_tokens(self(x)) [rows] without the outputs ever being written (qgemm.c, q8_0_gemm_argmax: the
        same values, compared in place): for a vocab projection, the greedy tokens of a step. None when the
        kernel does not take this many rows (then compute the outputs)."""
        x2 = self._rows(x)
        m = x2.shape[0]
        out = torch.empty(m, dtype=torch.long)
        k, qs, d, ws, n = self._args
        if not self._argmax(x2.data_ptr(), m, k, qs, d, ws, n, out.data_ptr(), *self._scratch):
            return None
        return out.view(x.shape[:-1])

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [N, K] int8, d [N, K / 32]) in the plain layout."""
        codes, d = deinterleave_q8_0(self.qs, self.d, self.group)
        return codes[: self.out_features], d[: self.out_features]

    def dequantized(self) -> torch.Tensor:
        codes, d = self.blocks()
        # reshape: with a single group the deinterleaved codes can be a strided view
        w = d[..., None] * codes.float().reshape(self.out_features, -1, QK)
        return w.reshape(self.out_features, self.in_features)

    def rows(self, index: torch.Tensor) -> Q80Linear:
        codes, d = self.blocks()
        return Q80Linear(codes.index_select(0, index), d.index_select(0, index))


class RowLookupEmbedding(nn.Module):
    """A token embedding looked up in a block linear's own blocks (`table`), each row dequantized by C as it is
    looked up, so the table is never held a second time in fp32. Subclasses say how a row is read (`_lookup`).

    `weight` is an empty [0, H] fp32 buffer: it answers the dtype/device questions code asks of an embedding,
    and fails loudly where code would read its values."""

    def __init__(self, table: BlockLinear, padding_idx: int | None = None) -> None:
        super().__init__()
        # not a submodule: a tied lm_head owns (and saves) the blocks; a plain attribute keeps a table made for
        # the embedding alone alive
        self.__dict__["table"] = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.padding_idx = padding_idx
        self.register_buffer("weight", torch.empty(0, table.in_features), persistent=False)

    def _lookup(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        out = torch.empty(flat.numel(), self.embedding_dim)
        self._lookup(flat, out)
        return out.view(*ids.shape, self.embedding_dim)


class BlockEmbedding(RowLookupEmbedding):
    """A token embedding looked up in a Q8_0 block linear's own blocks: the lm_head's, when the model ties the
    two and the float table is exactly those blocks dequantized (the embedded GGUF stores one Q8_0 token_embd
    for both; `model.forward.cpu_blocks.share_tied_embedding` checks the equality before swapping). A row is dequantized as it
    is looked up (csrc/qgemm.c, q8_0_rows: d * q, exact in fp32), so the table is not held a second time in fp32
    (49152 x 576: 113 MB for the embedded model)."""

    def __init__(self, table: Q80Linear, padding_idx: int | None = None) -> None:
        lib = load()
        if lib is None:
            raise RuntimeError(f"the qgemm kernel cannot run here: {unavailable_reason()}")
        super().__init__(table, padding_idx)
        self._rows_fn = lib.q8_0_rows

    def _lookup(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        t = self.table
        self._rows_fn(
            t.qs.data_ptr(), t.d.data_ptr(), t.in_features, t.group, flat.data_ptr(), flat.numel(), out.data_ptr()
        )

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the Q8_0 lm_head"


def interleave_q8_0(
    codes: torch.Tensor, d: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain Q8_0 blocks (codes [N, K] int8, N % group == 0; d [N, K / 32]) -> the kernel's interleaved layout:
    within a group of rows and a block, byte (j, c, t) = code of element 4j + t of row c, j in 0..7; then
    the group's d and block sums of codes."""
    n, k = codes.shape
    g, nb = n // group, k // QK
    c = codes.view(g, group, nb, 8, 4)  # [group, row, block, j, t]
    qs = c.permute(0, 2, 3, 1, 4).contiguous().view(n, k)
    # |sum| <= 32 * 127: 16 bits hold it. In chunks of rows: the sum widens its input to int16 first, which for
    # a 7B model's 32,000 x 4,096 head would be a 0.26 GB temporary (peak memory while heads load)
    sums = torch.empty(n, nb, dtype=torch.int16)
    rows = max(1, QUANTIZE_CHUNK // max(k, 1))
    for r in range(0, n, rows):
        sums[r : r + rows] = codes[r : r + rows].view(-1, nb, QK).sum(-1, dtype=torch.int16)
    d8 = d.view(g, group, nb).transpose(1, 2).to(torch.float16).contiguous().view(n, nb)
    s8 = sums.view(g, group, nb).transpose(1, 2).contiguous().view(n, nb)
    return qs, d8, s8


def deinterleave_q8_0(qs: torch.Tensor, d8: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `interleave_q8_0` (the block sums follow from the codes)."""
    n, nb = d8.shape
    g = n // group
    codes = qs.reshape(g, nb, 8, group, 4).permute(0, 3, 1, 2, 4).reshape(n, nb * QK)
    d = d8.reshape(g, nb, group).transpose(1, 2).reshape(n, nb).float()
    return codes, d


def fuse(modules: list[nn.Module]) -> BlockLinear | None:
    """One block linear computing several projections of the same input (q/k/v, gate/up): one kernel call
    instead of three. The originals are rebound to row views of the fused buffers, so no weight is stored
    twice. None unless all are block linears of one kind and input size."""
    first = modules[0] if modules else None
    if not isinstance(first, BlockLinear) or any(
        type(m) is not type(first) or m.in_features != first.in_features for m in modules
    ):
        return None
    cls = type(first)
    if any(m.group != first.group or m.out_features % m.group for m in modules):
        return None  # interleaved groups of rows: only whole groups of one layout can be laid end to end
    fused = cls.__new__(cls)
    BlockLinear.__init__(fused, sum(m.out_features for m in modules), first.in_features)
    fused.group = first.group
    for name in cls.buffer_names:
        whole = torch.cat([getattr(m, name) for m in modules])
        fused.register_buffer(name, whole)
        offset = 0
        for m in modules:
            m._buffers[name] = whole[offset : offset + m.out_features]
            offset += m.out_features
    for m in (*modules, fused):
        m.bind_buffers()
    return fused
