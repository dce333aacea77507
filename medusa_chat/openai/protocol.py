"""The OpenAI chat-completions protocol as this server speaks it: request parsing and validation, the error
object (`{"error": {"message", "type", "param", "code"}}`) and its handlers, and the response pieces."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from medusa_chat.events import ReplySummary
from medusa_chat.settings import OPTIONS, PENALTY_OPTIONS, SAMPLER_OPTIONS, parse_request_value

log = logging.getLogger("medusa_chat.openai.server")


API_KEY_ENV = "MEDUSA_CHAT_API_KEY"  # the server's API key, where --api-key is not given
MAX_BODY_BYTES = 16 * 1024 * 1024  # far above any prompt a local model's context window can hold
MAX_STOP_STRINGS = 4  # as OpenAI
# OpenAI's defaults when a request leaves them out (temperature 1: sampling), from the options' definitions
DEFAULT_TEMPERATURE = OPTIONS["temperature"].default_for("api")
DEFAULT_TOP_P = OPTIONS["top_p"].default_for("api")
DEFAULT_MAX_TOKENS = OPTIONS["max_new_tokens"].default_for("api")  # None: to the end of the context window


# Request fields that ask for something this server cannot do: refused rather than silently ignored.
_UNSUPPORTED = {
    "tools": "tool calling is not supported",
    "functions": "function calling is not supported",
    "tool_choice": "tool calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "logit_bias": "logit_bias is not supported",
}
# The reply options a request may set beyond OpenAI's core ones: its penalties (OpenAI's presence_penalty and
# frequency_penalty, llama-server's repeat and DRY penalties) and llama-server's top_k and min_p.
_REPLY_OPTIONS = (*SAMPLER_OPTIONS, *PENALTY_OPTIONS, "dry_sequence_breakers")
# Fields read below, and fields that change nothing a reply shows (accepted, then left aside)
_KNOWN = {
    "model", "messages", "stream", "stream_options", "n", "temperature", "top_p", "max_tokens",
    "max_completion_tokens", "stop", "seed", "logprobs", "top_logprobs", "response_format",
    *_UNSUPPORTED, *(name for option in _REPLY_OPTIONS for name in OPTIONS[option].api_names),
}  # fmt: skip
_IGNORED = {"user", "store", "metadata", "service_tier", "parallel_tool_calls"}


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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def internal_error(err: BaseException) -> APIError:
    """A 500 for an unexpected failure: the traceback goes to the server's log, never to the client."""
    log.error("unexpected error while answering a request", exc_info=err)
    return APIError(
        500,
        f"internal error ({type(err).__name__}); the server log has the details",
        type="server_error",
        code="internal_error",
    )


@dataclasses.dataclass
class ChatRequest:
    """A validated `POST /v1/chat/completions` body."""

    model: str
    messages: list[dict[str, str]]
    stream: bool = False
    include_usage: bool = False
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    seed: int | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # the _REPLY_OPTIONS the request set


def _setting(body: dict[str, Any], name: str, option: str, default: Any = None) -> Any:
    """The request's value for setting `option` (`name`: the request's name for it), converted and checked by
    settings.parse_request_value; `default` where the request leaves it out (or sends null)."""
    value = body.get(name)
    if value is None:
        return default
    try:
        return parse_request_value(option, value, name)
    except ValueError as err:
        raise bad_request(str(err), name) from None


def _reply_options(body: dict[str, Any]) -> dict[str, Any]:
    """The penalties and extra samplers the request sets (settings.OPTIONS checks each value)."""
    return {
        option: _setting(body, name, option)
        for option in _REPLY_OPTIONS
        for name in OPTIONS[option].api_names
        if body.get(name) is not None
    }


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
                raise bad_request(f"{param}[{j}]: only text parts are supported (got {kind!r})", f"{param}[{j}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{param} must be a string or a list of text parts, got {json.dumps(content)}", param)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("messages is required: a list of {role, content} objects", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if role in ("tool", "function") or message.get("tool_calls") or message.get("function_call"):
            raise bad_request(f"{where}: tool and function messages are not supported", f"{where}.role")
        if role == "developer":  # OpenAI's newer name for the system message
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise bad_request(
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
        raise bad_request(f"the request body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if model is None:
        raise bad_request("model is required (GET /v1/models lists the one this server runs)", "model")
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {json.dumps(model)}", "model")
    messages = _messages(body)
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad_request(f"n must be 1: this server generates one choice per request (got {json.dumps(n)})", "n")
    unknown = sorted(set(body) - _KNOWN - _IGNORED)
    if unknown:  # refused rather than silently ignored
        raise bad_request(f"unrecognized request argument {unknown[0]!r}: medusa-chat does not support it", unknown[0])
    for name, why in _UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}, "none"):
            raise bad_request(f"{name}: {why} by medusa-chat", name)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad_request("logprobs are not supported by medusa-chat", "logprobs")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request("response_format: only {'type': 'text'} is supported", "response_format")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {json.dumps(stream)}", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request("stream_options.include_usage must be true or false", "stream_options.include_usage")
    stop = body.get("stop")
    if not (stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise bad_request("stop must be a string or a list of strings", "stop")
    stops = OPTIONS["stop_strings"].parse(() if stop is None else stop)  # one string: one stop string
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    # max_completion_tokens is OpenAI's current name; max_tokens its deprecated alias
    max_tokens, legacy = (_setting(body, name, "max_new_tokens") for name in OPTIONS["max_new_tokens"].api_names)
    return ChatRequest(
        model=model,
        messages=messages,
        stream=bool(stream),
        include_usage=bool(stream) and include_usage,
        temperature=_setting(body, "temperature", "temperature", DEFAULT_TEMPERATURE),
        top_p=_setting(body, "top_p", "top_p", DEFAULT_TOP_P),
        max_tokens=max_tokens if max_tokens is not None else legacy,
        stop=stops,
        seed=_setting(body, "seed", "seed"),
        options=_reply_options(body),
    )


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
        return bad_request(f"invalid request: {exc}").response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc).response()

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)
