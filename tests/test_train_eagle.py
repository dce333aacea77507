"""EAGLE-1 draft training (training/train_eagle.py, `train-heads --heads-format eagle`) on the planted tiny Llama:
the feature cache is the backbone's, the training-time-test unroll is exactly what the engine's drafter computes
at each depth, training lowers the loss, a resumed run equals an uninterrupted one, and the written folder loads
with the app's loader and decodes bitwise as the plain loop does."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.events import GenerationSettings
from medusa_chat.model.forward.eagle import EagleDraft, eagle_taps
from medusa_chat.model.sources.loading import load_model
from medusa_chat.training.cli import add_train_args, train_main
from medusa_chat.training.distill import DistillSettings, distill, load_for_training
from medusa_chat.training.eagle_data import EagleData, cache_eagle_features, load_eagle_cache
from medusa_chat.training.eagle_model import draft_config, new_draft, unrolled_outputs
from medusa_chat.training.eagle_pipeline import EAGLE_FILE, EagleKind, evaluate_eagle, save_draft
from medusa_chat.training.loop import RunOptions
from medusa_chat.training.pipeline import SaveOptions, train_and_save
from medusa_chat.training.store import DistillStore
from medusa_chat.training.train_eagle import EagleSettings, batch_losses, train_eagle
from medusa_chat.training.train_heads import draft_vocabulary

CPU = torch.device("cpu")
PROMPTS = [
    f"tell me about {w} and {v}"
    for w, v in zip(
        "cats dogs rivers stars bread trains music paint".split(),
        "rocks glass maps tea ice sand wind clouds".split(),
        strict=True,
    )
]
QUIET = {"log": lambda m: None}
RUN = RunOptions(CPU, log=lambda m: None)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops (conftest)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("eagle-prompts") / "prompts.jsonl"
    p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in PROMPTS))
    return p


@pytest.fixture(scope="module")
def backbone(tiny_llama_dir: Path):
    return load_for_training(tiny_llama_dir, CPU)


@pytest.fixture(scope="module")
def data(
    backbone, prompt_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[DistillStore, EagleData]:
    model, tok = backbone
    root = tmp_path_factory.mktemp("eagle-data")
    settings = DistillSettings(
        magpie=0, prompt_file=str(prompt_file), max_new_tokens=24, batch_size=4, shard_size=4
    )
    store = distill(model, tok, DistillStore.open(root / "d", model="tiny"), settings, **QUIET)
    return store, load_eagle_cache(cache_eagle_features(model, store, root / "features", **QUIET))


def _draft(model) -> EagleDraft:
    return new_draft(draft_config(model.config, "tiny"), seed=0)


def _weights(model) -> tuple[torch.Tensor, torch.Tensor]:
    return model.get_output_embeddings().weight.detach(), model.get_input_embeddings().weight.detach()


SMALL = dict(epochs=6, batch_tokens=256, lr=3e-3, bf16=False, checkpoint_every=4)


def test_feature_cache_holds_every_position_of_prompt_and_reply(data, backbone) -> None:
    store, d = data
    model, _ = backbone
    samples = {idx: (ids, rs) for idx, ids, rs in store.samples()}
    assert len(d) == len(samples) == len(PROMPTS)
    for i in range(len(d)):
        o, n = int(d.offsets[i]), int(d.lengths[i])
        idx = int(d.sample[o])
        ids, rs = samples[idx]
        # pairs 0 .. len - 2; the first a decoding step uses is the last prompt token's
        assert n == len(ids) - 1 and int(d.first_pair[i]) == rs - 1
        assert d.targets[o : o + n, 0].tolist() == ids[1:]  # pair t embeds token t + 1
        assert d.targets[o : o + n - 1, 1].tolist() == ids[2:]  # and predicts token t + 2
        with torch.no_grad():
            want = model.base_model(torch.tensor([ids])).last_hidden_state[0, :-1]  # after the final norm
        torch.testing.assert_close(d.hidden[o : o + n].float(), want, atol=2e-3, rtol=2e-3)
    assert d.positions == store.reply_tokens


def _check_unroll(draft: EagleDraft, d: EagleData, embed: torch.nn.Module) -> None:
    """Step j at row s = the draft's depth-(j + 1) output for the chain rooted at pair s - j, computed the way the
    engine's drafter does it: the context's pairs in the draft's KV cache, then one call per depth fed the parent's
    output, at position root + depth, attending to the context and the chain's earlier entries."""
    feats, nxt, _, _ = d.batch([0], CPU)
    with torch.no_grad():
        outs = unrolled_outputs(draft, feats, embed(nxt), steps=3)
        torch.testing.assert_close(
            outs[0][0], draft.reference_outputs(feats[0], nxt[0], embed), atol=1e-5, rtol=1e-5
        )
        for root in (0, 5, int(d.lengths[0]) - 4):
            cache = draft.new_cache()
            cache.ensure(root + 8)
            ctx = torch.arange(root + 1)
            causal = torch.full((root + 1, root + 1), torch.finfo(torch.float32).min).triu(1)
            out = draft(feats[0, : root + 1], embed(nxt[0, : root + 1]), ctx, cache, ctx, causal, True)[-1:]
            for depth in (1, 2):
                s = root + depth
                slot = torch.tensor([s])
                out = draft(out, embed(nxt[0, s : s + 1]), slot, cache, slot, torch.zeros(1, s + 1), False)
                torch.testing.assert_close(out[0], outs[depth][0, s], atol=1e-5, rtol=1e-5)


