"""The OpenAI-compatible API: a real uvicorn server on a free 127.0.0.1 port, over a real SessionManager on the
tiny conftest model, driven by the official `openai` client (and httpx for what that client cannot send).

Checks plain and streamed replies (equal, and equal to plain HF greedy decoding), `stop`, `max_tokens`, seeds,
usage and the `medusa` object; OpenAI-style 4xx errors for bad requests (never a traceback, and the server goes
on); the API key; that a disconnected client stops its reply within a step; concurrent clients; the bounded
queue's 503; that the API leaves the UI's conversation alone; and the same routes inside the web app.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from medusa_chat.chat.session import SessionManager
from medusa_chat.engine.text import partial_stop_suffix
from medusa_chat.errors import MedusaChatError
from medusa_chat.events import ReplySummary, StepEvent
from medusa_chat.openai import protocol, routes
from medusa_chat.openai import server as api

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HELLO = [{"role": "user", "content": "Hello! How are you today?"}]


@pytest.fixture(scope="module")
def session(
    make_loaded_model: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory
) -> SessionManager:
    s = SessionManager(loaded=make_loaded_model(), data_dir=tmp_path_factory.mktemp("api-data"))
    s.load()
    return s


@pytest.fixture(scope="module")
def server(session: SessionManager) -> Iterator[api.APIServer]:
    app = api.create_app(session, max_queue=1)
    srv = api.APIServer(app, "127.0.0.1", 0, log_level="warning").start()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def client(server: api.APIServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(session: SessionManager) -> str:
    assert session.loaded is not None
    return session.loaded.spec.name


@dataclass
class Step:
    at: float  # time.monotonic() when the engine yielded it
    stop_was_set: bool  # whether the reply's stop flag was already set when it was yielded
    item: Any


@contextmanager
def recorded_steps(session: SessionManager, delay: float = 0.0) -> Iterator[list[Step]]:
    """Record every item the engine yields (with its time and whether the reply's stop flag was set by then),
    and make each step take at least `delay` seconds so a test can act mid-reply. The real engine still runs
    and checks its stop flag at the start of every step."""
    engine = session.engine
    assert engine is not None
    original = engine.generate
    log: list[Step] = []

    def slow(prompt_ids: Any, settings: Any, stop: threading.Event | None = None) -> Iterator[Any]:
        for item in original(prompt_ids, settings, stop):
            log.append(Step(time.monotonic(), stop is not None and stop.is_set(), item))
            if delay:
                time.sleep(delay)
            yield item

    engine.generate = slow  # type: ignore[method-assign]
    try:
        yield log
    finally:
        del engine.generate  # back to the class's method


def steps_after_stop(log: list[Step]) -> int:
    """Decoding steps that finished after the stop flag was set: at most the one already running."""
    return sum(1 for s in log if s.stop_was_set and isinstance(s.item, StepEvent))


def wait_idle(session: SessionManager, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while session.busy:
        assert time.monotonic() - t0 < timeout, "the session stayed busy"
        time.sleep(0.01)
    return time.monotonic() - t0


def hf_greedy(session: SessionManager, messages: list[dict[str, str]], max_new: int) -> str:
    """The reference: plain HF greedy decoding of the same prompt, no Medusa."""
    loaded = session.loaded
    assert loaded is not None
    ids = loaded.build_prompt(messages)
    with torch.no_grad():
        out = loaded.backbone.generate(
            torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new
        )
    text = loaded.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    # (a reply that ends in half a character ends in its U+FFFD, as the one-shot decode does)
    return text


def post(server: api.APIServer, body: Any, *, raw: bytes | None = None, **kw: Any) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(
        server.url + "/v1/chat/completions",
        content=content,
        headers={"Content-Type": "application/json", **kw.pop("headers", {})},
        timeout=kw.pop("timeout", 60),
        **kw,
    )


def assert_error(resp: httpx.Response, status: int, param: str | None = "*", code: str | None = "*") -> dict:
    assert resp.status_code == status, resp.text
    assert "Traceback" not in resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param != "*":
        assert body["error"]["param"] == param, body
    if code != "*":
        assert body["error"]["code"] == code, body
    return body["error"]


# ---- plain and streamed replies -----------------------------------------------------------------------------
def test_listens_on_loopback_and_lists_the_model(
    server: api.APIServer, client: openai.OpenAI, model_id: str
) -> None:
    assert server.sock.getsockname()[0] == "127.0.0.1"
    models = client.models.list()
    assert [m.id for m in models.data] == [model_id]
    assert client.models.retrieve(model_id).id == model_id
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["loaded"] is True


def test_plain_completion_matches_greedy_decoding_and_leaves_the_ui_alone(
    session: SessionManager, client: openai.OpenAI, model_id: str
) -> None:
    # The UI's conversation: one exchange made through the session, as the web UI and the REPL do.
    session.clear()
    session.update_settings(max_new_tokens=10, temperature=0)
    ui_reply = [i for i in session.send("What is the capital of France?") if isinstance(i, ReplySummary)][0]
    before = [(m.role, m.content, m.stopped) for m in session.conversation.messages]
    last_summary, settings = session.last_summary, session.settings

    out = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == model_id
    assert (
        choice.message.role == "assistant" and choice.finish_reason == "length"
    )  # the tiny model never ends
    assert choice.message.content == hf_greedy(session, HELLO, 12)
    assert session.loaded is not None
    prompt_tokens = len(session.loaded.build_prompt(HELLO))
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 12)
    assert out.usage.total_tokens == prompt_tokens + 12
    medusa = out.model_extra["medusa"]
    assert medusa["accept_mode"] == "greedy" and medusa["steps"] >= 1
    assert medusa["tokens_per_step"] > 1  # the planted heads are right often enough to accept guesses
    assert medusa["decode_tokens_per_s"] > 0 and medusa["tree"]["size"] == session.tree.size
    assert medusa["speedup_kind"] in ("estimated", "measured")

    # The UI's conversation, last reply and settings are untouched; its next reply reuses what it can.
    assert [(m.role, m.content, m.stopped) for m in session.conversation.messages] == before
    assert session.last_summary is last_summary and session.settings == settings
    again = [i for i in session.regenerate() if isinstance(i, ReplySummary)][0]
    assert again.text == ui_reply.text


def test_streamed_reply_equals_the_plain_one(
    server: api.APIServer, client: openai.OpenAI, model_id: str
) -> None:
    plain = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=20, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=model_id,
            messages=HELLO,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["medusa"]["steps"] >= 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens  # type: ignore[union-attr]

    # On the wire: SSE `data:` lines in the official format, ending with `data: [DONE]`.
    body = {"model": model_id, "messages": HELLO, "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert "usage" not in json.loads(lines[-2][6:])  # only with stream_options.include_usage, as OpenAI


def test_stop_strings_cut_the_reply_plain_and_streamed(client: openai.OpenAI, model_id: str) -> None:
    full = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=30, temperature=0)
    text = full.choices[0].message.content or ""
    stop = text[12:15]
    assert len(stop) == 3 and stop.strip(), text
    expected = text[: text.index(stop)]
    cut = client.chat.completions.create(
        model=model_id, messages=HELLO, max_tokens=30, temperature=0, stop=[stop]
    )
    assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
    assert cut.usage is not None and cut.usage.completion_tokens < 30
    stream = client.chat.completions.create(
        model=model_id, messages=HELLO, max_tokens=30, temperature=0, stop=stop, stream=True
    )
    chunks = list(stream)
    # the stream never shows the start of the stop string (it is held back until the cut is known)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_and_max_completion_tokens(client: openai.OpenAI, model_id: str) -> None:
    for kw in (
        {"max_tokens": 3},
        {"max_completion_tokens": 3},
        {"max_tokens": 50, "max_completion_tokens": 3},
    ):
        out = client.chat.completions.create(model=model_id, messages=HELLO, temperature=0, **kw)
        assert out.usage is not None and out.usage.completion_tokens == 3, kw
        assert out.choices[0].finish_reason == "length"


def test_seed_makes_sampling_reproducible(client: openai.OpenAI, model_id: str) -> None:
    def sample(seed: int) -> str:
        out = client.chat.completions.create(
            model=model_id, messages=HELLO, max_tokens=24, temperature=1.5, top_p=1.0, seed=seed
        )
        assert out.model_extra["medusa"]["accept_mode"] == "typical"
        return out.choices[0].message.content or ""

    first = sample(123)
    assert sample(123) == first
    assert len({first, sample(7), sample(99)}) > 1, "different seeds gave the same sample every time"


def test_session_complete_is_stateless_and_exclusive(session: SessionManager) -> None:
    """The session method under the API: it never touches the conversation, waits for (or refuses) a running
    reply, and releases the lock on a bad prompt."""
    from medusa_chat.errors import BusyError, PromptError
    from medusa_chat.events import GenerationSettings

    settings = GenerationSettings(max_new_tokens=5, temperature=0.0)
    before = list(session.conversation.messages)
    items = list(session.complete(HELLO, settings))
    assert isinstance(items[-1], ReplySummary) and items[-1].new_tokens == 5
    assert session.conversation.messages == before and not session.busy
    held = session.complete(HELLO, settings)  # holds the lock until read or closed
    try:
        t0 = time.monotonic()
        with pytest.raises(BusyError):
            session.complete(HELLO, settings, wait_s=0.2)
        assert time.monotonic() - t0 >= 0.19
        with pytest.raises(BusyError):
            session.send("the UI cannot start a reply meanwhile")
    finally:
        held.close()
    assert not session.busy and session.conversation.messages == before
    with pytest.raises(PromptError, match="too long"):
        session.complete([{"role": "user", "content": "Hello world! " * 400}], settings)
    assert not session.busy


# ---- bad requests -------------------------------------------------------------------------------------------
def test_bad_requests_get_openai_error_objects(
    server: api.APIServer, client: openai.OpenAI, model_id: str, session: SessionManager
) -> None:
    ok = {"model": model_id, "messages": HELLO, "max_tokens": 2}
    assert_error(post(server, None, raw=b'{"model": "x", "messages": [}'), 400, code="invalid_json")
    assert_error(post(server, None, raw=b"\xff\xfe"), 400, code="invalid_json")
    assert_error(post(server, [1, 2]), 400, code="invalid_json")
    assert_error(post(server, {"model": model_id}), 400, "messages")
    assert_error(post(server, {**ok, "messages": []}), 400, "messages")
    assert_error(post(server, {**ok, "messages": "hello"}), 400, "messages")
    assert_error(
        post(server, {**ok, "messages": [{"role": "robot", "content": "hi"}]}), 400, "messages[0].role"
    )
    assert_error(
        post(server, {**ok, "messages": [{"role": "user", "content": 5}]}), 400, "messages[0].content"
    )
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    assert_error(post(server, {**ok, "messages": [{"role": "user", "content": image}]}), 400)
    only_system = [{"role": "system", "content": "be brief"}]
    assert_error(post(server, {**ok, "messages": only_system}), 400, "messages")
    assert_error(post(server, {**ok, "temperature": -0.5}), 400, "temperature")
    assert_error(post(server, {**ok, "temperature": "hot"}), 400, "temperature")
    with_raw = json.dumps(ok)[:-1].encode()  # to add literals json.dumps would not write
    assert_error(post(server, None, raw=with_raw + b', "temperature": 1e999}'), 400, "temperature")  # inf
    assert_error(post(server, None, raw=with_raw + b', "temperature": NaN}'), 400, "temperature")
    assert_error(post(server, {**ok, "temperature": 10**400}), 400, "temperature")
    assert_error(post(server, None, raw=b"[" * 100000 + b"]" * 100000), 400, code="invalid_json")
    assert_error(post(server, {**ok, "top_p": 0}), 400, "top_p")
    assert_error(post(server, {**ok, "max_tokens": 0}), 400, "max_tokens")
    assert_error(post(server, {**ok, "max_tokens": "many"}), 400, "max_tokens")
    assert_error(post(server, {**ok, "stop": ["a", "b", "c", "d", "e"]}), 400, "stop")
    assert_error(post(server, {**ok, "stop": 7}), 400, "stop")
    assert_error(post(server, {**ok, "seed": "x"}), 400, "seed")
    assert_error(post(server, {**ok, "stream": "yes"}), 400, "stream")
    assert_error(post(server, {**ok, "n": 2}), 400, "n")
    assert_error(
        post(server, {**ok, "tools": [{"type": "function", "function": {"name": "f"}}]}), 400, "tools"
    )
    assert_error(post(server, {**ok, "model": "gpt-4o"}), 404, "model", "model_not_found")
    assert_error(post(server, {**ok, "model": None}), 400, "model")
    long_prompt = [{"role": "user", "content": "Hello world! " * 400}]  # far beyond the 512-token context
    assert_error(post(server, {**ok, "messages": long_prompt}), 400, "messages", "context_length_exceeded")
    # a streamed request that cannot start is a plain JSON error with its status, as OpenAI answers it
    assert_error(post(server, {**ok, "stream": True, "messages": long_prompt}), 400, "messages")
    assert_error(post(server, {**ok, "stream": True, "model": "gpt-4o"}), 404, "model")
    assert_error(httpx.get(server.url + "/v1/chat/completions", timeout=10), 405)
    assert_error(httpx.get(server.url + "/v1/nothing-here", timeout=10), 404)
    assert_error(httpx.get(server.url + "/v1/models/gpt-4o", timeout=10), 404, code="model_not_found")

    # The official client raises its own errors for them.
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model=model_id, messages=HELLO, n=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=model_id, messages=HELLO, temperature=-1)

    # ... and the server goes on serving, with the session free.
    assert not session.busy
    out = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=2)
    assert out.usage is not None and out.usage.completion_tokens == 2


def test_a_failing_reply_is_a_500_without_traceback_and_the_server_goes_on(
    session: SessionManager, server: api.APIServer, client: openai.OpenAI, model_id: str
) -> None:
    engine = session.engine
    assert engine is not None
    original = engine.generate

    def failing(error: BaseException) -> Callable[..., Iterator[Any]]:
        def gen(*args: Any, **kwargs: Any) -> Iterator[Any]:
            inner = original(*args, **kwargs)
            yield next(inner)  # the prefill's token arrives, then the step fails
            raise error

        return gen

    body = {"model": model_id, "messages": HELLO, "max_tokens": 20, "temperature": 0}
    try:
        engine.generate = failing(RuntimeError("boom"))  # type: ignore[method-assign]
        err = assert_error(post(server, body), 500, code="internal_error")
        assert "RuntimeError" in err["message"] and "boom" not in err["message"]
        engine.generate = failing(torch.OutOfMemoryError("CUDA out of memory"))  # type: ignore[method-assign]
        assert "out of memory" in assert_error(post(server, body), 500)["message"]
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200  # the headers went out before the failure
            lines = [line for line in resp.iter_lines() if line]
        assert (
            lines[-1] == "data: [DONE]" and "out of memory" in json.loads(lines[-2][6:])["error"]["message"]
        )
        assert "Traceback" not in "".join(lines)
        with pytest.raises(openai.APIError, match="out of memory"):
            list(client.chat.completions.create(model=model_id, messages=HELLO, stream=True))
    finally:
        del engine.generate
    assert not session.busy
    out = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=20, temperature=0)
    assert out.choices[0].message.content == hf_greedy(session, HELLO, 20)  # the cache was reset cleanly


def test_request_validation_in_isolation() -> None:
    """The parser alone: defaults, aliases and content forms that need no server to check."""
    req = protocol.parse_chat_request(
        json.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "developer", "content": "be brief"},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    },
                    {"role": "assistant", "content": None},
                    {"role": "user", "content": "c"},
                ],
                "n": 1,
                "max_tokens": 8.0,
                "stop": "x",
                "presence_penalty": 0,
            }
        ).encode()
    )
    assert req.messages[0] == {"role": "system", "content": "be brief"}
    assert req.messages[1]["content"] == "a\nb" and req.messages[2]["content"] == ""
    assert (req.temperature, req.top_p, req.max_tokens, req.stop, req.stream) == (1.0, 1.0, 8, ("x",), False)
    with pytest.raises(protocol.APIError, match="true or false"):
        protocol.parse_chat_request(b'{"model": "m", "messages": [{"role": "user", "content": "a"}], "stream": 1}')
    assert partial_stop_suffix("hello wor", ("world",)) == 3
    assert partial_stop_suffix("hello", ("xyz",)) == 0


# ---- auth -----------------------------------------------------------------------------------------------------
def test_api_key_is_required_when_set(
    session: SessionManager, model_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = api.APIServer(
        api.create_app(session, api_key="s3cret"), "127.0.0.1", 0, log_level="warning"
    ).start()
    try:
        base = srv.url + "/v1"
        bad = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
            bad.models.list()
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=model_id, messages=HELLO, max_tokens=2)
        for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Basic czNjcmV0"}):
            resp = httpx.post(
                base + "/chat/completions",
                json={"model": model_id, "messages": HELLO},
                headers=headers,
                timeout=10,
            )
            assert_error(resp, 401, code="invalid_api_key")
            assert resp.headers["www-authenticate"] == "Bearer"
        good = openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0, timeout=30)
        assert good.chat.completions.create(model=model_id, messages=HELLO, max_tokens=2).choices[0].message
    finally:
        srv.close()
    # --api-key wins over MEDUSA_CHAT_API_KEY, which applies when the option is left out
    from medusa_chat.cli import build_parser

    monkeypatch.setenv(protocol.API_KEY_ENV, "from-env")
    args = build_parser("serve").parse_args(["serve"])
    assert api.resolve_api_key(args) == "from-env"
    args = build_parser("serve").parse_args(
        ["serve", "--api-key", "opt", "--port", "9001", "--max-queue", "2"]
    )
    assert (api.resolve_api_key(args), args.port, args.max_queue, args.host) == ("opt", 9001, 2, "127.0.0.1")


def test_host_warning_and_taken_port() -> None:
    assert api.host_warning("127.0.0.1", None) is None and api.host_warning("localhost", None) is None
    warning = api.host_warning("0.0.0.0", None)
    assert warning is not None and "127.0.0.1" in warning and protocol.API_KEY_ENV in warning
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(MedusaChatError, match="cannot listen"):
            api.bind_socket("127.0.0.1", taken.getsockname()[1])


# ---- disconnects, concurrency, the queue ------------------------------------------------------------------
def test_disconnect_stops_a_streamed_reply_within_a_step(
    session: SessionManager, client: openai.OpenAI, model_id: str
) -> None:
    with recorded_steps(session, delay=0.05) as log:
        stream = client.chat.completions.create(
            model=model_id, messages=HELLO, max_tokens=400, temperature=0, stream=True
        )
        got = 0
        for chunk in stream:
            got += bool(chunk.choices and chunk.choices[0].delta.content)
            if got >= 3:
                break
        stream.close()  # the client goes away mid-reply
        wait_idle(session)
    summary = log[-1].item
    assert isinstance(summary, ReplySummary) and summary.stop_reason == "stopped", summary
    assert summary.new_tokens < 400
    assert steps_after_stop(log) <= 1, f"{steps_after_stop(log)} steps ran after the stop flag was set"


def test_disconnect_stops_a_plain_reply_and_a_waiting_request(
    session: SessionManager, server: api.APIServer, model_id: str
) -> None:
    body = {"model": model_id, "messages": HELLO, "max_tokens": 400, "temperature": 0}
    with recorded_steps(session, delay=0.05) as log:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up on a long non-streamed reply
            post(server, body, timeout=0.6)
        wait_idle(session)
    summary = log[-1].item
    assert isinstance(summary, ReplySummary) and summary.stop_reason == "stopped"
    assert summary.new_tokens < 400 and steps_after_stop(log) <= 1

    # A request waiting behind a UI reply leaves the queue when its client goes; nothing decodes for it.
    chat_api = server.app.state.chat_api
    held = session.send("a UI reply holds the session")  # not read yet: it holds the session's lock
    try:
        with recorded_steps(session) as log2:
            with pytest.raises(httpx.ReadTimeout):
                post(server, body, timeout=0.5)
            deadline = time.monotonic() + 10
            while chat_api.pending:
                assert time.monotonic() < deadline, "the abandoned request stayed in the queue"
                time.sleep(0.02)
            time.sleep(2 * routes.WAIT_POLL_S)  # it would have started by now if it were still there
            assert log2 == []
    finally:
        held.close()
    wait_idle(session)


def test_two_concurrent_clients_are_both_answered(client: openai.OpenAI, model_id: str) -> None:
    prompts = [
        [{"role": "user", "content": "Hello world!"}],
        [{"role": "user", "content": "Python is great."}],
    ]
    alone = [
        client.chat.completions.create(model=model_id, messages=p, max_tokens=16, temperature=0)
        for p in prompts
    ]
    results: dict[int, Any] = {}

    def ask(i: int) -> None:
        results[i] = client.chat.completions.create(
            model=model_id, messages=prompts[i], max_tokens=16, temperature=0
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1]
    for i in range(2):  # each answer is its own prompt's, exactly as when asked alone
        assert results[i].choices[0].message.content == alone[i].choices[0].message.content


def test_full_queue_answers_503(
    session: SessionManager, server: api.APIServer, client: openai.OpenAI, model_id: str
) -> None:
    """max_queue=1: behind a running reply (here the UI's), one API request is first in line and one waits;
    a third is refused at once with 503; the first two are answered once the session is free."""
    chat_api = server.app.state.chat_api
    answers: dict[str, str] = {}
    errors: list[BaseException] = []

    def ask(name: str) -> None:
        try:
            out = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=12, temperature=0)
            answers[name] = out.choices[0].message.content or ""
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    held = session.send("a UI reply holds the session")  # not read yet: it holds the session's lock
    try:
        threads = [threading.Thread(target=ask, args=(name,)) for name in ("first", "second")]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while chat_api.pending < 2:
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.02)
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=2)
        assert time.monotonic() - t0 < 5  # refused at once, not after waiting
        assert info.value.status_code == 503 and "queue is full" in str(info.value)
        assert info.value.body["code"] == "queue_full"  # type: ignore[index]
    finally:
        held.close()
    for t in threads:
        t.join(60)
    assert not errors and set(answers) == {"first", "second"} and answers["first"] == answers["second"]
    assert chat_api.pending == 0 and not session.busy


# ---- the web app serves the same routes ---------------------------------------------------------------------
def test_web_app_serves_v1_on_the_same_session(make_loaded_model: Callable[..., Any], tmp_path: Path) -> None:
    os.environ.setdefault("GRADIO_TEMP_DIR", tempfile.mkdtemp(prefix="medusa-gradio-test-"))
    from medusa_chat.ui import web

    session = SessionManager(loaded=make_loaded_model(), data_dir=tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = web.launch(session, port=port, block=False, quiet=True, api_key="k")
    try:
        assert app.medusa_web.loader.wait(60) and app.medusa_web.loader.status == "ready"
        base = app.local_url.rstrip("/") + "/v1"
        c = openai.OpenAI(base_url=base, api_key="k", max_retries=0, timeout=60)
        model = c.models.list().data[0].id
        out = c.chat.completions.create(model=model, messages=HELLO, max_tokens=6, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens == 6
        chunks = list(
            c.chat.completions.create(model=model, messages=HELLO, max_tokens=6, temperature=0, stream=True)
        )
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == out.choices[0].message.content
        assert session.conversation.messages == []  # the UI's conversation is untouched
        assert_error(httpx.get(base + "/models", timeout=10), 401, code="invalid_api_key")
        assert httpx.get(app.local_url, timeout=10).status_code == 200  # the UI is still there
    finally:
        app.close()


def test_serve_command_end_to_end(make_loaded_model: Callable[..., Any], tmp_path: Path) -> None:
    """`python -m medusa_chat serve` in its own process: loads, prints its URL, answers, stops on SIGINT."""
    loaded = make_loaded_model()
    env = {**os.environ, "MEDUSA_CHAT_DATA": str(tmp_path), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = str(Path(api.__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "medusa_chat", "serve", "--model", loaded.model_dir, "--heads",
           str(Path(loaded.heads_file).parent), "--device", "cpu", "--port", "0", "--tree", "chain-2"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "medusa-chat API: http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() else "")
        base = line.split()[2]
        c = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
        model = c.models.list().data[0].id
        out = c.chat.completions.create(model=model, messages=HELLO, max_tokens=4, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens == 4
        assert out.model_extra["medusa"]["tree"]["name"] == "chain-2"
    finally:
        proc.send_signal(2)
        code = proc.wait(20)
    assert code == 0


def test_the_servers_acceptance_rule_applies_to_sampled_requests(
    client: openai.OpenAI, model_id: str, session: SessionManager
) -> None:
    """`serve --accept exact` sets the session's rule; sampled requests use it (greedy ones stay greedy)."""
    session.update_settings(accept="exact")
    try:
        out = client.chat.completions.create(
            model=model_id, messages=HELLO, max_tokens=12, temperature=0.8, seed=5
        )
        assert out.model_extra["medusa"]["accept_mode"] == "exact"
        greedy = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=4, temperature=0)
        assert greedy.model_extra["medusa"]["accept_mode"] == "greedy"
    finally:
        session.update_settings(accept="typical")
