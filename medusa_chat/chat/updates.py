"""A reply's events as UI updates at a bounded rate, decoded ahead of the UI in a worker thread.

Why: the engine yields one StepEvent per decoding step, hundreds a second on a CPU. Redrawing the page (Gradio:
chat Markdown, meter, tree SVG; then the browser's layout) or the terminal (Rich Markdown of the whole reply) per
step costs more than the step itself, and when the decoder waits for the UI between two steps that time counts
as decode time: a browser on the same cores showed a third of the speed `ask` measures. So:

- `Coalescer` merges the steps that arrive between two updates into one `Update` (their text deltas joined,
  every StepEvent kept, in order, for the tree view) and lets an update out at most every `interval_s`; the
  first step (time to first token) goes out at once and the last update (final text and summary) always.
- `updates(stream)` runs the reply's iterator in its own thread ("decode ahead"), feeding a queue; the UI thread
  drains the queue and renders at the bounded rate. The decoder never waits for a render (the native step
  releases the GIL; only its short Python parts share it with the UI's).

Both UIs use `updates()`; they hold no model logic. Plain data, no UI imports.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from medusa_chat import envvars
from medusa_chat.events import ReplySummary, StepEvent

# At most this many UI updates a second while a reply streams (the last one is always sent). Each costs the
# browser (or the terminal) a re-render of the reply so far, on the decoder's cores and, for the web server, under
# the decoder's GIL. Measured on a 2-core EPYC in Chromium (benchmarks/browser_vs_ask.py, 4 rounds, medians), the
# page's decode speed against `ask`'s: 15 text updates a second with the panels each time (the former default)
# 0.65x, 15 with the panels at 2 a second 0.68x, 8 0.72x, 4 0.82x. So a machine of 2 cores or fewer, where the
# browser shares the decoder's cores, gets 4 (a line of text at a time); a bigger one 8, still a smooth stream.
# MEDUSA_CHAT_UI_HZ overrides it (the browser benchmark compares).
UPDATES_PER_S = 8.0
SMALL_MACHINE_UPDATES_PER_S = 4.0


def updates_per_s() -> float:
    """The default text update rate on this machine (MEDUSA_CHAT_UI_HZ aside)."""
    return SMALL_MACHINE_UPDATES_PER_S if (os.cpu_count() or 1) <= 2 else UPDATES_PER_S


def default_interval_s() -> float:
    """Seconds between two UI updates: 1 / MEDUSA_CHAT_UI_HZ when set (> 0), else 1 / updates_per_s()."""
    return 1.0 / envvars.positive_rate("MEDUSA_CHAT_UI_HZ", updates_per_s())


# The web page's panels (the meter with its tokens-per-step chart, the live tree view, the step slider) are
# redrawn at most this often while a reply streams; the reply's text keeps UPDATES_PER_S. Each panel update
# replaces ~30 KB of HTML and SVG (the chart grows with the reply) that the browser parses and lays out on the
# decoder's cores, where a text update appends a few words; the final update always redraws them all.
# MEDUSA_CHAT_UI_PANEL_HZ overrides it (the browser benchmark compares).
PANEL_UPDATES_PER_S = 2.0


def panel_interval_s() -> float:
    """Seconds between two redraws of the web page's panels: 1 / MEDUSA_CHAT_UI_PANEL_HZ when set (> 0), else
    1 / PANEL_UPDATES_PER_S."""
    return 1.0 / envvars.positive_rate("MEDUSA_CHAT_UI_PANEL_HZ", PANEL_UPDATES_PER_S)


def decode_ahead_default() -> bool:
    """Decode in a worker thread (the default); MEDUSA_CHAT_UI_DECODE_AHEAD=0 keeps the old single-thread way
    (the UI pulls each step itself), for measuring the difference."""
    return envvars.enabled("MEDUSA_CHAT_UI_DECODE_AHEAD")


@dataclass
class Update:
    """What a UI draws next: the steps since its previous update, merged."""

    steps: list[StepEvent] = field(default_factory=list)  # every step since the previous update, in order
    text: str = ""  # the text those steps added (their deltas joined)
    summary: ReplySummary | None = None  # set on the final update when the reply ended normally
    final: bool = False  # the reply is over: this is the last update

    @property
    def last(self) -> StepEvent | None:
        """The newest step in this update (its meter figures are the latest), None when it has none."""
        return self.steps[-1] if self.steps else None


class Coalescer:
    """Merges a reply's items into updates no closer together than `interval_s` (pure, clock injected).

    `add` items as they come, then ask `take(now)` for an update: it returns one when something is pending and
    either the interval since the previous update has passed or the pending items include the first step; else
    None. `finish()` returns the final update (pending steps and the summary), whatever the time.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0 (got {interval_s})")
        self.interval_s = interval_s
        self.clock = clock
        self._steps: list[StepEvent] = []
        self._text: list[str] = []
        self._summary: ReplySummary | None = None
        self._last_emit: float | None = None  # None until the first update: the first step goes out at once
        self.emitted = 0  # updates handed out (tests and benchmarks count them)

    def add(self, item: StepEvent | ReplySummary) -> None:
        if isinstance(item, ReplySummary):
            self._summary = item  # shown with the final update, after which nothing can follow
        else:
            self._steps.append(item)
            self._text.append(item.text)

    @property
    def pending(self) -> bool:
        return bool(self._steps)

    def due_in(self, now: float | None = None) -> float | None:
        """Seconds until pending steps may go out (0: now); None when nothing is pending."""
        if not self._steps:
            return None
        if self._last_emit is None:
            return 0.0
        now = self.clock() if now is None else now
        return max(self._last_emit + self.interval_s - now, 0.0)

    def take(self, now: float | None = None) -> Update | None:
        """The pending steps as one update when one is due, else None."""
        wait = self.due_in(now)
        if wait is None or wait > 0:
            return None
        return self._emit(final=False, now=now)

    def flush(self) -> Update:
        """The pending steps as an update now, whatever the time (not the final one)."""
        return self._emit(final=False)

    def finish(self) -> Update:
        """The last update: whatever is pending plus the summary (sent even when it carries no step)."""
        return self._emit(final=True)

    def _emit(self, final: bool, now: float | None = None) -> Update:
        out = Update(list(self._steps), "".join(self._text), self._summary if final else None, final)
        self._steps.clear()
        self._text.clear()
        self._last_emit = self.clock() if now is None else now
        self.emitted += 1
        return out


