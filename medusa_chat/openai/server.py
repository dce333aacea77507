"""The OpenAI-compatible HTTP API: `medusa-chat serve`, and the same `/v1` routes inside `medusa-chat web`.

Routes (FastAPI; uvicorn serves them): `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`
(plain JSON or SSE streaming in the official chunk format, ending with `data: [DONE]`). Every reply carries
`usage` and a `medusa` extension object (tokens per step, steps, decode tokens/s, acceptance mode, tree).

The API is stateless: each request brings its messages, and `SessionManager.complete` answers them under the
session's exclusive lock without touching the UI's conversation. One reply decodes at a time; API requests
wait their turn in FIFO order in a bounded queue (full: 503). A client that disconnects (while waiting or
while its reply streams) sets its reply's stop flag, which the engine checks every step. Every bad request
gets an OpenAI-style error object (`{"error": {"message", "type", "param", "code"}}`) with a 4xx status;
unexpected failures are logged here and answered with a 500 that holds no traceback.

This module holds no model logic: prompts, settings and decoding all belong to the session and the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import math
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from medusa_chat.engine.engine import partial_stop_suffix  # the engine's stream holds back the same way
from medusa_chat.errors import BusyError, MedusaChatError, PromptError
from medusa_chat.events import GenerationSettings, ReplySummary, StepEvent

if TYPE_CHECKING:
    import uvicorn

    from medusa_chat.chat.session import ReplyStream, SessionManager

log = logging.getLogger("medusa_chat.openai.server")

API_KEY_ENV = "MEDUSA_CHAT_API_KEY"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 8
MAX_BODY_BYTES = 16 * 1024 * 1024  # far above any prompt a local model's context window can hold
MAX_STOP_STRINGS = 4  # as OpenAI
DEFAULT_TEMPERATURE = 1.0  # OpenAI's defaults when a request leaves them out
DEFAULT_TOP_P = 1.0
_WAIT_POLL_S = 0.2  # how often a waiting request re-checks the session lock (and its client)

# Request fields that ask for something this server cannot do: refused rather than silently ignored.
_UNSUPPORTED = {
    "tools": "tool calling is not supported",
    "functions": "function calling is not supported",
    "tool_choice": "tool calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
}

T = TypeVar("T")


# ---- errors ---------------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered as an OpenAI-style error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _internal(err: BaseException) -> APIError:
    """A 500 for an unexpected failure: the traceback goes to the server's log, never to the client."""
    log.error("unexpected error while answering a request", exc_info=err)
    return APIError(
        500,
        f"internal error ({type(err).__name__}); the server log has the details",
        type="server_error",
        code="internal_error",
    )