def test_unroll_is_what_the_drafter_computes_at_each_depth(data, backbone) -> None:
    _, d = data
    model, _ = backbone
    _check_unroll(_draft(model).eval(), d, model.get_input_embeddings())


def test_training_lowers_loss_and_raises_chain_accuracy(data, backbone) -> None:
    _, d = data
    model, _ = backbone
    lm_w, emb_w = _weights(model)
    draft = _draft(model)
    s = EagleSettings(unroll=2, **SMALL)
    batch = d.batch(list(range(len(d))), CPU)
    with torch.no_grad():
        loss0, _ = batch_losses(draft.eval(), lm_w, emb_w, batch, s, 0.0)
    acc0 = evaluate_eagle(draft, lm_w, emb_w, d, CPU, depth=3)
    res = train_eagle(draft, lm_w, emb_w, d, s, RUN)
    with torch.no_grad():
        loss1, _ = batch_losses(draft.eval(), lm_w, emb_w, batch, s, 0.0)
    acc1 = evaluate_eagle(draft, lm_w, emb_w, d, CPU, depth=3)
    assert res.steps == res.total_steps > 10 and not res.stopped_early
    assert float(loss1) < 0.5 * float(loss0)
    assert acc1["top1"][0] > acc0["top1"][0] + 0.3 and acc1["top1"][1] > acc0["top1"][1]
    assert len(acc1["chain_top1_conditional"]) == 3 and acc1["joint"]["paths"][0] == [0]


def test_a_batch_with_no_counted_row_is_stepped_over(data, backbone) -> None:
    """Samples whose reply is empty (a later turn cut for its context's length) can fill a whole batch: no loss to
    learn from, and no crash."""
    import dataclasses

    _, d = data
    model, _ = backbone
    lm_w, emb_w = _weights(model)
    empty = dataclasses.replace(d, first_pair=d.lengths.clone())  # no pair of any sample is trained
    batch = empty.batch(list(range(len(empty))), CPU)
    draft = _draft(model)
    loss, _ = batch_losses(draft, lm_w, emb_w, batch, EagleSettings(unroll=2, **SMALL), 0.0)
    assert not loss.requires_grad
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    res = train_eagle(draft, lm_w, emb_w, empty, EagleSettings(unroll=2, **SMALL), RUN)
    assert res.steps == res.total_steps and all(torch.equal(v, draft.state_dict()[k]) for k, v in before.items())


