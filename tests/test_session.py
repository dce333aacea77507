"""Session manager and conversation store.

Storage tests need no model. Session tests run the real engine on the tiny models from conftest: they check the
prompt (chat template, truncation that keeps the system prompt), the conversation edits (regenerate, undo,
edit), stop, one-reply-at-a-time, errors that must not lose the conversation, and the atomic autosave.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from medusa_chat.atomic import TMP_PREFIX, atomic_write_text
from medusa_chat.chat.conversations import (
    Conversation,
    ConversationStore,
    Message,
    default_data_dir,
    export_conversation,
    hard_line_breaks,
)
from medusa_chat.chat.session import SessionManager, SessionOptions
from medusa_chat.errors import BusyError, MedusaChatError, PromptError
from medusa_chat.events import ReplySummary, StepEvent
from medusa_chat.settings import DRY_DEFAULT


# ------------------------------------------------------------------------------------------------------------
# Conversation store (no model)
# ------------------------------------------------------------------------------------------------------------
def _conv(n: int = 2, **kw) -> Conversation:
    msgs = []
    for i in range(n):
        msgs += [Message("user", f"question {i}"), Message("assistant", f"answer {i}", {"new_tokens": 3})]
    return Conversation(system_prompt="be brief", messages=msgs, **kw)


def test_default_data_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEDUSA_CHAT_DATA", str(tmp_path / "d"))
    assert default_data_dir() == tmp_path / "d"
    assert ConversationStore().root == tmp_path / "d" / "conversations"


def test_store_round_trip_list_resolve_delete(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    a = _conv(1, title="alpha", id="20250101-000000-aaaaaa")
    b = _conv(2, id="20250101-000000-bbbbbb")
    b.messages[-1].stopped = True
    store.save(a)
    time.sleep(1.01)  # `updated` has one-second resolution; the list is newest first
    store.save(b)
    got = store.load(b.id)
    assert got == b
    assert got.messages[-1].stopped and got.messages[0].stats is None
    metas = store.list_all()
    assert [m.id for m in metas] == [b.id, a.id]
    assert metas[0].messages == 4 and metas[0].title == "question 0"
    assert store.resolve("alpha") == a.id  # by title
    assert store.resolve("ALPHA") == a.id
    assert store.resolve("1") == b.id  # by list number
    assert store.resolve("20250101-000000-b") == b.id  # unique id prefix
    with pytest.raises(MedusaChatError, match="matches 2"):
        store.resolve("20250101")
    store.delete(a.id)
    assert [m.id for m in store.list_all()] == [b.id]
    with pytest.raises(MedusaChatError, match="no saved conversation"):
        store.load(a.id)
    with pytest.raises(MedusaChatError, match="no saved conversation"):
        store.resolve("nothing-like-this")


def test_store_rejects_path_tricks_and_skips_junk(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    with pytest.raises(MedusaChatError, match="invalid conversation id"):
        store.load("../../etc/passwd")
    store.save(_conv(1))
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / ".tmp-x.json.123.json").write_text("{}")
    assert len(store.list_all()) == 1  # a corrupt file or a crash's temp file is never listed


def test_atomic_write_keeps_old_file_when_replace_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ConversationStore(tmp_path)
    conv = _conv(1)
    store.save(conv)
    before = (tmp_path / f"{conv.id}.json").read_text()
    conv.messages.append(Message("user", "new"))

    def boom(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk on fire"):
        store.save(conv)
    monkeypatch.undo()
    assert (tmp_path / f"{conv.id}.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{conv.id}.json"]  # temp file cleaned up


def test_atomic_write_survives_kill_mid_write(tmp_path: Path) -> None:
    """A process killed (SIGKILL) while saving over and over never leaves a half-written conversation."""
    target = tmp_path / "c.json"
    atomic_write_text(target, json.dumps({"n": -1, "pad": ""}))
    script = textwrap.dedent(
        f"""
        import json, sys
        from pathlib import Path
        from medusa_chat.atomic import atomic_write_text
        target = Path({str(target)!r})
        pad = "x" * 2_000_000  # ~2 MB per write, so the kill lands inside a write most of the time
        print("ready", flush=True)
        n = 0
        while True:
            atomic_write_text(target, json.dumps({{"n": n, "pad": pad}}))
            n += 1
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.4)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=10)
    data = json.loads(target.read_text())  # whole JSON, old or new, never truncated
    assert data["n"] >= -1
    leftovers = [p for p in tmp_path.iterdir() if p.name != "c.json"]
    # a killed writer may leave its temp file behind, but never under a conversation's name
    assert all(p.name.startswith(TMP_PREFIX) for p in leftovers)