# ---- request parsing ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ChatRequest:
    """A validated `POST /v1/chat/completions` body."""

    model: str
    messages: list[dict[str, str]]
    stream: bool = False
    include_usage: bool = False
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool) -> float:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int in Python, but `"temperature": true` is a client bug worth reporting
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"{name} must be a number, got {json.dumps(value)}", name)
    try:
        value = float(value)
    except OverflowError:  # an integer literal too large for a float
        value = math.inf
    if not math.isfinite(value):
        raise _bad(f"{name} must be a finite number", name)
    if value > hi or value < lo or (lo_open and value == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise _bad(f"{name} must be in {interval}, got {value}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # some clients send 100.0
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer, got {json.dumps(value)}", name)
    if value < lo or (hi is not None and value > hi):
        raise _bad(
            f"{name} must be >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {value}", name
        )
    return value


def _content_text(content: Any, param: str) -> str:
    """A message's content: a string, or a list of text parts (the only kind a text model can read)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"{param}[{j}]: only text parts are supported (got {kind!r})", f"{param}[{j}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad(f"{param} must be a string or a list of text parts, got {json.dumps(content)}", param)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages is required: a list of {role, content} objects", "messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if role in ("tool", "function") or message.get("tool_calls") or message.get("function_call"):
            raise _bad(f"{where}: tool and function messages are not supported", f"{where}.role")
        if role == "developer":  # OpenAI's newer name for the system message
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise _bad(
                f"{where}.role must be 'system', 'developer', 'user' or 'assistant', got {json.dumps(role)}",
                f"{where}.role",
            )
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        out.append({"role": role, "content": _content_text(content, f"{where}.content")})
    return out


def parse_chat_request(raw: bytes) -> ChatRequest:
    """Validate a chat-completions body; raises APIError (400) naming the offending parameter."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _bad(f"the request body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:
        raise _bad("the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if model is None:
        raise _bad("model is required (GET /v1/models lists the one this server runs)", "model")
    if not isinstance(model, str):
        raise _bad(f"model must be a string, got {json.dumps(model)}", "model")
    messages = _messages(body)
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise _bad(f"n must be 1: this server generates one choice per request (got {json.dumps(n)})", "n")
    for name, why in _UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}, "none"):
            raise _bad(f"{name}: {why} by medusa-chat", name)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise _bad("logprobs are not supported by medusa-chat", "logprobs")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("response_format: only {'type': 'text'} is supported", "response_format")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad(f"stream must be true or false, got {json.dumps(stream)}", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _bad("stream_options.include_usage must be true or false", "stream_options.include_usage")
    stop = body.get("stop")
    stops: list[Any] = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise _bad("stop strings must not be empty", "stop")
    # max_completion_tokens is OpenAI's current name; max_tokens its deprecated alias
    max_tokens = _integer(body, "max_completion_tokens", 1, 2**31 - 1)
    legacy = _integer(body, "max_tokens", 1, 2**31 - 1)
    return ChatRequest(
        model=model,
        messages=messages,
        stream=bool(stream),
        include_usage=bool(stream) and include_usage,
        temperature=_number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0, lo_open=False),
        top_p=_number(body, "top_p", DEFAULT_TOP_P, 0.0, 1.0, lo_open=True),
        max_tokens=max_tokens if max_tokens is not None else legacy,
        stop=tuple(stops),
        seed=_integer(body, "seed", -(2**63), 2**64 - 1),
    )


# ---- response pieces ------------------------------------------------------------------------------------------
FINISH_REASONS = {
    "eos": "stop",
    "stop_string": "stop",
    "max_new_tokens": "length",
    "context_limit": "length",
    "stopped": "stop",  # only a disconnected client stops an API reply, and nobody reads its answer
}


def usage(summary: ReplySummary) -> dict[str, int]:
    return {
        "prompt_tokens": summary.prompt_tokens,
        "completion_tokens": summary.new_tokens,
        "total_tokens": summary.prompt_tokens + summary.new_tokens,
    }


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
        )
        try:
            settings.validate()
        except MedusaChatError as err:
            raise _bad(str(err)) from None
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
    def _admit(self) -> _Ticket:
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
        return _Ticket(self)

    async def _start(self, ticket: _Ticket, req: ChatRequest, gone: asyncio.Event) -> None:
        """Wait for this request's turn, then start its reply (ticket.stream). Raises _ClientGone if the client
        leaves first, APIError for a bad prompt or a model that cannot load."""
        assert self._turn is not None
        await _unless_gone(self._turn.acquire(), gone, on_late=self._turn.release)
        ticket.holds_turn = True
        if not self.session.is_loaded:  # the web app loads in the background: wait for that (or load now)
            try:
                await _unless_gone(asyncio.to_thread(self.session.load), gone)
            except MedusaChatError as err:
                raise APIError(503, f"the model could not be loaded: {err}", type="server_error") from None
        settings = self._settings(req)
        while True:
            if gone.is_set():
                raise _ClientGone
            # The UIs take the session lock without queueing: between two polls one of them may start a reply,
            # and this request then waits for that one too. `complete` builds and checks the prompt under the
            # lock (the tokenizer is not shared across threads).
            call = functools.partial(
                self.session.complete, req.messages, settings, stop=ticket.stop, wait_s=_WAIT_POLL_S
            )
            try:
                ticket.stream = await _in_thread(call, on_late=lambda s: s.close())
                return
            except BusyError:
                continue
            except PromptError as err:
                code = "context_length_exceeded" if "too long" in str(err) else None
                raise _bad(str(err), "messages", code) from None
            except MedusaChatError as err:  # e.g. settings the engine refuses
                raise _bad(str(err)) from None

    async def _items(self, ticket: _Ticket) -> AsyncIterator[StepEvent | ReplySummary]:
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
                put(_Failure(err))
            finally:
                stream.close()
                put(_END)

        ticket.producer = threading.Thread(target=produce, name="medusa-chat-api-reply", daemon=True)
        ticket.producer.start()
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
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
        watcher = asyncio.create_task(_watch_disconnect(request, gone, ticket.stop))
        handed_over = False
        try:
            await self._start(ticket, req, gone)
            if req.stream:
                response = _ReplyResponse(self._sse(ticket, req), cleanup=ticket.finish, watcher=watcher)
                handed_over = True  # the response now owns the ticket and the watcher
                return response
            return await self._complete(ticket, req)
        except _ClientGone:
            return APIError(499, "the client closed the request", code="client_closed").response()
        finally:
            if not handed_over:
                watcher.cancel()
                ticket.finish()

    async def _complete(self, ticket: _Ticket, req: ChatRequest) -> JSONResponse:
        summary: ReplySummary | None = None
        async for item in self._items(ticket):
            if isinstance(item, ReplySummary):
                summary = item
        if summary is None:  # the stream ended without its summary: only a bug does that
            raise _internal(RuntimeError("the reply ended without a summary"))
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

    async def _sse(self, ticket: _Ticket, req: ChatRequest) -> AsyncIterator[bytes]:
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
            return _event(body)

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
                        yield _event(body)
                    continue
                text += item.text
                safe = len(text) - partial_stop_suffix(text, stops) if stops else len(text)
                if safe > sent:
                    yield chunk({"content": text[sent:safe]})
                    sent = safe
        # The headers are sent already: an error goes into the stream (the openai client raises it).
        except APIError as err:
            yield _event(err.body())
        except Exception as err:  # noqa: BLE001
            yield _event(_internal(err).body())
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
                    return _internal(err).response()

            return run

        app.add_api_route("/models", guarded(self.list_models), methods=["GET"])
        app.add_api_route("/models/{model:path}", guarded(self.get_model), methods=["GET"])
        app.add_api_route("/chat/completions", guarded(self.chat_completions), methods=["POST"])
        install_error_handlers(app)
        app.state.chat_api = self
        return app


