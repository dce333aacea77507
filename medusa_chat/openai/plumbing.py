"""Threading plumbing between the event loop and the decoding thread: a request's ticket in the queue, the SSE
response that always finishes it, and waits that end when the client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

if TYPE_CHECKING:
    from medusa_chat.chat.stream import ReplyStream
    from medusa_chat.openai.routes import ChatAPI


T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its reply started."""


class Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


END = object()


class Ticket:
    """One admitted chat request: its place in the queue, its stop flag and (once started) its reply."""

    def __init__(self, api: ChatAPI) -> None:
        self.api = api
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.stop = threading.Event()
        self.stream: ReplyStream | None = None
        self.producer: threading.Thread | None = None
        self.holds_turn = False
        self._done = False

    def finish(self) -> None:
        """Leave the queue (on the event loop's thread; idempotent). A reply still decoding is told to stop; a
        reply never started is closed here, which releases the session lock."""
        if self._done:
            return
        self._done = True
        self.stop.set()
        if self.stream is not None and self.producer is None:
            self.stream.close()
        self.api.pending -= 1
        if self.holds_turn:
            self.holds_turn = False
            self.api.release_turn()


class ReplyResponse(StreamingResponse):
    """An SSE response that always finishes its ticket, even when the body never starts (e.g. the client left
    before the headers could be sent)."""

    def __init__(
        self, content: AsyncIterator[bytes], *, cleanup: Callable[[], None], watcher: asyncio.Task[None]
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._cleanup = cleanup
        self._watcher = watcher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._watcher.cancel()
            self._cleanup()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


def sse_event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def watch_disconnect(request: Request, gone: asyncio.Event, stop: threading.Event) -> None:
    """Set `gone` and the reply's stop flag as soon as the client disconnects (the body is read already, so
    the next ASGI message can only be the disconnect). Cancelled when the response is complete."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gone.set()
            stop.set()
            return


async def unless_gone(
    awaitable: Awaitable[T], gone: asyncio.Event, on_late: Callable[[], Any] | None = None
) -> T:
    """Await `awaitable` unless the client disconnects first (then ClientGone). If the awaitable completes
    anyway after we gave up on it, `on_late` undoes it (e.g. releases a lock acquired too late)."""
    task = asyncio.ensure_future(awaitable)
    waiter = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    if on_late is not None:

        def undo(t: asyncio.Future[T]) -> None:
            if not t.cancelled() and t.exception() is None:
                on_late()

        task.add_done_callback(undo)
    raise ClientGone


async def in_thread(call: Callable[[], T], on_late: Callable[[T], Any]) -> T:
    """Run a blocking call in a worker thread. If this coroutine is cancelled (server shutdown) while the call
    runs, `on_late` cleans up its result once it arrives (a reply nobody will read must release its lock)."""
    future = asyncio.get_running_loop().run_in_executor(None, call)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:

        def undo(f: asyncio.Future[T]) -> None:
            if not f.cancelled() and f.exception() is None:
                on_late(f.result())

        future.add_done_callback(undo)
        raise
