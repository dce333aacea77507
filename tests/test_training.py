"""Self-distillation, head training and tree fitting on a tiny random Llama (seconds, no downloads)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from medusa_chat.model.forward.heads import heads_from_state_dict
from medusa_chat.model.sources.heads_files import load_heads_file
from medusa_chat.training.distill import (
    TASK_OPENERS,
    DistillSettings,
    chat_prompt_ids,
    distill,
    greedy_replies,
    load_for_training,
    read_prompt_file,
    sample_user_turns,
    user_prefix_ids,
)
from medusa_chat.training.evaluate import evaluate_heads
from medusa_chat.training.fit_tree import expected_accept_length, fit_tree, grow_tree, independent_gain
from medusa_chat.training.loop import RunningTop1, RunOptions
from medusa_chat.training.pipeline import HEADS_FILE, round_heads_, save_heads
from medusa_chat.training.positions import (
    PositionData,
    cache_hidden_states,
    conversation_starts,
    covering_samples,
    heldout_mask,
    hidden_states_for,
    load_cache,
)
from medusa_chat.training.select import SampleRule
from medusa_chat.training.store import DistillStore, export_npz, import_npz
from medusa_chat.training.teacher import teacher_rows, teacher_targets
from medusa_chat.training.train_heads import TrainSettings, head_logits, head_losses, new_heads, train_heads
from medusa_chat.tree import Tree

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CPU = torch.device("cpu")
QUIET = RunOptions(CPU, log=lambda m: None)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops (conftest)


def _tiny_tokenizer():
    """A byte-level tokenizer with 259 tokens (3 ChatML specials + 256 bytes) and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama")
    tok = _tiny_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than the 0.02 init, so greedy text is not all one token
        model.lm_head.weight.mul_(8)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def backbone(tiny_dir: Path):
    return load_for_training(tiny_dir, CPU)


PROMPTS = [
    f"question number {i}: tell me about {w}"
    for i, w in enumerate(
        "cats dogs rivers stars bread trains music paint clouds rocks glass maps tea ice sand wind".split()
    )
]


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [json.dumps({"prompt": t}) for t in PROMPTS[:8]] + [
        json.dumps({"turns": [t, "x"]}) for t in PROMPTS[8:]
    ]
    lines.append(json.dumps({"prompt": PROMPTS[0].upper()}))  # a duplicate after normalisation
    p.write_text("\n".join(lines) + "\n")
    return p


def _settings(prompt_file: Path, **kw) -> DistillSettings:
    base = dict(magpie=0, prompt_file=str(prompt_file), max_new_tokens=16, batch_size=6, shard_size=6)
    return DistillSettings(**{**base, **kw})


@pytest.fixture(scope="session")
def distilled(
    tmp_path_factory: pytest.TempPathFactory, backbone, prompt_file: Path
) -> tuple[DistillStore, PositionData]:
    model, tok = backbone
    root = tmp_path_factory.mktemp("distill")
    store = distill(
        model, tok, DistillStore.open(root / "d", model="tiny"), _settings(prompt_file), log=lambda m: None
    )
    data = load_cache(cache_hidden_states(model, store, root / "hidden", log=lambda m: None))
    return store, data


# ---------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------
def test_prompt_file_and_bench_guard(prompt_file: Path, tmp_path: Path) -> None:
    assert read_prompt_file(prompt_file)[8] == PROMPTS[8]
    bench = tmp_path / "shared" / "bench"
    bench.mkdir(parents=True)
    (bench / "q.jsonl").write_text('{"turns": ["hi"]}\n')
    with pytest.raises(ValueError, match="benchmark"):
        read_prompt_file(bench / "q.jsonl")


def test_distill_shards_dedup_and_alignment(distilled, backbone) -> None:
    store, _ = distilled
    _, tok = backbone
    assert len(store.prompts) == len(PROMPTS)  # the upper-case duplicate was dropped
    assert [s.count for s in store.shards] == [6, 6, 4]
    for idx, ids, rs in store.samples():
        assert ids[:rs] == chat_prompt_ids(tok, store.prompts[idx])
        assert 1 <= len(ids) - rs <= 16


def test_batched_left_padded_replies_match_single(backbone) -> None:
    model, tok = backbone
    prompts = [chat_prompt_ids(tok, t) for t in PROMPTS[:3]]
    batched = greedy_replies(model, tok, prompts, batch_size=3, max_new_tokens=8)
    single = [greedy_replies(model, tok, [p], batch_size=1, max_new_tokens=8)[0] for p in prompts]
    assert batched == single