def install_error_handlers(app: FastAPI) -> None:
    """Unknown routes, wrong methods and anything unexpected answer as OpenAI-style error objects."""

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"unknown route {request.method} {request.url.path} (try GET /v1/models)"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, message, code=code).response()

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        return _bad(f"invalid request: {exc}").response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return _internal(exc).response()

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)


# ---- plumbing -------------------------------------------------------------------------------------------------
class _ClientGone(Exception):
    """The client disconnected before its reply started."""


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


class _Ticket:
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
        if self.holds_turn and self.api._turn is not None:
            self.holds_turn = False
            self.api._turn.release()


class _ReplyResponse(StreamingResponse):
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


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _watch_disconnect(request: Request, gone: asyncio.Event, stop: threading.Event) -> None:
    """Set `gone` and the reply's stop flag as soon as the client disconnects (the body is read already, so
    the next ASGI message can only be the disconnect). Cancelled when the response is complete."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gone.set()
            stop.set()
            return


async def _unless_gone(
    awaitable: Awaitable[T], gone: asyncio.Event, on_late: Callable[[], Any] | None = None
) -> T:
    """Await `awaitable` unless the client disconnects first (then _ClientGone). If the awaitable completes
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
    raise _ClientGone


async def _in_thread(call: Callable[[], T], on_late: Callable[[T], Any]) -> T:
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


# ---- mounting and serving -------------------------------------------------------------------------------------
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


