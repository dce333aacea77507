"""The native step's thread count (qgemm.set_threads, engine/threads.py) changes no output bit: the kernels split
work by rows, column groups, heads and key ranges, never inside one sum, so greedy replies with 1 and 2 threads
are the same tokens, and Medusa's equal the plain loop's either way."""

from __future__ import annotations

import pytest

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.events import GenerationSettings, ReplySummary
from medusa_chat.kernels import qgemm
from medusa_chat.tree import Tree
from tests.tinymodels import block_loaded, training_prompts


def _reply(engine: MedusaEngine, prompt: list[int], n: int = 32) -> list[int]:
    for event in engine.generate(prompt, GenerationSettings(max_new_tokens=n, temperature=0)):
        if isinstance(event, ReplySummary):
            return event.token_ids
    raise AssertionError("no summary")


@pytest.fixture
def restore_threads():
    import torch

    torch_threads = torch.get_num_threads()
    yield
    qgemm.set_threads(0)
    torch.set_num_threads(torch_threads)


def test_the_team_size_really_applies(restore_threads) -> None:
    if not qgemm.available():
        pytest.skip(qgemm.unavailable_reason())
    for n in (1, 2, 3):
        qgemm.set_threads(n)
        assert qgemm.get_threads() == n
        assert qgemm.load().mc_team_probe() == n  # the clause holds on the OpenMP runtime really loaded


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_one_and_two_threads_decode_the_same_tokens(quant: str, restore_threads, monkeypatch) -> None:
    model = block_loaded(quant)
    prompts = training_prompts()[:2] + [[5, 9, 17, 33, 65, 129, 257, 7, 11]]
    replies = {}
    for n in (1, 2):
        monkeypatch.setenv("MEDUSA_CHAT_THREADS", str(n))  # fixed: the engines' governors keep it
        plain = MedusaEngine(model, plain_tree())
        tree = MedusaEngine(model, Tree.named("mc_sim_7b_63"))
        assert not tree.threads.adaptive and qgemm.get_threads() == n and qgemm.load().mc_team_probe() == n
        replies[n] = [(_reply(plain, p), _reply(tree, p)) for p in prompts]
    assert replies[1] == replies[2]
    for ref, got in replies[1]:
        assert got == ref  # Medusa's greedy reply is the plain loop's


