"""A Qwen2 / Qwen2.5 Hugging Face checkpoint (safetensors, q/k/v biases) on a CPU block path is quantized tensor by
tensor into the cached GGUF (model/sources/quantized_cache.py) as llama.cpp's converter lays out a Qwen2 file: architecture
qwen2, the q/k/v biases F32, the q/k rows in Hugging Face's order. Then the native C step runs it: its greedy tree
decoding is the plain loop's, its logits agree with the transformers float model (and would not without the
biases), a later start maps the file, and no whole float model is ever built. Other bias layouts keep the old path,
with the reason in the model's notes."""

from __future__ import annotations

import functools
import json
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.kernels import cbind
from medusa_chat.kernels.gguf_file import dequantize, read_tensors
from medusa_chat.model.sources import checkpoint_reader, loading, quantized_cache
from medusa_chat.model.sources.gguf_folder import read_metadata
from medusa_chat.model.sources.gguf_names import gguf_state_dict
from medusa_chat.model.sources.loading import LoadedModel, load_model
from medusa_chat.tree import Tree
from tests.test_qwen2 import IDS, _close, _heads, _logits, _native, _reply
from tests.tinygguf import tiny_qwen2, write_qwen2_folder

pytestmark = pytest.mark.skipif(not cbind.available(), reason="block kernel not available here")

VARIANTS = {"tied": {"seed": 0, "tied": True}, "untied": {"seed": 3, "tied": False}}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "cache" / "models"


@functools.cache
def _root() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix="qwen2-hf-"))


@functools.cache
def _folder(name: str) -> Path:
    return write_qwen2_folder(_root() / f"tiny-qwen2-{name}", tiny_qwen2(**VARIANTS[name]))


def _load(folder: Path, quant: str, progress: list[str] | None = None, **kw: Any) -> LoadedModel:
    return load_model(
        str(folder),
        quant=quant,
        device="cpu",
        progress=progress.append if progress is not None else None,
        **kw,
    )


def _cached_file(cache: Path, quant: str) -> Path:
    (path,) = cache.glob(f"hfq-*-{quant}-*.gguf")
    return path


def _float_model(folder: Path, gguf: Path | None = None, *, biases: bool = True) -> Any:
    """The transformers float Qwen2 of the checkpoint (fp32), or holding exactly the values of the cached file
    `gguf` (its blocks dequantized, its lm_head its own); `biases=False`: the q/k/v biases zeroed."""
    from transformers import AutoConfig, Qwen2ForCausalLM

    config = AutoConfig.from_pretrained(folder)
    if gguf is None:
        model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
        state = model.state_dict()
    else:
        config.tie_word_embeddings = (
            False  # the file's lm_head is Q8_0 blocks of the embedding: a tensor apart
        )
        model = Qwen2ForCausalLM(config)
        state = gguf_state_dict(gguf, config)
    if not biases:
        state = {k: torch.zeros_like(v) if k.endswith(".bias") else v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=gguf is None)
    assert not missing and not unexpected, (missing, unexpected)
    return model.eval()


# ---- the file ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_qwen2_checkpoint_is_written_as_a_qwen2_gguf(name: str, quant: str, cache: Path) -> None:
    folder = _folder(name)
    progress: list[str] = []
    loaded = _load(folder, quant, progress)
    assert any(f"Quantizing {folder} once to {quant} blocks" in p for p in progress), progress
    assert any("cached quantized file" in n for n in loaded.notes), loaded.notes
    assert (
        loaded.backbone.config.model_type == "qwen2" and loaded.info()["architecture"] == "Qwen2ForCausalLM"
    )
    path = _cached_file(cache, quant)
    assert read_metadata(path, ("general.architecture",))["general.architecture"] == "qwen2"
    tensors = read_tensors(path)
    source = _float_model(folder)
    state = source.state_dict()
    layers = source.config.num_hidden_layers
    kind = "Q4_1" if quant == "int4" else "Q8_0"
    for i in range(layers):
        for module, part in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v")):
            bias = tensors[f"blk.{i}.{part}.bias"]
            want = state[f"model.layers.{i}.self_attn.{module}.bias"]
            assert bias.type_name == "F32" and torch.equal(torch.from_numpy(dequantize(bias)), want)
            weight = tensors[f"blk.{i}.{part}.weight"]
            assert weight.type_name == kind
            # Hugging Face's row order: each row is its own row, rounded (a rotary permutation would move rows)
            w = torch.from_numpy(dequantize(weight))
            ref = state[f"model.layers.{i}.self_attn.{module}.weight"]
            err = (w - ref).abs().amax(dim=1)
            assert (err < 0.2 * ref.abs().amax(dim=1)).all(), f"layer {i} {module}: rows moved?"
        assert f"blk.{i}.attn_output.bias" not in tensors
    assert tensors["output.weight"].type_name == "Q8_0"
    assert tensors["token_embd.weight"].type_name == "F16"  # as the checkpoint stores it
    # the native C step runs it, with the file's biases
    native = _native(loaded)
    assert len(native.qkv_biases) == layers


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_tree_decoding_equals_the_plain_loop(name: str, cache: Path) -> None:
    loaded = _load(_folder(name), "int4", heads=str(_heads()))  # random Medusa heads: branching trees
    _native(loaded)
    prompts = [loaded.build_prompt([{"role": "user", "content": "Tell me about the sea."}]), [1, 2, 3, 200]]
    assert prompts[0][0] == loaded.tokenizer.convert_tokens_to_ids(
        "<|im_start|>"
    )  # the template, whole tokens
    plain = MedusaEngine(loaded, plain_tree())
    refs = [_reply(plain, p) for p in prompts]
    assert refs[0] != refs[1]
    for tree in (Tree.chain(3), Tree.named("mc_sim_7b_63").prefix(12)):
        engine = MedusaEngine(loaded, tree)
        for prompt, ref in zip(prompts, refs, strict=True):
            assert _reply(engine, prompt) == ref, f"{name}, {tree.name}"