def create_app(
    session: SessionManager, *, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE
) -> FastAPI:
    """The standalone server's application (`medusa-chat serve`): the API at `/v1`, and `/health`."""
    root = FastAPI(title="medusa-chat", docs_url=None, redoc_url=None, openapi_url=None)
    sub = mount_api(root, session, api_key=api_key, max_queue=max_queue)

    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": sub.state.chat_api.model_id, "loaded": session.is_loaded}

    root.add_api_route("/health", health, methods=["GET"])
    install_error_handlers(root)
    root.state.chat_api = sub.state.chat_api
    return root


def host_warning(host: str, api_key: str | None) -> str | None:
    """The warning printed when the API listens on anything but this machine's loopback address."""
    if host in LOCAL_HOSTS:
        return None
    guard = (
        "requests need the API key" if api_key else f"there is no API key (set --api-key or {API_KEY_ENV})"
    )
    return (
        f"warning: serving the API on {host}: anyone who can reach this machine at that address can use your "
        f"model; {guard}. Leave out --host to keep it on 127.0.0.1."
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket on host:port (port 0: a free one), so a taken port is a clear error here
    instead of uvicorn exiting the process."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, socket.gaierror) as err:
        raise MedusaChatError(f"cannot listen on {host}:{port}: {err}") from err
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise MedusaChatError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
    return sock


class APIServer:
    """uvicorn serving an app on a bound socket; `start()` runs it in a background thread (tests), `run()`
    in this one until Ctrl-C."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = DEFAULT_PORT, log_level: str = "info"):
        import uvicorn

        self.app = app
        self.sock = bind_socket(host, port)
        self.host = host
        self.port = int(self.sock.getsockname()[1])
        config = uvicorn.Config(
            app,
            log_level=log_level,
            access_log=log_level in ("info", "debug"),
            timeout_graceful_shutdown=3,  # open streams get their stop flag; do not hang Ctrl-C on them
        )
        self.server: uvicorn.Server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self, timeout: float = 30.0) -> APIServer:
        self._thread = threading.Thread(target=self.run, name="medusa-chat-api-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise MedusaChatError(f"the API server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def close(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        with contextlib.suppress(OSError):
            self.sock.close()


# ---- CLI ------------------------------------------------------------------------------------------------------
def add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    """--api-key (also used by `medusa-chat web`, whose app serves the same routes)."""
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on /v1 requests (default: ${API_KEY_ENV}, else none)",
    )


def resolve_api_key(args: argparse.Namespace) -> str | None:
    return getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `medusa-chat serve` (on top of the model options)."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; anything else is reachable by others)",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    add_api_key_argument(parser)
    from medusa_chat.bench.harness import add_accept_arg

    add_accept_arg(parser)  # the acceptance rule for requests with temperature > 0 (typical | exact)
    parser.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        metavar="N",
        help=f"requests that may wait while one decodes; more get 503 (default {DEFAULT_MAX_QUEUE})",
    )


def serve_main(args: argparse.Namespace) -> int:
    """`medusa-chat serve`: load the model, then serve the OpenAI-compatible API until Ctrl-C."""
    from medusa_chat.chat.session import SessionManager

    api_key = resolve_api_key(args)
    host = getattr(args, "host", None) or "127.0.0.1"
    max_queue = int(getattr(args, "max_queue", DEFAULT_MAX_QUEUE))
    if max_queue < 0:
        raise MedusaChatError(f"--max-queue must be >= 0 (got {max_queue})")
    warning = host_warning(host, api_key)
    if warning:
        print(warning, file=sys.stderr)
    session = SessionManager.from_args(args)
    session.update_settings(accept=getattr(args, "accept", None) or "typical")
    # Bind first: a taken port is reported before minutes of model loading, not after.
    server = APIServer(create_app(session, api_key=api_key, max_queue=max_queue), host, args.port)
    session.load(progress=lambda text: print(text, file=sys.stderr, flush=True))
    for notice in session.notices:
        print(notice, file=sys.stderr)
    info = session.info
    print(
        f"medusa-chat API: {server.url}/v1  model {info.get('model')!r}, tree {info.get('tree')} "
        f"({info.get('tree_size')} nodes){', API key required' if api_key else ''}  (Ctrl-C stops it)",
        flush=True,
    )
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        with contextlib.suppress(OSError):
            server.sock.close()
    return 0
