"""A Hugging Face checkpoint's weight files read one tensor at a time, for quantized_cache.py (which quantizes
each into its cached GGUF): which files transformers would read (safetensors first, else the pickled ones), their
tensor tables (a safetensors JSON header; a pickle's memory map, no tensor's bytes read), and each tensor's
values (`TensorReader`: plain reads into memory of their own, or a pickle's mapped pages given back once written)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from medusa_chat.errors import ModelNotFoundError

# the safetensors dtypes a checkpoint's tensors may have -> (torch dtype, GGML type id)
SAFETENSORS_DTYPES = {"F32": (torch.float32, 0), "F16": (torch.float16, 1), "BF16": (torch.bfloat16, 30)}
TORCH_DTYPES = {v[0]: k for k, v in SAFETENSORS_DTYPES.items()}  # a pickled tensor's dtype, named as above


# ---- the checkpoint's tensor tables -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SourceTensor:
    name: str  # the checkpoint's name
    file: Path
    dtype: str  # safetensors dtype ("F16", ...)
    shape: tuple[int, ...]
    offset: int  # from the start of the file (safetensors; 0 in a pickle, whose tensors are found by name)
    nbytes: int


def _named_files(folder: Path, single: str, index_name: str) -> list[Path] | None:
    if (folder / single).is_file():
        return [folder / single]
    index = folder / index_name
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None
    return [folder / name for name in sorted(set(weight_map.values()))]


def safetensors_files(folder: Path) -> list[Path] | None:
    """The checkpoint's safetensors files as transformers picks them (model.safetensors, else the index's
    shards); None when it has none."""
    return _named_files(folder, "model.safetensors", "model.safetensors.index.json")


def checkpoint_files(folder: Path) -> list[Path] | None:
    """The weight files this path reads: the safetensors ones where there are any (as transformers and
    hub.weight_files prefer them), else the pickled ones (pytorch_model.bin, else the index's shards); None when
    there are neither."""
    return safetensors_files(folder) or _named_files(folder, "pytorch_model.bin", "pytorch_model.bin.index.json")


def is_pickle(path: Path) -> bool:
    return path.suffix != ".safetensors"


def read_pickle_table(path: Path) -> list[SourceTensor]:
    """The tensor table of one pickled checkpoint file, from its memory map (no tensor's bytes are read)."""
    state = pickled_state(path)
    return [
        SourceTensor(name, path, TORCH_DTYPES.get(t.dtype, str(t.dtype).removeprefix("torch.")), tuple(t.shape),
                     0, t.numel() * t.element_size())
        for name, t in state.items()
    ]  # fmt: skip


def pickled_state(path: Path) -> dict[str, torch.Tensor]:
    from medusa_chat.model.mapped_weights import load_pickle

    obj, _ = load_pickle(path, ModelNotFoundError)
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ModelNotFoundError(f"{path} does not hold a state dict of tensors")
    return obj


def read_header(path: Path) -> list[SourceTensor]:
    """The tensor table of one safetensors file (its JSON header only)."""
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelNotFoundError(f"{path}: not a readable safetensors file ({err})") from err
    start = 8 + n
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out.append(SourceTensor(name, path, info["dtype"], tuple(info["shape"]), start + begin, end - begin))
    return out


def read_tensor(f: IO[bytes], t: SourceTensor) -> torch.Tensor:
    """One tensor's values, read with plain reads into memory of its own."""
    buf = bytearray(t.nbytes)
    f.seek(t.offset)
    if f.readinto(buf) != t.nbytes:  # type: ignore[attr-defined]
        raise ModelNotFoundError(f"{t.file}: tensor {t.name} runs past the end of the file (truncated?)")
    dtype = SAFETENSORS_DTYPES[t.dtype][0]
    return torch.frombuffer(buf, dtype=dtype).reshape(t.shape) if t.nbytes else torch.empty(t.shape, dtype=dtype)


class TensorReader:
    """One checkpoint file's tensors, one at a time: safetensors by plain reads into memory of their own; a pickle
    through its memory map, each tensor's pages given back once written (mapped_weights.release), so only the
    quantized file's bytes and the tensor at hand stay resident."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[bytes] | None = None
        self._state: dict[str, torch.Tensor] = {}
        if is_pickle(path):
            self._state = pickled_state(path)
        else:
            self._file = path.open("rb")

    def read(self, t: SourceTensor) -> torch.Tensor:
        if self._file is not None:
            return read_tensor(self._file, t)
        values = self._state.get(t.name)
        if values is None or tuple(values.shape) != t.shape or TORCH_DTYPES.get(values.dtype) != t.dtype:
            raise ModelNotFoundError(f"{self.path}: tensor {t.name} changed while it was read")
        return values

    def done(self, values: torch.Tensor) -> None:
        if self._file is None:
            from medusa_chat.model.mapped_weights import release

            release(values)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._state = {}