def test_distill_resumes_where_it_stopped(backbone, prompt_file: Path, tmp_path: Path, distilled) -> None:
    model, tok = backbone
    full, _ = distilled
    # First run stops after one shard (token target reached), as a killed run would have.
    store = distill(
        model,
        tok,
        DistillStore.open(tmp_path / "d"),
        _settings(prompt_file, max_reply_tokens=1),
        log=lambda m: None,
    )
    assert len(store.shards) == 1
    # Simulate a kill between writing shard 1 and the manifest: the orphan shard is adopted on reopen.
    store2 = distill(
        model,
        tok,
        DistillStore.open(tmp_path / "d"),
        _settings(prompt_file, max_reply_tokens=100),
        log=lambda m: None,
    )
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:1]
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(manifest))
    reopened = DistillStore.open(tmp_path / "d")
    assert len(reopened.shards) == len(store2.shards) == 2
    resumed = distill(model, tok, reopened, _settings(prompt_file), log=lambda m: None)
    assert [s.__dict__ for s in resumed.shards] == [s.__dict__ for s in full.shards]
    assert list(resumed.samples()) == list(full.samples())


def _store(root: Path, prompts: list, answered: int, shard: int) -> DistillStore:
    """A store holding `prompts`, the first `answered` of them with replies (token ids made up)."""
    store = DistillStore.open(root)
    store.prompts, store.sources = list(prompts), ["test"] * len(prompts)
    for first in range(0, answered, shard):
        rows = range(first, min(first + shard, answered))
        store.write_shard(first, [[7, 8, 100 + i, 200 + i] for i in rows], [2] * len(rows), [True] * len(rows))
    return store


def test_import_joins_files_keeps_conversations_whole_and_export_drops_unanswered_prompts(tmp_path: Path) -> None:
    chats = _store(tmp_path / "a", ["a", {"follow": "a2"}, {"follow": "a3"}, "b", "c", "unanswered"], 5, 5)
    magpie = _store(tmp_path / "b", ["m1", "m2", "m3"], 3, 3)
    assert export_npz(chats, tmp_path / "a.npz") == {"samples": 5, "tokens": 20}
    export_npz(magpie, tmp_path / "b.npz")
    assert len(import_npz(DistillStore.open(tmp_path / "a1"), tmp_path / "a.npz").prompts) == 5  # not "unanswered"
    joined = import_npz(DistillStore.open(tmp_path / "j"), f"{tmp_path / 'a.npz'}:2,{tmp_path / 'b.npz'}:2",
                        shard_size=2)  # fmt: skip
    # a's first 2 samples grow to 3: the conversation's follow-ups stay with its first turn; b's follow
    assert joined.prompts == ["a", {"follow": "a2"}, {"follow": "a3"}, "m1", "m2"]
    samples = list(joined.samples())
    assert [i for i, _, _ in samples] == [0, 1, 2, 3, 4]
    assert [ids[2] for _, ids, _ in samples] == [100, 101, 102, 100, 101]
    assert [(s.first, s.count) for s in joined.shards] == [(0, 3), (3, 2)]  # a shard never splits a conversation
    whole = import_npz(DistillStore.open(tmp_path / "w"), f"{tmp_path / 'a.npz'},{tmp_path / 'b.npz'}")
    assert len(whole.prompts) == 8 and [i for i, _, _ in whole.samples()] == list(range(8))


def test_import_select_keeps_short_code_free_first_turns_and_drops_a_cut_conversation(tmp_path: Path) -> None:
    prompts = ["short q", {"follow": "its follow-up"}, "x" * 50, {"follow": "after a long one"},
               "fix this:\n```py\ndef f(): pass\n```", "another q", {"follow": "y" * 50}, {"follow": "kept?"},
               "not answered"]  # fmt: skip
    export_npz(_store(tmp_path / "a", prompts, 8, 8), tmp_path / "a.npz")
    short = SampleRule.parse("max-chars=20,no-code")
    got = import_npz(DistillStore.open(tmp_path / "s"), tmp_path / "a.npz", select=short)
    # the long turn drops its follow-up; the long follow-up drops the turn after it; the code turn goes
    assert got.prompts == ["short q", {"follow": "its follow-up"}, "another q"]
    assert [ids for _, ids, _ in got.samples()] == [[7, 8, 100, 200], [7, 8, 101, 201], [7, 8, 105, 205]]
    firsts = import_npz(DistillStore.open(tmp_path / "f"), f"{tmp_path / 'a.npz'}:2",
                        select=SampleRule.parse("first-turns"))  # fmt: skip
    assert firsts.prompts == ["short q", "x" * 50]  # the first 2 of the selected samples
    whole = import_npz(DistillStore.open(tmp_path / "w"), tmp_path / "a.npz", select=SampleRule.parse("first-turns"))
    assert whole.prompts == ["short q", "x" * 50, prompts[4], "another q"] and whole.reply_tokens == 4 * 2
    for bad in ("first-turn", "max-chars=0", "max-chars=x", ""):
        with pytest.raises(ValueError, match="unknown selection"):
            SampleRule.parse(bad)