def test_file_name_is_the_id_so_saves_never_overwrite_another_conversation(tmp_path: Path) -> None:
    """A file copied or renamed by hand keeps the other conversation's id inside; loading it under its own
    name and autosaving must change that file only."""
    store = ConversationStore(tmp_path / "conversations")
    a = _conv(1, id="20250101-000000-aaaaaa")
    store.save(a)
    original_a = store.path_for(a.id).read_bytes()
    copy = store.path_for("20250101-000000-cccccc")
    copy.write_bytes(original_a)  # stored id: aaaaaa
    odd = store.path_for("20250101-000000-dddddd")  # a stored id that cannot be a file name at all
    odd.write_text(json.dumps({**a.to_dict(), "id": "../../outside"}))
    assert sorted(m.id for m in store.list_all()) == [
        a.id,
        "20250101-000000-cccccc",
        "20250101-000000-dddddd",
    ]

    session = SessionManager(data_dir=tmp_path)  # never loaded: storage needs no model
    for name in ("20250101-000000-cccccc", "20250101-000000-dddddd"):
        conv = session.load_conversation(name)
        assert conv.id == name and conv.messages == a.messages
        session.set_system(f"edited {name}")  # autosaves
        assert session.notices == []
        assert json.loads(store.path_for(name).read_text())["system_prompt"] == f"edited {name}"
        assert json.loads(store.path_for(name).read_text())["id"] == name  # repaired on save
    assert store.path_for(a.id).read_bytes() == original_a  # the original is untouched
    assert sorted(p.name for p in store.root.iterdir()) == sorted(
        f"{i}.json" for i in (a.id, "20250101-000000-cccccc", "20250101-000000-dddddd")
    )
    assert not (tmp_path / "outside.json").exists() and not (tmp_path.parent / "outside.json").exists()


def test_broken_conversation_files_give_clear_errors_and_lose_nothing(tmp_path: Path) -> None:
    session = SessionManager(data_dir=tmp_path)
    store = session.store
    good = _conv(1, id="20250101-000000-aaaaaa")
    store.save(good)
    broken = {
        "20250101-000000-bbbbbb": "{not json",
        "20250101-000000-cccccc": json.dumps({"id": "x", "messages": [{"role": "system", "content": "hi"}]}),
        "20250101-000000-dddddd": json.dumps({"id": "x", "messages": ["just a string"]}),
        "20250101-000000-eeeeee": json.dumps(["not", "an", "object"]),
    }
    for name, text in broken.items():
        store.path_for(name).write_text(text)
    assert [m.id for m in session.list_conversations()] == [good.id]  # broken files are not listed
    session.load_conversation(good.id)
    for name, text in broken.items():
        with pytest.raises(MedusaChatError, match="cannot read conversation file"):
            session.load_conversation(name)
        assert session.conversation.id == good.id  # the current conversation stays
        assert store.path_for(name).read_text() == text  # and the broken file is kept for its owner
    session.set_system("still saving")  # autosave works after all those errors
    assert session.notices == [] and store.load(good.id).system_prompt == "still saving"
    # stats that are not an object are dropped (informational), the turn itself is kept
    data = good.to_dict()
    data["messages"][1]["stats"] = ["<img src=x>"]
    store.path_for("20250101-000000-ffffff").write_text(json.dumps(data))
    loaded = store.load("20250101-000000-ffffff")
    assert loaded.messages[1].stats is None and loaded.messages[1].content == "answer 0"


def test_autosave_of_an_id_the_store_refuses_is_a_notice_not_an_exception(tmp_path: Path) -> None:
    session = SessionManager(data_dir=tmp_path)
    session.conversation = _conv(1, id="not a valid id/..")
    session.set_system("x")  # autosave: the store refuses the id with MedusaChatError
    assert any(
        "could not save the conversation" in n and "invalid conversation id" in n for n in session.notices
    )
    assert session.conversation.system_prompt == "x" and len(session.conversation.messages) == 2


