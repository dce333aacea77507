"""A GGUF file read for everything but its weights: its tensor table, its metadata, and the weightless model
folder the loader treats like any model folder (config, tokenizer with its chat template, generation config).

`gguf_model_dir` builds that folder from one pass over the GGUF's metadata once per file (keyed by path, size
and mtime; exactly what transformers' AutoConfig/AutoTokenizer make with `gguf_file=`, without their slow
GGUFReader parse: gguf_config_dict) and keeps it in the user cache, so the next start reads three small files.
gguf_model.py builds the backbone from the tensors.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from medusa_chat.atomic import atomic_write_text, replace_folder
from medusa_chat.errors import MedusaChatError, ModelNotFoundError
from medusa_chat.paths import cache_root

Progress = Callable[[str], None]

SUPPORTED_ARCHS = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
)  # what the native step runs exactly (model_type after transformers' mapping)
HEAD_DIM_KEYED = ("qwen3",)  # whose head_dim the config takes from {arch}.attention.key_length
FOLDER_VERSION = "1"  # bump when the weightless folder's contents change


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: where its bytes are, not the bytes."""

    name: str
    shape: tuple[int, ...]  # torch order ([rows, cols] for a matrix)
    type_id: int
    type_name: str
    offset: int  # from the start of the file
    nbytes: int


# ---- reading the file ------------------------------------------------------------------------------------------
def read_table(gguf: Path) -> dict[str, TensorEntry]:
    """The file's tensor table (name -> TensorEntry); its memory map is dropped before this returns. A truncated
    or malformed file raises ModelNotFoundError."""
    from medusa_chat.kernels.gguf_file import read_tensors

    try:
        tensors = read_tensors(gguf)
    except (ValueError, OSError) as err:
        raise ModelNotFoundError(f"{gguf} cannot be used as a model: {err}") from err
    table: dict[str, TensorEntry] = {}
    for t in tensors.values():
        root = t.data
        while isinstance(root.base, np.ndarray):  # the whole-file map the view was sliced from
            root = root.base
        offset = t.data.ctypes.data - root.ctypes.data
        table[t.name] = TensorEntry(t.name, t.shape, t.type_id, t.type_name, offset, t.data.nbytes)
    del tensors, t, root
    return table


