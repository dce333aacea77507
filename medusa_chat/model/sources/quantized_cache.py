"""A Hugging Face checkpoint on a CPU block path (int4 / int8): quantized tensor by tensor into a cached GGUF file
once, then loaded through the GGUF path (model/sources/gguf_model.py) at this start and every later one.

Why: transformers loads a checkpoint as a whole float model; quantizing it only afterwards peaks at several times
the quantized size (a 1.1B fp16 model: 7.8 GB; a 7B one does not fit in 24 GB). Here no float model ever exists:
each tensor is read from the safetensors files with plain reads (no memory map, whose touched pages would stay
resident) or, for a pickled checkpoint (`pytorch_model.bin`, or shards + `pytorch_model.bin.index.json`), taken
from its shard opened with torch.load(mmap=True, weights_only=True) and its pages given back once written
(mapped_weights.release); then converted to the compute dtype, quantized in row chunks by the very functions the
in-memory path uses (quantizers.quantize_q4_1 and quantize_q8_0: the blocks are bit for bit the same) and
written at once; the GGUF loader then keeps those blocks as stored (~1.0x the file's bytes). The greedy output is therefore the
in-memory path's bit for bit. (A Qwen2 model differs there on purpose: the in-memory path keeps its biased q/k/v
projections dense float, this one quantizes them like the others and adds the biases in fp32, as a llama.cpp Qwen2
file is run; the native step's logits stay within its usual tolerance of the float model, tests/test_qwen2_checkpoint.py.)

What goes into the file (llama.cpp's tensor names, so the GGUF loader needs nothing new):
- projections: Q4_1 blocks for int4, Q8_0 for int8 (Llama/Mistral q/k rows in llama.cpp's rotary order, which
  the loader undoes; a Qwen2 model's rows as they are, as llama.cpp's converter keeps them for qwen2);
- a Qwen2 model's q/k/v biases: F32 (`blk.N.attn_q.bias`, ...), added in fp32 by the step as from a llama.cpp
  Qwen2 file;
- the lm_head: Q8_0 (both modes, as cpu_linears does); a tied model's from its token embedding;
- a Qwen3 model's per-head q/k norms: F32 (`blk.N.attn_q_norm.weight`, `attn_k_norm`), as llama.cpp writes them;
- the token embedding and the norms: float as the checkpoint stores them (the loader makes them the compute dtype,
  exactly as transformers would);
- medusa_head.* (a Medusa-2 checkpoint's heads, loaded apart as ever) and rotary inv_freq buffers: left out.
Config, tokenizer and chat template still come from the checkpoint's folder.

The file is `cache_root()/models/hfq-<name>-<key>.gguf`, key = the checkpoint's identity (its folder and every
weight file's size and mtime; a Hub snapshot's folder names its commit) + the quantization + the compute dtype +
FORMAT_VERSION. It is written under a temporary name and renamed (atomic.py): an interrupted or disk-full write
leaves no half file. Its metadata records that key and the file's own size; a file whose size or key differs
(truncated, corrupt, an older format) is made again.

Only what the GGUF path computes exactly as the in-memory path does is taken this way (`unsuitable` says why
not otherwise: no safetensors or .bin weights, a model type other than Llama/Mistral/Qwen2/Qwen3, biases other than
Qwen2's q/k/v ones, unexpected tensors, no block kernel here); the rest loads as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import torch

from medusa_chat import envvars
from medusa_chat.atomic import TMP_PREFIX, TMP_SUFFIX, atomic_write
from medusa_chat.errors import MedusaChatError, ModelNotFoundError
from medusa_chat.kernels.cpu_linears import GROUP
from medusa_chat.model.forward.cpu_blocks import set_tied_lm_head
from medusa_chat.model.sources.checkpoint_reader import (
    SAFETENSORS_DTYPES,
    SourceTensor,
    TensorReader,
    checkpoint_files,
    is_pickle,
    read_header,
    read_pickle_table,
)
from medusa_chat.model.sources.gguf_names import GGUF_LINEARS, GGUF_NORMS
from medusa_chat.paths import cache_root

if TYPE_CHECKING:
    from medusa_chat.model.sources.gguf_model import WeightsOptions

Progress = Callable[[str], None]

FORMAT_VERSION = 1  # bump when what is written changes: older files are then made again
ENV_SWITCH = "MEDUSA_CHAT_QUANT_CACHE"  # "0": quantize in memory after a whole float load (the old way)
KEY_SOURCE = "medusa_chat.source"  # metadata: the JSON of the checkpoint identity the file was made from
KEY_SIZE = "medusa_chat.file_size"  # metadata: the file's own size in bytes (a truncated copy differs)
ALIGN = 32
CHUNK_ELEMENTS = 1 << 22  # weights quantized at a time (16 MB of fp32 per temporary)
GGML = {"F32": 0, "F16": 1, "Q4_1": 3, "Q8_0": 8, "BF16": 30}
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # per 32 weights
SKIPPED = (re.compile(r"^medusa_head\."), re.compile(r"\.rotary_emb\.inv_freq$"))
HF_TO_GGUF_LAYER = {v: k for k, v in {**GGUF_LINEARS, **GGUF_NORMS}.items()}
ARCHS = ("llama", "mistral", "qwen2", "qwen3")  # what the GGUF loader builds
# llama.cpp's converter interleaves the rotary halves of q/k rows for these (the loader undoes it); it keeps
# Hugging Face's row order for qwen2 (NeoX-style rope), so nothing is permuted for it
PERMUTED_QK = ("llama", "mistral")
QKV_BIASED = ("qwen2",)  # model types whose q, k and v projections (and only those) have biases
QKV_BIASES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v"}


def gguf_name(hf_name: str) -> str | None:
    """llama.cpp's name for a Llama-family tensor of transformers' naming; None when there is none."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.([\w.]+)\.weight", hf_name)
    if m and m.group(2) in HF_TO_GGUF_LAYER:
        return f"blk.{m.group(1)}.{HF_TO_GGUF_LAYER[m.group(2)]}.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.([qkv]_proj)\.bias", hf_name)
    if m:  # Qwen2's q/k/v biases (plan() takes them only for a model type that has them)
        return f"blk.{m.group(1)}.{QKV_BIASES[m.group(2)]}.bias"
    return None


