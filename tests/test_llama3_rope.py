"""Llama 3.1/3.2/3.3's "llama3" RoPE scaling (rope_parameters: factor, low/high_freq_factor,
original_max_position_embeddings), GQA and tied embeddings (Llama 3.2 1B/3B), on a tiny random Llama made with
transformers: a checkpoint folder runs the lean forward bit for bit as transformers (its rotary module is the
model's own) and the native step over the quantized cache close to it; a GGUF written as llama.cpp's converter
writes one (no scaling keys, the factors as `rope_freqs.weight`, q/k rows permuted) gets the same frequencies.
The scaling is made to matter at short positions (original_max_position_embeddings 32): a step that ignored it
would be far off.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.kernels import cbind
from medusa_chat.model.sources.gguf_folder import gguf_config
from medusa_chat.model.sources.gguf_names import gguf_state_dict
from medusa_chat.model.sources.loading import LoadedModel, load_model
from medusa_chat.tree import Tree
from tests.test_qwen2 import IDS, _close, _logits
from tests.tinygguf import QWEN2_SHAPE, qwen2_shape_config, randomised, write_qwen2_folder, write_qwen2_gguf
from tests.tinymodels import random_heads_state, write_heads

ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))


def tiny_llama31(seed: int = 0, rope: dict[str, Any] | None = ROPE, layers: int = 0) -> Any:
    """A random tied Llama with GQA (4 heads, 2 KV heads) and the "llama3" RoPE scaling (None: plain RoPE)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **qwen2_shape_config(layers),
        rope_parameters=dict(rope or {"rope_type": "default", "rope_theta": ROPE["rope_theta"]}),
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    return randomised(LlamaForCausalLM, config, seed)


@functools.cache
def _root() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix="llama31-"))


@functools.cache
def _heads() -> Path:
    state = random_heads_state(3, own_lm_head=False, hidden=QWEN2_SHAPE["hidden"], seed=11)
    return write_heads(_root() / "heads", state, version2=True)


def _load(source: Path, **kw: Any) -> LoadedModel:
    return load_model(str(source), heads=str(_heads()), device="cpu", **kw)


def _positions_far(ref: torch.Tensor, other: torch.Tensor) -> bool:
    return not _close(other, ref)


def test_a_llama31_checkpoint_runs_its_scaled_rope_in_the_lean_forward() -> None:
    from tests.test_lean_forward import _assert_bitwise

    folder = write_qwen2_folder(_root() / "ckpt", tiny_llama31(), torch.float32)
    loaded = _load(folder, quant="none")
    assert loaded.backbone.model.rotary_emb.rope_type == "llama3"
    _assert_bitwise(loaded, Tree.named("mc_sim_7b_63").prefix(12))
    plain = tiny_llama31(rope=None)
    with torch.inference_mode():
        ref = loaded.backbone(IDS[None]).logits[0]
        unscaled = plain(IDS[None]).logits[0]
    assert torch.equal(_logits(loaded), ref) and _positions_far(ref, unscaled)


@pytest.mark.skipif(not cbind.available(), reason="block kernel not available here")
def test_the_native_step_on_a_llama31_checkpoint_and_gguf_file() -> None:
    """The model as a GGUF whose scaling is only its rope_freqs tensor: the native step runs it, agrees with the
    float model (with the scaling) holding the file's values and not with one without it, and decodes trees equal
    to the plain loop."""
    from medusa_chat.model.forward.block_forward import NativeForward

    model = tiny_llama31(seed=2)
    gguf = write_qwen2_gguf(_root() / "tiny-llama31.gguf", model)
    loaded = _load(gguf)
    assert any("rope_freqs" in n for n in loaded.notes), loaded.notes
    rotary = loaded.backbone.model.rotary_emb
    assert torch.allclose(rotary.inv_freq, model.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    assert isinstance(MedusaEngine(loaded, plain_tree()).runner.lean, NativeForward)
    config = gguf_config(gguf)
    assert config.num_key_value_heads == 2 and config.tie_word_embeddings
    state = gguf_state_dict(gguf, config)
    from transformers import LlamaForCausalLM

    float_model = LlamaForCausalLM(model.config).eval()
    float_model.load_state_dict(state, strict=False)
    plain = LlamaForCausalLM(config).eval()  # the file's config: no scaling keys
    plain.load_state_dict(state, strict=False)
    with torch.inference_mode():
        ref = float_model(IDS[None]).logits[0]
        unscaled = plain(IDS[None]).logits[0]
    got = _logits(loaded)
    assert _close(got, ref) and _positions_far(ref, unscaled)
    prompt = [1, 2, 3, 200, 116, 257, 265, 10, 84]
    from tests.test_qwen2 import _reply

    want = _reply(MedusaEngine(loaded, plain_tree()), prompt)
    assert _reply(MedusaEngine(loaded, Tree.named("mc_sim_7b_63").prefix(12)), prompt) == want
