"""The web page's model loading: the session's model loaded in a background thread at launch, its progress lines
kept for the browser, and any error said in one line a person can act on."""

from __future__ import annotations

import sys
import threading
import traceback
from typing import TYPE_CHECKING

from medusa_chat.errors import MedusaChatError

if TYPE_CHECKING:
    from medusa_chat.chat.session import SessionManager


def friendly_error(err: BaseException) -> str:
    """A one-line message a person can act on, for any exception a handler meets."""
    if isinstance(err, MedusaChatError):
        return str(err)
    if type(err).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError / torch.cuda.OutOfMemoryError
        return (
            "out of memory: try a smaller tree (Advanced → tree size), fewer max new tokens, a shorter "
            "conversation (Clear), or 4-bit weights (--quant nf4)"
        )
    return f"unexpected error ({type(err).__name__}): {err}"


class ModelLoader:
    """Loads the session's model in a background thread and keeps the progress lines for the browser."""

    def __init__(self, session: SessionManager) -> None:
        self.session = session
        self.status = "ready" if getattr(session, "loaded_ok", False) else "idle"
        self.lines: list[str] = []
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        if self.status == "ready":
            self._done.set()

    def start(self) -> None:
        """Start loading unless it is loaded or loading already (a failed load is retried)."""
        with self._lock:
            if self.status in ("ready", "loading"):
                return
            self.status, self.error = "loading", None
            self._done.clear()
            self.lines.append("starting…")
            self._thread = threading.Thread(target=self._run, name="medusa-chat-load", daemon=True)
            self._thread.start()

    def _progress(self, text: str) -> None:
        self.lines.append(str(text))
        del self.lines[:-50]

    def _run(self) -> None:
        try:
            self.session.load(progress=self._progress)
        except BaseException as err:  # noqa: BLE001 - shown in the browser; the app keeps running
            self.error = friendly_error(err)
            self.lines.append(self.error)
            self.status = "error"
            if not isinstance(err, MedusaChatError):
                traceback.print_exc()
            # the terminal that started the page says it too (the page shows it in its chat area)
            print(f"the model could not be loaded: {self.error}", file=sys.stderr, flush=True)
        else:
            self.lines.append("ready")
            self.status = "ready"
        finally:
            self._done.set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)
