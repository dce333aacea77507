"""A GGUF tensor's own blocks as a block-kernel linear, whatever its type among those real files use: Q4_0, Q4_1,
Q8_0 (csrc/qgemm.c) and the K-quants Q4_K, Q5_K, Q6_K (csrc/kquants.c). No second rounding: each module
computes with the file's codes and factors, and `dequantized()` is bit for bit gguf-py's dequantization of the
same bytes (tests/test_kquants.py).

- Q4_1, Q8_0: the kernel's own formats (block_linears.Q41Linear / Q80Linear), whose layout is a byte permutation of
  the file's blocks (a Q4_1 block's 16 code bytes hold elements j and j + 16, exactly the kernel's byte (j // 4,
  row, j % 4); Q8_0 codes are bytes already; the fp16 scales are the file's bits): the buffers are made by
  reordering bytes, without unpacking codes to integers (3x faster loads, a lower peak; tests check the
  result equals the unpacking path's bit for bit).
- Q4_0 (w = d * (q - 8)): Q4_1 with m = -8 d, exact in fp16 whenever 8 d is finite there (then d * q - 8 d is
  exactly d * (q - 8) in fp32: both terms are multiples of d's last bit, 15 bits wide). A block whose 8 d would
  overflow fp16 (|d| > 8188) makes the tensor Q8_0 with codes q - 8 instead: exact too, twice the bytes.
- Q4_K, Q5_K, Q6_K: `KQuantLinear`, the superblock stream of kquants.c (its header has the layout), repacked
  from the file's bytes a few thousand rows at a time, so a load holds at most one tensor's blocks plus a chunk.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from medusa_chat.errors import DeviceError
from medusa_chat.kernels.block_linears import BlockLinear, Q41Linear, Q80Linear, RowLookupEmbedding
from medusa_chat.kernels.cbind import available, load, unavailable_reason
from medusa_chat.kernels.gguf_file import (
    QK_K,
    KBlocks,
    dequantize_k,
    unpack_k,
    unpack_q4_0,
)
from medusa_chat.kernels.quantizers import QK

SUPPORTED_TYPES: frozenset[str] = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
# kquants.c: stream bytes per superblock and output column; per sub-block of 32: code bytes per column
STREAM_BYTES = {"Q4_K": 148, "Q5_K": 180, "Q6_K": 210}
SUB_BYTES = {"Q4_K": 16, "Q5_K": 20, "Q6_K": 24}
RAW_BYTES = {
    "Q4_K": 144,
    "Q5_K": 176,
    "Q6_K": 210,
}  # the file's bytes per superblock (kq_repack's type order)
CHUNK_ROWS = 2048  # rows unpacked and repacked at a time (bounded scratch however large the tensor)


def _words(bits: np.ndarray) -> np.ndarray:
    """bits [..., 32] (one bit per element of a sub-block) -> [..., 4] bytes: the little-endian 32-bit word with
    element 4j+t at bit 8t+j and element 16+4j+t at bit 8t+4+j (kquants.c): bit i of byte t is element
    4i + t. (Eight vector ORs: faster than np.packbits along a short axis.)"""
    b = bits.reshape(*bits.shape[:-1], 8, 4)  # [i = (half, j), t]
    out = np.zeros(b.shape[:-2] + (4,), np.uint8)
    for i in range(8):
        out |= b[..., i, :] << i
    return out


def _unwords(words: np.ndarray) -> np.ndarray:
    """The inverse of `_words`: [..., 4] bytes -> [..., 32] bits."""
    return np.stack([(words >> i) & 1 for i in range(8)], axis=-2).reshape(*words.shape[:-1], 32)


def _pair_words(hi2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K's bits 4-5 (hi2 [..., 32], 0..3) -> two [..., 4] byte words (kquants.c): byte t of word p holds,
    from bit 0, elements 8p+t, 16+8p+t, 8p+4+t, 20+8p+t (vector 2p's low and high element, then 2p+1's)."""
    v = hi2.reshape(*hi2.shape[:-1], 2, 4, 4)  # [half, j, t]
    return tuple(  # type: ignore[return-value]
        v[..., 0, 2 * p, :]
        | (v[..., 1, 2 * p, :] << 2)
        | (v[..., 0, 2 * p + 1, :] << 4)
        | (v[..., 1, 2 * p + 1, :] << 6)
        for p in (0, 1)
    )


