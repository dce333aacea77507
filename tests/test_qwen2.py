"""Qwen2 / Qwen2.5 GGUF files (architecture qwen2: Llama's layers with q/k/v biases, Hugging Face's q/k row order,
a byte-level BPE vocabulary with Qwen2's split regex), on tiny random Qwen2 models made with transformers and
written as llama.cpp's converter lays them out (tests/tinygguf.py): the biases are read and added (in the native C
step and in the PyTorch fallbacks), tree decoding reproduces the plain loop, the native step's logits agree with
the transformers float model, a run without the biases would not, and what is still unsupported is a clear error.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from medusa_chat.engine.engine import MedusaEngine, TreeKVCache, plain_tree
from medusa_chat.errors import ModelNotFoundError
from medusa_chat.events import GenerationSettings, ReplySummary
from medusa_chat.kernels import cbind, cthreads
from medusa_chat.kernels.cpu_linears import BlockLinearWithBias
from medusa_chat.model.sources.gguf_folder import gguf_config
from medusa_chat.model.sources.gguf_names import gguf_state_dict
from medusa_chat.model.sources.loading import LoadedModel, load_model
from medusa_chat.tree import Tree
from tests.tinygguf import QWEN2_SHAPE, tiny_qwen2, write_qwen2_gguf
from tests.tinymodels import random_heads_state, write_heads

pytestmark = pytest.mark.skipif(not cbind.available(), reason="block kernel not available here")

# variant -> (tiny_qwen2 arguments, write_qwen2_gguf types): tied Q8_0 (as Qwen2.5-0.5B ties its table), and
# untied Q4_1 projections with a Q8_0 output.weight
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, str, str | None]]] = {
    "q8_0-tied": ({"seed": 0, "tied": True}, ("Q8_0", "Q8_0", None)),
    "q4_1-untied": ({"seed": 3, "tied": False}, ("Q4_1", "Q8_0", "Q8_0")),
}
# native step vs the transformers forward on the same weights: activations quantized per block of 32 by the block
# kernel and an fp16 KV cache (the tolerance tests/test_kquants.py holds the native step to)
RTOL = 0.02
IDS = torch.tensor([269, 117, 115, 261, 10, 84, 267, 32, 109, 101, 259, 98, 262, 116, 258, 265])


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@functools.cache
def _root() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix="qwen2-gguf-"))


@functools.cache
def _file(name: str) -> Path:
    kw, types = VARIANTS[name]
    return write_qwen2_gguf(_root() / f"tiny-qwen2-{name}.gguf", tiny_qwen2(**kw), *types)


@functools.cache
def _heads() -> Path:
    state = random_heads_state(3, own_lm_head=False, hidden=QWEN2_SHAPE["hidden"], seed=11)
    return write_heads(_root() / "heads", state, version2=True)


@functools.cache
def _loaded(name: str) -> LoadedModel:
    return load_model(str(_file(name)), heads=str(_heads()), device="cpu")


def _float_model(name: str, *, biases: bool = True) -> Any:
    """The transformers float Qwen2 holding exactly the file's values (its blocks dequantized)."""
    from transformers import Qwen2ForCausalLM

    config = gguf_config(_file(name))  # as the loader reads it (tie_word_embeddings from the tensor table)
    state = gguf_state_dict(_file(name), config)
    if not biases:
        state = {k: torch.zeros_like(v) if k.endswith(".bias") else v for k, v in state.items()}
    model = Qwen2ForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def _logits(loaded: LoadedModel, ids: torch.Tensor = IDS) -> torch.Tensor:
    """The loaded model's logits for a prefill of `ids`, through the step the engine runs (native or lean)."""
    engine = MedusaEngine(loaded, plain_tree())
    engine.fresh_cache(capacity=64)
    with torch.inference_mode():
        hidden = engine.runner.forward(
            ids, torch.arange(len(ids)), engine.causal_mask(0, len(ids)), engine.cache
        )
        return engine.runner.lm_head(hidden).float()


def _close(a: torch.Tensor, ref: torch.Tensor) -> bool:
    return torch.allclose(a, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item())