def test_atomic_writers_in_parallel_never_mix_and_leave_nothing(tmp_path: Path) -> None:
    """Two threads replacing one file: each write has its own temporary file (a fixed ".tmp" name would let one
    writer rename the other's half-written data into place), the result is always one whole version."""
    target = tmp_path / "calibration.json"
    versions = {f"writer{w}": "x" * (200_000 + w) for w in range(2)}
    errors: list[BaseException] = []

    def write(name: str) -> None:
        try:
            for _ in range(25):
                atomic_write_text(target, json.dumps({"by": name, "pad": versions[name]}))
                data = json.loads(target.read_text())  # every read is a whole version
                assert data["pad"] == versions[data["by"]]
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=write, args=(name,)) for name in versions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.json"]  # no temporary file left behind


def test_conversation_files_are_private(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path)
    path = store.save(_conv(1))
    assert path.stat().st_mode & 0o777 == 0o600  # a chat is nobody else's business on a shared machine


def test_export_markdown_and_json(tmp_path: Path) -> None:
    conv = _conv(1, title="export me")
    conv.messages[-1].stopped = True
    md = export_conversation(conv, tmp_path / "c.md", "md").read_text()
    assert md.startswith("# export me")
    assert "> be brief" in md and "**User:**" in md and "answer 0" in md and "*(stopped)*" in md
    data = json.loads(export_conversation(conv, tmp_path / "c.json", "json").read_text())
    assert Conversation.from_dict(data) == conv
    with pytest.raises(MedusaChatError, match="unknown export format"):
        export_conversation(conv, tmp_path / "c.txt", "txt")


def test_markdown_export_keeps_line_breaks_and_code(tmp_path: Path) -> None:
    from markdown_it import MarkdownIt

    haiku = "An old silent pond\nA frog jumps into the pond\nSplash! Silence again."
    code = "```python\nx = 1\ny = 2\n```"
    conv = Conversation(system_prompt="Be brief.\nAnswer in English.", messages=[
        Message("user", "a haiku, then code"),
        Message("assistant", f"{haiku}\n\nSteps:\n1. mix\n2. bake\n{code}\nafter",
                stats={"new_tokens": 20, "tokens_per_step": 2.5, "decode_tokens_per_s": 30.0, "accept_mode": "greedy"}),
    ])  # fmt: skip
    md = export_conversation(conv, tmp_path / "c.md", "md").read_text()
    # rendered by a standard CommonMark parser (no "breaks" option): every line of the haiku is its own line
    rendered = MarkdownIt("commonmark").render(md)
    assert "An old silent pond<br />\nA frog jumps into the pond<br />\nSplash! Silence again." in rendered
    assert "Be brief.<br />\nAnswer in English." in rendered
    assert "<li>mix</li>" in rendered and "<li>bake</li>" in rendered
    assert (
        '<code class="language-python">x = 1\ny = 2\n</code>' in rendered
    )  # code untouched, no trailing spaces
    assert "\nx = 1\ny = 2\n" in md and "<sub>20 tokens, 2.50 tokens/step, 30.0 tokens/s, greedy</sub>" in md


def test_markdown_export_of_hostile_stats_does_not_crash(tmp_path: Path) -> None:
    conv = _conv(1)
    conv.messages[1].stats = {"new_tokens": "<img src=x>", "tokens_per_step": "<b>", "accept_mode": "<i>"}
    md = export_conversation(conv, tmp_path / "c.md", "md").read_text()
    assert "<img" not in md and "<b>" not in md and "<sub>" not in md
    conv.messages[1].stats = {"new_tokens": 7, "tokens_per_step": "nan?", "accept_mode": "<i>"}
    md = export_conversation(conv, tmp_path / "c.md", "md").read_text()
    assert "<sub>7 tokens</sub>" in md


def test_turns_put_system_first_and_omit_empty_system() -> None:
    conv = _conv(1)
    assert conv.turns()[0] == {"role": "system", "content": "be brief"}
    conv.system_prompt = ""
    assert conv.turns()[0]["role"] == "user"