def _unpair_words(w0: np.ndarray, w1: np.ndarray) -> np.ndarray:
    """The inverse of `_pair_words`: -> [..., 32] values 0..3."""
    v = np.empty((*w0.shape[:-1], 2, 4, 4), np.uint8)
    for p, w in enumerate((w0, w1)):
        v[..., 0, 2 * p, :], v[..., 1, 2 * p, :] = w & 3, (w >> 2) & 3
        v[..., 0, 2 * p + 1, :], v[..., 1, 2 * p + 1, :] = (w >> 4) & 3, w >> 6
    return v.reshape(*w0.shape[:-1], 32)


def interleave_k(type_name: str, k: KBlocks, group: int) -> np.ndarray:
    """A K-quant tensor's fields (gguf_file.unpack_k; rows a multiple of `group`) -> kquants.c's stream,
    [rows, cols / 256 * STREAM_BYTES] uint8: each group of rows holds its own bytes, so groups slice and
    concatenate (block_linears.fuse)."""
    codes = k["codes"]
    n, cols = codes.shape
    g, nb, nsb, G = n // group, cols // 32, cols // QK_K, group
    c = codes.reshape(g, G, nb, 2, 4, 4)  # [group, row, block, half, j, t]
    nib = (c[:, :, :, 0] & 0x0F) | ((c[:, :, :, 1] & 0x0F) << 4)
    parts = [nib.transpose(0, 2, 3, 1, 4).reshape(g, nb, G * 16)]
    if type_name == "Q5_K":
        words = _words((codes.reshape(g, G, nb, 32) >> 4) & 1)  # [group, row, block, 4]
        parts.append(words.transpose(0, 2, 1, 3).reshape(g, nb, G * 4))
    elif type_name == "Q6_K":
        for words in _pair_words((codes.reshape(g, G, nb, 32) >> 4) & 3):
            parts.append(words.transpose(0, 2, 1, 3).reshape(g, nb, G * 4))
    sub = np.concatenate(parts, axis=-1).reshape(g, nsb, 8 * SUB_BYTES[type_name] * G)

    def per_column(a: np.ndarray, per: int) -> np.ndarray:  # [n, nsb * per] -> [g, nsb, per * G]
        a = np.ascontiguousarray(a.reshape(g, G, nsb, per).transpose(0, 2, 3, 1))
        return a.view(np.uint8).reshape(g, nsb, -1)

    if type_name == "Q6_K":
        tail = [per_column(k["sc"].view(np.uint8), 16), per_column(k["d"], 1)]
    else:
        tail = [
            per_column(k["sc"], 8),
            per_column(k["m"], 8),
            per_column(k["d"], 1),
            per_column(k["dmin"], 1),
        ]
    return np.concatenate([sub, *tail], axis=-1).reshape(n, nsb * STREAM_BYTES[type_name])


