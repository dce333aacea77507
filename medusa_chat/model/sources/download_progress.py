"""A download's progress: byte counts from huggingface_hub turned into Rich bars on a terminal and throttled text
lines for the UIs (hub.py fetches; this only reports)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from medusa_chat.units import human_bytes

Progress = Callable[[str], None]


class DownloadReporter:
    """Byte progress of one repo's files: Rich bars on a terminal and/or throttled text lines for a callback.

    Rich is imported only when bars are shown, so library users (and the web UI) never need a terminal.
    """

    def __init__(
        self, repo: str, files: dict[str, int | None], callback: Progress | None, bars: bool
    ) -> None:
        self.repo = repo
        self.files = files
        self.callback = callback
        self.total = sum(s or 0 for s in files.values())
        self.done = 0
        self._last_text = 0.0
        self._lock = threading.Lock()
        self._progress = None
        self._tasks: dict[str, int] = {}
        self._current: str | None = None
        if bars:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )

    def __enter__(self) -> DownloadReporter:
        if self._progress is not None:
            self._progress.start()
        self._say(f"Downloading {len(self.files)} file(s), {human_bytes(self.total)}, from {self.repo}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
        if exc[0] is None:
            self._say(f"Downloaded {self.repo} ({human_bytes(self.done)})")

    def _say(self, text: str) -> None:
        if self.callback is not None:
            self.callback(text)

    def start_file(self, name: str) -> None:
        self._current = name
        if self._progress is not None:
            self._tasks[name] = self._progress.add_task(name, total=self.files.get(name))

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self._progress is not None and self._current in self._tasks:
                self._progress.update(self._tasks[self._current], advance=n)
            now = time.monotonic()
            if self.callback is not None and now - self._last_text >= 1.0:
                self._last_text = now
                pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
                self.callback(
                    f"Downloading {self.repo}: {self._current} — "
                    f"{human_bytes(self.done)} of {human_bytes(self.total)}{pct}"
                )

    def tqdm_class(self) -> type:
        """A tqdm stand-in for huggingface_hub that forwards byte counts here."""
        reporter = self

        class _Bar:
            # Having update_transfer makes huggingface_hub route its network-transfer bar to this same object;
            # only bytes written to disk (`update`) are counted, so nothing is counted twice.
            def __init__(self, *args: object, **kwargs: object) -> None:
                self.n = int(kwargs.get("initial") or 0)  # a resumed download starts past zero
                self.total = kwargs.get("total")
                if self.n:
                    reporter.advance(self.n)

            def update(self, n: float | None = 1) -> None:
                n = int(n or 0)
                self.n += n
                reporter.advance(n)

            def update_transfer(self, n: float | None = 1) -> None:
                pass

            def close(self) -> None:
                pass

            def __enter__(self) -> _Bar:
                return self

            def __exit__(self, *exc: object) -> bool:
                return False

            def __getattr__(self, name: str) -> Callable[..., None]:
                # refresh(), set_description(), set_postfix_str(), ...: display details we do not need.
                return lambda *a, **k: None

        return _Bar
