"""EAGLE drafts (model/forward/eagle.py, engine/eagle_drafter.py): published Hub layouts load and are checked against the
backbone; every greedy reply is bitwise the plain loop's (static and EAGLE-2 dynamic trees, EAGLE-1 and EAGLE-3,
lean and transformers forwards); exact sampling equals the plain loop with the same seed; the drafter's features
are the backbone's and its incremental KV cache reproduces a from-scratch run of the draft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.errors import HeadsError
from medusa_chat.events import GenerationSettings
from medusa_chat.model.sources import hub
from medusa_chat.model.sources.loaded import summary_lines
from medusa_chat.model.sources.loading import load_model
from medusa_chat.model.sources.registry import heads_folder_kind
from medusa_chat.tree import Tree
from tests.eagle_helpers import (
    c_draft_agreement,
    deep_planted_backbone,
    draft_config,
    planted_eagle1_state,
    random_eagle3_state,
    write_eagle,
)
from tests.tinymodels import folder_files

TREE = Tree.named("mc_sim_7b_63").prefix(16)


def _reply(engine: MedusaEngine, prompt: list[int], **kw):
    return list(engine.generate(prompt, GenerationSettings(**kw)))[-1]


@pytest.fixture(scope="module")
def eagle1(_tiny_models, fixtures_root: Path):
    model, _, _, path = _tiny_models["llama"]
    folder = fixtures_root / "eagle1-bin"
    if not folder.exists():
        write_eagle(folder, planted_eagle1_state(model.get_input_embeddings().weight.detach()), draft_config())
    return load_model(model=str(path), heads=str(folder), quant="none", device="cpu")


@pytest.fixture(scope="module")
def deep_dir(fixtures_root: Path) -> Path:
    return deep_planted_backbone(fixtures_root / "tiny-llama-8-layers")


@pytest.fixture(scope="module")
def eagle3_dir(fixtures_root: Path) -> Path:
    folder = fixtures_root / "eagle3-st"
    if not folder.exists():
        write_eagle(folder, random_eagle3_state(64, 512, 200), draft_config(draft_vocab=200), fmt="safetensors")
    return folder


def _prompts(loaded) -> list[list[int]]:
    return [loaded.build_prompt([{"role": "user", "content": t}]) for t in ("tell me a story", "hello there")]


def _hf_hidden_states(loaded, ids: list[int]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out = loaded.backbone(torch.tensor([ids]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def test_eagle1_folder_loads_as_an_eagle_draft(eagle1, fixtures_root: Path, hub_cache, _tiny_models) -> None:
    folder = fixtures_root / "eagle1-bin"
    hub_cache.add("tiny-org/eagle-draft", folder_files(folder))  # a Hub repo in the published layout
    from_hub = load_model(model=str(_tiny_models["llama"][3]), heads="tiny-org/eagle-draft", quant="none")
    assert from_hub.spec.kind == "eagle" and from_hub.heads.format == "eagle"
    assert heads_folder_kind(folder) == "eagle"
    assert eagle1.spec.kind == "eagle"
    info = eagle1.info()
    assert info["heads"]["format"] == "eagle"
    assert any("EAGLE" in line for line in summary_lines(info))
    assert hub.select_files(["config.json", "pytorch_model.bin", "README.md"], "heads") == [
        "config.json",
        "pytorch_model.bin",
    ]


@pytest.mark.parametrize("shaped", [True, False], ids=["eagle2-dynamic", "static"])
def test_eagle1_greedy_replies_are_the_plain_loops(eagle1, shaped: bool) -> None:
    engine = MedusaEngine(eagle1, TREE, shaped=shaped)
    plain = MedusaEngine(eagle1, plain_tree())
    assert engine.drafter is not None and ("EAGLE-2" in engine.tree_note) == shaped
    for prompt in _prompts(eagle1):
        a, b = _reply(engine, prompt, max_new_tokens=40), _reply(plain, prompt, max_new_tokens=40)
        assert a.token_ids == b.token_ids
        assert a.tokens_per_step > 2.0  # the planted draft is right most of the time: deep paths are accepted


def test_eagle1_features_and_draft_cache_match_a_from_scratch_run(eagle1) -> None:
    """After two turns (the second reuses the first's cached prefix: crop + extend), the drafter's features are
    the backbone's final hidden states and its incremental cache gives the draft's from-scratch outputs."""
    engine = MedusaEngine(eagle1, TREE)
    first = _prompts(eagle1)[0]
    reply = _reply(engine, first, max_new_tokens=30)
    second = first + reply.token_ids[:-1] + _prompts(eagle1)[1]
    _reply(engine, second, max_new_tokens=20)
    drafter = engine.drafter
    p = drafter.known
    ids = drafter.ids[:p].tolist()
    assert ids == engine.cached_ids
    hf = _hf_hidden_states(eagle1, ids)[-1]  # transformers' last hidden state is after the final norm
    torch.testing.assert_close(drafter.feats[:p], hf, atol=1e-4, rtol=1e-4)
    root = torch.tensor([7])
    with torch.inference_mode():  # (the drafter's buffers were made in the engine's inference mode)
        _, out = drafter._extend(root)
        ref = drafter.draft.reference_outputs(drafter.feats[:p], torch.cat([drafter.ids[1:p], root]), drafter.embed)
    torch.testing.assert_close(out[0], ref[-1], atol=1e-4, rtol=1e-4)


def test_eagle1_exact_sampling_equals_the_plain_loop_with_the_same_seed(eagle1) -> None:
    engine = MedusaEngine(eagle1, TREE)
    plain = MedusaEngine(eagle1, plain_tree())
    prompt = _prompts(eagle1)[0]
    for seed in range(3):
        kw = dict(max_new_tokens=20, temperature=0.7, top_p=0.95, seed=seed, accept="exact")
        assert _reply(engine, prompt, **kw).token_ids == _reply(plain, prompt, **kw).token_ids


def test_eagle1_safetensors_without_embedding_shares_the_backbones(_tiny_models, tmp_path: Path) -> None:
    model, _, _, path = _tiny_models["llama"]
    state = planted_eagle1_state(model.get_input_embeddings().weight.detach())
    del state["embed_tokens.weight"]
    folder = write_eagle(tmp_path / "e1", state, draft_config(), fmt="safetensors")
    loaded = load_model(model=str(path), heads=str(folder), quant="none", device="cpu")
    engine = MedusaEngine(loaded, TREE)
    prompt = _prompts(loaded)[1]
    assert _reply(engine, prompt, max_new_tokens=24).token_ids == _reply(
        MedusaEngine(loaded, plain_tree()), prompt, max_new_tokens=24
    ).token_ids


@pytest.mark.parametrize("lean", ["1", "0"], ids=["lean-forward", "transformers-forward"])
def test_eagle3_greedy_and_features(deep_dir: Path, eagle3_dir: Path, lean: str, monkeypatch) -> None:
    """EAGLE-3 reads the inputs of layers 2, N/2, N - 3 (8 layers: 2, 4, 5) from either forward; greedy replies
    are the plain loop's with static and dynamic trees; the draft vocabulary maps through d2t."""
    monkeypatch.setenv("MEDUSA_CHAT_LEAN", lean)
    loaded = load_model(model=str(deep_dir), heads=str(eagle3_dir), quant="none", device="cpu")
    assert loaded.info()["heads"]["format"] == "eagle3"
    plain = MedusaEngine(loaded, plain_tree())
    assert (plain.runner.lean is not None) == (lean == "1")
    prompt = _prompts(loaded)[0]
    expected = _reply(plain, prompt, max_new_tokens=16).token_ids
    for shaped in (True, False):
        engine = MedusaEngine(loaded, TREE.prefix(8), shaped=shaped)
        events = list(engine.generate(prompt, GenerationSettings(max_new_tokens=16)))
        assert events[-1].token_ids == expected
        drafted = {t for e in events[1:-1] for t in e.tree.tokens[1:]}
        assert drafted and drafted <= set(engine.drafter.vocab.tolist())  # draft-vocabulary tokens only (d2t)
    drafter = engine.drafter
    p = drafter.known
    hs = _hf_hidden_states(loaded, drafter.ids[:p].tolist())
    torch.testing.assert_close(drafter.feats[:p], torch.cat([hs[2], hs[4], hs[5]], dim=-1), atol=1e-4, rtol=1e-4)
    root = torch.tensor([9])
    with torch.inference_mode():  # (the drafter's buffers were made in the engine's inference mode)
        _, out = drafter._extend(root)
        ref = drafter.draft.reference_outputs(drafter.feats[:p], torch.cat([drafter.ids[1:p], root]), drafter.embed)
    torch.testing.assert_close(out[0], ref[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_eagle3_drafts_in_c_on_the_block_kernel(deep_dir: Path, eagle3_dir: Path, quant: str) -> None:
    """On the native C step (the CPU default) an EAGLE-3 draft drafts each step in one C call (native_eagle.py,
    csrc/eagle.c): the step gives the three layers' inputs (taps), trees are shaped by the draft, and every greedy
    reply is the plain loop's, with shaped trees, static trees and a 2-node tree. The C draft (Q4_1 blocks) guesses
    what the PyTorch draft guesses from the same features."""
    loaded = load_model(model=str(deep_dir), heads=str(eagle3_dir), quant=quant, device="cpu")
    plain = MedusaEngine(loaded, plain_tree())
    assert plain.runner.lean is not None and hasattr(plain.runner.lean, "lib")  # the native step
    prompts = _prompts(loaded)
    expected = [_reply(plain, p, max_new_tokens=20).token_ids for p in prompts]
    for tree, shaped in ((TREE.prefix(6), True), (TREE.prefix(8), False), (TREE.prefix(2), True)):
        engine = MedusaEngine(loaded, tree, shaped=shaped)
        assert engine.drafter.native is not None
        assert engine.draft_shaped == (shaped and tree.size > 2)
        for p, want in zip(prompts, expected, strict=True):
            events = list(engine.generate(p, GenerationSettings(max_new_tokens=20)))
            assert events[-1].token_ids == want
            drafted = {t for e in events[1:-1] for j, t in enumerate(e.tree.tokens) if j and j not in e.tree.lookup_nodes}
            assert drafted <= set(engine.drafter.vocab.tolist())  # (context-lookup guesses aside)
    # exact sampling: the same tokens as the plain loop with the same seed, with trees drafted in C
    shaped = MedusaEngine(loaded, TREE.prefix(6))
    for seed in range(3):
        kw = dict(max_new_tokens=16, temperature=0.7, top_p=0.95, seed=seed, accept="exact")
        assert _reply(shaped, prompts[0], **kw).token_ids == _reply(plain, prompts[0], **kw).token_ids
    # the taps: the native step's hidden states entering layers 2, 4 and 5, one [T, 3H] tensor per call
    drafter = engine.drafter
    assert drafter.feats.shape[1] == 3 * 64 and drafter.feats[: drafter.known].abs().sum() > 0
    # the C draft's depth-1 guess vs the PyTorch draft's over the whole context from scratch, for many roots
    roots = range(40, 120, 2)
    agree = c_draft_agreement(drafter, roots, within=3)
    # 4-bit weights and 8-bit activations move a random 64-wide draft's logits (36-40 of 40 here); a wrong layer
    # (the two norms swapped, say) gets 0 of 40
    assert agree >= 0.8 * len(roots), f"the C draft's top-1 was in the PyTorch draft's top-3 {agree}/{len(roots)} times"


@pytest.fixture(scope="module")
def eagle1_deep_dir(deep_dir: Path, fixtures_root: Path) -> Path:
    """A planted EAGLE-1 draft for the 8-layer backbone, with an fc bias and q/k/v biases (both read by the C
    drafter)."""
    folder = fixtures_root / "eagle1-deep-st"
    if not folder.exists():
        from safetensors.torch import load_file

        weights = load_file(str(next(deep_dir.glob("*.safetensors"))))
        emb = weights["model.embed_tokens.weight"].float()
        g = torch.Generator().manual_seed(11)
        state = planted_eagle1_state(emb, seed=2)
        state["fc.bias"] = torch.randn(emb.shape[1], generator=g) * 0.3
        for name in ("q_proj", "k_proj", "v_proj"):
            rows = state[f"layers.0.self_attn.{name}.weight"].shape[0]
            state[f"layers.0.self_attn.{name}.bias"] = torch.randn(rows, generator=g) * 0.3
        write_eagle(folder, state, draft_config(), fmt="safetensors")
    return folder


def drafter_vocab(loaded) -> int:
    return int(loaded.backbone.get_output_embeddings().out_features)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_eagle1_drafts_in_c_on_the_block_kernel(deep_dir: Path, eagle1_deep_dir: Path, quant: str) -> None:
    """An EAGLE-1 draft on the native C step drafts in one C call too (its fc over cat(embedding, feature) with
    the bias, the layer without an input norm, the backbone's own block lm_head as its head): every greedy reply
    is the plain loop's, with shaped and static trees; the planted draft's guesses are accepted (deep paths);
    the C draft guesses what the PyTorch draft guesses from the same features."""
    loaded = load_model(model=str(deep_dir), heads=str(eagle1_deep_dir), quant=quant, device="cpu")
    assert loaded.heads.version == 1 and loaded.heads.fc.bias is not None
    plain = MedusaEngine(loaded, plain_tree())
    prompts = _prompts(loaded)
    expected = [_reply(plain, p, max_new_tokens=24).token_ids for p in prompts]
    blocks = MedusaEngine(loaded, TREE.prefix(4)).drafter.native.blocks
    # the C code drafts from the blocks; the PyTorch draft (the reference) stays in its file's 16 bits
    assert loaded.heads.fc.weight.dtype == torch.float16 and loaded.heads.layers[0].mlp.down_proj.weight.dtype == torch.float16
    for tree, shaped in ((TREE.prefix(6), True), (TREE.prefix(8), False)):
        engine = MedusaEngine(loaded, tree, shaped=shaped)
        native = engine.drafter.native
        assert native is not None and native.vocab is None and native.V == drafter_vocab(loaded)
        assert engine.draft_shaped == shaped
        assert native.blocks is blocks  # the draft's blocks are built once, every engine drafts from them
        for p, want in zip(prompts, expected, strict=True):
            reply = _reply(engine, p, max_new_tokens=24)
            assert reply.token_ids == want
            assert reply.tokens_per_step > 1.5, reply.tokens_per_step
    roots = range(40, 120, 2)
    agree = c_draft_agreement(engine.drafter, roots)
    # (below: a draft vocabulary of the first 400 ids, as a real vocabulary's first 8,192; the bits of the
    # replies do not depend on it)
    # the same 4 candidates in the same order: 29 / 21 of 40 roots with int8 / int4 backbones (the draft's weights
    # in 4 bits move near-ties); with the fc bias left out of the C layer, 1 of 40
    assert agree >= 0.4 * len(roots), f"the C draft's top-4 was the PyTorch draft's {agree}/{len(roots)} times"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEDUSA_CHAT_EAGLE_DRAFT_VOCAB", "400")
        engine = MedusaEngine(loaded, TREE.prefix(6))
        assert engine.drafter.native.V == 400 and engine.drafter.native.vocab.tolist() == list(range(400))
        for p, want in zip(prompts, expected, strict=True):
            events = list(engine.generate(p, GenerationSettings(max_new_tokens=24)))
            assert events[-1].token_ids == want
            drafted = {t for e in events[1:-1] for j, t in enumerate(e.tree.tokens) if j and j not in e.tree.lookup_nodes}
            assert drafted and max(drafted) < 400


def test_an_eagle1_draft_vocabulary_beside_the_draft_is_what_the_c_drafter_guesses_among(
    deep_dir: Path, eagle1_deep_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """draft_vocab.safetensors beside an EAGLE-1 draft (train-heads writes the most frequent reply tokens there):
    the C drafter reads only those rows of the lm_head and guesses only those tokens; replies stay the plain
    loop's; MEDUSA_CHAT_EAGLE_DRAFT_VOCAB=0 reads the whole head; ids outside the vocabulary are a clear error."""
    import shutil

    from safetensors.torch import save_file

    folder = tmp_path / "eagle1-dv"
    shutil.copytree(eagle1_deep_dir, folder)
    ids = torch.randperm(512, generator=torch.Generator().manual_seed(0))[:300]
    save_file({"draft_vocab": ids}, str(folder / "draft_vocab.safetensors"))
    loaded = load_model(model=str(deep_dir), heads=str(folder), quant="int8", device="cpu")
    assert torch.equal(loaded.heads.draft_vocab_ids, ids)
    native = MedusaEngine(loaded, TREE.prefix(6)).drafter.native
    assert native.V == 300 and torch.equal(native.vocab, ids)
    plain = MedusaEngine(loaded, plain_tree())
    engine = MedusaEngine(loaded, TREE.prefix(6))
    drafted: set[int] = set()
    for p in _prompts(loaded):
        events = list(engine.generate(p, GenerationSettings(max_new_tokens=20)))
        assert events[-1].token_ids == _reply(plain, p, max_new_tokens=20).token_ids
        drafted |= {t for e in events[1:-1] for j, t in enumerate(e.tree.tokens) if j and j not in e.tree.lookup_nodes}
    assert drafted and drafted <= set(ids.tolist())
    monkeypatch.setenv("MEDUSA_CHAT_EAGLE_DRAFT_VOCAB", "0")
    assert MedusaEngine(loaded, TREE.prefix(6)).drafter.native.vocab is None
    save_file({"draft_vocab": torch.tensor([3, 700])}, str(folder / "draft_vocab.safetensors"))
    with pytest.raises(HeadsError, match="another tokenizer"):
        load_model(model=str(deep_dir), heads=str(folder), quant="int8", device="cpu")


def test_an_embedding_the_c_code_cannot_read_is_looked_up_through_a_callback() -> None:
    """embed_struct(callback=True) for any embedding module (a GGUF file's K-quant or F16 rows): the C drafters'
    row lookup calls the module back and gets its row; a lookup that fails gives zeros, never an exception in C;
    without `callback` (the drafters that look rows up inside parallel regions) such an embedding is refused."""
    from medusa_chat.model.forward.draft_structs import embed_struct

    class Rows(torch.nn.Module):  # an embedding the C code has no reader for
        embedding_dim = 8

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            if int(ids.max()) >= 100:
                raise IndexError("token id out of range")
            return ids[..., None].float() * torch.arange(8.0)

    mod = Rows()
    assert embed_struct(mod) is None
    st, keep = embed_struct(mod, callback=True)
    assert not st.table and not st.qs and keep[0] is mod
    out = torch.full((8,), 5.0)
    st.lookup(3, out.data_ptr())
    assert out.tolist() == [3.0 * i for i in range(8)]
    st.lookup(1000, out.data_ptr())
    assert out.tolist() == [0.0] * 8


def test_a_draft_loads_as_its_files_tensors(eagle3_dir: Path, deep_dir: Path) -> None:
    """An EAGLE draft is built without weights and given the file's own tensors: its 16 bits as stored (no fp32
    copy while loading), nothing left on the meta device, the rotary frequencies fp32; on a CPU the loader keeps
    that precision, and the PyTorch drafter widens the draft to fp32 where it runs (no C drafter: --quant none)."""
    from safetensors.torch import load_file

    from medusa_chat.model.sources.heads_files import load_heads_file

    draft = load_heads_file(eagle3_dir)[0]
    saved = load_file(str(eagle3_dir / "model.safetensors"))
    own = draft.state_dict()
    assert not any(t.is_meta for t in own.values())
    for key, value in saved.items():
        if value.is_floating_point():
            assert own[key].dtype == torch.float16 and torch.equal(own[key], value), key
    assert draft.inv_freq.dtype == torch.float32 and draft.inv_freq.device.type == "cpu"
    loaded = load_model(model=str(deep_dir), heads=str(eagle3_dir), quant="none", device="cpu")
    assert loaded.heads.fc.weight.dtype == torch.float16
    MedusaEngine(loaded, TREE.prefix(4))
    assert loaded.heads.fc.weight.dtype == torch.float32


def test_the_c_drafters_blocks_give_the_files_pages_back(
    eagle3_dir: Path, deep_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the C drafter's blocks are built, the draft's weights (views of the mapped file) leave the process'
    resident memory: the PyTorch draft is then only the reference, and a 7B-class draft would otherwise stay
    resident beside its blocks (its whole file, ~0.5-0.8 GB); a later touch reads the same values again."""
    from safetensors.torch import load_file

    from medusa_chat.model import mapped_weights
    from medusa_chat.model.forward import native_eagle

    given_back: list[int] = []

    def release(t: torch.Tensor) -> int:  # the real one, its answers kept
        given_back.append(mapped_weights.release(t))
        return given_back[-1]

    monkeypatch.setattr(native_eagle, "release", release)
    loaded = load_model(model=str(deep_dir), heads=str(eagle3_dir), quant="int8", device="cpu")
    layer = loaded.heads.midlayer
    weights = [loaded.heads.fc.weight, loaded.heads.lm_head.weight] + [
        m.weight for m in (*layer.self_attn.children(), *layer.mlp.children()) if hasattr(m, "weight")
    ]
    assert all(mapped_weights._file_mapping(w.data_ptr(), w.data_ptr() + w.nbytes) for w in weights)
    assert MedusaEngine(loaded, TREE.prefix(4)).drafter.native is not None
    assert len(given_back) == len(weights)
    assert sum(given_back) >= sum(w.nbytes for w in weights) - 2 * 4096 * len(weights)
    saved = load_file(str(eagle3_dir / "model.safetensors"))
    for key, value in loaded.heads.state_dict().items():
        if value.is_floating_point():
            assert torch.equal(value, saved[key]), key  # the values read back from the file


# ---- errors ---------------------------------------------------------------------------------------------------
def _load(path: Path, folder: Path):
    return load_model(model=str(path), heads=str(folder), quant="none", device="cpu")


def test_eagle_drafts_for_another_model_are_refused(_tiny_models, eagle3_dir: Path, tmp_path: Path) -> None:
    model, _, _, path = _tiny_models["llama"]
    emb = model.get_input_embeddings().weight.detach()
    small = planted_eagle1_state(torch.randn(512, 32))
    with pytest.raises(HeadsError, match="hidden size 64"):
        _load(path, write_eagle(tmp_path / "h32", small, draft_config(hidden=32)))
    state = planted_eagle1_state(torch.randn(600, 64))
    with pytest.raises(HeadsError, match="vocabulary of 600"):
        _load(path, write_eagle(tmp_path / "v600", state, draft_config(vocab=600)))
    with pytest.raises(HeadsError, match="at least 7 needed"):
        _load(path, eagle3_dir)  # EAGLE-3 on a 2-layer backbone
    bad = random_eagle3_state(64, 512, 200)
    bad["d2t"][-1] = 1000
    with pytest.raises(HeadsError, match="d2t"):
        _load(path, write_eagle(tmp_path / "d2t", bad, draft_config(draft_vocab=200), fmt="safetensors"))
    cfg = draft_config()
    cfg["num_attention_heads"] = 8  # the weights are for 4 heads of 16
    with pytest.raises(HeadsError, match="q_proj.weight has shape"):
        _load(path, write_eagle(tmp_path / "heads", planted_eagle1_state(emb), cfg))


def test_corrupt_or_incomplete_eagle_checkpoints_are_clear_errors(_tiny_models, tmp_path: Path) -> None:
    model, _, _, path = _tiny_models["llama"]
    folder = write_eagle(tmp_path / "cut", planted_eagle1_state(model.get_input_embeddings().weight.detach()),
                         draft_config(), fmt="safetensors")
    blob = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(HeadsError, match="truncated or corrupt|EAGLE"):
        _load(path, folder)
    state = random_eagle3_state(64, 512, 200)
    del state["d2t"]
    folder = write_eagle(tmp_path / "nod2t", state, draft_config(draft_vocab=200), fmt="safetensors")
    with pytest.raises(HeadsError, match="needs d2t"):
        _load(path, folder)
    cut = write_eagle(tmp_path / "bin", planted_eagle1_state(model.get_input_embeddings().weight.detach()),
                      draft_config())
    data = (cut / "pytorch_model.bin").read_bytes()
    (cut / "pytorch_model.bin").write_bytes(data[: len(data) // 3])
    with pytest.raises(HeadsError):
        _load(path, cut)


@pytest.fixture(scope="module")
def random_eagle1(_tiny_models, fixtures_root: Path):
    """An EAGLE-1 draft whose attention dominates (random fc, full-size o_proj / down_proj): its guesses move
    with any change of position, mask or cache slot."""
    model, _, _, path = _tiny_models["llama"]
    folder = fixtures_root / "eagle1-random"
    if not folder.exists():
        state = planted_eagle1_state(model.get_input_embeddings().weight.detach(), seed=5, scale=4.0)
        state["fc.weight"] = torch.randn(64, 128, generator=torch.Generator().manual_seed(6)) / 128**0.5 * 3
        write_eagle(folder, state, draft_config(), fmt="safetensors")
    return load_model(model=str(path), heads=str(folder), quant="none", device="cpu")


@pytest.mark.parametrize("shaped", [False, True], ids=["static", "eagle2-dynamic"])
def test_every_drafted_node_is_the_drafts_guess_along_its_own_path(random_eagle1, shaped: bool) -> None:
    """Each node's token is the draft's top-k at the node's rank, the draft run from scratch over the context and
    then along the node's own path (one row at a time): the depth calls' slots, positions and tree masks."""
    eagle1 = random_eagle1
    engine = MedusaEngine(eagle1, TREE, shaped=shaped)
    prompt = _prompts(eagle1)[0]
    _reply(engine, prompt, max_new_tokens=12)
    drafter, draft = engine.drafter, engine.drafter.draft
    root = torch.tensor([int(drafter.ids[drafter.known - 1]) + 1])
    with torch.inference_mode():
        if shaped:
            at = drafter.dynamic_tree(root, engine.tree, engine.step_state)
            tree, tokens = at.tree, at.tokens
        else:
            tree, tokens = TREE, drafter.propose(root, None, engine.buffers)
        p = drafter.known
        context = draft.reference_outputs(drafter.feats[:p], torch.cat([drafter.ids[1:p], root]), drafter.embed)
        k = 1 + max(tree.ranks)
        checked = 0
        for node in range(1, tree.size):
            path = tree.path_nodes(node)[1:-1]  # the node's ancestors below the root
            cache = draft.new_cache()
            cache.ensure(p + len(path) + 1)
            pos = torch.arange(p)
            causal = torch.full((p, p), torch.finfo(torch.float32).min).triu(1)
            h = draft(drafter.feats[:p], drafter.embed(torch.cat([drafter.ids[1:p], root])), pos, cache, pos,
                      causal, True)[-1:]
            torch.testing.assert_close(h, context[-1:])
            for i, a in enumerate(path):
                slot = torch.tensor([p + i])
                h = draft(h, drafter.embed(tokens[a : a + 1]), slot, cache, slot, torch.zeros(1, p + i + 1),
                          False)
            top = drafter._logits(h).topk(k, dim=-1).indices[0]
            assert int(tokens[node]) == int(top[tree.ranks[node]]), node
            checked += len(path) > 0
        assert checked >= 3  # nodes below depth 1 were checked
