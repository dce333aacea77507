"""UI updates at a bounded rate (chat/updates.py): merging, the last update, every step kept, the rate bound
(with a fake clock), and the decoding thread: it runs ahead of a slow consumer, hands errors over, and closing it
ends the reply cleanly (kept, marked stopped; the session free again)."""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from medusa_chat.chat.session import SessionManager, SessionOptions
from medusa_chat.chat.updates import Coalescer, Update, default_interval_s, panel_interval_s, updates
from medusa_chat.errors import MedusaChatError
from medusa_chat.events import ReplySummary, StepEvent


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step(i: int, text: str | None = None) -> StepEvent:
    return StepEvent(
        i, [i], f"t{i} " if text is None else text, [0], None, 0.001, i + 1, i * 0.001, 100.0, 1.0
    )


def summary_of(steps: list[StepEvent]) -> ReplySummary:
    text = "".join(s.text for s in steps)
    return ReplySummary(
        text, [], len(steps), len(steps) - 1, 1.0, 100.0, 0.0, 0.0, 0.0, 1, 0, "greedy", "eos", 4
    )


def test_coalescer_merges_deltas_keeps_every_step_and_bounds_the_rate() -> None:
    clock = FakeClock()
    c = Coalescer(0.1, clock)
    steps = [step(i) for i in range(1000)]
    out: list[Update] = []
    for s in steps:  # one step per millisecond for a second
        c.add(s)
        u = c.take()
        if u is not None:
            out.append(u)
        clock.now += 0.001
    c.add(summary_of(steps))
    out.append(c.finish())
    assert out[0].steps == [steps[0]]  # the first step (time to first token) goes out at once
    # at most one update per interval (the first at t=0), plus the final one
    assert len(out) <= 1 + 1.0 / 0.1 + 1 and c.emitted == len(out)
    times = [u.steps[0].step * 0.001 for u in out[1:-1]]
    assert all(b - a >= 0.1 - 1e-9 for a, b in zip(times, times[1:], strict=False))
    # nothing lost, nothing repeated, in order; each update's text is its steps' deltas joined
    assert [s for u in out for s in u.steps] == steps
    assert all(u.text == "".join(s.text for s in u.steps) for u in out)
    assert "".join(u.text for u in out) == "".join(s.text for s in steps)
    assert out[-1].final and out[-1].summary is not None and not any(u.final or u.summary for u in out[:-1])


def test_coalescer_final_update_is_sent_even_with_nothing_pending() -> None:
    clock = FakeClock()
    c = Coalescer(0.5, clock)
    c.add(step(0))
    first = c.take()
    assert first is not None and first.last == step(0)
    c.add(step(1))
    assert c.take() is None and c.due_in() == pytest.approx(0.5)  # too soon: held back
    clock.now = 0.2
    assert c.take() is None and c.due_in() == pytest.approx(0.3)
    final = c.finish()  # the reply ended: the held step goes out now, whatever the time
    assert final.final and final.steps == [step(1)] and final.text == "t1 "
    assert c.due_in() is None and c.take() is None
    empty = c.finish()  # ended with nothing pending (e.g. a stopped reply): still a final update
    assert empty.final and empty.steps == [] and empty.last is None
    with pytest.raises(ValueError):
        Coalescer(-1)


def test_inline_updates_with_a_fake_clock() -> None:
    """Without the decoding thread (the UI pulls the steps itself): same merging and bound."""
    clock = FakeClock()
    steps = [step(i) for i in range(300)]

    def stream() -> Iterator[StepEvent | ReplySummary]:
        for s in steps:
            yield s
            clock.now += 0.002  # 500 steps a second
        yield summary_of(steps)

    out = list(updates(stream(), 1 / 15, ahead=False, clock=clock))
    assert len(out) <= 2 + 0.6 * 15 and [s for u in out for s in u.steps] == steps
    assert (
        out[-1].final and out[-1].summary is not None and out[-1].summary.text == "".join(u.text for u in out)
    )


def test_interval_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEDUSA_CHAT_UI_HZ", raising=False)
    expected = 4 if (os.cpu_count() or 1) <= 2 else 8  # the browser shares a small machine's cores
    assert default_interval_s() == pytest.approx(1 / expected)
    monkeypatch.setenv("MEDUSA_CHAT_UI_HZ", "4")
    assert default_interval_s() == pytest.approx(0.25)
    for bad in ("0", "fast"):
        monkeypatch.setenv("MEDUSA_CHAT_UI_HZ", bad)
        with pytest.raises(ValueError, match="MEDUSA_CHAT_UI_HZ"):
            default_interval_s()
    monkeypatch.delenv("MEDUSA_CHAT_UI_PANEL_HZ", raising=False)
    assert panel_interval_s() == pytest.approx(0.5)
    monkeypatch.setenv("MEDUSA_CHAT_UI_PANEL_HZ", "5")
    assert panel_interval_s() == pytest.approx(0.2)
    monkeypatch.setenv("MEDUSA_CHAT_UI_PANEL_HZ", "-1")
    with pytest.raises(ValueError, match="MEDUSA_CHAT_UI_PANEL_HZ"):
        panel_interval_s()


