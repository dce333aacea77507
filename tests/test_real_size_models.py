"""benchmarks/make_real_size_models.py at its "tiny" shape: the files it writes are what medusa_chat and llama.cpp
read (HF folder + Medusa-1 heads loaded by the real loader and decoded; GGUF files made by llama.cpp's own tools
when they are installed: MEDUSA_CHAT_LLAMA_CPP), streamed tensor by tensor, reproducible and resumable.

Marked slow: the writer copies the embedded model's tokenizer, which the first use in a fresh cache converts (~15 s,
shared with the other tests that use the embedded model); the rest takes a few seconds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from benchmarks import make_real_size_models as rs
from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.errors import HeadsError
from medusa_chat.events import GenerationSettings, ReplySummary
from medusa_chat.model.sources.heads_files import load_heads_file
from medusa_chat.model.sources.loading import load_model
from medusa_chat.tree import Tree

pytestmark = pytest.mark.slow
TINY = rs.SHAPES["tiny"]


@pytest.fixture(scope="module")
def tiny_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("realsize") / "llama-tiny"
    # a shard limit below the embedding's size: the folder is sharded with an index, as 7B checkpoints are
    rs.make("tiny", out, shard_bytes=4 << 20, say=lambda s: None)
    return out


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_hf_folder_has_every_tensor_streamed_and_reproducible(tiny_out: Path) -> None:
    hf = tiny_out / "hf"
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in hf.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    state = _read_all(hf)
    assert {k: tuple(v.shape) for k, v in state.items()} == dict(TINY.tensors())
    assert sum(v.numel() for v in state.values()) == TINY.params()
    assert all(v.dtype == torch.float16 for v in state.values())
    assert torch.equal(state["model.norm.weight"], torch.ones(TINY.hidden, dtype=torch.float16))
    emb = state["model.embed_tokens.weight"].float()
    assert abs(emb.std().item() - rs.STD) < 1e-3 and abs(emb.mean().item()) < 1e-3
    # each tensor is its own seeded stream: the same bytes again, and different tensors differ
    again = b"".join(rs.tensor_chunks("model.embed_tokens.weight", (TINY.vocab, TINY.hidden), 0))
    assert again == state["model.embed_tokens.weight"].numpy().tobytes()
    assert not torch.equal(
        state["model.layers.0.self_attn.q_proj.weight"], state["model.layers.1.self_attn.q_proj.weight"]
    )
    config = json.loads((hf / "config.json").read_text())
    assert config["vocab_size"] == TINY.vocab and config["num_key_value_heads"] == TINY.kv_heads
    assert (hf / "tokenizer.json").is_file() and (hf / "chat_template.jinja").is_file()


def test_chunked_writer_matches_one_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows drawn a few at a time are the rows one draw of the whole tensor gives (chunking changes no value)."""
    whole = b"".join(rs.tensor_chunks("w", (100, 64), 7))
    monkeypatch.setattr(rs, "CHUNK_ELEMENTS", 64 * 3)  # 3 rows per chunk, the last one short
    assert b"".join(rs.tensor_chunks("w", (100, 64), 7)) == whole


def test_rerun_skips_and_resumes_a_missing_shard(tiny_out: Path) -> None:
    hf = tiny_out / "hf"
    first = sorted(hf.glob("model-*.safetensors"))[0]
    before = first.read_bytes()
    first.unlink()
    (hf / rs.STAMP).unlink()
    lines: list[str] = []
    rs.make("tiny", tiny_out, shard_bytes=4 << 20, say=lines.append)
    assert first.read_bytes() == before  # rewritten alone, bit for bit
    assert sum("exists, kept" in s for s in lines) == len(list(hf.glob("model-*.safetensors"))) - 1
    assert any("medusa1: exists, skipped" in s for s in lines)
    lines.clear()
    rs.make("tiny", tiny_out, shard_bytes=4 << 20, say=lines.append)
    assert any(s.endswith("hf: exists, skipped") for s in lines)
    assert not list(tiny_out.rglob("*.tmp"))


