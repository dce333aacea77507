"""The tensors of a GGUF file, read without parsing its metadata values.

Why not `gguf.GGUFReader`: it builds a numpy view for every metadata value, and a chat model's GGUF carries its
whole tokenizer as metadata (~100k vocabulary and merge strings): ~4 s per open on a 2-core machine, paid at
every start for the int4 blocks and three more times when the embedded model was converted with transformers.
Here the metadata is skipped (string lengths only), the tensor table is read, and each tensor's bytes are a
slice of one read-only memory map: ~0.1 s. The format (v2/v3): magic "GGUF", version, tensor count, metadata
count, metadata key/value pairs, tensor infos (name, dims fastest-first, type, offset), padding to
`general.alignment` (default 32), then the data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# GGML types this project reads: (bytes per block, weights per block)
TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16",
}  # fmt: skip
BLOCK = {
    0: (4, 1), 1: (2, 1), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32),
    10: (84, 256), 11: (110, 256), 12: (144, 256), 13: (176, 256), 14: (210, 256), 30: (2, 1),
}  # fmt: skip
QK_K = 256  # weights per K-quant superblock
# metadata value types -> struct format of a scalar (8: string, 9: array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # as torch orders it: slowest dimension first ([rows, cols] for a matrix)
    type_id: int
    data: np.ndarray  # the raw bytes (uint8), a view of the file

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.type_id, str(self.type_id))


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> tuple:
        out = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return out

    def string(self) -> str:
        (n,) = self.take("Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_value(self, vtype: int) -> int | None:
        """Skip one metadata value; returns it when it is an unsigned/signed integer (for the alignment)."""
        if vtype == 8:
            (n,) = self.take("Q")
            self.pos += n
            return None
        if vtype == 9:
            (etype, count) = self.take("IQ")
            if etype == 8:  # strings: each has its own length
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", self.buf, self.pos)
                    self.pos += 8 + n
            elif etype == 9:
                for _ in range(count):
                    (inner,) = self.take("I")
                    self.skip_value(inner)
            else:
                self.pos += struct.calcsize("<" + SCALARS[etype]) * count
            return None
        (value,) = self.take(SCALARS[vtype])
        return value if isinstance(value, int) else None


def read_metadata(path: str | Path, string_arrays: tuple[str, ...] = ()) -> dict[str, object]:
    """The file's metadata as plain Python values: scalars, strings, numeric arrays as lists; an array of
    strings is its length unless its key is in `string_arrays` (a vocabulary is ~50k strings: ~0.5 s to
    decode, and only the tokenizer wants them). A truncated or malformed file raises ValueError."""
    mm = np.memmap(str(path), dtype=np.uint8, mode="r")
    try:
        cur = _Cursor(memoryview(mm))
        if cur.take("4s")[0] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        cur.take("I")
        _, n_kv = cur.take("QQ")
        out: dict[str, object] = {}
        for _ in range(n_kv):
            key = cur.string()
            (vtype,) = cur.take("I")
            out[key] = _value(cur, vtype, key in string_arrays)
        return out
    except (struct.error, KeyError, IndexError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: its metadata cannot be read ({type(err).__name__}: {err})") from err
    finally:
        del mm


def _value(cur: _Cursor, vtype: int, keep_strings: bool) -> object:
    if vtype == 8:
        (n,) = cur.take("Q")
        s = bytes(cur.buf[cur.pos : cur.pos + n]).decode("utf-8")  # strict, as transformers decodes them
        cur.pos += n
        return s
    if vtype != 9:
        return cur.take(SCALARS[vtype])[0]
    etype, count = cur.take("IQ")
    if etype in SCALARS:
        return list(cur.take(f"{count}{SCALARS[etype]}")) if count else []
    if etype == 8 and keep_strings:
        return [_value(cur, 8, True) for _ in range(count)]
    cur.pos -= 12  # back to the array's header: skip_value walks the strings (or nested arrays) by length
    cur.skip_value(9)
    return count


def read_tensors(path: str | Path) -> dict[str, GGUFTensor]:
    """Every tensor of the GGUF at `path`, in file order, each a view of a read-only memory map. A truncated or
    malformed file raises ValueError."""
    try:
        return _read_tensors(path)
    except (struct.error, KeyError, IndexError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a readable GGUF file ({type(err).__name__}: {err})") from err


def _read_tensors(path: str | Path) -> dict[str, GGUFTensor]:
    mm = np.memmap(str(path), dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    (magic,) = cur.take("4s")
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    (version,) = cur.take("I")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3 are)")
    n_tensors, n_kv = cur.take("QQ")
    alignment = 32
    for _ in range(n_kv):
        key = cur.string()
        (vtype,) = cur.take("I")
        value = cur.skip_value(vtype)
        if key == "general.alignment" and value:
            alignment = int(value)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = cur.take("I")
        dims = cur.take("Q" * n_dims)
        type_id, offset = cur.take("IQ")
        infos.append((name, tuple(int(d) for d in reversed(dims)), int(type_id), int(offset)))
    start = (cur.pos + alignment - 1) // alignment * alignment
    out: dict[str, GGUFTensor] = {}
    for name, shape, type_id, offset in infos:
        if type_id not in BLOCK:
            raise ValueError(
                f"{path}: tensor {name} has GGML type {type_id}, which this reader does not size"
            )
        per_block_bytes, per_block = BLOCK[type_id]
        count = int(np.prod(shape)) if shape else 1
        nbytes = count // per_block * per_block_bytes
        if start + offset + nbytes > len(mm):
            raise ValueError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        out[name] = GGUFTensor(name, shape, type_id, mm[start + offset : start + offset + nbytes])
    return out


def unpack_q4_1(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 bytes [rows, cols / 32 * 20] -> codes [rows, cols] (0..15), d and m [rows, cols / 32] (fp32).

    A block is d (fp16), m (fp16), then 16 bytes whose low nibbles are weights 0..15 and high nibbles 16..31.
    """
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:20]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return (
        torch.from_numpy(codes.astype(np.int32)),
        torch.from_numpy(d.astype(np.float32)),
        torch.from_numpy(m.astype(np.float32)),
    )