@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_native_logits_agree_with_the_transformers_float_model(name: str, quant: str, cache: Path) -> None:
    """Against the transformers float Qwen2 on the cached file's values, within the tolerance the native step is
    held to (tests/test_qwen2.py); and the same model with its q/k/v biases zeroed is far outside it, so a file
    or a step that dropped them would fail here. int8 also stays within it of the checkpoint's own float model."""
    folder = _folder(name)
    loaded = _load(folder, quant)
    _native(loaded)
    got = _logits(loaded)
    path = _cached_file(cache, quant)
    with torch.inference_mode():
        ref = _float_model(folder, path)(IDS[None]).logits[0]
        bare = _float_model(folder, path, biases=False)(IDS[None]).logits[0]
        checkpoint = _float_model(folder)(IDS[None]).logits[0]
    assert _close(got, ref), f"max |diff| {(got - ref).abs().max().item()} of {ref.abs().max().item()}"
    assert not _close(got, bare) and (ref - bare).abs().max() > 10 * 0.02 * ref.abs().max()
    if quant == "int8":
        assert _close(got, checkpoint), f"max |diff| {(got - checkpoint).abs().max().item()}"


# ---- the cache --------------------------------------------------------------------------------------------------
def test_a_later_start_maps_the_file(cache: Path) -> None:
    folder = _folder("untied")
    first: list[str] = []
    a = _load(folder, "int4", first)
    assert any("Quantizing" in p for p in first)
    path = _cached_file(cache, "int4")
    stamp = path.stat().st_mtime_ns
    again: list[str] = []
    b = _load(folder, "int4", again)
    assert not any("Quantizing" in p for p in again), again
    assert any("quantized from the checkpoint once" in n for n in b.notes), b.notes
    assert path.stat().st_mtime_ns == stamp and len(list(cache.glob("hfq-*.gguf"))) == 1
    prompt = [1, 2, 3, 200]
    assert _reply(MedusaEngine(b, plain_tree()), prompt) == _reply(MedusaEngine(a, plain_tree()), prompt)
    assert torch.equal(_logits(a), _logits(b))


def test_no_whole_float_model_is_built(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint is read one tensor at a time (each freed before the next is read) and transformers never
    loads it: no float copy of the whole model exists at any moment."""
    from transformers import PreTrainedModel

    def refuse(*args: Any, **kw: Any) -> Any:
        raise AssertionError("a whole float model was loaded")

    monkeypatch.setattr(loading, "load_backbone", refuse)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))
    real = checkpoint_reader.read_tensor
    alive: list[weakref.ref[torch.Tensor]] = []
    overlaps: list[int] = []

    def tracked(f: Any, t: checkpoint_reader.SourceTensor) -> torch.Tensor:
        overlaps.append(
            sum(r() is not None for r in alive)
        )  # earlier tensors still held when this one is read
        out = real(f, t)
        alive.append(weakref.ref(out))
        return out

    monkeypatch.setattr(checkpoint_reader, "read_tensor", tracked)
    folder = _folder("tied")
    loaded = _load(folder, "int4")
    assert any("cached quantized file" in n for n in loaded.notes)
    # per layer 7 projections, 3 biases, 2 norms; the embedding, the final norm, and the embedding again for the
    # tied lm_head's Q8_0 blocks
    tensors = json.loads((folder / "config.json").read_text())["num_hidden_layers"] * 12 + 3
    assert len(overlaps) == tensors and max(overlaps) == 0, overlaps
    assert not any(type(m) is torch.nn.Linear for m in loaded.backbone.modules())  # every projection blocks


# ---- what keeps the old path ----------------------------------------------------------------------------------------
def _with_tensor(folder: Path, out: Path, name: str, value: torch.Tensor | None) -> Path:
    """A copy of checkpoint `folder` with tensor `name` set to `value` (None: left out)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    state = load_file(out / "model.safetensors")
    if value is None:
        del state[name]
    else:
        state[name] = value
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_other_bias_layouts_keep_the_old_path_with_a_reason(cache: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, LlamaForCausalLM

    from tests.tinymodels import tiny_config

    folder = _folder("tied")
    config = AutoConfig.from_pretrained(folder)
    assert quantized_cache.plan(folder, config, "int4")[1] == ""
    o_bias = _with_tensor(
        folder, tmp_path / "o-bias", "model.layers.1.self_attn.o_proj.bias", torch.zeros(64).half()
    )
    why = quantized_cache.plan(o_bias, config, "int4")[1]
    assert "model.layers.1.self_attn.o_proj.bias" in why and "q/k/v" in why
    no_k = _with_tensor(folder, tmp_path / "no-k", "model.layers.0.self_attn.k_proj.bias", None)
    assert (
        quantized_cache.plan(no_k, config, "int4")[1]
        == "the checkpoint lacks model.layers.0.self_attn.k_proj.bias"
    )
    for flag, words in (("attention_bias", "attention projections"), ("mlp_bias", "MLP projections")):
        llama = tmp_path / flag
        LlamaForCausalLM(tiny_config("llama", **{flag: True})).save_pretrained(llama)
        why = quantized_cache.plan(llama, AutoConfig.from_pretrained(llama), "int4")[1]
        assert words in why and flag in why, why
    # such a checkpoint still loads (whole, then quantized in memory) and its notes say why
    loaded = _load(o_bias, "int4")
    assert not list(cache.glob("hfq-*")) if cache.exists() else True
    assert any("o_proj.bias" in n and "float load" in n for n in loaded.notes), loaded.notes