def _reply(engine: MedusaEngine, prompt: list[int], n: int = 24) -> list[int]:
    for event in engine.generate(prompt, GenerationSettings(max_new_tokens=n, temperature=0)):
        if isinstance(event, ReplySummary):
            return event.token_ids
    raise AssertionError("no summary")


def _native(loaded: LoadedModel) -> Any:
    from medusa_chat.model.forward.block_forward import NativeForward

    lean = MedusaEngine(loaded, plain_tree()).runner.lean
    assert isinstance(lean, NativeForward), "the native C step must run a Qwen2 GGUF"
    return lean


# ---- loading ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_qwen2_file_loads_with_its_biases_and_tokenizer(name: str) -> None:
    loaded = _loaded(name)
    kw, _ = VARIANTS[name]
    source = tiny_qwen2(**kw)
    model = loaded.backbone
    assert loaded.spec.kind == "gguf" and model.config.model_type == "qwen2"
    assert loaded.info()["architecture"] == "Qwen2ForCausalLM" and loaded.info()["context_limit"] == 4096
    native = _native(loaded)
    for i, layer in enumerate(model.model.layers):
        ref = source.model.layers[i].self_attn
        parts = []
        for proj in ("q_proj", "k_proj", "v_proj"):
            mod = getattr(layer.self_attn, proj)
            assert isinstance(mod, BlockLinearWithBias), proj
            want = getattr(ref, proj)
            assert torch.equal(mod.bias, want.bias), f"{proj}: the F32 bias is the model's own"
            # Hugging Face's row order (no rotary permutation to undo): the blocks are the weight, rounded
            w = mod.block.dequantized()
            assert (w - want.weight).abs().max() < 0.1 * want.weight.abs().max(), (
                f"layer {i} {proj}: rows moved?"
            )
            parts.append(want.bias)
        assert torch.equal(native.qkv_biases[i], torch.cat(parts))  # what the C step adds
    tok = loaded.tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    prompt = loaded.build_prompt([{"role": "user", "content": "the sea"}])
    assert prompt[0] == tok.convert_tokens_to_ids("<|im_start|>")  # a control token stays whole
    assert tok.decode(prompt) == "<|im_start|>user\nthe sea<|im_end|>\n<|im_start|>assistant\n"
    assert tok("the sea")["input_ids"] == [116, 257, 265]  # t, he, Ġsea: the file's merges, Qwen2's split


# ---- decoding ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_tree_decoding_equals_the_plain_loop(name: str) -> None:
    loaded = _loaded(name)
    _native(loaded)
    prompts = [loaded.build_prompt([{"role": "user", "content": "Tell me about the sea."}]), [1, 2, 3, 200]]
    plain = MedusaEngine(loaded, plain_tree())
    refs = [_reply(plain, p) for p in prompts]
    assert refs[0] != refs[1]
    for tree in (Tree.chain(3), Tree.named("mc_sim_7b_63").prefix(12)):
        engine = MedusaEngine(loaded, tree)
        for prompt, ref in zip(prompts, refs, strict=True):
            assert _reply(engine, prompt) == ref, f"{name}, {tree.name}"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_native_logits_agree_with_the_transformers_float_model(name: str) -> None:
    """The native step's logits against the transformers float Qwen2 on the file's values, within the tolerance
    the native step is held to for Llama; and a token decoded alone gets the bits it gets in a prefill block."""
    loaded = _loaded(name)
    native = _native(loaded)
    with torch.inference_mode():
        ref = _float_model(name)(IDS[None]).logits[0]
    got = _logits(loaded)
    assert _close(got, ref), f"max |diff| {(got - ref).abs().max().item()} of {ref.abs().max().item()}"
    cache = TreeKVCache(loaded.backbone.config.num_hidden_layers, capacity=64)
    n = len(IDS)
    with torch.inference_mode():
        block = native(IDS, torch.arange(n), torch.zeros(1), cache).clone()
        cache2 = TreeKVCache(loaded.backbone.config.num_hidden_layers, capacity=64)
        native(IDS[:-1], torch.arange(n - 1), torch.zeros(1), cache2)
        alone = native(IDS[-1:], torch.arange(n - 1, n), torch.zeros(1), cache2).clone()
    assert torch.equal(alone[0], block[-1])