def test_export_import_roundtrip(distilled, tmp_path: Path) -> None:
    store, _ = distilled
    info = export_npz(store, tmp_path / "data.npz")
    assert info["samples"] == len(PROMPTS)
    again = import_npz(DistillStore.open(tmp_path / "d2"), tmp_path / "data.npz", shard_size=5)
    assert list(again.samples()) == list(store.samples())
    assert again.prompts == store.prompts and again.reply_tokens == store.reply_tokens
    with pytest.raises(ValueError, match="already holds"):
        import_npz(again, tmp_path / "data.npz")


class _FakeSampler:
    """Stands in for a model in a Magpie round: returns fixed 'sampled' continuations."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows
        self.generation_config = None

    def parameters(self):
        yield torch.zeros(1)

    def generate(self, input_ids, attention_mask, generation_config):
        width = max(len(r) for r in self.rows)  # rows that hit the budget are the longest, as in generate
        gen = torch.tensor([r + [2] * (width - len(r)) for r in self.rows])
        return torch.cat([input_ids, gen], dim=1)


def test_magpie_keeps_clean_distinct_turns(backbone) -> None:
    _, tok = backbone
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = [
        enc("How do I bake bread at home?") + [2],  # clean
        enc("How do I bake bread at home?") + [2],  # duplicate (dropped by the store)
        enc("What is the tallest mountain on the whole wide planet"),  # no EOS in budget: cut off
        enc("ok") + [2],  # near-empty
        enc("Tell me a story") + [1] + enc("x") + [2],  # another special token inside
        enc("Explain how rainbows form in the sky.") + [2],
    ]
    texts, n = sample_user_turns(_FakeSampler(rows), tok, n=len(rows), seed=1)
    assert n == len(rows)
    assert texts == [
        "How do I bake bread at home?",
        "How do I bake bread at home?",
        "Explain how rainbows form in the sky.",
    ]
    assert tok.decode(user_prefix_ids(tok)) == "<|im_start|>user\n"


class _RecordingSampler(_FakeSampler):
    def generate(self, input_ids, attention_mask, generation_config):
        self.seen = (input_ids, attention_mask)
        return super().generate(input_ids, attention_mask, generation_config)


def test_magpie_task_openers_start_the_user_turn(backbone) -> None:
    """With opener_frac=1 every row is the user prefix + a task opener (left-padded), and every kept turn
    starts with that opener; with 0 the rows are the bare prefix (plain Magpie)."""
    _, tok = backbone
    rows = [tok(" the rain in spring, please.", add_special_tokens=False)["input_ids"] + [2]] * 6
    prefix = user_prefix_ids(tok)

    sampler = _RecordingSampler(rows)
    texts, _ = sample_user_turns(sampler, tok, n=6, seed=5, opener_frac=1.0)
    assert len(texts) == 6 and all(any(t.startswith(o) for o in TASK_OPENERS) for t in texts)
    assert len({t.split(" the rain")[0] for t in texts}) > 1  # openers vary within a round
    ids, mask = sampler.seen
    for r in range(6):
        row = ids[r][mask[r].bool()].tolist()
        assert row[: len(prefix)] == prefix and len(row) > len(prefix)
        assert not mask[r, : ids.shape[1] - len(row)].any()  # padding on the left only

    plain = _RecordingSampler(rows)
    sample_user_turns(plain, tok, n=6, seed=5, opener_frac=0.0)
    assert plain.seen[0].tolist() == [prefix] * 6


# ---------------------------------------------------------------------------------------------------------
# hidden states and training
# ---------------------------------------------------------------------------------------------------------
def test_hidden_cache_matches_greedy_tokens(distilled, backbone) -> None:
    store, data = distilled
    model, _ = backbone
    assert len(data) == store.reply_tokens
    assert data.hidden.dtype == torch.float16
    agree = (model.lm_head(data.hidden.float()).argmax(-1) == data.targets[:, 0].long()).float().mean()
    assert agree > 0.98  # the replies are the backbone's own greedy tokens


def test_covering_samples_groups_turns_by_prefix() -> None:
    seqs = [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2], [7, 2, 3], [1, 9]]
    roots, root_of = covering_samples(seqs)
    assert sorted(map(tuple, roots)) == [(1, 2, 3, 4, 5), (1, 9), (7, 2, 3)]
    assert [roots[r] for r in root_of] == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [7, 2, 3], [1, 9]]


def test_heldout_split_keeps_conversations_whole() -> None:
    from medusa_chat.training.conversations import expand

    prompts = ["a", *expand(["b", "b2", "b3"]), "c", *expand(["d", "d2"])]
    starts = conversation_starts(prompts)
    assert starts.tolist() == [0, 1, 1, 1, 4, 5, 5]
    sample = torch.arange(len(prompts)).repeat(3)
    for frac in (0.3, 0.5, 0.7):
        mask = heldout_mask(starts[sample], frac)
        for conv in ([1, 2, 3], [5, 6]):
            assert len({bool(m) for m, s in zip(mask, sample, strict=True) if int(s) in conv}) == 1
    assert torch.equal(conversation_starts(["x", "y", "z"]), torch.arange(3))  # single turns: as by prompt


def test_later_turn_gives_the_earlier_turns_states(backbone) -> None:
    """A conversation's turns share a prefix: the states read from the longest turn are each turn's own."""
    model, _ = backbone
    g = torch.Generator().manual_seed(3)
    turn = torch.randint(5, 100, (40,), generator=g).tolist()
    samples = [(0, turn[:12], 6), (1, turn[:25], 18), (2, turn, 30), (3, turn[:10] + [3, 4, 5], 11)]
    together = hidden_states_for(model, samples, store_dtype=torch.float32)
    for s in samples:
        alone = hidden_states_for(model, [s], store_dtype=torch.float32)
        mine = together.sample == s[0]
        assert int(mine.sum()) == len(s[1]) - s[2]
        assert torch.equal(together.targets[mine], alone.targets)
        torch.testing.assert_close(together.hidden[mine], alone.hidden, atol=1e-4, rtol=1e-4)


def _loss_and_acc(heads, lm_w, data: PositionData, k: int) -> tuple[float, list[float]]:
    with torch.no_grad():
        logits = head_logits(heads, data.hidden.float(), lm_w)
        t = data.targets[:, 1 : 1 + k]
        loss = float((head_losses(logits, t) * torch.tensor([0.8**i for i in range(k)])).sum())
        hit = (logits.argmax(-1) == t.T.long()) & (t.T >= 0)
        acc = (hit.sum(1) / (t.T >= 0).sum(1)).tolist()
    return loss, acc


@pytest.mark.parametrize("fmt", ["v2", "v1"])
def test_training_lowers_loss_and_raises_accuracy(distilled, backbone, fmt: str) -> None:
    _, data = distilled
    model, _ = backbone
    s = TrainSettings(
        num_heads=3, num_layers=1, heads_format=fmt, epochs=30, batch_size=64, lr=3e-3, bf16=False
    )
    lm_w = model.lm_head.weight.detach()
    heads = new_heads(s, model.lm_head, 64, lm_w.shape[0])
    loss0, acc0 = _loss_and_acc(heads, lm_w, data, 3)
    res = train_heads(heads, lm_w, data, s, QUIET)
    loss1, acc1 = _loss_and_acc(heads.eval(), lm_w, data, 3)
    assert res.steps == res.total_steps > 0
    assert loss1 < 0.8 * loss0
    assert sum(acc1) > sum(acc0) + 0.1 and all(a1 >= a0 for a0, a1 in zip(acc0, acc1, strict=True))
    # a warm-started run's running top-1 is the heads' accuracy from its first step (bias-corrected), not a
    # ramp up from zero that reads like a broken warm start
    again = train_heads(heads, lm_w, data, replace(s, epochs=1, lr=1e-12), replace(QUIET, stop_after_steps=1))
    assert again.steps == 1 and sum(acc1) > 0.6
    assert all(abs(r - a) < 0.2 for r, a in zip(again.train_top1, acc1, strict=True)), (again.train_top1, acc1)


def _random_replies(model, n: int, length: int, seed: int) -> PositionData:
    """Hidden states over random token strings: their stored tokens are not what the backbone would say."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    samples = [(i, torch.randint(3, vocab, (length,), generator=g).tolist(), 4) for i in range(n)]
    return hidden_states_for(model, samples, store_dtype=torch.float32)


