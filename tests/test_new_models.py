"""The Llama-3.1 and Qwen3 aliases with their published EAGLE-3 drafts, offline from a Hugging Face cache holding
tiny models in exactly the published layouts: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (SafeAILab's EAGLE-3:
config.json with draft_vocab_size and Llama 3.1's rope_scaling, pytorch_model.bin with fc / midlayer.* / norm /
lm_head / d2t / t2d), AngelSlim/Qwen3-*_eagle3 (the same keys, LlamaForCausalLMEagle3, model_type llama) and
Tengyunw/qwen3_8b_eagle3 (SpecForge's model.safetensors, its frozen embed_tokens included). The aliases resolve
to those repos, `models` and `info` name them, the drafts load as EAGLE-3 with their rope scaling, greedy tree
decoding equals the plain loop, and a gated repository is a clear message about the Hub login.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.errors import ModelNotFoundError
from medusa_chat.model.forward.eagle import EagleDraft, rotary_inv_freq
from medusa_chat.model.sources.loading import load_model
from medusa_chat.model.sources.registry import MODELS, resolve
from medusa_chat.tree import Tree
from tests.conftest import HubCache
from tests.eagle_helpers import write_random_eagle
from tests.test_llama3_rope import ROPE, tiny_llama31
from tests.test_qwen2 import _reply
from tests.test_registry_hub import fake_hub  # noqa: F401  (the local stand-in Hub server, as a fixture)
from tests.tinygguf import tiny_qwen3, write_qwen2_folder
from tests.tinymodels import folder_files

NEW = {
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),
    "qwen3-1.7b": ("Qwen/Qwen3-1.7B", "AngelSlim/Qwen3-1.7B_eagle3"),
    "qwen3-4b": ("Qwen/Qwen3-4B", "AngelSlim/Qwen3-4B_eagle3"),
    "qwen3-8b": ("Qwen/Qwen3-8B", "AngelSlim/Qwen3-8B_eagle3"),
}


@pytest.mark.parametrize("name", list(NEW))
def test_the_aliases_name_the_model_and_its_published_draft(name: str) -> None:
    spec = resolve(name)
    assert (spec.backbone, spec.heads) == NEW[name] and spec.kind == "eagle" and not spec.custom
    assert spec.chat_template == "tokenizer" and spec.download_gb > 1 and spec.params_b
    assert Tree.named(spec.default_tree).size == 64
    assert name in MODELS


def _published_draft(folder: Path, backbone: Any, layout: str) -> dict[str, Path | bytes]:
    """A random EAGLE-3 draft for `backbone` in a published layout: "safeailab" / "angelslim" (pytorch_model.bin,
    fp16) or "specforge" (model.safetensors with the target's embed_tokens)."""
    cfg = backbone.config.to_dict()
    rope = cfg.get("rope_parameters") or {}
    cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
    write_random_eagle(folder, cfg, version=3, draft_vocab=64)
    draft_cfg = json.loads((folder / "config.json").read_text())
    draft_cfg.update(torch_dtype="float16", tie_word_embeddings=False)
    if rope.get("rope_type") == "llama3":  # the Llama 3.1 draft carries the target's scaling
        draft_cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    (folder / "config.json").write_text(json.dumps(draft_cfg, indent=2))
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    if layout == "specforge":
        state["embed_tokens.weight"] = backbone.model.embed_tokens.weight.detach().half().contiguous()
        save_file(state, str(folder / "model.safetensors"))
    else:
        (folder / "model.safetensors").unlink()
        torch.save(state, folder / "pytorch_model.bin")
    return folder_files(folder)


def _check_decoding(loaded: Any) -> None:
    prompt = loaded.build_prompt([{"role": "user", "content": "Tell me about the sea."}])
    want = _reply(MedusaEngine(loaded, plain_tree()), prompt)
    assert _reply(MedusaEngine(loaded, Tree.named("mc_sim_7b_63").prefix(12)), prompt) == want


@pytest.mark.parametrize(("alias", "heads", "layout", "quant"), [
    ("qwen3-8b", None, "angelslim", "none"),
    ("qwen3-8b", "Tengyunw/qwen3_8b_eagle3", "specforge", "none"),
    ("qwen3-1.7b", None, "angelslim", "none"),
    ("qwen3-4b", None, "angelslim", "int8"),  # the quantized cache, the native step and the C drafter
])  # fmt: skip
def test_qwen3_aliases_load_their_published_drafts_offline(
    alias: str, heads: str | None, layout: str, quant: str, hub_cache: HubCache, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    backbone = tiny_qwen3(seed=5, tied=True, layers=8)
    repo, draft_repo = NEW[alias]
    hub_cache.add(repo, folder_files(write_qwen2_folder(tmp_path / "qwen3", backbone)))
    hub_cache.add(heads or draft_repo, _published_draft(tmp_path / "draft", backbone, layout))
    loaded = load_model(alias, heads=heads, device="cpu", quant=quant)
    assert isinstance(loaded.heads, EagleDraft) and loaded.heads.version == 3
    assert loaded.backbone.config.model_type == "qwen3" and loaded.spec.kind == "eagle"
    assert loaded.heads.d2t.shape == (64,)
    if quant == "int8":
        from medusa_chat.model.forward.block_forward import NativeForward

        assert isinstance(MedusaEngine(loaded, plain_tree()).runner.lean, NativeForward)
    _check_decoding(loaded)


def test_llama31_alias_loads_the_eagle3_draft_with_its_rope_scaling(
    hub_cache: HubCache, tmp_path: Path
) -> None:
    backbone = tiny_llama31(seed=4, layers=8)
    repo, draft_repo = NEW["llama-3.1-8b"]
    hub_cache.add(repo, folder_files(write_qwen2_folder(tmp_path / "llama", backbone)))
    hub_cache.add(draft_repo, _published_draft(tmp_path / "draft", backbone, "safeailab"))
    loaded = load_model("llama-3.1-8b", device="cpu", quant="none")
    draft = loaded.heads
    assert isinstance(draft, EagleDraft) and draft.version == 3
    assert loaded.backbone.model.rotary_emb.rope_type == "llama3"
    # the draft's rotary frequencies carry the same llama3 scaling as the backbone's
    scaled = rotary_inv_freq({"rope_theta": ROPE["rope_theta"], "rope_scaling": ROPE}, draft.head_dim)
    assert torch.equal(draft.inv_freq, scaled)
    plain = rotary_inv_freq({"rope_theta": ROPE["rope_theta"]}, draft.head_dim)
    assert not torch.allclose(scaled, plain)
    _check_decoding(loaded)


def test_info_says_what_an_alias_would_download(
    capsys: pytest.CaptureFixture[str], hub_cache: HubCache
) -> None:
    from medusa_chat import cli

    assert cli.main(["info", "--model", "llama-3.1-8b"]) == 0
    out = capsys.readouterr().out
    assert "downloads meta-llama/Llama-3.1-8B-Instruct + yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (~17 GB)" in out
    assert "is gated (accept its licence on the Hub" in out


def test_a_gated_repo_is_a_clear_message(fake_hub: Any, tiny_llama_dir: Path) -> None:  # noqa: F811
    """The Hub answers a gated repo's file requests 401 with X-Error-Code GatedRepo (its listing stays public):
    huggingface_hub raises its GatedRepoError, which becomes one line on the licence and the login."""
    fake_hub.repos["meta-llama/Tiny-Gated"] = {
        n: Path(p).read_bytes() for n, p in folder_files(tiny_llama_dir).items()
    }
    fake_hub.gated = {"meta-llama/Tiny-Gated"}
    with pytest.raises(ModelNotFoundError) as err:
        load_model("meta-llama/Tiny-Gated", device="cpu", quant="none")
    text = str(err.value)
    assert "\n" not in text and "meta-llama/Tiny-Gated is gated: accept its licence on" in text
    assert "hf auth login" in text and "HF_TOKEN" in text
    from huggingface_hub.errors import GatedRepoError

    assert isinstance(err.value.__cause__, GatedRepoError)