class _Clock:
    """A governor fed made-up step times: the rule, without a loaded machine."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)


def _feed(gov, seconds: float, until: int, most: int) -> int:
    """Steps of `seconds` (tree size 8) until the governor runs `until` threads; how many it took."""
    for n in range(1, most + 1):
        gov.observe(seconds, 8)
        if gov.threads == until:
            return n
    raise AssertionError(f"still on {gov.threads} threads after {most} steps")


def test_the_governor_drops_to_one_thread_under_load_and_comes_back(monkeypatch) -> None:
    from medusa_chat.engine import threads

    monkeypatch.delenv("MEDUSA_CHAT_THREADS", raising=False)
    gov = threads.ThreadGovernor(full=2, set_threads=_Clock())
    assert gov.adaptive and gov.threads == 2
    for _ in range(20):
        gov.observe(0.005, 8)  # quiet: 5 ms
    assert gov.threads == 2
    _feed(gov, 0.015, until=1, most=threads.WINDOW)  # 3x slower: dropped within the window
    _feed(gov, 0.008, until=2, most=threads.PROBE_EVERY)  # 1 thread under load; then a try of 2
    assert gov.threads == 2
    _feed(gov, 1.0, until=1, most=1)  # a stall in the try (200x): it loses
    _feed(gov, 0.008, until=2, most=2 * threads.PROBE_EVERY)
    _feed(gov, 1.0, until=1, most=threads.PROBE)  # still loaded: the try loses
    _feed(gov, 0.008, until=2, most=4 * threads.PROBE_EVERY)  # each lost try puts the next one further off
    for _ in range(threads.PROBE):
        gov.observe(0.005, 8)  # the load is gone: 2 threads win the try and stay
    for _ in range(10):
        gov.observe(0.005, 8)
        assert gov.threads == 2


def test_a_load_present_from_the_start_is_found_by_a_try_of_one_thread(monkeypatch) -> None:
    from medusa_chat.engine import threads

    monkeypatch.delenv("MEDUSA_CHAT_THREADS", raising=False)
    gov = threads.ThreadGovernor(full=2, set_threads=_Clock())
    _feed(gov, 1.0, until=1, most=threads.DOWN_EVERY + 1)  # 2 threads, slow all along: the try of 1 begins
    for _ in range(threads.PROBE):
        gov.observe(0.008, 8)
    assert gov.threads == 1  # and wins


def test_a_fixed_count_disables_adaptation(monkeypatch) -> None:
    from medusa_chat.engine import threads

    monkeypatch.setenv("MEDUSA_CHAT_THREADS", "1")
    calls = _Clock()
    gov = threads.ThreadGovernor(full=2, set_threads=calls)
    assert not gov.adaptive and gov.threads == 1
    for _ in range(50):
        gov.observe(1.0, 8)
    assert gov.threads == 1 and set(calls.calls) == {1}
    assert threads.describe() == "1, fixed by MEDUSA_CHAT_THREADS"


def test_products_and_the_fused_argmax_are_the_same_bits_on_1_2_3_threads(restore_threads) -> None:
    """Above PAR_MIN (qgemm.c: N * K >= 2^18) a standalone product and the lm_head's fused argmax run their own
    multi-threaded regions (the tiny models' products are below it): same outputs, same tokens (ties: the first
    index, merged across threads in column order)."""
    import torch

    from medusa_chat.kernels.cpu_linears import quantize_q4_1

    if not qgemm.available():
        pytest.skip(qgemm.unavailable_reason())
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1000, 512, generator=g) * 0.05
    w[700:] = w[100:400]  # tied pairs across the threads' column ranges: the earlier index must win
    q8, q4 = qgemm.Q80Linear(*qgemm.quantize_q8_0(w)), qgemm.Q41Linear(*quantize_q4_1(w[:992]))
    x = torch.randn(9, 512, generator=g)
    got = {}
    for n in (1, 2, 3):
        qgemm.set_threads(n)
        got[n] = (q8(x), q4(x), q8.argmax(x))
    for n in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(got[1], got[n], strict=True)), n


def test_on_one_thread_the_engine_verifies_the_calibrated_one_thread_prefix(restore_threads, monkeypatch) -> None:
    """Calibration's one-thread size (LoadedModel.single_thread_trees) is the tree while the native step runs one
    thread; all threads verify the whole tree; the replies are the plain loop's either way."""
    monkeypatch.delenv("MEDUSA_CHAT_THREADS", raising=False)
    model = block_loaded("int8")
    monkeypatch.setattr(model, "single_thread_trees", {8: 3})
    engine = MedusaEngine(model, Tree.named("mc_sim_7b_63").prefix(8))
    plain = MedusaEngine(model, plain_tree())
    settings = GenerationSettings(max_new_tokens=24, temperature=0, context_lookup=False)
    for count, largest in ((1, 3), (2, 8)):
        engine.threads.adaptive, engine.threads.threads = False, count  # as the governor would leave it
        sizes = []
        for prompt in training_prompts()[:3]:
            events = list(engine.generate(prompt, settings))
            assert qgemm.get_threads() == count
            sizes += [len(e.tree.tokens) for e in events[:-1] if e.tree is not None]
            assert events[-1].token_ids == _reply(plain, prompt, 24)
        assert max(sizes) == largest, (count, sizes)


def test_calibration_times_one_thread_too_and_never_picks_a_larger_tree(restore_threads, monkeypatch, tmp_path) -> None:
    import json
    import os

    import torch

    from medusa_chat.tuning import calibrate as cal

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: there is no other thread count to time")
    monkeypatch.delenv("MEDUSA_CHAT_THREADS", raising=False)
    torch.set_num_threads(2)  # (a test before may have left torch's pool, the runtime's default team, at one)
    model = block_loaded("int8")
    base = Tree.named("mc_sim_7b_63").prefix(4)
    accuracy = tmp_path / "tree.json"  # (this tiny model has no chat template for the built-in prompts)
    accuracy.write_text(
        json.dumps({"paths": [list(p) for p in base.paths], "expected_tokens_per_step": [1.0, 1.6, 1.9, 2.1]})
    )
    record = cal.calibrate(model, base=base, sizes=[1, 2, 4], prefix_tokens=16, reps=2, accuracy_file=accuracy)
    assert 1 <= record["tree_size_1_thread"] <= record["tree_size"]
    assert all(row["latency_1_thread_s"] > 0 for row in record["sizes"])
