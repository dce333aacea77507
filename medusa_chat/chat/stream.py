"""A reply in progress as an iterator of the engine's events, which releases the session when it ends or is closed."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Generator, Iterator

from medusa_chat import compute
from medusa_chat.errors import BusyError
from medusa_chat.events import ReplySummary, StepEvent

Item = StepEvent | ReplySummary


class ReplyStream(Iterator[Item]):
    """The iterator `send`/`regenerate`/`edit_last` return.

    The session's lock is taken when the reply is requested (so a second request fails at once with
    BusyError) and released when this stream ends, fails, or is closed/garbage-collected, even if the
    caller never started iterating it.
    """

    def __init__(
        self, gen: Generator[Item, None, None], release: Callable[[], None], stop: Callable[[], None]
    ) -> None:
        self._gen = gen
        self._release: Callable[[], None] | None = release
        self._stop = stop

    def __iter__(self) -> ReplyStream:
        return self

    def __next__(self) -> Item:
        if inspect.getgeneratorstate(self._gen) == inspect.GEN_RUNNING:
            raise BusyError("this reply is already being read by another thread")  # and keeps its lock
        try:
            return compute.run(next, self._gen)  # every step on the thread that runs the model (compute.py)
        except BaseException:  # StopIteration included: the reply is over either way
            self._finish()
            raise

    def close(self) -> None:
        if inspect.getgeneratorstate(self._gen) == inspect.GEN_RUNNING:
            # Another thread is inside next() (a decode step): a generator cannot be closed from outside
            # while it runs, and the lock must stay held until it returns. Stop it instead; the reply then
            # ends by itself and the consumer's next() (or garbage collection) finishes the cleanup.
            self._stop()
            return
        try:
            compute.run(self._gen.close)  # runs the session's cleanup: a partial reply is kept, marked stopped
        finally:
            self._finish()

    def _finish(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
