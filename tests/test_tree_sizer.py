"""The tree sizer (engine/tree_sizer.py): each CPU step's prefix size, chosen from step times measured as replies
run, and the replies it gives (the plain loop's, whatever the sizes).

The choice is tested on synthetic step times whose best size is known, including a change of the machine's state
half-way; the replies on the embedded model's exact native step with a sizer that switches often.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from medusa_chat.engine.tree_sizer import SizeChoices, TreeSizer
from medusa_chat.tuning.tree_choice import adaptive_choices, calibrated_source

# calibrated tokens per step of the embedded model's prefixes (2-core Zen 4, 12 built-in prompts)
TPS = {1: 1.0, 2: 1.48, 3: 1.68, 4: 1.83, 6: 1.96, 8: 2.03}


def run(sizer: TreeSizer, step_seconds: dict[int, float], steps: int) -> list[int]:
    """`steps` steps whose time depends only on their size; the sizes used, in order."""
    used = []
    for _ in range(steps):
        n = sizer.size()
        used.append(n)
        sizer.observe(n, step_seconds[n])
    return used


def best(step_seconds: dict[int, float]) -> int:
    return max(step_seconds, key=lambda n: TPS[n] / step_seconds[n])


# the two states of the same machine, minutes apart (ms per step, tree_sizer.py's docstring)
FAST_MEMORY = {1: 2.52, 2: 3.19, 3: 3.85, 4: 4.47, 6: 6.27, 8: 7.49}  # best: 2 nodes
SLOW_MEMORY = {1: 3.43, 2: 3.67, 3: 3.91, 4: 4.13, 6: 5.14, 8: 6.23}  # best: 4 nodes


@pytest.mark.parametrize("start", [1, 2, 4, 8])
@pytest.mark.parametrize("times", [FAST_MEMORY, SLOW_MEMORY], ids=["fast-memory", "slow-memory"])
def test_the_sizer_finds_the_fastest_size_from_any_start(times: dict[int, float], start: int) -> None:
    sizer = TreeSizer(SizeChoices(list(TPS), start, TPS))
    used = run(sizer, times, 600)
    assert sizer.current == best(times)
    # after settling, trials are the only steps away from the best size: at most trial_steps of every
    # explore_every + trial_steps
    tail = used[-360:]
    share = sum(n == best(times) for n in tail) / len(tail)
    assert share >= sizer.explore_every / (sizer.explore_every + sizer.trial_steps) - 0.02


def test_the_sizer_follows_the_machine_when_its_state_changes() -> None:
    sizer = TreeSizer(SizeChoices(list(TPS), 2, TPS))
    run(sizer, FAST_MEMORY, 300)
    assert sizer.current == 2
    run(sizer, SLOW_MEMORY, 400)
    assert sizer.current == 4
    run(sizer, FAST_MEMORY, 400)
    assert sizer.current == 2


def test_near_ties_and_noise_do_not_move_the_sizer() -> None:
    """A neighbour within the margin does not take over, and the choice is deterministic."""
    even = {n: TPS[n] / 400.0 for n in TPS}  # every size exactly 400 tokens/s
    a, b = TreeSizer(SizeChoices(list(TPS), 3, TPS)), TreeSizer(SizeChoices(list(TPS), 3, TPS))
    assert run(a, even, 500) == run(b, even, 500)
    assert a.current == 3 and a.switches == 0


def test_lost_trials_turn_and_won_ones_climb_on_inside_the_sizes() -> None:
    sizer = TreeSizer(SizeChoices([1, 2, 4], 2, {1: 1.0, 2: 1.5, 4: 1.8}), explore_every=4, trial_steps=2)
    times = {1: 1.0, 2: 1.5 / 1.2, 4: 1.8 / 1.1}  # 2 is the fastest
    used = run(sizer, times, 36)
    trials = [n for n in used if n != 2]
    assert trials[:6] == [4, 4, 1, 1, 4, 4] and set(used) == {1, 2, 4}
    climb = TreeSizer(SizeChoices(list(TPS), 1, TPS), explore_every=4, trial_steps=2)
    fastest_big = {n: TPS[n] / (1.0 + 0.1 * n) for n in TPS}  # rate 1 + 0.1 n: each size beats the one below
    run(climb, fastest_big, 5 * 6)
    assert climb.current == 8 and climb.switches == 5  # five won trials in a row, all upward
    one = TreeSizer(SizeChoices([3], 3, {3: 1.7}))
    assert set(run(one, {3: 1.0}, 100)) == {3}


# ---- from the calibration record --------------------------------------------------------------------------------------
def _record(rates: dict[int, float], pick: int, **extra: Any) -> dict[str, Any]:
    rows = [{"size": n, "tokens_per_step": TPS[n], "tokens_per_s_est": r} for n, r in rates.items()]
    doc = {"device": "cpu", "timing": "replies", "forward": "native C step", "tree_size": pick, "speedup_est": 1.2}
    return doc | {"sizes": rows} | extra


def test_a_reply_timed_cpu_calibration_gives_the_sizes_near_its_pick() -> None:
    rates = {1: 392.0, 2: 469.0, 3: 432.0, 4: 399.0, 6: 312.0, 8: 270.0}  # pick 2; 4 is 0.85x of it
    choices = adaptive_choices(_record(rates, 2), 64)
    assert choices is not None and choices.sizes == [1, 2, 3, 4] and choices.start == 2
    assert choices.tokens_per_step[4] == TPS[4]
    assert "1-4 nodes" in calibrated_source(_record(rates, 2))
    # the engine's tree cannot exceed the model's: sizes above it are left out
    assert adaptive_choices(_record(rates, 2), 3).sizes == [1, 2, 3]
    # a trial-step calibration (a bigger model's) gives them too; older records, GPUs and models without heads
    # keep the one calibrated size
    assert adaptive_choices(_record(rates, 2, timing="steps"), 64).sizes == [1, 2, 3, 4]
    assert adaptive_choices(_record(rates, 2, timing=None), 64) is None
    assert adaptive_choices(_record(rates, 2, device="cuda"), 64) is None
    assert adaptive_choices(_record(rates, 2, lookup_only=True), 64) is None
    assert adaptive_choices(_record(rates, 2, forward="transformers"), 64) is None


def test_choose_tree_gives_the_engine_the_largest_size_and_the_sizer_the_pick(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, make_loaded_model: Any
) -> None:
    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.tuning import tree_choice

    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    loaded = make_loaded_model()
    name, device, quant, dtype = tree_choice.model_identity(loaded)
    rates = {1: 392.0, 2: 469.0, 4: 420.0, 8: 270.0}
    record = _record(rates, 2, version=tree_choice.CALIBRATION_VERSION, tree=loaded.default_tree.name)
    tree_choice.save_calibration(record, name, device, quant, dtype)
    tree, source = tree_choice.choose_tree(loaded)
    assert tree.size == 4 and "1-4 nodes" in source
    assert tree.sizes is not None and tree.sizes.start == 2
    engine = MedusaEngine(loaded, tree)
    # the tiny test model runs eagerly in PyTorch, not on the exact native step: every step verifies the whole tree
    assert engine.sizer is None or engine.exact


def test_greedy_replies_equal_the_plain_loop_while_the_sizer_switches(embedded_model: Any) -> None:
    """On the exact native step every prefix of the tree gives the plain loop's tokens, so a sizer that tries
    another size every few steps (and the sizes it switches to) changes nothing in the reply."""
    from medusa_chat.engine.engine import MedusaEngine, plain_tree
    from medusa_chat.events import GenerationSettings, ReplySummary

    loaded = embedded_model
    choices = SizeChoices([1, 2, 3, 4], 2, dict.fromkeys([1, 2, 3, 4], 1.0))  # (equal tokens per step: the step times decide)
    engine = MedusaEngine(loaded, replace(loaded.default_tree.prefix(4), sizes=choices))
    assert engine.sizer is not None
    engine.sizer.explore_every, engine.sizer.trial_steps = 3, 2
    plain = MedusaEngine(loaded, plain_tree())
    used: list[int] = []
    sizer = engine.sizer
    observe = sizer.observe

    def recording(size: int, seconds: float) -> None:
        # every trial size steps twice as fast as the current one: each trial wins, so the current size climbs to
        # one end and back, whatever the number of steps the replies take (their acceptance)
        used.append(size)
        observe(size, 1.0 if size == sizer.current else 0.5)

    engine.sizer.observe = recording  # type: ignore[method-assign]
    settings = GenerationSettings(max_new_tokens=40, temperature=0.0)

    def reply(e: MedusaEngine, text: str) -> list[int]:
        ids = loaded.build_prompt([{"role": "user", "content": text}])
        out = [x for x in e.generate(ids, settings) if isinstance(x, ReplySummary)]
        return out[0].token_ids

    for text in ("Write a haiku about the sea.", "List three prime numbers and say why.", "What is a CPU cache?"):
        assert reply(engine, text) == reply(plain, text), text
    assert set(used) == {1, 2, 3, 4} and engine.sizer.switches >= 3, used  # every size ran, the current one moved