def deinterleave_k(type_name: str, stream: np.ndarray, group: int, cols: int) -> KBlocks:
    """The inverse of `interleave_k`."""
    n = stream.shape[0]
    g, nb, nsb, G = n // group, cols // 32, cols // QK_K, group
    sb = stream.reshape(g, nsb, STREAM_BYTES[type_name] * G)
    sub_bytes = SUB_BYTES[type_name] * G
    sub = sb[..., : 8 * sub_bytes].reshape(g, nb, sub_bytes)
    nib = sub[..., : 16 * G].reshape(g, nb, 4, G, 4).transpose(0, 3, 1, 2, 4)  # [group, row, block, j, t]
    codes = np.stack([nib & 0x0F, nib >> 4], axis=3).reshape(g, G, nb, 32)

    def words(i: int) -> np.ndarray:  # the i-th word vector of a sub-block, [group, row, block, 4]
        return sub[..., (16 + 4 * i) * G : (20 + 4 * i) * G].reshape(g, nb, G, 4).transpose(0, 2, 1, 3)

    if type_name == "Q5_K":
        codes = codes | (_unwords(words(0)) << 4)
    elif type_name == "Q6_K":
        codes = codes | (_unpair_words(words(0), words(1)) << 4)
    tail = sb[..., 8 * sub_bytes :]

    def per_column(off: int, per: int, dtype: type) -> np.ndarray:  # inverse of interleave_k's
        size = per * G * np.dtype(dtype).itemsize
        a = np.ascontiguousarray(tail[..., off : off + size]).view(dtype).reshape(g, nsb, per, G)
        return np.ascontiguousarray(a.transpose(0, 3, 1, 2)).reshape(n, nsb * per)

    out: KBlocks = {"codes": codes.reshape(n, cols)}
    if type_name == "Q6_K":
        out["sc"], out["d"] = per_column(0, 16, np.int8), per_column(16 * G, 1, np.float16)
    else:
        out["sc"], out["m"] = per_column(0, 8, np.uint8), per_column(8 * G, 8, np.uint8)
        out["d"], out["dmin"] = per_column(16 * G, 1, np.float16), per_column(18 * G, 1, np.float16)
    return out


def _pad_rows(k: KBlocks, rows: int) -> KBlocks:
    """Zero rows appended (zero factors: the padding columns compute 0 and are never stored)."""
    return {
        name: np.concatenate([a, np.zeros((rows - a.shape[0], a.shape[1]), a.dtype)]) for name, a in k.items()
    }