def test_teacher_targets_are_the_backbones_top_tokens_at_the_heads_rows(backbone) -> None:
    model, _ = backbone
    data = _random_replies(model, 3, 12, seed=1)  # 8 reply positions per sample
    lm_w = model.lm_head.weight.detach()
    teacher = teacher_targets(data, lm_w, top=4, batch=5)  # batches that cut samples
    value, index = torch.softmax(data.hidden @ lm_w.T, -1).topk(4, -1)
    assert torch.equal(teacher.ids.long(), index)
    torch.testing.assert_close(teacher.probs.float(), value / value.sum(-1, keepdim=True), atol=1e-3, rtol=0)
    # head k at row i: the teacher sits at row i + 1 + k of the same sample, and only there
    idx = torch.arange(len(data))
    rows, valid = teacher_rows(data, idx, 3)
    assert torch.equal(rows[:, 0], (idx + 1).clamp(max=len(data) - 1))
    left = torch.tensor([7 - i % 8 for i in range(len(data))])  # rows of the sample after row i
    assert torch.equal(valid, torch.arange(3)[None, :] < left[:, None])
    assert torch.equal(data.targets[rows[valid], 0], data.targets[:, 1:4][valid])
    # a split by sample keeps the rows in order; shuffled rows are refused, not paired with a stranger
    kept = data.subset(data.sample != 1)
    assert torch.equal(teacher_rows(kept, torch.arange(len(kept)), 3)[1], valid[data.sample != 1])
    shuffled = data.subset(torch.randperm(len(data), generator=torch.Generator().manual_seed(0)))
    assert teacher_rows(shuffled, torch.arange(len(data)), 3)[1].float().mean() < 0.2