def test_medusa1_heads_in_the_published_layout_fit_the_backbone(tiny_out: Path, tmp_path: Path) -> None:
    heads, path, config = load_heads_file(tiny_out / "medusa1")
    assert path.name == "medusa_lm_head.safetensors" and heads.own_lm_head
    assert heads.num_heads == TINY.medusa_heads == config["medusa_num_heads"] and heads.num_layers == 1
    assert (heads.hidden_size, heads.vocab_size) == (TINY.hidden, TINY.vocab)
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == {k for k, _ in rs.medusa1_tensors(TINY)}
    # heads of another shape are refused against this backbone
    rs.write_medusa1_heads(rs.SHAPES["small"], tmp_path / "small-heads", tiny_out / "hf", say=lambda s: None)
    with pytest.raises(HeadsError, match="hidden size 256"):
        load_model(
            model=str(tiny_out / "hf"), heads=str(tmp_path / "small-heads"), device="cpu", quant="none"
        )


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_loads_and_decodes_with_medusa_chat(tiny_out: Path, quant: str) -> None:
    model = load_model(model=str(tiny_out / "hf"), heads=str(tiny_out / "medusa1"), device="cpu", quant=quant)
    assert model.quant == quant and model.heads.num_heads == TINY.medusa_heads
    assert model.backbone.config.num_hidden_layers == TINY.layers
    prompt = model.build_prompt([{"role": "user", "content": "Hello there"}])
    assert model.tokenizer.decode(prompt).startswith("<|im_start|>")  # SmolLM2's ChatML template came along

    def reply(tree: Tree) -> list[int]:
        settings = GenerationSettings(max_new_tokens=8, temperature=0)
        events = MedusaEngine(model, tree).generate(prompt, settings)
        return next(e for e in events if isinstance(e, ReplySummary)).token_ids

    plain = reply(plain_tree())
    assert len(plain) >= 1
    assert reply(Tree.chain(TINY.medusa_heads)) == plain  # random heads: nothing accepted, still exact


def test_bad_shape_and_types_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(rs.RealSizeError, match="unknown shape"):
        rs.make("3b", tmp_path)
    with pytest.raises(rs.RealSizeError, match="unsupported GGUF"):
        rs.make("tiny", tmp_path, gguf_types=["Q3_X"])
    with pytest.raises(rs.RealSizeError, match="llama.cpp tools missing"):
        rs.llama_cpp_tools(tmp_path)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen2-0.5b-l4", "7b"])
def test_shape_tensors_are_the_transformers_models(name: str) -> None:
    """Every shape's tensor list and config.json are what transformers builds from that config: the same names and
    shapes (Qwen3's 128-wide heads make q_proj 2048 x 1024 and o_proj 1024 x 2048; its q/k norms per head)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = rs.SHAPES[name]
    config_dict = rs.qwen2_config(shape) if shape.qwen else rs.llama_config(shape)
    config = AutoConfig.for_model(**{k: v for k, v in config_dict.items() if k != "model_type"},
                                  model_type=str(config_dict["model_type"]))  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if shape.tied:
        expected.pop("lm_head.weight")
    assert dict(shape.tensors()) == expected
    assert shape.params() == sum(int(torch.Size(d).numel()) for d in expected.values())


LLAMA_CPP = os.environ.get(rs.LLAMA_CPP_ENV)


@pytest.mark.skipif(
    not LLAMA_CPP or not (Path(LLAMA_CPP) / "convert_hf_to_gguf.py").is_file(),
    reason=f"llama.cpp tools not given (set {rs.LLAMA_CPP_ENV})",
)
def test_gguf_files_by_llama_cpp(tmp_path: Path) -> None:
    """At rows of 256 the Q4_K_M file really holds K-quant blocks; the tokenizer is recognised as SmolLM's."""
    import importlib

    gguf = importlib.import_module("gguf")  # gguf-py (the venv's copy)
    files = rs.make("small", tmp_path, ["Q4_K_M", "Q8_0"], Path(str(LLAMA_CPP)), say=lambda s: None)
    assert not (tmp_path / "llama-small-f16.gguf").exists()  # deleted without --keep-f16
    reader = gguf.GGUFReader(str(files["Q4_K_M"]))
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert {"Q4_K", "Q6_K"} <= kinds, kinds
    pre = reader.fields["tokenizer.ggml.pre"]
    assert bytes(pre.parts[pre.data[0]]).decode() == "smollm"
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(files["Q8_0"])).tensors} <= {"Q8_0", "F32"}