# ------------------------------------------------------------------------------------------------------------
# Session manager on a tiny real model
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture
def make_session(make_loaded_model, tmp_path: Path):
    """A session on conftest's tiny Llama (ChatML template, planted v1 heads; replies run to max_new_tokens)."""

    def make(
        context_limit: int | None = None, max_new_tokens: int = 12, tree_size: int | None = 16
    ) -> SessionManager:
        loaded = make_loaded_model()
        if context_limit is not None:  # a copy: the cached LoadedModel is shared between tests
            loaded = dataclasses.replace(loaded, context_limit=context_limit)
        s = SessionManager(SessionOptions(tree_size=tree_size), tmp_path, loaded)
        s.load()
        s.update_settings(max_new_tokens=max_new_tokens)
        return s

    return make


def _drain(stream) -> tuple[list[StepEvent], ReplySummary]:
    items = list(stream)
    assert isinstance(items[-1], ReplySummary) and all(isinstance(i, StepEvent) for i in items[:-1])
    return items[:-1], items[-1]


def _spy_prompts(session: SessionManager) -> list[list[int]]:
    prompts: list[list[int]] = []
    real = session.engine.generate

    def spy(prompt_ids, settings, stop):
        prompts.append(list(prompt_ids))
        return real(prompt_ids, settings, stop)

    session.engine.generate = spy
    return prompts


def test_send_streams_uses_the_template_and_autosaves(make_session) -> None:
    s = make_session()
    assert s.settings.dry_multiplier == DRY_DEFAULT  # the app's replies: DRY on unless turned off
    s.set_system("Be brief.")
    prompts = _spy_prompts(s)
    events, summary = _drain(s.send("Hello world! How are you today?"))
    assert summary.new_tokens == 12 and "".join(e.text for e in events) == summary.text
    expected = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello world! How are you today?"},
    ]
    assert prompts[0] == s.loaded.build_prompt(expected)
    assert s.loaded.tokenizer.decode(prompts[0]).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    msgs = s.conversation.messages
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[1].content == summary.text
    assert msgs[1].stats["tokens_per_step"] == summary.tokens_per_step and not msgs[1].stopped
    assert (
        msgs[1].stats["speedup_kind"] == "estimated" and summary.tokens_per_step > 1
    )  # planted heads accept
    assert s.last_summary is summary and s.last_events == events and not s.busy
    # the second turn's prompt is the whole history, system first
    _drain(s.send("What is the capital of France?"))
    assert prompts[1] == s.loaded.build_prompt(s.conversation.turns()[:-1])  # system, user, reply, user
    # autosave: a fresh session on the same folder lists and loads the same conversation
    other = SessionManager(loaded=s.loaded, data_dir=s.data_dir)
    assert [m.id for m in other.list_conversations()] == [s.conversation.id]
    assert other.load_conversation(s.conversation.id) == s.conversation


def test_truncation_drops_oldest_turns_but_keeps_system(make_session) -> None:
    s = make_session(context_limit=120, max_new_tokens=16)
    s.set_system("Be brief.")
    prompts = _spy_prompts(s)
    questions = ["First: what is the capital of France?", "Second: give me three tips for staying healthy.",
                 "Third: what is Python?", "Fourth: how are you today?"]  # fmt: skip
    for q in questions:
        _drain(s.send(q))
    assert len(s.conversation.messages) == 8  # nothing is deleted from the conversation itself
    last = prompts[-1]
    assert len(last) <= 120 - 16
    text = s.loaded.tokenizer.decode(last)
    assert text.startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    )  # system, then a user turn
    assert "First:" not in text and "Fourth:" in text
    assert s.notices and "dropped the" in s.notices[0] and "oldest" in s.notices[0]
    dropped = s.conversation.messages[-1].stats["dropped_messages"]
    assert dropped >= 2 and dropped % 2 == 0  # whole exchanges
    turns = s.conversation.turns()[:-1]  # the prompt's messages: system + history + the newest question
    assert last == s.loaded.build_prompt([turns[0], *turns[1 + dropped :]])
    assert (
        len(s.loaded.build_prompt([turns[0], *turns[dropped - 1 :]])) > 120 - 16
    )  # no more dropped than needed
    # a message that can never fit is refused and not kept
    with pytest.raises(PromptError, match="too long"):
        s.send("word " * 200)
    assert len(s.conversation.messages) == 8 and not s.busy