def test_teacher_loss_teaches_the_backbones_choice_where_the_stored_tokens_are_noise(backbone) -> None:
    """Hydra heads trained on random replies learn nothing from the stored tokens, but the teacher's argmax."""
    model, _ = backbone
    data = _random_replies(model, 24, 40, seed=2)
    lm_w = model.lm_head.weight.detach()
    embed = model.get_input_embeddings().weight.detach()
    vocab = lm_w.shape[0]
    draft = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))  # the whole vocabulary, reordered
    idx = torch.arange(len(data))
    rows, valid = teacher_rows(data, idx, 2)
    backbone_choice = (data.hidden @ lm_w.T).argmax(-1)[rows]  # [N, K]: the backbone's token at each head

    def agreement(weight: float) -> float:
        torch.manual_seed(0)
        s = TrainSettings(
            num_heads=2, heads_format="hydra", draft_vocab_size=vocab, epochs=20, batch_size=64, lr=3e-3,
            bf16=False, teacher_weight=weight, teacher_top=4,
        )
        heads = new_heads(s, model.lm_head, 64, vocab, draft)
        train_heads(heads, lm_w, data, s, QUIET, embed_weight=embed)
        with torch.no_grad():
            logits = head_logits(heads.eval(), data.hidden, lm_w[draft], data.targets, embed)
        hits = draft[logits.argmax(-1).T] == backbone_choice  # [N, K]
        per_head = [float(hits[:, k][valid[:, k]].float().mean()) for k in range(2)]
        ev = evaluate_heads(heads, lm_w, data, CPU, embed_weight=embed)  # its score of the same thing
        assert ev["top1_backbone"] == pytest.approx(per_head, abs=1e-3)
        return float(hits[valid].float().mean())

    stored, taught = agreement(0.0), agreement(1.0)
    assert taught > stored + 0.3, (stored, taught)  # measured: 0.01 against 0.47


def test_running_top1_is_bias_corrected_and_skips_empty_entries() -> None:
    running = RunningTop1(2, 0.9)
    running.update([0.6, None])
    assert running.values == pytest.approx([0.6, 0.0])
    running.update([0.8, 0.5])
    assert running.values == pytest.approx([(0.9 * 0.1 * 0.6 + 0.1 * 0.8) / (0.9 * 0.1 + 0.1), 0.5])
    assert str(running) == "0.71 0.50"


