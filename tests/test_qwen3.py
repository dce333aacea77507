"""Qwen3 (Llama's layers without biases, an RMSNorm over each q and k head after the projection and before rotary,
head_dim apart from hidden / heads, tied embeddings on the small sizes), on tiny random Qwen3 models made with
transformers: as a GGUF laid out as llama.cpp's converter writes one (arch qwen3, blk.N.attn_q_norm / attn_k_norm)
and as a Hugging Face checkpoint. Each forward is pinned against transformers' Qwen3ForCausalLM: the lean PyTorch
forward bit for bit on the float checkpoint, the native C step and the lean forward over block linears within the
tolerance the Llama/Qwen2 tests hold them to; greedy tree decoding reproduces the plain loop on every path; a step
without the q/k norms would not agree.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from medusa_chat.engine.engine import MedusaEngine, TreeKVCache, plain_tree
from medusa_chat.errors import ModelNotFoundError
from medusa_chat.kernels import cbind
from medusa_chat.model.forward.lean_forward import LeanForward
from medusa_chat.model.sources.gguf_folder import gguf_config
from medusa_chat.model.sources.gguf_names import gguf_state_dict
from medusa_chat.model.sources.loading import LoadedModel, load_model
from medusa_chat.tree import Tree
from tests.test_qwen2 import IDS, _close, _logits, _reply
from tests.tinygguf import QWEN2_SHAPE, tiny_qwen3, write_qwen2_folder, write_qwen2_gguf
from tests.tinymodels import random_heads_state, write_heads

native_only = pytest.mark.skipif(not cbind.available(), reason="block kernel not available here")
# variant -> (tiny_qwen3 arguments, write_qwen2_gguf types): tied Q8_0 (as Qwen3-0.6B..4B tie their table) and
# untied Q4_1 projections with a Q8_0 output.weight (as Qwen3-8B)
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, str, str | None]]] = {
    "q8_0-tied": ({"seed": 0, "tied": True}, ("Q8_0", "Q8_0", None)),
    "q4_1-untied": ({"seed": 3, "tied": False}, ("Q4_1", "Q8_0", "Q8_0")),
}
TREES = (Tree.chain(3), Tree.named("mc_sim_7b_63").prefix(12))


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))


@functools.cache
def _root() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix="qwen3-"))


@functools.cache
def _file(name: str) -> Path:
    kw, types = VARIANTS[name]
    return write_qwen2_gguf(_root() / f"tiny-qwen3-{name}.gguf", tiny_qwen3(**kw), *types)


@functools.cache
def _folder(name: str) -> Path:
    return write_qwen2_folder(_root() / f"tiny-qwen3-{name}", tiny_qwen3(**VARIANTS[name][0]), torch.float32)


@functools.cache
def _heads() -> Path:
    state = random_heads_state(3, own_lm_head=False, hidden=QWEN2_SHAPE["hidden"], seed=11)
    return write_heads(_root() / "heads", state, version2=True)


def _load(source: Path, **kw: Any) -> LoadedModel:
    return load_model(str(source), heads=str(_heads()), device="cpu", **kw)


def _file_float_model(name: str, *, norms: bool = True) -> Any:
    """The transformers float Qwen3 holding exactly the file's values (its blocks dequantized); `norms=False`:
    the q/k norm weights ones (what a step that skipped them would compute, their weights aside)."""
    from transformers import Qwen3ForCausalLM

    config = gguf_config(_file(name))
    state = gguf_state_dict(_file(name), config)
    if not norms:
        state = {
            k: torch.ones_like(v) if k.endswith(("q_norm.weight", "k_norm.weight")) else v
            for k, v in state.items()
        }
    model = Qwen3ForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def _agree(got: torch.Tensor, ref: torch.Tensor, name: str) -> bool:
    """Q8_0 files: the Llama/Qwen2 tests' tolerance. Q4_1 projections quantize their activations per block too,
    and the q/k norms (weights up to ~2 here) sharpen attention: like tests/test_kquants.py's superblock case the
    error is then held by its norm (a step without the norms, or a wrong kernel, is off by tens of percent)."""
    if name.startswith("q8_0"):
        return _close(got, ref)
    return float((got - ref).norm() / ref.norm()) < 0.05


def _assert_trees_equal_plain(loaded: LoadedModel) -> None:
    prompts = [loaded.build_prompt([{"role": "user", "content": "Tell me about the sea."}]), [1, 2, 3, 200]]
    plain = MedusaEngine(loaded, plain_tree())
    refs = [_reply(plain, p) for p in prompts]
    assert refs[0] != refs[1]
    for tree in TREES:
        engine = MedusaEngine(loaded, tree)
        for prompt, ref in zip(prompts, refs, strict=True):
            assert _reply(engine, prompt) == ref, tree.name


# ---- the float checkpoint: the lean forward is transformers' bit for bit -------------------------------------
@pytest.mark.parametrize("name", list(VARIANTS))
def test_lean_forward_is_bitwise_transformers_on_a_qwen3_checkpoint(name: str) -> None:
    from tests.test_lean_forward import _assert_bitwise

    loaded = _load(_folder(name), quant="none")
    model = loaded.backbone
    assert model.config.model_type == "qwen3" and model.config.head_dim == 32
    assert model.config.head_dim != model.config.hidden_size // model.config.num_attention_heads
    lean = MedusaEngine(loaded, plain_tree()).runner.lean
    assert isinstance(lean, LeanForward) and all(layer.q_norm is not None for layer in lean.layers)
    _assert_bitwise(loaded, Tree.named("mc_sim_7b_63").prefix(12))
    with torch.inference_mode():
        ref = model(IDS[None]).logits[0]
    assert torch.equal(_logits(loaded), ref)
    _assert_trees_equal_plain(loaded)


def test_lean_forward_bf16_on_qwen3_is_bitwise_transformers() -> None:
    from tests.test_lean_forward import _assert_bitwise

    loaded = _load(_folder("q8_0-tied"), quant="none", dtype="bfloat16")
    assert loaded.backbone.model.layers[0].self_attn.q_norm.weight.dtype == torch.bfloat16
    _assert_bitwise(loaded, Tree.named("mc_sim_7b_63").prefix(16))


# ---- GGUF files -----------------------------------------------------------------------------------------------
@native_only
@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_qwen3_file_loads_and_the_native_step_runs_it(name: str) -> None:
    from medusa_chat.model.forward.block_forward import NativeForward

    loaded = _load(_file(name))
    source = tiny_qwen3(**VARIANTS[name][0])
    model = loaded.backbone
    assert loaded.spec.kind == "gguf" and model.config.model_type == "qwen3"
    assert loaded.info()["architecture"] == "Qwen3ForCausalLM" and model.config.head_dim == 32
    for layer, ref in zip(model.model.layers, source.model.layers, strict=True):
        for norm in ("q_norm", "k_norm"):
            assert torch.equal(getattr(layer.self_attn, norm).weight, getattr(ref.self_attn, norm).weight)
    native = MedusaEngine(loaded, plain_tree()).runner.lean
    assert isinstance(native, NativeForward), "the native C step must run a Qwen3 GGUF"
    assert loaded.tokenizer.eos_token == "<|im_end|>"
    with torch.inference_mode():
        ref = _file_float_model(name)(IDS[None]).logits[0]
    got = _logits(loaded)
    assert _agree(got, ref, name), f"max |diff| {(got - ref).abs().max().item()} of {ref.abs().max().item()}"
    # a token decoded alone gets the bits it gets in a prefill block
    n = len(IDS)
    with torch.inference_mode():
        block = native(IDS, torch.arange(n), torch.zeros(1), TreeKVCache(2, capacity=64)).clone()
        cache = TreeKVCache(2, capacity=64)
        native(IDS[:-1], torch.arange(n - 1), torch.zeros(1), cache)
        alone = native(IDS[-1:], torch.arange(n - 1, n), torch.zeros(1), cache).clone()
    assert torch.equal(alone[0], block[-1])
    _assert_trees_equal_plain(loaded)


@native_only
def test_dropping_the_qk_norms_would_be_caught() -> None:
    """The agreement above depends on the q/k norms: the float model with them set to ones is far outside the
    tolerance, and the native step with its norm weights set to ones agrees with that model instead."""
    name = "q8_0-tied"
    loaded = _load(_file(name))
    with torch.inference_mode():
        ref = _file_float_model(name)(IDS[None]).logits[0]
        bare = _file_float_model(name, norms=False)(IDS[None]).logits[0]
    assert not _close(bare, ref)
    native = MedusaEngine(loaded, plain_tree()).runner.lean
    weights = [t for t in native._keep if isinstance(t, torch.Tensor) and t.shape == (32,)]
    assert len(weights) == 4  # q and k norm per layer: what the C structs point at
    saved = [w.clone() for w in weights]
    try:
        for w in weights:
            w.fill_(1.0)  # in place: the C struct points at these
        dropped = _logits(loaded)
    finally:
        for w, s in zip(weights, saved, strict=True):
            w.copy_(s)
    assert _close(dropped, bare) and not _close(dropped, ref)
    assert _close(_logits(loaded), ref)


@native_only
def test_the_pytorch_fallback_runs_the_qk_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the native step off, the lean PyTorch forward over the file's block linears: bitwise the
    transformers forward over the same modules, within the tolerance of the float model, trees = plain loop."""
    from tests.test_lean_forward import _assert_bitwise

    monkeypatch.setenv("MEDUSA_CHAT_NATIVE", "0")
    name = "q4_1-untied"
    loaded = _load(_file(name))
    assert isinstance(MedusaEngine(loaded, plain_tree()).runner.lean, LeanForward)
    _assert_bitwise(loaded, Tree.chain(3))
    with torch.inference_mode():
        ref = _file_float_model(name)(IDS[None]).logits[0]
    assert _agree(_logits(loaded), ref, name)
    _assert_trees_equal_plain(loaded)