def test_regenerate_edit_undo_clear(make_session) -> None:
    s = make_session()
    _drain(s.send("Hello world!"))
    _drain(s.send("How are you today?"))
    s.update_settings(temperature=0.8, seed=1)
    _, summary = _drain(s.regenerate())
    msgs = s.conversation.messages
    assert len(msgs) == 4 and msgs[-1].content == summary.text and msgs[-1].stats["accept_mode"] == "typical"
    _drain(s.edit_last("What is Python?"))
    assert [m.content for m in msgs[:3]] == ["Hello world!", msgs[1].content, "What is Python?"] and len(
        msgs
    ) == 4
    s.undo()
    assert [m.role for m in s.conversation.messages] == ["user", "assistant"]
    s.undo()
    assert s.conversation.messages == []
    with pytest.raises(MedusaChatError, match="nothing to undo"):
        s.undo()
    with pytest.raises(MedusaChatError, match="nothing to regenerate"):
        s.regenerate()
    saved = s.store.load(s.conversation.id)  # undo is autosaved too
    assert saved.messages == []
    s.set_system("Be brief.")
    old_id = s.conversation.id
    s.clear()
    assert (
        s.conversation.id != old_id
        and s.conversation.system_prompt == "Be brief."
        and not s.conversation.messages
    )


def test_one_reply_at_a_time(make_session) -> None:
    s = make_session()
    stream = s.send("Hello number 10")
    assert s.busy
    with pytest.raises(BusyError):
        s.send("Hello number 11")
    with pytest.raises(BusyError):
        s.undo()
    next(stream)
    with pytest.raises(BusyError):  # from another thread too
        errors: list[BaseException] = []
        t = threading.Thread(target=lambda: errors.append(_catch(lambda: s.send("Hello number 12"))))
        t.start()
        t.join()
        raise errors[0]
    _drain_rest(stream)
    assert not s.busy
    _drain(s.send("Hello number 13"))  # usable again


