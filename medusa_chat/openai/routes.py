"""The `/v1` routes (FastAPI): `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions` (plain JSON,
or SSE streaming in the official chunk format ending with `data: [DONE]`), over one SessionManager."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from medusa_chat.engine.text import partial_stop_suffix  # the engine's stream holds back the same way
from medusa_chat.errors import BusyError, MedusaChatError, PromptError
from medusa_chat.events import GenerationSettings, ReplySummary, StepEvent
from medusa_chat.openai.plumbing import (
    END,
    ClientGone,
    Failure,
    ReplyResponse,
    Ticket,
    in_thread,
    sse_event,
    unless_gone,
    watch_disconnect,
)
from medusa_chat.openai.protocol import (
    API_KEY_ENV,
    FINISH_REASONS,
    MAX_BODY_BYTES,
    APIError,
    ChatRequest,
    bad_request,
    install_error_handlers,
    internal_error,
    parse_chat_request,
    usage,
)

if TYPE_CHECKING:

    from medusa_chat.chat.session import SessionManager

log = logging.getLogger("medusa_chat.openai.server")


DEFAULT_MAX_QUEUE = 8
WAIT_POLL_S = 0.2  # how often a waiting request re-checks the session lock (and its client)


class ChatAPI:
    """The `/v1` application over one SessionManager (shared with the UIs when mounted in the web app)."""

    def __init__(
        self, session: SessionManager, *, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE
    ) -> None:
        if max_queue < 0:
            raise MedusaChatError(f"max_queue must be >= 0 (got {max_queue})")
        self.session = session
        self.api_key = api_key or None
        self.max_queue = max_queue
        self.created = int(time.time())
        # Requests admitted and not yet finished: the one decoding (or first in line) plus those waiting.
        # Touched only on the event loop's thread, so a plain int is safe.
        self.pending = 0
        self._turn: asyncio.Lock | None = None  # FIFO order among API requests (asyncio locks are fair)
        self.app = self._build()

    # ---- helpers --------------------------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        loaded = self.session.loaded
        return loaded.spec.name if loaded is not None else self.session.model_name

    def _model_object(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "medusa-chat"}

    def _check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(
                401,
                "missing API key: send it as 'Authorization: Bearer <key>' (this server was started with "
                f"--api-key or {API_KEY_ENV})",
                code="invalid_api_key",
            )
        # constant-time comparison: the key must not leak through response timing
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    def _settings(self, req: ChatRequest) -> GenerationSettings:
        """The reply's settings: the request's OpenAI parameters over the session's own (so options the API
        does not expose, e.g. the acceptance rule's parameters, follow the server's configuration)."""
        assert self.session.loaded is not None
        # Without a limit a reply may run to the end of the context window, as OpenAI's do; the engine then
        # stops it there with "context_limit" (finish_reason "length").
        max_new = req.max_tokens if req.max_tokens is not None else int(self.session.loaded.context_limit)
        settings = dataclasses.replace(
            self.session.settings,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            max_new_tokens=max_new,
            stop_strings=req.stop,
            **req.options,  # penalties, top_k, min_p: the request's where it sets them
        )
        try:
            settings.validate()
        except MedusaChatError as err:
            raise bad_request(str(err)) from None
        return settings

    def _medusa(self, summary: ReplySummary) -> dict[str, Any]:
        """The extension object: how Medusa decoding did on this reply."""
        out: dict[str, Any] = {
            "tokens_per_step": round(summary.tokens_per_step, 4),
            "steps": summary.steps,
            "decode_tokens_per_s": round(summary.decode_tokens_per_s, 3),
            "time_to_first_token_s": round(summary.time_to_first_token_s, 4),
            "accept_mode": summary.accept_mode,
            "tree": {"name": getattr(self.session.tree, "name", None), "size": summary.tree_size},
            "reused_prefix_tokens": summary.reused_prefix_tokens,
            "stop_reason": summary.stop_reason,
        }
        try:
            speedup, kind = self.session.speedup(summary.decode_tokens_per_s, summary.tokens_per_step)
            out.update(speedup=round(speedup, 3), speedup_kind=kind)
        except Exception:  # noqa: BLE001 - an optional figure must never fail a reply
            pass
        return out

    # ---- queue ----------------------------------------------------------------------------------------------
    def _admit(self) -> Ticket:
        if self.pending >= 1 + self.max_queue:
            raise APIError(
                503,
                f"the server is busy: one reply is decoding and {self.max_queue} request"
                f"{'s are' if self.max_queue != 1 else ' is'} waiting (the queue is full); retry later",
                type="server_error",
                code="queue_full",
            )
        if self._turn is None:
            self._turn = asyncio.Lock()
        self.pending += 1
        return Ticket(self)

    def release_turn(self) -> None:
        """Give the reply's turn to the next request in the queue (a ticket that held it, as it finishes)."""
        if self._turn is not None:
            self._turn.release()

    async def _start(self, ticket: Ticket, req: ChatRequest, gone: asyncio.Event) -> None:
        """Wait for this request's turn, then start its reply (ticket.stream). Raises ClientGone if the client
        leaves first, APIError for a bad prompt or a model that cannot load."""
        assert self._turn is not None
        await unless_gone(self._turn.acquire(), gone, on_late=self._turn.release)
        ticket.holds_turn = True
        if not self.session.is_loaded:  # the web app loads in the background: wait for that (or load now)
            try:
                await unless_gone(asyncio.to_thread(self.session.load), gone)
            except MedusaChatError as err:
                raise APIError(503, f"the model could not be loaded: {err}", type="server_error") from None
        settings = self._settings(req)
        while True:
            if gone.is_set():
                raise ClientGone
            # The UIs take the session lock without queueing: between two polls one of them may start a reply,
            # and this request then waits for that one too. `complete` builds and checks the prompt under the
            # lock (the tokenizer is not shared across threads).
            call = functools.partial(
                self.session.complete, req.messages, settings, stop=ticket.stop, wait_s=WAIT_POLL_S
            )
            try:
                ticket.stream = await in_thread(call, on_late=lambda s: s.close())
                return
            except BusyError:
                continue
            except PromptError as err:
                code = "context_length_exceeded" if "too long" in str(err) else None
                raise bad_request(str(err), "messages", code) from None
            except MedusaChatError as err:  # e.g. settings the engine refuses
                raise bad_request(str(err)) from None

    async def _items(self, ticket: Ticket) -> AsyncIterator[StepEvent | ReplySummary]:
        """The reply's events. The engine runs in its own thread, so a step never blocks the event loop; when
        this iterator is abandoned (client gone), the stop flag ends the reply after the current step and the
        thread still drives it to its end, which releases the session lock at a clean point."""
        assert ticket.stream is not None
        stream = ticket.stream
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def produce() -> None:
            try:
                for item in stream:
                    put(item)
            except BaseException as err:  # noqa: BLE001 - handed to the request's coroutine
                put(Failure(err))
            finally:
                stream.close()
                put(END)

        ticket.producer = threading.Thread(target=produce, name="medusa-chat-api-reply", daemon=True)
        ticket.producer.start()
        while True:
            item = await queue.get()
            if item is END:
                return
            if isinstance(item, Failure):
                err = item.error
                if isinstance(err, MedusaChatError):
                    raise APIError(500, str(err), type="server_error") from None
                raise err
            yield item

    # ---- routes ---------------------------------------------------------------------------------------------
    async def list_models(self, request: Request) -> JSONResponse:
        self._check_auth(request)
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def get_model(self, request: Request, model: str) -> JSONResponse:
        self._check_auth(request)
        if model != self.model_id:
            raise self._unknown_model(model)
        return JSONResponse(self._model_object())

    def _unknown_model(self, model: str) -> APIError:
        return APIError(
            404,
            f"the model {model!r} does not exist on this server; it serves {self.model_id!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )

    async def chat_completions(self, request: Request) -> Any:
        self._check_auth(request)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:  # a chunked upload has no content-length to check beforehand
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB")
        req = parse_chat_request(raw)
        if req.model != self.model_id:
            raise self._unknown_model(req.model)
        ticket = self._admit()
        gone = asyncio.Event()
        watcher = asyncio.create_task(watch_disconnect(request, gone, ticket.stop))
        handed_over = False
        try:
            await self._start(ticket, req, gone)
            if req.stream:
                response = ReplyResponse(self._sse(ticket, req), cleanup=ticket.finish, watcher=watcher)
                handed_over = True  # the response now owns the ticket and the watcher
                return response
            return await self._complete(ticket, req)
        except ClientGone:
            return APIError(499, "the client closed the request", code="client_closed").response()
        finally:
            if not handed_over:
                watcher.cancel()
                ticket.finish()

    async def _complete(self, ticket: Ticket, req: ChatRequest) -> JSONResponse:
        summary: ReplySummary | None = None
        async for item in self._items(ticket):
            if isinstance(item, ReplySummary):
                summary = item
        if summary is None:  # the stream ended without its summary: only a bug does that
            raise internal_error(RuntimeError("the reply ended without a summary"))
        body = {
            "id": ticket.id,
            "object": "chat.completion",
            "created": ticket.created,
            "model": self.model_id,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": summary.text, "refusal": None},
                    "logprobs": None,
                    "finish_reason": FINISH_REASONS.get(summary.stop_reason, "stop"),
                }
            ],
            "usage": usage(summary),
            "medusa": self._medusa(summary),
        }
        return JSONResponse(body)

    async def _sse(self, ticket: Ticket, req: ChatRequest) -> AsyncIterator[bytes]:
        model = self.model_id
        extra = {"usage": None} if req.include_usage else {}

        def chunk(delta: dict[str, Any], finish: str | None = None, **more: Any) -> bytes:
            body = {
                "id": ticket.id,
                "object": "chat.completion.chunk",
                "created": ticket.created,
                "model": model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                **extra,
                **more,
            }
            return sse_event(body)

        assert self.session.loaded is not None
        stops = tuple(req.stop) + tuple(getattr(self.session.loaded, "stop_strings", ()) or ())
        yield chunk({"role": "assistant", "content": "", "refusal": None})
        text, sent = "", 0
        try:
            async for item in self._items(ticket):
                if isinstance(item, ReplySummary):
                    # The summary's text is the exact reply: send what the hold-back kept, if it still belongs.
                    if item.text.startswith(text[:sent]) and len(item.text) > sent:
                        yield chunk({"content": item.text[sent:]})
                    finish = FINISH_REASONS.get(item.stop_reason, "stop")
                    yield chunk({}, finish, medusa=self._medusa(item))
                    if req.include_usage:
                        body = {
                            "id": ticket.id,
                            "object": "chat.completion.chunk",
                            "created": ticket.created,
                            "model": model,
                            "system_fingerprint": None,
                            "choices": [],
                            "usage": usage(item),
                        }
                        yield sse_event(body)
                    continue
                text += item.text
                safe = len(text) - partial_stop_suffix(text, stops) if stops else len(text)
                if safe > sent:
                    yield chunk({"content": text[sent:safe]})
                    sent = safe
        # The headers are sent already: an error goes into the stream (the openai client raises it).
        except APIError as err:
            yield sse_event(err.body())
        except Exception as err:  # noqa: BLE001
            yield sse_event(internal_error(err).body())
        yield b"data: [DONE]\n\n"

    # ---- the FastAPI application ------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI(
            title="medusa-chat OpenAI-compatible API",
            # no docs pages (they load scripts from a CDN) and no schema: the body is checked by hand, so the
            # schema would say nothing; the README documents the routes
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
        )

        def guarded(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            @functools.wraps(handler)
            async def run(*args: Any, **kwargs: Any) -> Any:
                try:
                    return await handler(*args, **kwargs)
                except APIError as err:
                    return err.response()
                except Exception as err:  # noqa: BLE001 - never a traceback for the client
                    return internal_error(err).response()

            return run

        app.add_api_route("/models", guarded(self.list_models), methods=["GET"])
        app.add_api_route("/models/{model:path}", guarded(self.get_model), methods=["GET"])
        app.add_api_route("/chat/completions", guarded(self.chat_completions), methods=["POST"])
        install_error_handlers(app)
        app.state.chat_api = self
        return app


def create_api(
    session: SessionManager, *, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE
) -> FastAPI:
    """The `/v1` sub-application (routes `/models`, `/chat/completions`), to mount at `/v1`."""
    return ChatAPI(session, api_key=api_key, max_queue=max_queue).app


def mount_api(
    app: Any, session: SessionManager, *, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE
) -> FastAPI:
    """Mount the API at `/v1` on an existing Starlette/FastAPI app (the Gradio server): same process, same
    session, so the UI and the API share the loaded model and take turns on it."""
    sub = create_api(session, api_key=api_key, max_queue=max_queue)
    app.mount("/v1", sub)
    return sub