def test_resumed_training_equals_an_uninterrupted_run(data, backbone, tmp_path: Path) -> None:
    _, d = data
    model, _ = backbone
    lm_w, emb_w = _weights(model)
    s = EagleSettings(unroll=2, **{**SMALL, "epochs": 2})  # feature noise on: a resume must draw the same
    ref = _draft(model)
    train_eagle(ref, lm_w, emb_w, d, s, RUN)
    ck = tmp_path / "ck.pt"
    part = _draft(model)
    r1 = train_eagle(part, lm_w, emb_w, d, s, replace(RUN, checkpoint=ck, stop_after_steps=5))
    assert r1.stopped_early and r1.steps == 5
    resumed = _draft(model)  # a new process: the weights come from the checkpoint only
    r2 = train_eagle(resumed, lm_w, emb_w, d, s, replace(RUN, checkpoint=ck, resume=True))
    assert r2.steps == r2.total_steps > 5
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=1e-6)
    other = EagleSettings(unroll=3, **{**SMALL, "epochs": 2})  # other settings: the checkpoint is not used
    logs: list[str] = []
    train_eagle(
        _draft(model),
        lm_w,
        emb_w,
        d,
        other,
        RunOptions(CPU, checkpoint=ck, resume=True, log=logs.append, stop_after_steps=1),
    )
    assert any("from scratch" in m for m in logs)