def read_metadata(gguf: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """The scalar/string metadata values of `keys` that the file has (gguf_file.read_metadata, one pass over the
    metadata; a file it cannot read is a ModelNotFoundError)."""
    from medusa_chat.kernels import gguf_file

    try:
        meta = gguf_file.read_metadata(gguf)
    except ValueError as err:
        raise ModelNotFoundError(f"{gguf}: its metadata cannot be read (truncated or corrupt file?)") from err
    return {k: meta[k] for k in keys if isinstance(meta.get(k), (str, int, float, bool))}


def check_architecture(gguf: Path) -> str:
    """general.architecture, refused with a clear error unless the native step runs it exactly."""
    arch = str(read_metadata(gguf, ("general.architecture",)).get("general.architecture", ""))
    if arch in SUPPORTED_ARCHS:
        return arch
    why = " (the file names no general.architecture)" if not arch else ""
    raise ModelNotFoundError(
        f"{gguf.name}: GGUF architecture {arch or '?'!r} is not supported{why}; supported are "
        f"{', '.join(SUPPORTED_ARCHS)} (Llama 1/2/3, Mistral, TinyLlama, SmolLM, Qwen2 / Qwen2.5, Qwen3, ...)"
    )


def read_tensor_bytes(f: Any, entry: TensorEntry) -> np.ndarray:
    """One tensor's bytes from the open file `f` (a plain read: no memory map left behind)."""
    buf = bytearray(entry.nbytes)
    f.seek(entry.offset)
    if f.readinto(buf) != entry.nbytes:
        raise ModelNotFoundError(f"{f.name}: tensor {entry.name} runs past the end of the file (truncated?)")
    return np.frombuffer(buf, dtype=np.uint8)


def dequantize_raw(type_id: int, raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 values of `raw` (the tensor's bytes, or whole rows of them) in `shape`: gguf_file.dequantize for
    the types it knows (bitwise what the embedded model's conversion gives), else gguf-py's dequantizer."""
    from medusa_chat.kernels.gguf_file import GGUFTensor, dequantize

    raw = np.ascontiguousarray(raw).reshape(-1)
    if type_id == 30:  # BF16: the top half of an fp32
        return torch.from_numpy((raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape))
    if type_id in (0, 1, 3, 8):
        return torch.from_numpy(np.array(dequantize(GGUFTensor("", shape, type_id, raw)), copy=True))
    import gguf as gguf_py

    try:
        qtype = gguf_py.GGMLQuantizationType(type_id)
    except ValueError as err:
        raise MedusaChatError(f"GGML type {type_id} cannot be dequantized here") from err
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return torch.from_numpy(gguf_py.quants.dequantize(raw.reshape(rows, -1), qtype).reshape(shape).copy())


# ---- the weightless model folder --------------------------------------------------------------------------------
def gguf_model_dir(gguf: Path, progress: Progress | None = None) -> Path:
    """A folder with the file's config.json, tokenizer files and generation config (no weights), made once."""
    st = gguf.stat()
    source = {"gguf": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "version": FOLDER_VERSION}
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", gguf.stem)[:48]
    out = cache_root() / "models" / f"gguf-{slug}-{key}"
    stamp = out / "medusa_chat_source.json"
    try:
        if json.loads(stamp.read_text()) == source:
            return out
    except (OSError, json.JSONDecodeError):
        pass
    read_table(gguf)  # a truncated file is refused before transformers parses it
    check_architecture(gguf)
    if progress:
        progress(f"Reading the config and tokenizer of {gguf.name} once (kept in {out})")

    def write(tmp: Path) -> None:
        _write_folder(gguf, tmp)
        atomic_write_text(tmp / stamp.name, json.dumps(source))

    return replace_folder(out, write, prefix=".gguf-")


def _write_folder(gguf: Path, out: Path) -> None:
    from transformers import GenerationConfig

    # the class name by model type: the mapping of classes would import the modeling module (~1 s) for a name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = gguf_config(gguf)
        tokenizer = gguf_tokenizer(gguf)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ModelNotFoundError(f"cannot read the config and tokenizer of {gguf}: {first[:300]}") from err
    if getattr(config, "model_type", None) not in SUPPORTED_ARCHS:
        raise ModelNotFoundError(
            f"{gguf.name}: model type {config.model_type!r} is not supported; supported are "
            f"{', '.join(SUPPORTED_ARCHS)}"
        )
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def gguf_config_dict(metadata: dict[str, Any], tensor_names: Iterable[str]) -> dict[str, Any]:
    """The config dict transformers' GGUF loader (`load_gguf_checkpoint(...)["config"]`) makes of a Llama,
    Mistral or Qwen2 file, from metadata read once (`gguf_file.read_metadata`). That loader opens the file
    with gguf-py's GGUFReader, which makes a numpy view of every metadata value, the vocabulary and merges
    included: ~5 s per call for a 49k vocabulary, and AutoConfig and AutoTokenizer each call it. The rules
    here are that loader's, step for step, over the same rename tables (tests compare the saved config.json
    with transformers' own, byte for byte)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = str(metadata["general.architecture"])
    names = [metadata["general.name"]] if "general.name" in metadata else []
    # llama.cpp writes Mistral files as llama; the loader tells them apart by the model name alone
    updated = "mistral" if "llama" in arch and "mistral" in names else arch
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in set(tensor_names)}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, config_key = key.replace(arch, updated).partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(config_key, -1)
        if renamed not in (None, -1):
            config[renamed] = value
    key_length = metadata.get(f"{arch}.attention.key_length")
    if updated in HEAD_DIM_KEYED and isinstance(key_length, int):
        config["head_dim"] = key_length  # Qwen3-4B: 128, not hidden / heads (transformers' table skips the key)
    if "vocab_size" not in config and isinstance(metadata.get("tokenizer.ggml.tokens"), int):
        config["vocab_size"] = metadata["tokenizer.ggml.tokens"]  # read_metadata gives a string array's length
    return config


def gguf_config(gguf: Path) -> Any:
    """The transformers config of a Llama/Mistral/Qwen2 GGUF, as `AutoConfig.from_pretrained(folder,
    gguf_file=...)` makes it, from one pass over the metadata (no vocabulary decoded)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from medusa_chat.kernels.gguf_file import read_metadata as read_all

    metadata = read_all(gguf)
    config_dict = gguf_config_dict(metadata, read_table(gguf))
    if config_dict.get("model_type") not in SUPPORTED_ARCHS:
        raise ModelNotFoundError(
            f"{gguf.name}: model type {config_dict.get('model_type')!r} is not supported; supported are "
            f"{', '.join(SUPPORTED_ARCHS)}"
        )
    return CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)


def gguf_tokenizer(gguf: Path) -> Any:
    """The tokenizer of a Llama/Mistral/Qwen2 GGUF, as `AutoTokenizer.from_pretrained(folder, gguf_file=...)`
    makes it.

    AutoTokenizer first parses the whole file's metadata with the slow GGUFReader (see gguf_config_dict) only
    to learn the model type, which picks the class: TokenizersBackend for llama and mistral (no Llama-specific
    tokenizer class is registered in transformers 5, and a GGUF folder is not in Mistral's own format),
    Qwen2Tokenizer (a TokenizersBackend) for qwen2. That class reads the vocabulary, merges and special tokens
    with transformers' fast metadata reader and converts them itself, so calling it directly gives the same
    tokenizer without that parse. The converter follows `tokenizer.ggml.model`: "llama" is sentencepiece,
    "gpt2" byte-level BPE (what Qwen2 files state) split by the regex `tokenizer.ggml.pre` names ("qwen2");
    transformers refuses another model with a one-line ValueError naming those it knows (_write_folder makes
    it a ModelNotFoundError)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = TokenizersBackend
    if read_metadata(gguf, ("general.architecture",)).get("general.architecture") in ("qwen2", "qwen3"):
        from transformers import Qwen2Tokenizer  # what AutoTokenizer picks for both (same tokenizer.json)

        cls = Qwen2Tokenizer
    return cls.from_pretrained(str(gguf.parent), gguf_file=gguf.name, _from_auto=True)