def test_the_thread_count_changes_no_bit() -> None:
    """The bias add is per element: one thread or three give the step's logits bit for bit."""
    loaded = _loaded("q4_1-untied")
    _native(loaded)
    try:
        outs = []
        for n in (1, 3):
            cthreads.set_threads(n)
            outs.append(_logits(loaded))
    finally:
        cthreads.set_threads(0)  # the runtime's default again
    assert torch.equal(outs[0], outs[1])


def test_dropping_the_biases_would_be_caught() -> None:
    """The agreement above depends on the biases: the float model without them is far outside the tolerance,
    and the native step with its bias vectors zeroed agrees with that bias-less model instead."""
    name = "q8_0-tied"
    loaded = _loaded(name)
    native = _native(loaded)
    with torch.inference_mode():
        ref = _float_model(name)(IDS[None]).logits[0]
        bare = _float_model(name, biases=False)(IDS[None]).logits[0]
    atol = RTOL * ref.abs().max().item()
    assert (ref - bare).abs().max().item() > 10 * atol and not _close(bare, ref)
    saved = [b.clone() for b in native.qkv_biases]
    try:
        for b in native.qkv_biases:
            b.zero_()  # in place: the C struct points at these
        dropped = _logits(loaded)
    finally:
        for b, s in zip(native.qkv_biases, saved, strict=True):
            b.copy_(s)
    assert _close(dropped, bare) and not _close(dropped, ref)
    assert _close(_logits(loaded), ref)  # restored


def test_the_pytorch_fallback_adds_the_biases(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the native step off, the lean PyTorch forward runs the same modules (bias added after each block
    linear): bitwise the transformers forward over them, its logits within the tolerance of the float model,
    and its tree decoding the plain loop's."""
    from medusa_chat.model.forward.lean_forward import LeanForward
    from tests.test_lean_forward import _assert_bitwise

    monkeypatch.setenv("MEDUSA_CHAT_NATIVE", "0")
    name = "q4_1-untied"
    loaded = load_model(str(_file(name)), heads=str(_heads()), device="cpu")  # a model of its own
    assert isinstance(MedusaEngine(loaded, plain_tree()).runner.lean, LeanForward)
    _assert_bitwise(loaded, Tree.chain(3))
    with torch.inference_mode():
        ref = _float_model(name)(IDS[None]).logits[0]
    assert _close(_logits(loaded), ref)
    prompt = [1, 2, 3, 200]
    assert _reply(MedusaEngine(loaded, Tree.named("mc_sim_7b_63").prefix(12)), prompt) == _reply(
        MedusaEngine(loaded, plain_tree()), prompt
    )


# ---- errors -----------------------------------------------------------------------------------------------------
def test_unsupported_files_are_clear_one_line_errors(tmp_path: Path) -> None:
    model = tiny_qwen2()
    phi3 = write_qwen2_gguf(tmp_path / "phi3.gguf", model, arch="phi3")
    with pytest.raises(ModelNotFoundError) as err:
        load_model(str(phi3), device="cpu")
    text = str(err.value)
    assert (
        "\n" not in text
        and "architecture 'phi3' is not supported; supported are llama, mistral, qwen2" in text
    )
    no_bias = write_qwen2_gguf(tmp_path / "no-bias.gguf", model, drop=("blk.1.attn_k.bias",))
    with pytest.raises(
        ModelNotFoundError, match=r"lacks the tensor for model\.layers\.1\.self_attn\.k_proj\.bias"
    ):
        load_model(str(no_bias), device="cpu")
    odd = write_qwen2_gguf(tmp_path / "odd-tokenizer.gguf", model, tokenizer_model="rwkv")
    with pytest.raises(
        ModelNotFoundError, match=r"cannot read the config and tokenizer.*'rwkv'.*gpt2"
    ) as err:
        load_model(str(odd), device="cpu")
    assert "\n" not in str(err.value)