# ---- a checkpoint on the CPU block paths (the quantized cache, then the native step) ---------------------------
@native_only
@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_a_qwen3_checkpoint_on_the_block_path(quant: str, tmp_path: Path) -> None:
    from medusa_chat.kernels.gguf_file import read_tensors
    from medusa_chat.model.forward.block_forward import NativeForward

    name = "q4_1-untied" if quant == "int4" else "q8_0-tied"
    folder = _folder(name)
    loaded = _load(folder, quant=quant)
    assert any("cached quantized file" in n for n in loaded.notes), loaded.notes
    (cached,) = (tmp_path / "cache" / "models").glob(f"hfq-*-{quant}-*.gguf")
    tensors = read_tensors(cached)
    assert tensors["blk.1.attn_k_norm.weight"].type_name == "F32" and "blk.0.attn_q.bias" not in tensors
    assert isinstance(MedusaEngine(loaded, plain_tree()).runner.lean, NativeForward)
    from transformers import AutoConfig, Qwen3ForCausalLM

    # against the float model holding the cached file's values (its lm_head a tensor of its own)
    config = AutoConfig.from_pretrained(folder)
    config.tie_word_embeddings = False
    model = Qwen3ForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(gguf_state_dict(cached, config), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    with torch.inference_mode():
        ref = model(IDS[None]).logits[0]
    # (held by its norm for both: the float checkpoint's values pass through the compute dtype and the cached
    # file's blocks, and the tied lm_head is Q8_0 blocks of the embedding)
    assert _agree(_logits(loaded), ref, "checkpoint")
    _assert_trees_equal_plain(loaded)


# ---- errors ---------------------------------------------------------------------------------------------------
def test_a_qwen3_file_without_its_norms_or_a_llama_file_with_them_is_refused(tmp_path: Path) -> None:
    model = tiny_qwen3()
    missing = write_qwen2_gguf(tmp_path / "no-norm.gguf", model, drop=("blk.1.attn_k_norm.weight",))
    with pytest.raises(ModelNotFoundError, match=r"lacks tensors for .*k_norm"):
        load_model(str(missing), device="cpu")
    mislabeled = write_qwen2_gguf(tmp_path / "qwen2-with-norms.gguf", model, arch="qwen2")
    with pytest.raises(ModelNotFoundError, match=r"attn_q_norm\.weight has no place in a qwen2 model"):
        load_model(str(mislabeled), device="cpu")
    phi3 = write_qwen2_gguf(tmp_path / "phi3.gguf", model, arch="phi3")
    with pytest.raises(ModelNotFoundError, match="supported are llama, mistral, qwen2, qwen3"):
        load_model(str(phi3), device="cpu")


# ---- the CUDA int4 path (Triton's interpreter on a CPU) --------------------------------------------------------
def test_cuda_int4_path_on_qwen3_replies_equal_its_plain_loop() -> None:
    """The CUDA 4-bit load of a Qwen3 checkpoint (the lean forward over row-invariant Triton linears, exact path
    attention): Medusa replies equal its plain loop, eager and through the graph step's static body; on a CPU
    under Triton's interpreter, as tests/test_cuda_int4.py runs the Llama one."""
    from transformers import Qwen3ForCausalLM

    from medusa_chat.kernels import triton_matmul
    from tests.test_cuda_int4 import DEVICE, DTYPE, _reply
    from tests.tinymodels import moved

    if not triton_matmul.available():
        pytest.skip("needs triton (a GPU or its interpreter)")
    from medusa_chat.kernels.triton_linears import Int4Linear
    from medusa_chat.model.forward.cuda_int4 import quantize_backbone

    folder = _folder("q8_0-tied")
    loaded = _load(folder, quant="none")
    loaded.backbone = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # plain nn.Linear
    loaded = moved(loaded, DEVICE, DTYPE)
    loaded.dtype = DTYPE
    done = quantize_backbone(loaded.backbone, DEVICE, DTYPE)
    assert done["int4"] == 14 and not done["kept_16bit"]
    if DEVICE.type == "cpu":  # one program per column block: the interpreter's cost is per program
        for m in loaded.backbone.modules():
            if isinstance(m, Int4Linear):
                m.config = triton_matmul.Config(64, 32, 1, 4, 3)
    loaded.quant = "int4"
    tree = Tree.named("mc_sim_7b_63").prefix(12)
    plain = MedusaEngine(loaded, plain_tree())
    assert plain.runner.lean.path_attention and plain.runner.lean.layers[0].q_norm is not None
    prompt = [1, 2, 3, 200, 116, 257, 265]
    want = _reply(plain, prompt, 12).token_ids
    graph = MedusaEngine(loaded, tree)
    graph.use_graphs(capture=DEVICE.type == "cuda")
    for engine in (MedusaEngine(loaded, tree), graph):
        assert _reply(engine, prompt, 12).token_ids == want


# ---- the chat template's thinking switch -------------------------------------------------------------------------
def test_qwen3_thinking_is_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3's template reads `enable_thinking` (thinking when undefined); a chat asks for a direct answer unless
    MEDUSA_CHAT_THINKING=1. Templates without the switch are untouched."""
    from medusa_chat.model.sources.chat_template import build_prompt_ids
    from tests.tinygguf import QWEN2_TEMPLATE, qwen2_tokenizer

    tok = qwen2_tokenizer()
    tok.chat_template = QWEN2_TEMPLATE.replace(
        "{{ '<|im_start|>assistant\\n' }}",
        "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and enable_thinking is false %}"
        "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}",
    )
    messages = [{"role": "user", "content": "the sea"}]
    head = "<|im_start|>user\nthe sea<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(build_prompt_ids(tok, "tokenizer", messages)) == head + "<think>\n\n</think>\n\n"
    monkeypatch.setenv("MEDUSA_CHAT_THINKING", "1")
    assert tok.decode(build_prompt_ids(tok, "tokenizer", messages)) == head
    tok.chat_template = QWEN2_TEMPLATE
    monkeypatch.setenv("MEDUSA_CHAT_THINKING", "0")
    assert tok.decode(build_prompt_ids(tok, "tokenizer", messages)) == head