def _catch(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - the test inspects it
        return err
    return None


def _drain_rest(stream) -> list:
    return list(stream)


def test_stop_keeps_partial_reply_marked_stopped(make_session) -> None:
    s = make_session(max_new_tokens=200, tree_size=4)
    stream = s.send("Hello number 10")
    got = [next(stream), next(stream)]
    threading.Thread(target=s.stop).start()  # as the web UI would: from another thread
    got += list(stream)
    summary = got[-1]
    assert summary.stop_reason == "stopped" and 0 < summary.new_tokens < 200
    msg = s.conversation.messages[-1]
    assert msg.stopped and msg.content == summary.text and msg.content
    assert s.store.load(s.conversation.id).messages[-1].stopped  # saved as stopped
    # a stream closed by its consumer (browser tab gone) also keeps its text, marked stopped, and frees the lock
    stream = s.send("Hello number 12")
    first = next(stream)
    stream.close()
    assert not s.busy
    assert s.conversation.messages[-1].stopped and s.conversation.messages[-1].content == first.text
    # an abandoned, never-started stream frees the lock when dropped
    stream = s.send("Hello number 13")
    del stream
    assert not s.busy


def test_engine_errors_keep_the_conversation(make_session, monkeypatch: pytest.MonkeyPatch) -> None:
    s = make_session()
    _drain(s.send("Hello number 10"))
    real = s.engine.generate

    def failing(exc):
        def gen(prompt_ids, settings, stop):
            it = real(prompt_ids, settings, stop)
            yield next(it)
            raise exc

        return gen

    monkeypatch.setattr(s.engine, "generate", failing(MedusaChatError("device fell over")))
    with pytest.raises(MedusaChatError, match="device fell over"):
        _drain(s.send("Hello number 11"))
    assert [m.role for m in s.conversation.messages] == ["user", "assistant", "user"]
    assert s.conversation.messages[-1].content == "Hello number 11" and not s.busy
    assert any("your message is kept" in n for n in s.notices)
    assert s.store.load(s.conversation.id).messages[-1].content == "Hello number 11"

    monkeypatch.setattr(s.engine, "generate", failing(torch.OutOfMemoryError("CUDA out of memory")))
    with pytest.raises(MedusaChatError, match="out of memory.*smaller tree"):
        _drain(s.regenerate())
    monkeypatch.setattr(s.engine, "generate", real)
    _, summary = _drain(s.regenerate())  # the session survived: the kept message gets its answer
    assert s.conversation.messages[-1].content == summary.text and len(s.conversation.messages) == 4


def test_autosave_failure_is_reported_not_fatal(make_session, monkeypatch: pytest.MonkeyPatch) -> None:
    s = make_session()
    _drain(s.send("Hello number 10"))
    path = s.store.path_for(s.conversation.id)
    before = path.read_text()

    def boom(src, dst):
        raise OSError("read-only file system")

    monkeypatch.setattr(os, "replace", boom)
    _drain(s.send("Hello number 11"))
    monkeypatch.undo()
    assert len(s.conversation.messages) == 4  # still in memory
    assert any("could not save" in n for n in s.notices)
    assert path.read_text() == before  # the old file is intact
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_settings_tree_baseline_and_export(make_session, tmp_path: Path) -> None:
    s = make_session()
    with pytest.raises(MedusaChatError, match="temperature"):
        s.update_settings(temperature=-1)
    with pytest.raises(MedusaChatError, match="bad value for temperature"):
        s.update_settings(temperature="nan")
    with pytest.raises(MedusaChatError, match="unknown setting"):
        s.update_settings(temprature=1)
    assert s.settings.temperature == 0
    s.update_settings(temperature="0.7", seed="none", max_new_tokens="9")
    assert (s.settings.temperature, s.settings.seed, s.settings.max_new_tokens) == (0.7, None, 9)
    assert s.info["accept_mode"] == "typical"
    assert s.info["context_lookup"] is True
    for word, state in (("off", False), ("ON", True), (False, False), ("1", True)):
        s.update_settings(context_lookup=word)
        assert s.settings.context_lookup is state and s.info["context_lookup"] is state
    with pytest.raises(MedusaChatError, match="bad value for context_lookup"):
        s.update_settings(context_lookup="maybe")
    assert s.settings.context_lookup is True
    s.set_tree("chain-2", None)
    assert (s.info["tree"], s.info["tree_size"]) == ("chain-2", 3)
    s.set_tree(None, 8)
    assert s.info["tree_size"] == 8
    assert s.speedup(50.0, 2.0) == (2.0, "estimated")
    tps = s.measure_baseline(max_new_tokens=10)
    assert tps > 0 and s.engine.tree.size == 8  # the tree is restored
    value, kind = s.speedup(2 * tps, 2.0)
    assert kind == "measured" and value == pytest.approx(2.0)
    _drain(s.send("Hello number 10"))
    with open(s.export(tmp_path / "out.md"), encoding="utf-8", newline="") as f:  # a reply's "\r" stays "\r"
        md = f.read()
    reply = s.conversation.messages[-1]
    assert (
        "**User:**\n\nHello number 10\n" in md
        and f"**Assistant:**\n\n{hard_line_breaks(reply.content)}\n" in md
    )
    tps = reply.stats["decode_tokens_per_s"]
    assert (
        f"<sub>9 tokens, {reply.stats['tokens_per_step']:.2f} tokens/step, {tps:.1f} tokens/s, typical</sub>"
        in md
    )


def test_estimated_speedup_counts_the_calibrated_step_cost(make_session, tmp_path: Path, monkeypatch) -> None:
    """tokens/step alone over-promises where a tree step costs more than a one-token step (a CPU)."""
    from medusa_chat.tuning.tree_choice import CALIBRATION_VERSION, model_identity, save_calibration

    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    s = make_session(tree_size=8)
    s.baseline_tokens_per_s = None  # another test may have measured plain decoding in this process
    assert s.speedup(50.0, 2.0) == (2.0, "estimated")  # no calibration: tokens per step
    sizes = [{"size": 1, "latency_s": 0.040}, {"size": 8, "latency_s": 0.100}]
    record = {"version": CALIBRATION_VERSION, "tree": s.engine.tree.name, "tree_size": 1, "sizes": sizes}
    save_calibration(record, *model_identity(s.loaded))
    # The calibration is read when the tree is chosen, not on every step of a streaming reply ...
    assert s.speedup(50.0, 2.0) == (2.0, "estimated")
    s.set_tree(None, 8)  # ... so a tree change picks up the new one
    reads: list[tuple] = []
    from medusa_chat.tuning import tree_choice

    real = tree_choice.load_calibration
    monkeypatch.setattr(tree_choice, "load_calibration", lambda *a: reads.append(a) or real(*a))
    for _ in range(20):
        value, kind = s.speedup(50.0, 2.0)
    assert kind == "estimated" and value == pytest.approx(2.0 * 0.040 / 0.100)
    assert reads == []  # nothing read from disk per step


def test_first_cpu_load_calibrates_the_tree_once(make_loaded_model, tmp_path: Path, monkeypatch) -> None:
    """Without a cached calibration, a CPU session measures tokens/step and times the tree sizes once, uses
    the fastest prefix and caches it; the next load only reads the cache; an explicit tree always wins."""
    from medusa_chat.tuning import first_start as cal
    from medusa_chat.tuning import tree_choice

    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MEDUSA_CHAT_AUTO_CALIBRATE", "1")
    loaded = make_loaded_model()
    tree = loaded.default_tree
    calls = []
    real, real_replies = cal.calibrate, cal.calibrate_on_replies
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(cal, "calibrate_on_replies", lambda *a, **k: calls.append(1) or real_replies(*a, **k))

    s = SessionManager(loaded=loaded, data_dir=tmp_path)
    s.load()
    record = tree_choice.load_calibration(*tree_choice.model_identity(loaded))
    assert calls == [1] and record is not None and record["accuracy_source"].startswith("measured")
    # the engine's tree: the pick, or with a sizer the largest size near it, its steps starting at the pick
    choices = tree_choice.adaptive_choices(record, tree.size)
    size = choices.sizes[-1] if choices else record["tree_size"]
    assert "calibrated" in s.info["tree_source"] and s.engine.tree.size == size
    assert s.engine.tree.paths == tree.paths[: size - 1]
    assert (s.engine.sizer.current if s.engine.sizer else size) == (record["tree_size"] if choices else size)

    again = SessionManager(loaded=loaded, data_dir=tmp_path)
    again.load()
    assert calls == [1] and again.engine.tree.size == size  # read from the cache

    off = SessionManager(SessionOptions(tree_size=4), tmp_path, loaded)
    off.load()
    assert calls == [1] and off.engine.tree.size == 4  # an explicit tree is never overridden

    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "other-cache"))
    monkeypatch.setenv("MEDUSA_CHAT_AUTO_CALIBRATE", "0")
    plain = SessionManager(loaded=loaded, data_dir=tmp_path)
    plain.load()
    assert calls == [1] and plain.engine.tree.size == tree.size and plain.info["tree_source"] == "default"


def test_the_model_runs_on_one_thread_whoever_reads_the_reply(make_session) -> None:
    """Loading, every decoding step and the stream's cleanup run on the compute thread (compute.py: OpenMP gives
    each calling thread its own team, and two teams on a small machine halve the speed), whether the reply is
    read here or from another thread (the web page's and the API's readers)."""
    import threading

    from medusa_chat import compute

    s = make_session()
    seen: list[str] = []
    real = s.engine.generate

    def spy(prompt_ids, settings, stop):
        for item in real(prompt_ids, settings, stop):
            seen.append(threading.current_thread().name)
            yield item

    s.engine.generate = spy
    _drain(s.send("Hello there"))
    reader = threading.Thread(target=lambda: _drain(s.send("And again")))
    reader.start()
    reader.join()
    stream = s.send("Once more")
    next(stream)
    stream.close()  # stopped after one step: the cleanup ran there too
    assert len(seen) >= 3 and all(name.startswith(compute.THREAD_NAME) for name in seen)
    assert not compute.on_compute_thread()
    # the caller's torch thread count holds there too (OpenMP keeps it per thread: `--threads` must not be lost)
    import torch

    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert compute.run(torch.get_num_threads) == n
    finally:
        torch.set_num_threads(before)