class KQuantLinear(BlockLinear):
    """A K-quant tensor on kquants.c: one uint8 buffer `qs` [N (padded to the group), K / 256 * stream bytes]."""

    type_name = ""
    buffer_names = ("qs",)

    def __init__(
        self,
        rows: int,
        cols: int,
        raw: np.ndarray | None = None,
        blocks: KBlocks | None = None,
        numpy_repack: bool = False,
    ) -> None:
        """From the file's bytes `raw` [rows, bytes per row] (repacked in C; numpy_repack: by interleave_k, the
        tests' reference) or from unpacked fields `blocks` (unpack_k)."""
        if cols % QK_K:
            raise ValueError(f"{self.type_name} needs in_features divisible by {QK_K} (got {cols})")
        super().__init__(rows, cols)
        G = self.group
        padded = rows + (-rows % G)
        stream = np.empty((padded, cols // QK_K * STREAM_BYTES[self.type_name]), np.uint8)
        if raw is not None and not numpy_repack:  # kquants.c: the same bytes as interleave_k, far faster
            raw = np.ascontiguousarray(raw, dtype=np.uint8)
            need = rows * cols // QK_K * RAW_BYTES[self.type_name]
            if raw.size != need:
                raise ValueError(f"{self.type_name} [{rows}, {cols}] is {need} bytes, got {raw.size}")
            lib = load()
            assert lib is not None  # BlockLinear.__init__ checked it
            code = list(RAW_BYTES).index(self.type_name)
            lib.kq_repack(code, raw.ctypes.data, rows, cols, G, stream.ctypes.data)
        else:
            for r in range(0, rows, CHUNK_ROWS):  # a chunk at a time: bounded scratch
                e = min(rows, r + CHUNK_ROWS)
                if raw is not None:
                    k = unpack_k(self.type_name, raw[r:e], e - r, cols)
                else:
                    assert blocks is not None
                    k = {name: a[r:e] for name, a in blocks.items()}
                k = _pad_rows(k, padded - r if e == rows else e - r)
                stream[r : r + k["codes"].shape[0]] = interleave_k(self.type_name, k, G)
        self.register_buffer("qs", torch.from_numpy(stream))
        self.bind_buffers()

    def blocks(self) -> KBlocks:
        """The fields (as gguf_file.unpack_k gives them) of the true rows."""
        k = deinterleave_k(self.type_name, self.qs.numpy(), self.group, self.in_features)
        return {name: a[: self.out_features] for name, a in k.items()}

    def dequantized(self) -> torch.Tensor:
        return dequantize_k(self.type_name, self.blocks())

    def rows(self, index: torch.Tensor) -> KQuantLinear:
        """A K-quant linear of the rows `index` (the drafter's vocabulary rows of an lm_head): only the groups
        holding them are unpacked."""
        idx = index.cpu().numpy().astype(np.int64)
        G = self.group
        groups = np.unique(idx // G)
        stream = self.qs.numpy().reshape(-1, G, self.qs.shape[1])[groups].reshape(-1, self.qs.shape[1])
        k = deinterleave_k(self.type_name, stream, G, self.in_features)
        at = np.searchsorted(groups, idx // G) * G + idx % G
        return type(self)(len(idx), self.in_features, blocks={name: a[at] for name, a in k.items()})


class Q4KLinear(KQuantLinear):
    """GGUF Q4_K: per 32 weights w = (d * sc) * q - (dmin * m), q 0..15 (kquants.c)."""

    kind, c_kind, type_name = "q4_k", 2, "Q4_K"


class Q5KLinear(KQuantLinear):
    """GGUF Q5_K: as Q4_K with 5-bit codes."""

    kind, c_kind, type_name = "q5_k", 3, "Q5_K"


class Q6KLinear(KQuantLinear):
    """GGUF Q6_K: per 16 weights w = (d * sc) * (q - 32), q 0..63, sc int8 (kquants.c)."""

    kind, c_kind, type_name = "q6_k", 4, "Q6_K"


K_CLASSES: dict[str, type[KQuantLinear]] = {"Q4_K": Q4KLinear, "Q5_K": Q5KLinear, "Q6_K": Q6KLinear}


def q4_0_linear(raw: np.ndarray, rows: int, cols: int) -> BlockLinear:
    """Q4_0 as Q4_1 (m = -8 d) when every 8 d is exact in fp16, else as Q8_0 (codes q - 8): both exact."""
    codes, d = unpack_q4_0(raw, rows, cols)
    m = -8 * d
    if bool(torch.isfinite(m.half()).all()) and torch.equal(m.half().float(), m):
        return Q41Linear(codes, d, m)
    return Q80Linear((codes - 8).to(torch.int8), d)


def block_linear_from_gguf(type_name: str, raw: np.ndarray, rows: int, cols: int) -> torch.nn.Module | None:
    """The block-kernel linear [rows out, cols in] of a GGUF tensor's bytes `raw` ([rows, bytes per row] uint8,
    rows already in the caller's order), computing with the file's own blocks; None for a type not in
    SUPPORTED_TYPES (F32 / F16 / BF16 and the rest are the caller's). Raises DeviceError (one line) when the
    block kernel cannot run here or its kind fails the known-answer check on this machine (the caller may then
    use the float weights, gguf_file.dequantize)."""
    if type_name not in SUPPORTED_TYPES:
        return None
    if not available():
        raise DeviceError(f"the block kernel cannot run here: {unavailable_reason()}")
    raw = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    if type_name in K_CLASSES:
        lin: BlockLinear = K_CLASSES[type_name](rows, cols, raw=raw)
    elif type_name == "Q4_0":
        lin = q4_0_linear(raw, rows, cols)
    elif type_name == "Q4_1":
        lin = _q4_1(np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1), rows, cols)
    else:
        lin = _q8_0(np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1), rows, cols)
    from medusa_chat.kernels.known_answers import check_known_answer

    check_known_answer(type(lin))
    return lin


class KQuantEmbedding(RowLookupEmbedding):
    """A token embedding looked up in a K-quant linear's own blocks (kquants.c, kq_rows: each row dequantized
    as ggml does, bit for bit `table.dequantized()`'s rows), so a K-quant token_embd is never held in fp32
    (49152 x 2048: 400 MB). `table`: the tied lm_head, or a KQuantLinear made for the embedding alone."""

    def __init__(self, table: KQuantLinear, padding_idx: int | None = None) -> None:
        lib = load()
        if lib is None:
            raise DeviceError(f"the block kernel cannot run here: {unavailable_reason()}")
        super().__init__(table, padding_idx)
        self._rows_fn = lib.kq_rows
        self._code = list(RAW_BYTES).index(table.type_name)

    def _lookup(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        t = self.table
        self._rows_fn(self._code, t.qs.data_ptr(), t.in_features, t.group, flat.data_ptr(), flat.numel(), out.data_ptr())

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of {self.table.type_name} blocks"


def embedding_from_gguf(type_name: str, raw: np.ndarray, rows: int, cols: int) -> torch.nn.Module | None:
    """A token embedding [rows tokens, cols] looked up in a GGUF tensor's own K-quant blocks (KQuantEmbedding);
    None for other types (Q8_0: block_linears.BlockEmbedding over a Q80Linear; float tables: the caller's)."""
    if type_name not in K_CLASSES:
        return None
    if not available():
        raise DeviceError(f"the block kernel cannot run here: {unavailable_reason()}")
    return KQuantEmbedding(K_CLASSES[type_name](rows, cols, raw=np.asarray(raw)))


# ---- Q4_1 / Q8_0 by byte reordering ----------------------------------------------------------------------------
def _padded(data: np.ndarray, group: int) -> np.ndarray:
    """Zero blocks appended up to a whole group of rows (zero scales: weights never read back)."""
    pad = -data.shape[0] % group
    return np.concatenate([data, np.zeros((pad, data.shape[1]), np.uint8)]) if pad else data


def _scales(blocks: np.ndarray, at: int, group: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block [N, nb, size] in the kernel's order (per group of rows: block-
    major, then row) as an fp16 tensor [N, nb]."""
    n, nb = blocks.shape[:2]
    bits = np.ascontiguousarray(blocks[:, :, at : at + 2]).view(np.uint16).reshape(n // group, group, nb)
    return torch.from_numpy(np.ascontiguousarray(bits.transpose(0, 2, 1)).reshape(n, nb)).view(torch.float16)


def _q4_1(data: np.ndarray, rows: int, cols: int) -> nn.Module:
    module = Q41Linear.__new__(Q41Linear)
    BlockLinear.__init__(module, rows, cols)
    g = module.group
    nb = cols // QK
    blocks = _padded(data, g).reshape(-1, nb, 20)  # d (fp16), m (fp16), 16 code bytes
    n = blocks.shape[0]
    qs = blocks[:, :, 4:].reshape(n // g, g, nb, 4, 4).transpose(0, 2, 3, 1, 4)  # [group, block, j, row, t]
    module.register_buffer("qs", torch.from_numpy(np.ascontiguousarray(qs).reshape(n, cols // 2)))
    module.register_buffer("d", _scales(blocks, 0, g))
    module.register_buffer("m", _scales(blocks, 2, g))
    module.bind_buffers()
    return module


def _q8_0(data: np.ndarray, rows: int, cols: int) -> nn.Module:
    module = Q80Linear.__new__(Q80Linear)
    BlockLinear.__init__(module, rows, cols)
    g = module.group
    nb = cols // QK
    blocks = _padded(data, g).reshape(-1, nb, 34)  # d (fp16), 32 int8 codes
    n = blocks.shape[0]
    qs = np.ascontiguousarray(blocks[:, :, 2:].reshape(n // g, g, nb, 8, 4).transpose(0, 2, 3, 1, 4)).view(np.int8)
    module.register_buffer("qs", torch.from_numpy(qs.reshape(n, cols)))  # [group, block, j, row, t]
    module.register_buffer("d", _scales(blocks, 0, g))
    # each block's sum of codes, in the kernel's [group, block, row] order: summed over j and t
    sums = qs.sum(axis=(2, 4), dtype=np.int16)  # |sum| <= 32 * 127
    module.register_buffer("s", torch.from_numpy(sums.reshape(n, nb)))
    module._argmax = load().q8_0_gemm_argmax  # type: ignore[union-attr]  # BlockLinear checked the kernel
    module.bind_buffers()
    return module