def test_written_draft_loads_and_greedy_replies_are_the_plain_loops(
    data, backbone, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    _, d = data
    model, tok = backbone
    out = tmp_path / "eagle"
    kind = EagleKind(model, d, EagleSettings(unroll=2, **SMALL), 0.25, eval_depth=3, eagle1_draft_vocab=100)
    report = train_and_save(kind, SaveOptions(out, "tiny", RUN, tree_budget=12))
    files = {f.name for f in out.iterdir()}
    assert {"config.json", EAGLE_FILE, "accuracy.json", "tree.json", "draft_vocab.safetensors"} <= files
    assert report["data"]["heldout_samples"] > 0 and len(report["heldout"]["top1"]) == 3
    saved = load_file(str(out / EAGLE_FILE))
    assert all(v.dtype == torch.float16 for v in saved.values()) and "fc.weight" in saved
    loaded = load_model(model=str(tiny_llama_dir), heads=str(out), quant="none", device="cpu")
    assert loaded.spec.kind == "eagle" and loaded.heads.format == "eagle"
    ids = loaded.heads.draft_vocab_ids  # the 100 most frequent reply tokens, for the C drafter
    assert ids is not None and ids.numel() == 100 == ids.unique().numel()
    assert loaded.default_tree.size <= 12  # the fitted tree.json beside the draft
    for key, value in saved.items():
        assert torch.equal(loaded.heads.state_dict()[key], value.float()), key
    plain = MedusaEngine(loaded, plain_tree())
    engines = [MedusaEngine(loaded, loaded.default_tree, shaped=shaped) for shaped in (True, False)]
    steps = []
    for text in PROMPTS[:3]:
        prompt = loaded.build_prompt([{"role": "user", "content": text}])
        want = list(plain.generate(prompt, GenerationSettings(max_new_tokens=32)))[-1]
        for engine in engines:
            got = list(engine.generate(prompt, GenerationSettings(max_new_tokens=32)))[-1]
            assert got.token_ids == want.token_ids
            steps.append(got.tokens_per_step)
    assert max(steps) > 1.5  # the trained draft's guesses are accepted (the planted model is predictable)


def _argv(tiny_llama_dir: Path, prompt_file: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(tiny_llama_dir),
        "--prompts",
        str(prompt_file),
        "--magpie",
        "0",
        "--max-new-tokens",
        "16",
        "--out",
        str(out),
        "--device",
        "cpu",
        "--holdout",
        "0.3",
        "--train-batch-size",
        "256",
        "--tree-budget",
        "8",
        "--bf16",
        "off",
        "--heads-format",
        "eagle",
        "--epochs",
        "2",
        *extra,
    ]


def test_train_heads_command_writes_an_eagle_draft(
    tiny_llama_dir: Path, prompt_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = add_train_args(argparse.ArgumentParser())
    out = tmp_path / "draft"
    argv = _argv(tiny_llama_dir, prompt_file, out)
    assert train_main(p.parse_args(argv)) == 0
    assert (out / "work" / "eagle-checkpoint.pt").is_file() and any(
        (out / "work" / "eagle-features").iterdir()
    )
    acc = json.loads((out / "accuracy.json").read_text())
    assert acc["heads"]["format"] == "eagle" and acc["training"]["unroll"] == 3
    assert acc["distill"]["reply_tokens"] > 0 and len(acc["heldout"]["chain_top1_conditional"]) == 5
    assert train_main(p.parse_args([*argv, "--resume", "--stage", "train"])) == 0  # the same run, resumed
    loaded = load_model(model=str(tiny_llama_dir), heads=str(out), quant="none", device="cpu")
    assert loaded.heads.format == "eagle"
    capsys.readouterr()
    for bad, says in (
        (["--unroll", "0"], "--unroll must be between 1"),
        (["--unroll", "9"], "--unroll must be between 1"),
        (["--lr", "-1"], "must be positive"),
        (["--heads-format", "hydra", "--init-from", str(out)], "cannot start a --heads-format hydra run"),
    ):
        assert train_main(p.parse_args(_argv(tiny_llama_dir, prompt_file, tmp_path / "bad", *bad))) == 2
        assert says in capsys.readouterr().out
    assert not (tmp_path / "bad").exists()  # refused before any work
    # the trained draft, trained further (a warm start: the same kind and shape, from its own weights)
    more = tmp_path / "more"
    assert train_main(p.parse_args(_argv(tiny_llama_dir, prompt_file, more, "--init-from", str(out)))) == 0
    assert "from a trained draft" in (more / "work" / "train.log").read_text()
    first = json.loads((out / "accuracy.json").read_text())["training"]["epoch_heldout_loss"]
    again = json.loads((more / "accuracy.json").read_text())["training"]["epoch_heldout_loss"]
    assert again[0] < first[0], (first, again)  # its first epoch starts where the first run ended


# ---- EAGLE-3: an 8-layer planted backbone (taps 2, 4, 5) ------------------------------------------------------
@pytest.fixture(scope="module")
def deep(fixtures_root: Path):
    from tests.eagle_helpers import deep_planted_backbone

    folder = deep_planted_backbone(fixtures_root / "tiny-llama-8-layers")
    return folder, *load_for_training(folder, CPU)


@pytest.fixture(scope="module")
def data3(
    deep, prompt_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[DistillStore, EagleData]:
    _, model, tok = deep
    root = tmp_path_factory.mktemp("eagle3-data")
    settings = DistillSettings(
        magpie=0, prompt_file=str(prompt_file), max_new_tokens=24, batch_size=4, shard_size=4
    )
    store = distill(model, tok, DistillStore.open(root / "d", model="deep"), settings, **QUIET)
    return store, load_eagle_cache(
        cache_eagle_features(model, store, root / "f", taps=eagle_taps(8), **QUIET)
    )


def _draft3(model, data: EagleData, size: int = 60) -> EagleDraft:
    ids = draft_vocabulary(data, size, model.config.vocab_size)  # type: ignore[arg-type]
    return new_draft(draft_config(model.config, "deep", size), 0, _weights(model)[0], ids)


def test_eagle3_features_are_the_inputs_of_layers_2_n2_n3(deep, data3) -> None:
    _, model, _ = deep
    store, d = data3
    samples = {idx: ids for idx, ids, _ in store.samples()}
    seen: list[torch.Tensor] = []

    def hook(module, args, kwargs) -> None:
        seen.append((args[0] if args else kwargs["hidden_states"])[0])

    hooks = [model.model.layers[i].register_forward_pre_hook(hook, with_kwargs=True) for i in eagle_taps(8)]
    try:
        for i in (0, len(d) - 1):
            o, n = int(d.offsets[i]), int(d.lengths[i])
            seen.clear()
            with torch.no_grad():
                model(torch.tensor([samples[int(d.sample[o])]]))
            want = torch.cat(seen, dim=-1)[:-1]
            assert d.hidden.dtype == torch.bfloat16 and d.hidden.shape[1] == 3 * model.config.hidden_size
            torch.testing.assert_close(d.hidden[o : o + n].float(), want, atol=0.02, rtol=0.01)
    finally:
        for h in hooks:
            h.remove()


def test_eagle3_unroll_is_what_the_drafter_computes(deep, data3) -> None:
    _, model, _ = deep
    _, d = data3
    draft = _draft3(model, d).eval()
    assert draft.version == 3
    _check_unroll(draft, d, model.get_input_embeddings())


def test_eagle3_trains_writes_loads_and_decodes_as_the_plain_loop(deep, data3, tmp_path: Path) -> None:
    folder, model, _ = deep
    _, d = data3
    lm_w, emb_w = _weights(model)
    settings = EagleSettings(unroll=2, **SMALL)
    probe = _draft3(model, d)
    batch = d.batch(list(range(len(d))), CPU)
    with torch.no_grad():
        loss0, _ = batch_losses(probe.eval(), lm_w, emb_w, batch, settings, 0.0)
    train_eagle(probe, lm_w, emb_w, d, settings, RUN)
    with torch.no_grad():
        loss1, _ = batch_losses(probe.eval(), lm_w, emb_w, batch, settings, 0.0)
    assert float(loss1) < 0.7 * float(loss0)

    out = tmp_path / "eagle3"
    kind = EagleKind(model, d, settings, 0.25, eval_depth=3, draft_vocab=60)
    report = train_and_save(kind, SaveOptions(out, "deep", RUN, tree_budget=8))
    assert report["heads"]["format"] == "eagle3" and len(report["heldout"]["top1"]) == 3
    saved = load_file(str(out / EAGLE_FILE))
    assert (
        saved["d2t"].dtype == torch.int64
        and saved["t2d"].dtype == torch.bool
        and int(saved["t2d"].sum()) == 60
    )
    loaded = load_model(model=str(folder), heads=str(out), quant="none", device="cpu")
    assert loaded.heads.format == "eagle3" and loaded.heads.vocab_map().tolist() == sorted(
        loaded.heads.vocab_map().tolist()
    )
    plain = MedusaEngine(loaded, plain_tree())
    engine = MedusaEngine(loaded, loaded.default_tree)
    for text in PROMPTS[:2]:
        prompt = loaded.build_prompt([{"role": "user", "content": text}])
        want = list(plain.generate(prompt, GenerationSettings(max_new_tokens=24)))[-1]
        assert (
            list(engine.generate(prompt, GenerationSettings(max_new_tokens=24)))[-1].token_ids
            == want.token_ids
        )


def test_an_eagle3_draft_goes_on_training_from_a_trained_one(deep, data3, tmp_path: Path) -> None:
    """`init_from`: the trained draft's weights and its own draft vocabulary (not the data's most frequent
    tokens), the held-out loss going on from where it was; a draft of another kind or shape is refused."""
    from medusa_chat.model.sources.heads_files import load_heads_file
    from medusa_chat.training.eagle_model import warm_start_eagle

    _, model, _ = deep
    _, d = data3
    settings = EagleSettings(unroll=2, **SMALL)
    first = train_and_save(
        EagleKind(model, d, settings, 0.25, eval_depth=3, draft_vocab=60),
        SaveOptions(tmp_path / "a", "deep", RUN, tree_budget=8),
    )
    trained = load_heads_file(tmp_path / "a")[0]
    more = EagleSettings(unroll=2, **{**SMALL, "epochs": 1, "lr": 3e-4})
    again = train_and_save(
        EagleKind(model, d, more, 0.25, eval_depth=3, draft_vocab=200, init_from=trained),
        SaveOptions(tmp_path / "b", "deep", RUN, tree_budget=8),
    )
    assert again["training"]["epoch_heldout_loss"][0] < first["training"]["epoch_heldout_loss"][0]
    saved = load_file(str(tmp_path / "b" / EAGLE_FILE))
    assert torch.equal(saved["d2t"], trained.d2t) and int(saved["t2d"].sum()) == 60  # its vocabulary kept
    fresh = new_draft(draft_config(model.config, "deep"), seed=0)  # EAGLE-1
    with pytest.raises(ValueError, match="EAGLE-1 draft from an EAGLE-3"):
        warm_start_eagle(fresh, trained)
    wider = _draft3(model, d, size=80)
    with pytest.raises(ValueError, match="does not fit"):
        warm_start_eagle(wider, trained)


def test_eagle3_command_refuses_a_backbone_too_shallow(
    tiny_llama_dir: Path, prompt_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = add_train_args(argparse.ArgumentParser())
    argv = _argv(tiny_llama_dir, prompt_file, tmp_path / "e3")
    argv[argv.index("eagle")] = "eagle3"
    assert train_main(p.parse_args(argv)) == 2  # the planted Llama has 2 layers
    assert "at least 7 needed" in capsys.readouterr().out


def test_evaluate_stage_scores_eagle3_drafts_before_and_after_on_the_same_replies(deep, data3, tmp_path: Path) -> None:
    """`train-heads --stage evaluate` scores EAGLE-3 drafts on the store's replies (their features cached in the
    work folder as training caches them): the numbers are evaluate_eagle's on those features, a trained draft
    beats an untrained one, and both are scored on the same positions."""
    from medusa_chat.model.sources.heads_files import load_heads_file
    from medusa_chat.paths import repo_path
    from medusa_chat.training.stages import evaluate_main

    _, model, _ = deep
    store, d = data3
    train_and_save(
        EagleKind(model, d, EagleSettings(unroll=2, **SMALL), 0.25, eval_depth=3, draft_vocab=60),
        SaveOptions(tmp_path / "trained", "deep", RUN, tree_budget=8),
    )
    save_draft(_draft3(model, d), draft_config(model.config, "deep", 60), tmp_path / "fresh")
    folders = [str(tmp_path / "trained"), str(tmp_path / "fresh")]
    out = tmp_path / "eval.json"
    args = argparse.Namespace(heads=",".join(folders), eval_json=str(out))
    assert evaluate_main(args, model, store, tmp_path / "w", lambda m: None) == 0
    assert (tmp_path / "w" / "eagle3-features").is_dir()
    ev = json.loads(out.read_text())
    trained, untrained = (ev[repo_path(f)] for f in folders)
    assert ev["eagle_positions"]["eagle3"] > 0
    assert trained["top1"][0] > untrained["top1"][0] + 0.1
    lm_w, emb_w = _weights(model)
    direct = evaluate_eagle(load_heads_file(tmp_path / "trained")[0], lm_w, emb_w, d, CPU)
    assert direct["positions"] == ev["eagle_positions"]["eagle3"]
    assert trained["top1"] == direct["top1"]



def _random_store(model, root: Path, samples: int, length: int, seed: int) -> DistillStore:
    """Replies of random tokens: the stored token is noise, the backbone's own choice at each position is not."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, model.config.vocab_size, (length,), generator=g).tolist() for _ in range(samples)]
    store = DistillStore.open(root, model="deep")
    store.write_shard(0, ids, [6] * samples, [True] * samples)
    return store


def test_an_eagle3_teacher_is_the_backbones_distribution_and_teaches_it_where_the_stored_tokens_are_noise(
    deep, tmp_path: Path
) -> None:
    """`teacher.eagle_teacher`: row t of a sample gets the backbone's distribution of token t + 2 over the draft
    vocabulary, read from the hidden-state cache at position t + 1 (so it agrees with the backbone run on the
    whole sample there, and not at t or t + 2); every trained row has one; a cache of other replies gives none.
    Trained on random replies, a draft learns nothing from the stored tokens but learns the backbone's choice
    from its teacher."""
    from medusa_chat.training.eagle_model import draft_logits
    from medusa_chat.training.positions import cache_hidden_states, load_cache
    from medusa_chat.training.teacher import eagle_teacher

    _, model, _ = deep
    store = _random_store(model, tmp_path / "d", 24, 40, seed=3)
    d = load_eagle_cache(cache_eagle_features(model, store, tmp_path / "f", taps=eagle_taps(8), **QUIET))
    positions = load_cache(cache_hidden_states(model, store, tmp_path / "h", **QUIET))
    lm_w, emb_w = _weights(model)
    vocab = draft_vocabulary(d, 60, model.config.vocab_size)  # type: ignore[arg-type]
    order = new_draft(draft_config(model.config, "deep", 60), 0, lm_w, vocab).vocab_map()  # draft index -> token
    teacher, has = eagle_teacher(d, positions, lm_w[order].float(), top=4)
    trained = torch.zeros(len(d.hidden), dtype=torch.bool)
    for o, n, f in zip(d.offsets.tolist(), d.lengths.tolist(), d.first_pair.tolist(), strict=True):
        trained[o + f : o + n] = True
    assert torch.equal(has, trained & (d.targets[:, 1] >= 0))
    assert not bool(teacher.probs[~has].any())
    torch.testing.assert_close(teacher.probs[has].float().sum(-1), torch.ones(int(has.sum())), atol=2e-3, rtol=0)
    samples = {idx: ids for idx, ids, _ in store.samples()}
    agree: dict[int, list[bool]] = {shift: [] for shift in (0, 1, 2)}
    for i in range(len(d)):
        o, n = int(d.offsets[i]), int(d.lengths[i])
        with torch.no_grad():
            logits = model(torch.tensor([samples[int(d.sample[o])]])).logits[0][:, order]
        for t in range(int(d.first_pair[i]), n):
            if has[o + t]:
                for shift, seen in agree.items():
                    seen.append(int(teacher.ids[o + t, 0]) == int(logits[t + shift].argmax()))
    share = {shift: sum(a) / len(a) for shift, a in agree.items()}
    assert share[1] > 0.97 and share[1] > max(share[0], share[2]) + 0.25, share  # measured: 1.0, .59, .58
    others = _random_store(model, tmp_path / "d2", 24, 40, seed=4)  # another cache: no row gets a teacher
    strangers = load_cache(cache_hidden_states(model, others, tmp_path / "h2", **QUIET))
    assert float(eagle_teacher(d, strangers, lm_w[order].float(), top=4)[1].float().mean()) < 0.05

    taught_data = d.with_teacher(teacher)
    feats, nxt, _, _, teacher_ids, teacher_probs = taught_data.batch(list(range(len(d))), CPU)
    rows = teacher_probs.sum(-1) > 0

    def agreement(weight: float) -> float:
        settings = EagleSettings(unroll=2, **{**SMALL, "epochs": 12}, teacher_weight=weight)
        draft = new_draft(draft_config(model.config, "deep", 60), 0, lm_w, vocab)
        train_eagle(draft, lm_w, emb_w, taught_data, settings, RUN)
        with torch.no_grad():
            out = unrolled_outputs(draft.eval(), feats, torch.nn.functional.embedding(nxt, emb_w), 1)[0]
            guess = draft_logits(draft, out, lm_w).argmax(-1)  # draft indices, as the teacher's ids
        return float((guess[rows] == teacher_ids[..., 0][rows]).float().mean())

    stored, taught = agreement(0.0), agreement(1.0)
    assert taught > stored + 0.3, (stored, taught)  # measured: 0.02 against 0.65


def test_an_eagle3_run_with_a_teacher_gives_every_trained_row_its_teacher(deep, data3, tmp_path: Path) -> None:
    """EagleKind with `teacher_weight`: the hidden-state cache of the same samples gives each training row with a
    next token its teacher (the log says how many), the report keeps the weight, and without the cache the run
    is refused before training."""
    import re

    from medusa_chat.training.positions import cache_hidden_states, load_cache

    _, model, _ = deep
    store, d = data3
    positions = load_cache(cache_hidden_states(model, store, tmp_path / "h", **QUIET))
    said: list[str] = []
    settings = EagleSettings(unroll=2, **SMALL, teacher_weight=0.5)
    kind = EagleKind(model, d, settings, 0.25, eval_depth=3, draft_vocab=60, teacher_hidden=positions, teacher_top=4)
    report = train_and_save(kind, SaveOptions(tmp_path / "out", "deep", replace(RUN, log=said.append), tree_budget=8))
    assert report["training"]["teacher_weight"] == 0.5 and kind.train_data.teacher is not None
    found = re.search(r"teacher: the backbone's top 4 at (\d+) of (\d+) trained positions", "\n".join(said))
    assert found, said
    taught, trained = map(int, found.groups())
    assert taught == trained - len(kind.train_data)  # all but each sample's last pair, which has no next token
    with pytest.raises(ValueError, match="hidden-state cache"):
        EagleKind(model, d, settings, 0.25, draft_vocab=60).build("deep", said.append)