def test_the_decoder_runs_ahead_of_a_consumer_that_does_not_read() -> None:
    """The consumer takes one update and then renders "forever": the reply still decodes to its end."""
    produced: list[int] = []
    finished = threading.Event()

    def stream() -> Iterator[StepEvent | ReplySummary]:
        steps = []
        for i in range(50):
            steps.append(step(i))
            produced.append(i)
            yield steps[-1]
        finished.set()
        yield summary_of(steps)

    feed = updates(stream(), 0.05)
    first = next(feed)
    assert first.steps[0].step == 0
    assert finished.wait(10), f"the decoder waited for the UI ({len(produced)} of 50 steps)"
    out = [first, *feed]  # (the first update may already hold every step: they were all decoded)
    assert [s.step for u in out for s in u.steps] == list(range(50))
    assert out[-1].final and out[-1].summary is not None
    # inline (the old way), the same consumer holds the decoder up
    produced.clear()
    finished.clear()
    inline = updates(stream(), 0.05, ahead=False)
    next(inline)
    time.sleep(0.2)
    assert len(produced) < 50 and not finished.is_set()
    inline.close()


def test_an_error_in_the_reply_reaches_the_consumer_after_the_steps_before_it() -> None:
    closed = threading.Event()

    def stream() -> Iterator[StepEvent]:
        try:
            yield step(0)
            yield step(1)
            raise MedusaChatError("out of memory while generating")
        finally:
            closed.set()

    seen: list[StepEvent] = []
    with pytest.raises(MedusaChatError, match="out of memory"):
        for u in updates(stream(), 0.0):
            seen += u.steps
    assert [s.step for s in seen] == [0, 1] and closed.is_set()


@pytest.fixture
def session(make_loaded_model: Callable[..., Any], tmp_path: Path) -> SessionManager:
    s = SessionManager(SessionOptions(tree_size=8), tmp_path, make_loaded_model(), auto_calibrate=False)
    s.load()
    return s


def test_a_real_reply_through_the_decoding_thread_is_complete(session: SessionManager) -> None:
    session.update_settings(max_new_tokens=120, temperature=0)
    out = list(updates(session.send("Tell me a story."), 1 / 15))
    steps = [s for u in out for s in u.steps]
    final = out[-1]
    assert final.final and final.summary is not None and final.summary.new_tokens > 0
    assert steps == session.last_events  # every step, in order, for the tree view
    assert "".join(u.text for u in out) == final.summary.text == session.conversation.messages[-1].content
    assert not session.busy  # the stream was released by the decoding thread
    # the same reply decoded without any UI: identical tokens
    session.undo()
    plain = list(session.send("Tell me a story."))
    assert plain[-1].token_ids == final.summary.token_ids


def test_closing_mid_reply_keeps_it_stopped_and_frees_the_session(session: SessionManager) -> None:
    session.update_settings(max_new_tokens=400, temperature=0)
    engine = session.engine
    assert engine is not None
    original = engine.generate

    def paced(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for item in original(*args, **kwargs):
            time.sleep(0.01)
            yield item

    engine.generate = paced  # type: ignore[method-assign]
    try:
        feed = updates(session.send("Tell me a very long story."), 0.02)
        got = [next(feed), next(feed)]
        feed.close()
    finally:
        del engine.generate
    assert not session.busy
    kept = session.conversation.messages[-1]
    assert kept.role == "assistant" and kept.stopped and kept.stats["new_tokens"] < 400
    assert kept.content.startswith("".join(u.text for u in got))
    assert list(feed) == []  # a closed feed yields nothing more


def test_terminal_redraws_a_long_fast_reply_at_a_bounded_rate(session: SessionManager) -> None:
    from medusa_chat.ui.terminal import TerminalChat

    steps = [step(i, f"word{i} ") for i in range(600)]

    def stream() -> Iterator[StepEvent | ReplySummary]:
        for s in steps:
            time.sleep(0.002)  # ~1.2 s of fast steps: per-step redraws would be 600
            yield s
        yield summary_of(steps)

    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=True, height=40)
    chat = TerminalChat(session, console, interactive=True, out=out)
    t0 = time.monotonic()
    chat.stream_reply(stream)
    elapsed = time.monotonic() - t0
    assert 2 <= chat.screen_updates <= 2 + elapsed * 15 + 1
    assert "word599" in out.getvalue()  # the final frame has the whole reply


def test_ctrl_c_in_the_consumer_does_not_wait_for_a_long_step() -> None:
    release = threading.Event()
    closed = threading.Event()

    def stream() -> Iterator[StepEvent]:
        try:
            yield step(0)
            release.wait(10)  # a long prefill or step
            yield step(1)
        finally:
            closed.set()

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt), updates(stream(), 0.0) as feed:
        next(feed)
        raise KeyboardInterrupt
    assert time.monotonic() - t0 < 5 and not closed.is_set()  # did not wait for the step
    release.set()
    assert closed.wait(10)  # the decoding thread closed the stream by itself after the step