_END = object()  # the worker's last queue item


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class ReplyUpdates(Iterator[Update]):
    """The iterator `updates()` returns; `close()` ends the reply (kept, marked stopped) and its thread."""

    def __init__(
        self,
        stream: Iterable[StepEvent | ReplySummary],
        interval_s: float | None = None,
        *,
        ahead: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.coalescer = Coalescer(default_interval_s() if interval_s is None else interval_s, clock)
        self._stream = stream
        self._source: Iterator[StepEvent | ReplySummary] = iter(stream)
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._done = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if decode_ahead_default() if ahead is None else ahead:
            self._thread = threading.Thread(target=self._decode, name="medusa-chat-decode", daemon=True)
            self._thread.start()

    # ---- the decoding thread ------------------------------------------------------------------------------
    def _decode(self) -> None:
        # This thread alone calls next() and close() on the stream, so the two never race; a closing consumer
        # only sets a flag, seen after the current step (a clean point: the session keeps the partial reply).
        try:
            for item in self._source:
                self._queue.put(item)
                if self._closing.is_set():
                    break
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
            self._queue.put(_Failure(err))
        finally:
            try:
                self._close_stream()
            finally:
                self._queue.put(_END)

    def _close_stream(self) -> None:
        close = getattr(self._stream, "close", None)
        if close is not None:
            close()

    # ---- the consumer -------------------------------------------------------------------------------------
    def __iter__(self) -> ReplyUpdates:
        return self

    def __next__(self) -> Update:
        if self._error is not None:  # the steps before the failure went out with the previous update
            error, self._error = self._error, None
            raise error
        if self._done:
            raise StopIteration
        if self._thread is None:
            return self._next_inline()
        c = self.coalescer
        while True:
            update = c.take()
            if update is not None:
                return update
            wait = c.due_in()
            try:  # block until the next item, or until the pending steps are due
                item = self._queue.get(timeout=wait) if wait is not None else self._queue.get()
            except queue.Empty:
                continue
            while True:  # then everything already decoded: one update carries it all
                if item is _END:
                    self._done = True
                    self._thread.join()
                    return c.finish()
                if isinstance(item, _Failure):
                    self._done = True
                    self._thread.join()
                    return self._fail(item.error)
                c.add(item)  # type: ignore[arg-type]
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break

    def _next_inline(self) -> Update:
        # Without the worker: the UI pulls the steps itself (the decoder waits while it renders).
        c = self.coalescer
        try:
            for item in self._source:
                c.add(item)
                update = c.take()
                if update is not None:
                    return update
        except Exception as err:  # raised by _fail, after the steps before it (Ctrl-C: at once)
            self._done = True
            return self._fail(err)
        self._done = True
        return c.finish()

    def _fail(self, error: BaseException) -> Update:
        """The reply failed: the steps decoded before the failure still go out, then the error is raised."""
        if not self.coalescer.pending:
            raise error
        self._error = error
        return self.coalescer.flush()

    def close(self, wait: bool = True) -> None:
        """Stop reading: the reply ends after its current step (kept, marked stopped, by the session) and the
        stream is closed (its lock released) before this returns; with `wait=False` that happens in the
        decoding thread after this returns."""
        self._done = True
        if self._thread is None:
            self._close_stream()
            return
        self._closing.set()
        if wait:
            self._thread.join()

    def __enter__(self) -> ReplyUpdates:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Ctrl-C (the REPL's second one, its escape hatch from a long prefill) does not wait for the step: the
        # decoding thread ends the reply by itself once the step returns.
        self.close(wait=exc_type is None or not issubclass(exc_type, KeyboardInterrupt))


def updates(
    stream: Iterable[StepEvent | ReplySummary],
    interval_s: float | None = None,
    *,
    ahead: bool | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> ReplyUpdates:
    """A reply's items as coalesced updates (see the module doc); `close()` it when done, or use `with`."""
    return ReplyUpdates(stream, interval_s, ahead=ahead, clock=clock)