def test_deadline_fit_shortens_the_plan_again_when_steps_slow_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps take 1 s while timed, then 3 s (a busier machine): a single fit at the warm-up's rate would run
    past the deadline mid-decay; the repeated check ends the shortened schedule in time."""
    import medusa_chat.training.loop as loop

    clock = [0.0]
    monkeypatch.setattr(loop.time, "time", lambda: clock[0])
    fit = loop.DeadlineFit(deadline=100.0, start=0, end=2, per_step_text=lambda per: f"{per:.1f} s/step")
    plan, lines, step = loop.WarmupCosine.planned(500, 0.03), [], 0
    while step < plan.total:
        fit.after_step(step, plan, lines.append)
        clock[0] += 1.0 if step < 4 else 3.0
        step += 1
    assert len(lines) >= 2 and lines[0].endswith("(1.0 s/step)")
    assert clock[0] <= 100.0 and plan.total < 40  # ended by the deadline, the cosine run to its end
    assert not loop.DeadlineFit(None, 0, 2, str).passed()


def test_saved_heads_reload_bit_exactly(distilled, backbone, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    _, data = distilled
    model, _ = backbone
    s = TrainSettings(num_heads=2, num_layers=2, epochs=1, batch_size=64, bf16=False)
    heads = new_heads(s, model.lm_head, 64, model.lm_head.weight.shape[0])
    train_heads(heads, model.lm_head.weight, data, s, QUIET)
    round_heads_(heads)
    cfg = save_heads(heads, tmp_path, "tiny")
    sd = load_file(str(tmp_path / HEADS_FILE))
    assert all(v.dtype == torch.float16 for v in sd.values())
    assert sorted(sd) == sorted(heads.state_dict())  # published key names: "0.0.linear.weight", ...
    again = heads_from_state_dict(sd)
    for key, value in heads.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    x = data.hidden[:8].float()
    assert torch.equal(again(x, model.lm_head), heads(x, model.lm_head))
    assert json.loads((tmp_path / "config.json").read_text()) == cfg
    assert cfg["version"] == "2" and cfg["medusa_num_heads"] == 2 and cfg["medusa_num_layers"] == 2


def test_training_resumes_from_checkpoint(distilled, backbone, tmp_path: Path) -> None:
    _, data = distilled
    model, _ = backbone
    s = TrainSettings(num_heads=2, epochs=3, batch_size=32, checkpoint_every=3, bf16=False)
    lm_w = model.lm_head.weight

    def fresh():
        torch.manual_seed(0)
        return new_heads(s, model.lm_head, 64, lm_w.shape[0])

    ref = fresh()
    train_heads(ref, lm_w, data, s, QUIET)
    ck = tmp_path / "ck.pt"
    part = fresh()
    r1 = train_heads(part, lm_w, data, s, replace(QUIET, checkpoint=ck, stop_after_steps=5))
    assert r1.stopped_early and r1.steps == 5
    resumed = fresh()  # a new process: weights come from the checkpoint only
    r2 = train_heads(resumed, lm_w, data, s, replace(QUIET, checkpoint=ck, resume=True))
    assert r2.steps == r2.total_steps
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=1e-6)


def test_evaluation_reports_consistent_accuracies(distilled, backbone) -> None:
    _, data = distilled
    model, _ = backbone
    s = TrainSettings(num_heads=3, epochs=10, batch_size=64, lr=3e-3, bf16=False)
    heads = new_heads(s, model.lm_head, 64, model.lm_head.weight.shape[0])
    train_heads(heads, model.lm_head.weight, data, s, QUIET)
    ev = evaluate_heads(heads, model.lm_head.weight, data, CPU)
    assert ev["backbone_agreement"] > 0.98
    for k in range(3):  # the stored replies are the backbone's greedy ones: both scores nearly agree
        assert ev["top1_backbone"][k] == pytest.approx(ev["top1"][k], abs=0.05)
        assert ev["rank_acc"][k][0] == pytest.approx(ev["top1"][k], abs=1e-3)
        assert sum(ev["rank_acc"][k][:5]) == pytest.approx(ev["top5"][k], abs=1e-3)
        assert sum(ev["rank_acc"][k]) <= 1 + 1e-6
    joint = {tuple(p): q for p, q in zip(ev["joint"]["paths"], ev["joint"]["probs"], strict=True)}
    # P(first node) over decoding steps equals head 0's rank-0 rate over the same positions.
    assert joint[(0,)] == pytest.approx(ev["rank_acc"][0][0], abs=0.02)
    chain = ev["chain_top1_conditional"]
    assert joint.get((0, 0), 0) == pytest.approx(chain[0] * chain[1], abs=1e-3)
    for p, q in joint.items():  # a prefix is at least as likely as any extension
        assert len(p) == 1 or joint[p[:-1]] >= q


def test_fine_tuning_keeps_the_given_draft_vocabulary(distilled, backbone, tmp_path: Path) -> None:
    """Fine-tuning Hydra heads on a small new set keeps the warm start's draft vocabulary when asked (counted on
    more data); without it the vocabulary is counted from the new set; a wrong size is refused."""
    from medusa_chat.training.pipeline import HeadsKind, SaveOptions, train_and_save
    from medusa_chat.training.train_heads import draft_vocabulary

    _, data = distilled
    model, _ = backbone
    vocab = model.lm_head.weight.shape[0]
    s = TrainSettings(
        num_heads=2, heads_format="hydra", draft_vocab_size=32, epochs=1, batch_size=64, bf16=False
    )
    embed = model.get_input_embeddings().weight.detach()
    counted = draft_vocabulary(data, 32, vocab)
    given = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))[:32]
    assert not torch.equal(given.sort().values, counted.sort().values)
    for vocab_in, out in ((given, tmp_path / "given"), (None, tmp_path / "counted")):
        kind = HeadsKind(model.lm_head, data, data.subset(data.sample < 0), s, embed, draft_vocab=vocab_in)
        train_and_save(kind, SaveOptions(out, "tiny", QUIET))
    assert torch.equal(load_heads_file(tmp_path / "given")[0].draft_vocab, given)
    assert torch.equal(load_heads_file(tmp_path / "counted")[0].draft_vocab, counted)
    with pytest.raises(ValueError, match="draft vocabulary of 31 tokens"):
        kind = HeadsKind(model.lm_head, data, data.subset(data.sample < 0), s, embed, draft_vocab=given[:31])
        train_and_save(kind, SaveOptions(tmp_path / "bad", "tiny", QUIET))


def test_heldout_split_is_by_prompt() -> None:
    sample = torch.arange(10000, dtype=torch.int32).repeat_interleave(3)
    m = heldout_mask(sample, 0.1)
    assert 0.08 < float(m.float().mean()) < 0.12
    assert torch.equal(m.view(-1, 3).all(1), m.view(-1, 3).any(1))  # all positions of a prompt go together


# ---------------------------------------------------------------------------------------------------------
# trees
# ---------------------------------------------------------------------------------------------------------
ACC = [
    [0.38, 0.10, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01, 0.008, 0.006],
    [0.23, 0.09, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01, 0.008, 0.006],
    [0.17, 0.07, 0.04, 0.03, 0.02, 0.015, 0.01, 0.01, 0.008, 0.006],
    [0.13, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01, 0.01, 0.008, 0.006],
]


@pytest.mark.parametrize("budget", [1, 2, 8, 16, 64, 200])
def test_fit_tree_budget_parents_and_growth_order(budget: int) -> None:
    tree = fit_tree(ACC, budget=budget)
    paths = [tuple(p) for p in tree["paths"]]
    assert len(paths) == min(budget - 1, len(paths)) and len(paths) == budget - 1
    seen: set[tuple[int, ...]] = {()}
    for p in paths:
        assert p[:-1] in seen, f"{p} before its parent"
        assert len(p) <= len(ACC) and max(p) < 10
        seen.add(p)
    curve = tree["expected_tokens_per_step"]
    assert len(curve) == budget and curve[0] == 1.0
    steps = [b - a for a, b in zip(curve, curve[1:], strict=False)]
    assert all(x >= y - 2e-4 for x, y in zip(steps, steps[1:], strict=False))  # greedy: gains never increase
    assert expected_accept_length(paths, ACC) == pytest.approx(curve[-1], abs=1e-3)
    t = Tree.from_paths(tree["paths"])
    assert list(t.paths) == paths  # already in growth order: the Tree keeps it
    if budget > 1:
        assert paths[0] == (0,)


def test_fit_tree_prefixes_are_the_best_smaller_trees() -> None:
    big = fit_tree(ACC, budget=64)
    for n in (8, 16, 32):
        small = fit_tree(ACC, budget=n)
        assert small["paths"] == big["paths"][: n - 1]


def test_fit_tree_prefers_measured_joint_hits() -> None:
    # Correlated heads: head 1 is right only when head 0 is; a branch under rank 1 is never accepted.
    joint = {(0,): 0.4, (1,): 0.1, (0, 0): 0.3, (0, 1): 0.05, (0, 0, 0): 0.25}
    report = {
        "heldout": {
            "rank_acc": [[0.4, 0.1], [0.35, 0.1], [0.3, 0.1]],
            "joint": {"paths": [list(p) for p in joint], "probs": list(joint.values()), "max_rank": 2},
        }
    }
    tree = fit_tree(report, budget=5)
    assert tree["gains_from"] == "joint"
    assert [tuple(p) for p in tree["paths"]] == [(0,), (0, 0), (0, 0, 0), (1,)]
    assert expected_accept_length(tree["paths"], report) == pytest.approx(1 + 0.4 + 0.3 + 0.25 + 0.1)
    indep = fit_tree(report, budget=5, prefer_joint=False)
    assert indep["gains_from"] == "independent"
    assert expected_accept_length(tree["paths"], report["heldout"]["rank_acc"]) > 1.0


def test_grow_tree_stops_when_nothing_can_be_accepted() -> None:
    paths, gains = grow_tree(independent_gain([[0.5, 0.0]]), num_heads=1, max_rank=2, budget=10)
    assert paths == [(0,)] and gains == [0.5]


# ---------------------------------------------------------------------------------------------------------
# the commands, end to end on the tiny model
# ---------------------------------------------------------------------------------------------------------
def test_train_heads_and_fit_tree_commands(tiny_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    from medusa_chat.training.cli import add_fit_tree_args, add_train_args, fit_tree_main, train_main

    p = add_train_args(argparse.ArgumentParser())
    out = tmp_path / "heads"
    argv = [
        "--model",
        str(tiny_dir),
        "--prompts",
        str(prompt_file),
        "--magpie",
        "0",
        "--max-new-tokens",
        "16",
        "--num-heads",
        "3",
        "--epochs",
        "2",
        "--out",
        str(out),
        "--device",
        "cpu",
        "--holdout",
        "0.3",
        "--train-batch-size",
        "32",
        "--tree-budget",
        "16",
        "--bf16",
        "off",
    ]
    assert train_main(p.parse_args(argv)) == 0
    assert {"config.json", HEADS_FILE, "accuracy.json", "tree.json"} <= {f.name for f in out.iterdir()}
    acc = json.loads((out / "accuracy.json").read_text())
    assert len(acc["heldout"]["rank_acc"]) == 3 and acc["data"]["heldout_positions"] > 0
    assert len(json.loads((out / "tree.json").read_text())["paths"]) <= 15
    assert train_main(p.parse_args(argv)) == 2  # refuses to mix runs without --resume
    assert train_main(p.parse_args([*argv, "--resume"])) == 0
    f = add_fit_tree_args(argparse.ArgumentParser())
    assert fit_tree_main(f.parse_args(["--heads", str(out), "--budget", "8"])) == 0
    tree = Tree.load(out / "tree.json")
    assert tree.size <= 8 and tree.depth <= 3
    # Hydra heads warm-started from the v2 heads just trained, on the same data (no new generation)
    hydra = tmp_path / "hydra"
    hargv = [*argv, "--out", str(hydra), "--work", str(out / "work"), "--resume", "--stage", "train"]
    hargv += ["--heads-format", "hydra", "--init-from", str(out), "--draft-vocab", "40"]
    assert train_main(p.parse_args([*hargv, "--teacher-weight", "1.5"])) == 2  # a share: refused
    assert train_main(p.parse_args([*hargv, "--heads-format", "eagle", "--teacher-weight", "1"])) == 2  # EAGLE-1
    assert train_main(p.parse_args([*hargv, "--teacher-weight", "0.5"])) == 0
    assert json.loads((hydra / "accuracy.json").read_text())["training"]["teacher_weight"] == 0.5
    loaded, _, cfg = load_heads_file(hydra)
    assert cfg["version"] == "hydra" and loaded.format == "hydra" and loaded.draft_vocab_size == 40
    v2, _, _ = load_heads_file(out)
    assert not torch.equal(loaded.draft.linear.weight, torch.zeros_like(loaded.draft.linear.weight))
    assert loaded.num_heads == v2.num_heads == 3
    assert len(json.loads((hydra / "accuracy.json").read_text())["heldout"]["rank_acc"]) == 3


def test_gpu_script_runs_end_to_end_on_cpu(tiny_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_train_heads.py"
    spec = importlib.util.spec_from_file_location("gpu_train_heads", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "run"
    rc = mod.main(
        [
            str(tiny_dir),
            str(out),
            "--device",
            "cpu",
            "--minutes",
            "2",
            "--magpie",
            "0",
            "--prompts",
            str(prompt_file),
            "--batch-size",
            "8",
            "--max-new-tokens",
            "12",
            "--configs",
            "3x1,2x2h",
            "--train-batch",
            "64",
            "--holdout",
            "0.3",
            "--base-model",
            "tiny",
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (
        set(summary["configs"]) == {"heads-3x1", "heads-2x2-hydra"}
        and summary["best"]["config"] in summary["configs"]
    )
    assert {"config.json", HEADS_FILE, "accuracy.json", "tree.json"} <= {
        f.name for f in (out / "best").iterdir()
    }
    assert summary["data"]["samples"] == len(PROMPTS)
