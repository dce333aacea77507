"""The web UI in a real browser (Debian chromium driven by playwright), on the tiny conftest model.

Types a message, sends it, watches the reply stream, the meter change and the accepted-tree SVG appear; flips the
temperature label; presses Stop during a long reply and sees it end; sends HTML/Markdown injection payloads as a
user message and opens a saved conversation whose model replies and statistics carry them, and checks that no
element, dialog or outside request comes of it. Screenshots go to the test's tmp folder, and a copy to
out/web-ui.png (gitignored) for people to look at.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("GRADIO_TEMP_DIR", tempfile.mkdtemp(prefix="medusa-gradio-test-"))

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    pytest.skip(
        f"browser test skipped: Debian chromium is not installed at {CHROMIUM} (apt-get install chromium)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip("playwright.sync_api", reason="browser test skipped: pip install playwright")

from medusa_chat.chat.conversations import Conversation, Message  # noqa: E402
from medusa_chat.chat.session import SessionManager  # noqa: E402
from medusa_chat.chat.updates import UPDATES_PER_S  # noqa: E402
from medusa_chat.events import StepEvent  # noqa: E402
from medusa_chat.ui import web  # noqa: E402
from tests.test_render import INJECTIONS, MARKDOWN_TAGS  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::Warning:gradio.queueing")]

# MEDUSA_FACTS section 12: never `playwright install`; no network except the app on 127.0.0.1.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
]
STEP_DELAY_S = 0.1  # every decoding step takes at least this long, so streaming is watchable
# When set (a test sets it and puts it back), the steps' text is replaced by these pieces in turn and the reply's
# by their join: text a test chooses, markup included, on the real decoding and streaming path.
SCRIPTED: dict[str, list[str] | None] = {"texts": None}
OUT_DIR = Path(__file__).resolve().parents[1] / "out"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(make_loaded_model: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    session = SessionManager(loaded=make_loaded_model(), data_dir=tmp_path_factory.mktemp("browser-data"))
    app = web.launch(session, port=free_port(), block=False, quiet=True)
    assert app.medusa_web.loader.wait(60) and app.medusa_web.loader.status == "ready"
    engine = session.engine
    original = engine.generate

    def slow(*args: Any, **kwargs: Any) -> Iterator[Any]:  # the real engine, paced; it still checks Stop
        texts, shown = SCRIPTED["texts"], []
        for item in original(*args, **kwargs):
            time.sleep(STEP_DELAY_S)
            if texts:
                if isinstance(item, StepEvent):
                    item = dataclasses.replace(item, text=texts[len(shown) % len(texts)])
                    shown.append(item.text)
                else:
                    item = dataclasses.replace(item, text="".join(shown))
            yield item

    engine.generate = slow
    try:
        yield app
    finally:
        del engine.generate
        app.close()


@pytest.fixture(scope="module")
def page(served: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    xdg = tmp_path_factory.mktemp("xdg")
    env = {**os.environ, "XDG_CONFIG_HOME": str(xdg / "config"), "XDG_CACHE_HOME": str(xdg / "cache")}
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, env=env)
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        pg.outside = []  # requests to anything but the app
        pg.dialogs = []  # alert()/confirm() opened by page content (there must be none)
        pg.on("request", lambda r: None if r.url.startswith(served.local_url) else pg.outside.append(r.url))
        pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.dismiss()))
        pg.goto(served.local_url)
        pg.wait_for_selector("#msg textarea")
        pg.wait_for_function("document.querySelector('#model-panel').innerText.includes('Model ready')")
        yield pg
        browser.close()


def set_number(page: Any, elem_id: str, value: float) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def wait_until(cond: Callable[[], bool], timeout: float = 20, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def bot_text(page: Any) -> str:
    bots = page.locator("#chat .message-row.bot-row, #chat .bot")
    return bots.last.inner_text() if bots.count() else ""


def bot_count(page: Any) -> int:
    return page.locator("#chat .message-row.bot-row").count()


# The live reply element: its text (textContent: also while hidden), whether it is shown, its elements.
LIVE_JS = """() => { const e = document.querySelector('#live-reply .mc-live-text');
    const box = document.querySelector('#live-reply');
    return e ? {text: e.textContent, shown: box.checkVisibility(), elements: e.querySelectorAll('*').length}
             : null; }"""


def live_reply(page: Any) -> dict[str, Any]:
    state = page.evaluate(LIVE_JS)
    assert state is not None, "no live reply element on the page"
    return state


# The page's streaming state read in one evaluation (one DOM state: a reply cannot end between the reads, as it
# can between separate calls on a loaded machine): the meter's text, the live reply's, and the chat's replies.
STREAM_JS = """() => { const e = document.querySelector('#live-reply .mc-live-text');
    return {meter: document.querySelector('#meter').innerText, text: e ? e.textContent : null,
            shown: document.querySelector('#live-reply').checkVisibility(),
            elements: e ? e.querySelectorAll('*').length : -1,
            bots: document.querySelectorAll('#chat .message-row.bot-row').length}; }"""


def shoot(page: Any, path: Path, name: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    shot = path / name
    page.screenshot(path=str(shot), full_page=True)
    try:
        OUT_DIR.mkdir(exist_ok=True)
        shutil.copy(shot, OUT_DIR / name)
    except OSError:
        pass  # a read-only checkout: the tmp copy is enough
    return shot


def test_chat_streams_with_meter_and_tree(page: Any, served: Any, tmp_path: Path) -> None:
    session: SessionManager = served.medusa_web.session
    set_number(page, "max-new", 64)
    wait_until(lambda: session.settings.max_new_tokens == 64, what="max new tokens to reach the session")
    meter_before = page.inner_text("#meter")
    assert live_reply(page) == {"text": "", "shown": False, "elements": 0}
    bots_before = bot_count(page)
    page.fill("#msg textarea", "Hello! <img src=x onerror=alert(1)> How are you today?")
    page.click("#send")
    # the reply streams into the live element under the chat: several different partial texts, shown, while the
    # meter says "streaming"; the chat has the user's message and no reply until the reply is done
    seen: list[str] = []
    meters: set[str] = set()
    deadline = time.monotonic() + 30
    while "max new tokens" not in (meter := (live := page.evaluate(STREAM_JS))["meter"]):
        assert time.monotonic() < deadline, "the reply did not finish"
        if live["text"] and (not seen or seen[-1] != live["text"]):
            assert live["shown"] and live["elements"] == 0
            if "streaming" in meter:
                assert live["bots"] == bots_before, "the reply reached the chat before it was done"
            seen.append(live["text"])
            if len(seen) == 3:
                shoot(page, tmp_path, "web-ui-streaming.png")
        meters.add(meter)
        time.sleep(0.05)
    assert len(seen) >= 3, f"the reply did not stream (saw {len(seen)} versions)"
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:], strict=False)), "the live text did not just grow"
    assert len(meters) >= 3 and meter_before not in meters
    assert any("streaming" in m for m in meters)
    # the finished reply is in the chat, as the session has it; nothing is left in the live element
    reply = session.conversation.messages[-1]
    assert reply.role == "assistant" and bot_count(page) == bots_before + 1
    assert live_reply(page) == {"text": "", "shown": False, "elements": 0}
    assert seen[-1] and reply.content.startswith(seen[-1])
    # the tree of the last step, drawn as SVG inside #accepted-tree, with the accepted path highlighted
    svg = page.locator("#accepted-tree svg.mc-tree")
    svg.wait_for()
    n_nodes = int(svg.get_attribute("data-nodes"))
    assert page.locator("#accepted-tree svg.mc-tree g.node").count() == n_nodes > 1
    assert page.locator("#accepted-tree svg.mc-tree g.node.accepted").count() >= 1
    assert page.locator("#accepted-tree .mc-seg").count() == len(session.last_events)
    # the message's HTML shows as the characters typed: no element, no script
    assert "<img src=x onerror=alert(1)>" in page.inner_text("#chat")
    assert page.locator("#chat img").count() == 0 and page.dialogs == []
    final = session.last_summary
    assert final is not None and final.new_tokens == 64
    # a message's copy button puts its text on the clipboard (as typed / as the model wrote it), not its HTML
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=served.local_url.rstrip("/"))
    copies = page.get_by_role("button", name=re.compile(r"^copy message$", re.I))
    wait_until(lambda: copies.count() >= 2, what="the messages' copy buttons")
    for button, message in zip(
        [copies.nth(copies.count() - 2), copies.last], session.conversation.messages[-2:], strict=True
    ):
        page.evaluate("navigator.clipboard.writeText('-')")
        button.click()
        wait_until(
            lambda m=message: page.evaluate("navigator.clipboard.readText()") == m.content, what="the copy"
        )
    # after the reply, the step slider shows any step's tree
    set_number(page, "step", 2)
    page.wait_for_function("document.querySelector('#accepted-tree').innerText.includes('Step 2 of')")
    assert page.locator("#accepted-tree .mc-seg.selected").get_attribute("data-step") == "2"
    # the temperature slider switches the acceptance-mode label live
    set_number(page, "temperature", 0.7)
    page.wait_for_function("document.querySelector('#mode').innerText.includes('typical acceptance')")
    wait_until(lambda: session.settings.temperature == 0.7, what="temperature to reach the session")
    set_number(page, "temperature", 0)
    page.wait_for_function(
        "document.querySelector('#mode').innerText.includes('greedy: identical to plain decoding')"
    )
    wait_until(lambda: session.settings.temperature == 0, what="temperature 0 to reach the session")
    # context lookup (Advanced): the checkbox reaches the session, both ways
    page.get_by_text("Advanced").click()
    box = page.locator("#context-lookup input[type=checkbox]")
    assert box.is_checked() and session.settings.context_lookup is True
    box.click()
    wait_until(lambda: session.settings.context_lookup is False, what="context lookup off")
    box.click()
    wait_until(lambda: session.settings.context_lookup is True, what="context lookup on")
    page.get_by_text("Advanced").click()
    shot = shoot(page, tmp_path, "web-ui.png")
    assert shot.stat().st_size > 10_000
    assert page.outside == [], f"the page tried to reach other hosts: {page.outside[:5]}"


def test_a_long_fast_reply_is_complete_with_a_bounded_number_of_page_updates(page: Any, served: Any) -> None:
    """The engine unpaced: hundreds of steps in a second or two. The page gets at most UPDATES_PER_S updates a second
    (chat/updates.py), and its last one shows the whole reply and every step in the tree view."""
    session: SessionManager = served.medusa_web.session
    ui = served.medusa_web
    engine = session.engine
    paced = engine.generate
    del engine.generate  # the real engine, at full speed
    counted: list[float] = []
    real_stream = ui.stream

    def counting(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for out in real_stream(*args, **kwargs):
            counted.append(time.monotonic())
            yield out

    ui.stream = counting  # WebApp.send looks it up per call
    try:
        set_number(page, "max-new", 300)
        wait_until(lambda: session.settings.max_new_tokens == 300, what="max new tokens to reach the session")
        before = len(session.conversation.messages)
        page.fill("#msg textarea", "Tell me a very long story.")
        page.click("#send")
        wait_until(lambda: len(session.conversation.messages) == before + 2 and not session.busy, 60, "a reply")
        page.wait_for_function("document.querySelector('#meter').innerText.includes('max new tokens')")
    finally:
        engine.generate = paced
        del ui.stream
    summary = session.last_summary
    assert summary is not None and summary.new_tokens == 300
    steps = len(session.last_events)
    elapsed = counted[-1] - counted[0]
    # the user's message, "starting…", the bounded stream (the first step at once), the final update
    assert len(counted) <= 3 + elapsed * UPDATES_PER_S + 1, (len(counted), elapsed, steps)
    assert page.locator("#accepted-tree .mc-seg").count() == steps
    reply = session.conversation.messages[-1]
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=served.local_url.rstrip("/"))
    copy = page.get_by_role("button", name=re.compile(r"^copy message$", re.I)).last
    page.evaluate("navigator.clipboard.writeText('-')")
    copy.click()
    # (the copy of the tiny model's noise turns a tab into a space: compared without that difference)
    whole = reply.content.replace("\t", " ")
    wait_until(lambda: page.evaluate("navigator.clipboard.readText()").replace("\t", " ") == whole, what="the reply")


def test_stop_ends_a_long_reply(page: Any, served: Any, tmp_path: Path) -> None:
    session: SessionManager = served.medusa_web.session
    set_number(page, "max-new", 400)
    wait_until(lambda: session.settings.max_new_tokens == 400, what="max new tokens to reach the session")
    page.fill("#msg textarea", "Tell me a very long story.")
    previous = session.last_events
    page.click("#send")
    wait_until(
        lambda: session.last_events is not previous and len(session.last_events) >= 6, what="the reply"
    )
    page.wait_for_function("document.querySelector('#meter').innerText.includes('streaming')")
    page.click("#stop")
    t0 = time.monotonic()
    page.wait_for_function("document.querySelector('#meter').innerText.includes('stopped')", timeout=15_000)
    assert time.monotonic() - t0 < 10
    summary = session.last_summary
    assert summary is not None and summary.stop_reason == "stopped" and summary.new_tokens < 400
    assert "stopped" in bot_text(page)
    assert not session.busy
    shoot(page, tmp_path, "web-ui-stopped.png")


def test_markup_in_a_streaming_reply_shows_as_text(page: Any, served: Any) -> None:
    """Tokens that look like markup are characters in the live element while the reply streams, and in the chat
    once it lands: no element, no script, no dialog."""
    session: SessionManager = served.medusa_web.session
    # 40 tokens: steps enough (the pieces repeat) that the live element shows the first three pieces before the
    # reply lands, however the updates are coalesced on a loaded machine (12 left one or two live updates)
    set_number(page, "max-new", 40)
    wait_until(lambda: session.settings.max_new_tokens == 40, what="max new tokens to reach the session")
    pieces = ["<script>alert(21)</script>", " <img src=x onerror=alert(22)>", " & ", "<b>bold</b>"]
    SCRIPTED["texts"] = pieces
    try:
        before = len(session.conversation.messages)
        page.fill("#msg textarea", "Say it.")
        page.click("#send")
        seen: list[str] = []
        deadline = time.monotonic() + 30
        while not (len(session.conversation.messages) == before + 2 and not session.busy):
            assert time.monotonic() < deadline, "the reply did not finish"
            live = live_reply(page)
            assert live["elements"] == 0, "markup from the reply became an element"
            if live["text"] and (not seen or seen[-1] != live["text"]):
                seen.append(live["text"])
            time.sleep(0.03)
    finally:
        SCRIPTED["texts"] = None
    page.wait_for_function("document.querySelector('#meter').innerText.includes('max new tokens')")
    assert any("<script>alert(21)</script> <img src=x onerror=alert(22)> & " in t for t in seen), seen
    assert session.conversation.messages[-1].content.startswith("".join(pieces))
    assert "<script>alert(21)</script> <img src=x onerror=alert(22)> & <b>bold</b>" in bot_text(page)
    assert live_reply(page) == {"text": "", "shown": False, "elements": 0}
    assert page.evaluate("document.querySelectorAll('#live-reply script, #live-reply img, #live-reply b').length") == 0
    assert_chat_is_inert(page)


# Every element inside the rendered chat messages, with its attribute names (run in the page).
MESSAGE_ELEMENTS_JS = """() => Array.from(document.querySelectorAll('#chat .mc-msg, #chat .mc-msg *, #chat .mc-msg-stats'))
    .map(e => [e.tagName.toLowerCase(), Array.from(e.attributes).map(a => a.name)])"""
# Elements that load or run something, anywhere in the chat column (gradio's own icons are inline SVG, some
# with a <style> inside: those are the app's, not the messages').
ACTIVE_JS = """() => Array.from(document.querySelectorAll(
    '#chat img, #chat script, #chat iframe, #chat object, #chat embed, #chat link, #chat style:not(svg style), #chat video,'
    + ' #chat audio, #chat source, #chat [onerror], #chat [onload], #chat [onclick], #chat [onmouseover]'))
    .map(e => e.outerHTML.slice(0, 120))"""


def assert_chat_is_inert(page: Any) -> None:
    time.sleep(1.0)  # an <img onerror> fires asynchronously, once its load fails: give it the time
    assert page.evaluate(ACTIVE_JS) == []
    for tag, attrs in page.evaluate(MESSAGE_ELEMENTS_JS):
        assert tag in MARKDOWN_TAGS, f"<{tag}> from message text became an element"
        assert not [a for a in attrs if a.startswith("on") or a in ("src", "srcset", "style")], (tag, attrs)
    assert page.dialogs == [], f"a dialog opened: {page.dialogs}"
    assert page.outside == [], f"the page tried to reach other hosts: {page.outside[:5]}"


def test_injection_payloads_stay_text(page: Any, served: Any, tmp_path: Path) -> None:
    session: SessionManager = served.medusa_web.session
    set_number(page, "max-new", 6)
    wait_until(lambda: session.settings.max_new_tokens == 6, what="max new tokens to reach the session")
    # 1. the payloads as user messages (the reported message first; two messages: the tiny model's context
    # window is 512 tokens)
    for chunk in (INJECTIONS[:4], INJECTIONS[4:]):
        before = len(session.conversation.messages)
        page.fill("#msg textarea", "\n\n".join(chunk))
        page.click("#send")
        wait_until(
            lambda n=before: len(session.conversation.messages) == n + 2 and not session.busy, what="a reply"
        )
        page.wait_for_function("document.querySelector('#meter').innerText.includes('max new tokens')")
    chat = page.inner_text("#chat")
    assert "<img src=x onerror=alert(1)> `<img src=y onerror=alert(2)>` <script>alert(3)</script>" in chat
    assert "[image: secret]" in chat and "<iframe src=https://evil.example></iframe>" in chat
    assert_chat_is_inert(page)

    # 2. the payloads as model replies and statistics, from a conversation file opened in the UI
    conv = Conversation(title="hostile <img src=t onerror=alert(12)>", messages=[
        Message("user", "say it"),
        Message("assistant", "haiku line one\nline two\nline three\n\n" + "\n\n".join(INJECTIONS), stopped=True,
                stats={"new_tokens": "<img src=s onerror=alert(13)>", "tokens_per_step": "<b>x</b>",
                       "speedup": 1.25, "speedup_kind": "<img src=k onerror=alert(14)>"}),
    ])  # fmt: skip
    session.store.save(conv)
    page.get_by_role("button", name="Refresh").click()
    dropdown = page.locator("#conv-list input")
    dropdown.click()
    page.get_by_role("option", name=re.compile("hostile")).click()
    page.get_by_role("button", name="Open").click()
    page.wait_for_function("document.querySelector('#chat').innerText.includes('haiku line one')")
    wait_until(lambda: session.conversation.id == conv.id, what="the conversation to open")
    chat = page.inner_text("#chat")
    assert "haiku line one\nline two\nline three" in chat  # the reply's line breaks, kept
    # a statistic that is not a number is left out; the speedup kind is a string: shown, as text
    assert "alert(13)" not in chat and "1.25× <img src=k onerror=alert(14)>" in chat
    assert "<script>alert(3)</script>" in chat
    assert_chat_is_inert(page)
    shoot(page, tmp_path, "web-ui-injection.png")