def unpack_q8_0(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 bytes [rows, cols / 32 * 34] -> codes [rows, cols] int8, d [rows, cols / 32] (fp32)."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:34].copy().view(np.int8).reshape(rows, cols)
    return torch.from_numpy(q.copy()), torch.from_numpy(d)


def unpack_q4_0(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 bytes [rows, cols / 32 * 18] -> codes [rows, cols] (0..15; the weight is d * (q - 8)), d (fp32)."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, 18)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    qs = blocks[..., 2:18]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return torch.from_numpy(codes.astype(np.int32)), torch.from_numpy(d.astype(np.float32))


KBlocks = dict[str, np.ndarray]  # a K-quant tensor's fields, one row per output row (unpack_k)


def unpack_k(type_name: str, raw: np.ndarray, rows: int, cols: int) -> KBlocks:
    """K-quant bytes [rows, cols / 256 * block bytes] -> their fields (ggml-common.h's block_q4_K etc.):
    codes [rows, cols] uint8 (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63, in weight order), d [rows, cols / 256] fp16,
    and per sub-block: Q4_K / Q5_K sc, m [rows, cols / 32] uint8 (6-bit) and dmin fp16; Q6_K sc [rows,
    cols / 16] int8."""
    nsb = cols // QK_K
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[type_name]
    blocks = np.ascontiguousarray(raw).reshape(rows, nsb, size)
    if type_name == "Q6_K":
        ql, qh = blocks[..., 0:128], blocks[..., 128:192]
        lo = (ql.reshape(rows, nsb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
        hi = (qh.reshape(rows, nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03
        codes = lo.reshape(rows, nsb, 8, 32) | (hi.reshape(rows, nsb, 8, 32) << 4)
        return {
            "codes": codes.reshape(rows, cols),
            "sc": blocks[..., 192:208].copy().view(np.int8).reshape(rows, nsb * 16),
            "d": blocks[..., 208:210].copy().view(np.float16).reshape(rows, nsb),
        }
    d = blocks[..., 0:2].copy().view(np.float16).reshape(rows, nsb)
    dmin = blocks[..., 2:4].copy().view(np.float16).reshape(rows, nsb)
    s = blocks[..., 4:16].reshape(rows, nsb, 3, 4)
    sd, sm, smd = s[:, :, 0], s[:, :, 1], s[:, :, 2]  # get_scale_min_k4's three 4-byte rows
    sc = np.concatenate([sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)], axis=-1)
    qs = blocks[..., 16:144] if type_name == "Q4_K" else blocks[..., 48:176]
    q = qs.reshape(rows, nsb, 4, 1, 32)  # 32 bytes hold sub-blocks 2i (low nibbles) and 2i + 1 (high)
    codes = np.concatenate([q & 0x0F, q >> 4], axis=3).reshape(rows, nsb, 8, 32)
    if type_name == "Q5_K":  # bit j of qh[e]: the 5th bit of element e of sub-block j
        qh = blocks[..., 16:48].reshape(rows, nsb, 1, 32)
        codes = codes | (((qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1) << 4)
    return {
        "codes": codes.reshape(rows, cols),
        "sc": sc.reshape(rows, nsb * 8),
        "m": mn.reshape(rows, nsb * 8),
        "d": d,
        "dmin": dmin,
    }


def dequantize_k(type_name: str, k: KBlocks) -> torch.Tensor:
    """The fp32 weights [rows, cols] K-quant fields define, in ggml's (and gguf-py's) order of fp32 operations:
    Q4_K / Q5_K (d * sc) * q - dmin * m, Q6_K (d * sc) * (q - 32); every factor exact, one rounding each."""
    codes = torch.from_numpy(np.ascontiguousarray(k["codes"]))
    rows, cols = codes.shape
    d = torch.from_numpy(np.ascontiguousarray(k["d"]).astype(np.float32))
    sc = torch.from_numpy(np.ascontiguousarray(k["sc"]).astype(np.float32))
    if type_name == "Q6_K":
        a = d.repeat_interleave(16, dim=1) * sc
        return (a[..., None] * (codes.view(rows, -1, 16).float() - 32)).reshape(rows, cols)
    a = d.repeat_interleave(8, dim=1) * sc
    dmin = torch.from_numpy(np.ascontiguousarray(k["dmin"]).astype(np.float32))
    b = dmin.repeat_interleave(8, dim=1) * torch.from_numpy(np.ascontiguousarray(k["m"]).astype(np.float32))
    return (a[..., None] * codes.view(rows, -1, 32).float() - b[..., None]).reshape(rows, cols)


def dequantize(t: GGUFTensor) -> np.ndarray:
    """The tensor as float32 in its torch shape (F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K): exactly the
    values the blocks define (w = d * q + m, w = d * q, ...; each product and sum rounded once in fp32, as
    gguf-py and transformers do)."""
    if t.type_id == 0:
        return t.data.view(np.float32).reshape(t.shape).copy()
    if t.type_id == 1:
        return t.data.view(np.float16).astype(np.float32).reshape(t.shape)
    rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
    cols = t.shape[-1]
    if t.type_id == 3:
        codes, d, m = unpack_q4_1(t.data, rows, cols)
        w = d[..., None] * codes.float().view(rows, -1, 32) + m[..., None]
        return w.reshape(t.shape).numpy()
    if t.type_id == 8:
        codes, d = unpack_q8_0(t.data, rows, cols)
        return (d[..., None] * codes.float().view(rows, -1, 32)).reshape(t.shape).numpy()
    if t.type_id == 2:
        codes, d = unpack_q4_0(t.data, rows, cols)
        return (d[..., None] * (codes.float().view(rows, -1, 32) - 8)).reshape(t.shape).numpy()
    if t.type_name in ("Q4_K", "Q5_K", "Q6_K"):
        return dequantize_k(t.type_name, unpack_k(t.type_name, t.data, rows, cols)).reshape(t.shape).numpy()
    raise ValueError(f"tensor {t.name}: dequantizing GGML type {t.type_name} is not supported here")


def gguf_tensor_types(path: Path) -> dict[str, str]:
    """{tensor name: its type name} of a GGUF file."""
    return {t.name: t.type_name for t in read_tensors(path).values()}
