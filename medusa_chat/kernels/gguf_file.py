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
TYPE_NAMES = {0: "F32", 1: "F16", 3: "Q4_1", 8: "Q8_0", 30: "BF16"}
BLOCK = {0: (4, 1), 1: (2, 1), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32), 30: (2, 1)}
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


def dequantize(t: GGUFTensor) -> np.ndarray:
    """The tensor as float32 in its torch shape (F32, F16, Q4_1, Q8_0): exactly the values the blocks define
    (w = d * q + m, w = d * q, each product and sum rounded once in fp32, as gguf-py and transformers do)."""
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
    raise ValueError(f"tensor {t.name}: dequantizing GGML type {t.type_name} is not supported here")