@dataclass(frozen=True)
class Planned:
    """One tensor of the GGUF to write: where its values come from and what it becomes."""

    name: str  # GGUF name
    source: SourceTensor
    type_name: str  # F32 / F16 / BF16 / Q4_1 / Q8_0
    shape: tuple[int, ...]  # torch order
    permute_heads: int = 0  # q/k: llama.cpp's rotary row order for this many heads

    @property
    def nbytes(self) -> int:
        count = int(np.prod(self.shape))
        if self.type_name in BLOCK_BYTES:
            return count // 32 * BLOCK_BYTES[self.type_name]
        return count * (4 if self.type_name == "F32" else 2)


def plan(folder: Path, config: Any, quant: str) -> tuple[list[Planned], str]:
    """(the tensors to write, "") or ([], why this checkpoint loads the old way)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHS:
        return [], f"model type {model_type!r} is not one the GGUF loader builds"
    # Qwen2's q/k/v biases are its architecture's (transformers makes them whatever the config says); any other
    # bias (Llama's attention_bias: o_proj too; mlp_bias) has no place in the loader's modules
    if getattr(config, "mlp_bias", False):
        return [], "the MLP projections have biases (mlp_bias), which the GGUF path does not add"
    if getattr(config, "attention_bias", False) and model_type not in QKV_BIASED:
        return [], "the attention projections have biases (attention_bias), which the GGUF path does not add"
    files = checkpoint_files(folder)
    if not files:
        return [], "the checkpoint has neither safetensors nor pytorch_model*.bin weight files"
    tensors = {t.name: t for f in files for t in (read_pickle_table(f) if is_pickle(f) else read_header(f))}
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    permuted = model_type in PERMUTED_QK
    out: list[Planned] = []
    for t in tensors.values():
        if any(p.search(t.name) for p in SKIPPED):
            continue
        name = gguf_name(t.name)
        if name is None:
            if t.name.endswith(".bias"):
                return [], (
                    f"tensor {t.name}: only a Qwen2 model's q/k/v projections may have biases on this path"
                )
            return [], f"tensor {t.name} has no place in the GGUF layout"
        if name.endswith(".bias"):
            if model_type not in QKV_BIASED:
                return [], f"tensor {t.name}: a {model_type} model's projections have no biases on this path"
            if t.dtype not in SAFETENSORS_DTYPES:
                return [], f"tensor {t.name} is stored as {t.dtype}"
            out.append(Planned(name, t, "F32", t.shape))  # fp32 as the step adds it (exact from any float)
            continue
        if t.dtype not in SAFETENSORS_DTYPES:
            return [], f"tensor {t.name} is stored as {t.dtype}"
        if name == "output.weight" and tied:
            continue  # transformers ties it to the embedding: the embedding's values count
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if part in GGUF_LINEARS or name == "output.weight":
            if len(t.shape) != 2 or t.shape[1] % GROUP:
                return [], f"{t.name} {list(t.shape)} is not a whole number of 32-weight blocks per row"
            kind = "Q4_1" if quant == "int4" and part in GGUF_LINEARS else "Q8_0"
            n = heads if part == "attn_q" else kv_heads if part == "attn_k" else 0
            out.append(Planned(name, t, kind, t.shape, n if permuted else 0))
        elif name == "token_embd.weight":
            out.append(Planned(name, t, t.dtype, t.shape))
        else:  # norms: exact in F32 whatever the checkpoint's float type
            out.append(Planned(name, t, "F32", t.shape))
    names = {p.name for p in out}
    if "token_embd.weight" not in names:
        return [], "the checkpoint has no token embedding"
    if tied:
        embed = next(p for p in out if p.name == "token_embd.weight")
        if embed.shape[1] % GROUP:
            return [], "the embedding's rows are not whole 32-weight blocks"
        out.append(Planned("output.weight", embed.source, "Q8_0", embed.shape))
    elif "output.weight" not in names:
        return [], "the checkpoint has no lm_head"
    if model_type in QKV_BIASED:  # the loader refuses a file without them: say so before anything is written
        for i in range(int(config.num_hidden_layers)):
            for module, part in QKV_BIASES.items():
                if f"blk.{i}.{part}.bias" not in names:
                    return [], f"the checkpoint lacks model.layers.{i}.self_attn.{module}.bias"
    return out, ""


def unsuitable(folder: Path, config: Any, quant: str, trust_remote_code: bool) -> str:
    """Why this checkpoint cannot take the cached-file path ("" when it can)."""
    if not envvars.enabled(ENV_SWITCH):
        return f"{ENV_SWITCH}=0"
    if quant not in ("int4", "int8"):
        return f"quantization {quant}"
    if trust_remote_code and getattr(config, "auto_map", None):
        return "the model runs its own code"
    from medusa_chat.kernels.cbind import available

    if not available():
        return "no block kernel here"
    from medusa_chat.kernels.block_linears import Q41Linear, Q80Linear
    from medusa_chat.kernels.known_answers import kernels_agree

    refused = kernels_agree((Q41Linear, Q80Linear) if quant == "int4" else (Q80Linear,))
    return refused or plan(folder, config, quant)[1]


# ---- writing the GGUF -----------------------------------------------------------------------------------------
def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter `permute`: each head's rotary halves interleaved (the GGUF loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q4_1_bytes(weight: torch.Tensor) -> np.ndarray:
    """GGUF Q4_1 blocks [rows, cols / 32 * 20] of fp32 rows, by quantizers.quantize_q4_1 (the in-memory path's
    rule): per block d (fp16), m (fp16), 16 bytes holding element j in the low nibble and j + 16 in the high."""
    from medusa_chat.kernels.quantizers import quantize_q4_1

    codes, d, m = quantize_q4_1(weight)
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n, k // 32, 32)
    qs = (c[..., :16] | (c[..., 16:] << 4)).numpy()
    d16 = d.half().numpy().view(np.uint8).reshape(n, k // 32, 2)
    m16 = m.half().numpy().view(np.uint8).reshape(n, k // 32, 2)
    return np.concatenate([d16, m16, qs], axis=-1).reshape(n, -1)


def q8_0_bytes(weight: torch.Tensor) -> np.ndarray:
    """GGUF Q8_0 blocks [rows, cols / 32 * 34] by quantizers.quantize_q8_0: per block d (fp16), 32 int8 codes."""
    from medusa_chat.kernels.quantizers import quantize_q8_0

    codes, d = quantize_q8_0(weight)
    n, k = codes.shape
    d16 = d.half().numpy().view(np.uint8).reshape(n, k // 32, 2)
    return np.concatenate([d16, codes.numpy().view(np.uint8).reshape(n, k // 32, 32)], axis=-1).reshape(n, -1)


def tensor_bytes(p: Planned, values: torch.Tensor, dtype: torch.dtype) -> Iterator[np.ndarray]:
    """The GGUF bytes (uint8 arrays, written without a copy) of one planned tensor, a row chunk at a time
    (quantization is row by row, so chunks give the whole tensor's bits)."""
    if p.type_name in GGML and p.type_name not in BLOCK_BYTES:  # float: as stored (norms widened to F32)
        yield (values.float() if p.type_name == "F32" else values).contiguous().view(torch.uint8).numpy()
        return
    if p.permute_heads:
        values = _permute(values, p.permute_heads)
    rows = max(1, CHUNK_ELEMENTS // values.shape[1])
    pack = q4_1_bytes if p.type_name == "Q4_1" else q8_0_bytes
    for r in range(0, values.shape[0], rows):
        # the compute dtype first (as transformers' load would round), then fp32 for the quantizer
        chunk = values[r : r + rows].to(dtype).float()
        yield pack(chunk)


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv_string(key: str, value: str) -> bytes:
    return _string(key) + struct.pack("<I", 8) + _string(value)


def header_bytes(planned: list[Planned], arch: str, source: str) -> tuple[bytes, list[int], int]:
    """(the GGUF v3 header up to the aligned data start, each tensor's data offset, the file's total size). The
    size is recorded in the header itself, so a reader can tell a complete file from a truncated one."""
    offsets, pos = [], 0
    for p in planned:
        offsets.append(pos)
        pos += (p.nbytes + ALIGN - 1) // ALIGN * ALIGN
    data_bytes = pos

    def build(total: int) -> bytes:
        kv = [
            _kv_string("general.architecture", arch),
            _string("general.alignment") + struct.pack("<II", 4, ALIGN),
            _kv_string(KEY_SOURCE, source),
            _string(KEY_SIZE) + struct.pack("<IQ", 10, total),
        ]
        infos = b"".join(
            _string(p.name)
            + struct.pack("<I", len(p.shape))
            + struct.pack(f"<{len(p.shape)}Q", *reversed(p.shape))
            + struct.pack("<IQ", GGML[p.type_name], off)
            for p, off in zip(planned, offsets, strict=True)
        )
        head = b"GGUF" + struct.pack("<IQQ", 3, len(planned), len(kv)) + b"".join(kv) + infos
        return head + bytes(-len(head) % ALIGN)

    head = build(0)  # the size field is fixed-width: the header's length does not depend on its value
    total = len(head) + data_bytes
    return build(total), offsets, total


def write_gguf(
    fh: IO[bytes],
    planned: list[Planned],
    arch: str,
    source: str,
    dtype: torch.dtype,
    tick: Callable[[int], None],
) -> None:
    """The whole GGUF into `fh`, one tensor in memory at a time."""
    head, _, _ = header_bytes(planned, arch, source)
    fh.write(head)
    reader: TensorReader | None = None
    try:
        for i, p in enumerate(planned):
            if reader is None or reader.path != p.source.file:
                if reader is not None:  # one source file open at a time (a pickled shard's map is unmapped)
                    reader.close()
                    reader = None
                reader = TensorReader(p.source.file)
            values = reader.read(p.source)
            written = 0
            for part in tensor_bytes(p, values, dtype):
                fh.write(memoryview(part).cast("B"))
                written += part.nbytes
            reader.done(values)
            del values
            if written != p.nbytes:  # never a file whose table lies about its contents
                raise MedusaChatError(f"{p.name}: wrote {written} bytes, expected {p.nbytes}")
            fh.write(bytes(-written % ALIGN))
            tick(i + 1)
    finally:
        if reader is not None:
            reader.close()


# ---- the cache ------------------------------------------------------------------------------------------------
def source_identity(folder: Path, quant: str, dtype: torch.dtype) -> dict[str, Any]:
    files = checkpoint_files(folder) or []
    return {
        "folder": str(folder.resolve()),
        "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        "quant": quant,
        "dtype": str(dtype).removeprefix("torch."),
        "version": FORMAT_VERSION,
    }


def cache_path(folder: Path, source: dict[str, Any]) -> Path:
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    resolved = folder.resolve()
    # a Hub snapshot folder is named by its commit: the repo's folder name says more
    label = resolved.parent.parent.name if resolved.parent.name == "snapshots" else resolved.name
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", label)[:48]
    return cache_root() / "models" / f"hfq-{slug}-{source['quant']}-{key}.gguf"


def is_complete(path: Path, source: dict[str, Any]) -> bool:
    """The file exists, was made from `source` by this format, and has the size its header records."""
    from medusa_chat.model.sources.gguf_folder import read_metadata

    try:
        meta = read_metadata(path, (KEY_SOURCE, KEY_SIZE))
        return json.loads(meta.get(KEY_SOURCE, "null")) == source and meta.get(KEY_SIZE) == path.stat().st_size
    except (OSError, ValueError, ModelNotFoundError):
        return False


def _remove_stale_temporaries(path: Path) -> None:
    """Temporary files of this cache entry left by a killed process (their writer's pid is gone)."""
    pattern = re.compile(re.escape(f"{TMP_PREFIX}{path.name}.") + r"(\d+)-[0-9a-f]+" + re.escape(TMP_SUFFIX))
    for tmp in path.parent.glob(f"{TMP_PREFIX}{path.name}.*"):
        m = pattern.fullmatch(tmp.name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                tmp.unlink()
        except OSError:
            pass


def quantized_file(
    folder: Path, name: str, config: Any, quant: str, dtype: torch.dtype, progress: Progress | None = None
) -> tuple[Path, bool]:
    """(the cached quantized GGUF of this checkpoint, whether it was made now)."""
    source = source_identity(folder, quant, dtype)
    path = cache_path(folder, source)
    if is_complete(path, source):
        return path, False
    planned, why = plan(folder, config, quant)
    if not planned:
        raise MedusaChatError(f"{folder} cannot be quantized tensor by tensor: {why}")
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path)
    text = json.dumps(source, sort_keys=True)
    _, _, total = header_bytes(planned, getattr(config, "model_type", "llama"), text)
    free = shutil.disk_usage(path.parent).free
    if free < total * 1.02:
        raise OSError(
            28, f"{human(total)} needed for the quantized file, {human(free)} free in {path.parent}"
        )
    say = progress or (lambda text: None)
    label = f"Quantizing {name} once to {quant} blocks (cached for next time)"
    say(f"{label}: 0/{len(planned)} tensors")
    last = [time.monotonic()]

    def tick(done: int) -> None:
        now = time.monotonic()
        if done == len(planned) or now - last[0] >= 2.0:
            last[0] = now
            say(f"{label}: {done}/{len(planned)} tensors")

    arch = str(getattr(config, "model_type", "llama"))
    t0 = time.monotonic()
    atomic_write(path, lambda fh: write_gguf(fh, planned, arch, text, dtype, tick))
    say(f"  {human(total)} written to {path} in {time.monotonic() - t0:.0f} s")
    _release_memory()
    return path, True


def human(n: float) -> str:
    from medusa_chat.units import human_bytes

    return human_bytes(n)


def _release_memory() -> None:
    from medusa_chat.model.forward.block_forward import trim_heap

    trim_heap()


def load_quantized_backbone(folder: Path, name: str, config: Any, options: WeightsOptions) -> Any:
    """The backbone of checkpoint `folder` on the block kernel, from its cached quantized GGUF (made now when
    there is none yet). A cached file the GGUF loader refuses (damaged after its check) is made again once.
    `options.half_embedding`: a 16-bit token embedding stays 16-bit in memory, rows widened as looked up (the
    same values as an fp32 table, half the bytes)."""
    from medusa_chat.model.sources.gguf_model import load_gguf_backbone

    quant, dtype, notes, progress = options.quant, options.dtype, options.notes, options.progress
    path, made = quantized_file(folder, name, config, quant, dtype, progress)
    scratch: list[str] = []
    try:
        model, _ = load_gguf_backbone(path, folder, torch.device("cpu"), replace(options, notes=scratch))
    except ModelNotFoundError:
        if made:
            raise
        with contextlib.suppress(OSError):
            path.unlink()
        path, made = quantized_file(folder, name, config, quant, dtype, progress)
        scratch = []
        model, _ = load_gguf_backbone(path, folder, torch.device("cpu"), replace(options, notes=scratch))
    # as the in-memory path counts it: a tied lm_head is the embedding's weight (its blocks still cost bytes)
    set_tied_lm_head(model, bool(getattr(config, "tie_word_embeddings", False)))
    kinds = "Q4_1 projections, Q8_0 lm_head" if quant == "int4" else "Q8_0 projections and lm_head"
    notes.append(
        f"weights from the cached quantized file {path} ({kinds}; "
        + ("quantized from the checkpoint at this start)" if made else "quantized from the checkpoint once)")
    )
    notes.extend(n for n in scratch if "used as stored" not in n)
    return model
