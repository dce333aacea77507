"""The Rich terminal REPL, the default `medusa-chat` command.

It renders what the SessionManager streams (StepEvents, then a ReplySummary) and turns slash commands into
session calls; it holds no model logic. On a terminal replies stream as Markdown inside Rich Live with a status
line; when stdin/stdout are not a terminal (pipes, files) it prints plain text, reads lines, and exits at EOF.

Ctrl-C during a reply does not raise inside the engine: a temporary SIGINT handler calls `session.stop()`,
which the engine checks every step, so the reply ends cleanly within one step and is kept, marked stopped.
(A second Ctrl-C during the same reply raises KeyboardInterrupt, the escape hatch for a stuck prefill.)
"""

from __future__ import annotations

import argparse
import contextlib
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.text import Text

from medusa_chat.chat.updates import updates
from medusa_chat.cliargs import add_generation_args, given_settings
from medusa_chat.errors import MedusaChatError
from medusa_chat.events import ReplySummary, StepEvent
from medusa_chat.ui.commands import ALIASES, COMMANDS_NAMES, SlashCommands, help_table
from medusa_chat.ui.rich_render import (  # how things look; this module decides when
    ReplyMarkdown,
    TailView,
    accepted_tokens_text,
    info_panel,
    status_text,
    strip_controls,
)

if TYPE_CHECKING:  # the session (and torch) are imported only when main() runs
    from medusa_chat.chat.session import SessionManager

PROMPT_TTY = (
    "\001\033[1;36m\002you>\001\033[0m\002 "  # \001/\002 tell readline the colour codes take no width
)
CONT_TTY = "... "
PASTE_WAIT_S = 0.03  # lines arriving within this window after Enter are part of one paste


class TerminalChat(SlashCommands):
    def __init__(
        self,
        session: SessionManager,
        console: Console,
        interactive: bool,
        stdin: TextIO | None = None,
        out: TextIO | None = None,
    ) -> None:
        self.session = session
        self.console = console
        self.interactive = interactive
        self.stdin = stdin or sys.stdin
        self.out = out or sys.stdout
        self.history_path = session.data_dir / "history"
        self._readline: Any = None
        self._interrupts = 0
        self.screen_updates = 0  # redraws of the last streamed reply (bounded by chat/updates.py's rate)

    # ---- input --------------------------------------------------------------------------------------------
    def setup_history(self) -> None:
        if not self.interactive:
            return
        try:
            import readline
        except ImportError:  # Windows without pyreadline: input works, just without history
            return
        self._readline = readline
        with contextlib.suppress(OSError):
            readline.read_history_file(self.history_path)
        readline.set_history_length(2000)
        names = sorted(set(COMMANDS_NAMES) | set(ALIASES))

        def complete(text: str, state: int) -> str | None:
            matches = [n for n in names if n.startswith(text)] if text.startswith("/") else []
            return matches[state] if state < len(matches) else None

        readline.set_completer(complete)
        readline.set_completer_delims(" \t\n")
        readline.parse_and_bind("tab: complete")

    def save_history(self) -> None:
        if self._readline is not None:
            with contextlib.suppress(OSError):
                self.history_path.parent.mkdir(parents=True, exist_ok=True)
                self._readline.write_history_file(self.history_path)

    def _input(self, prompt: str) -> str:
        """One line; EOFError at the end of input."""
        if self.interactive:
            return input(prompt)
        line = self.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")

    def _pending_paste(self) -> bool:
        """More input already waiting right after Enter: the rest of a multi-line paste."""
        if not self.interactive:
            return False
        try:
            ready, _, _ = select.select([self.stdin], [], [], PASTE_WAIT_S)
        except (OSError, ValueError):  # not selectable (e.g. Windows console)
            return False
        return bool(ready)

    def read_message(self) -> str:
        """A whole message: continuation lines (trailing \\), /multi ... /end blocks, and pasted lines joined.
        Raises EOFError at end of input, KeyboardInterrupt on Ctrl-C."""
        lines = [self._input(PROMPT_TTY if self.interactive else "")]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            lines.append(self._input(CONT_TTY if self.interactive else ""))
        if len(lines) == 1 and lines[0].strip() == "/multi":
            self.console.print(Text("multi-line mode: finish with a line /end", style="dim"))
            lines = []
            while True:
                try:
                    line = self._input(CONT_TTY if self.interactive else "")
                except EOFError:
                    break  # piped input without /end: send what was read
                if line.strip() == "/end":
                    break
                lines.append(line)
            return "\n".join(lines)
        # A command is one line; a paste of several lines is one message.
        if not lines[0].startswith("/"):
            while self._pending_paste():
                lines.append(self._input(""))
        return "\n".join(lines)

    # ---- main loop ----------------------------------------------------------------------------------------
    def run(self) -> int:
        self.setup_history()
        try:
            while True:
                try:
                    text = self.read_message()
                except EOFError:
                    if self.interactive:
                        self.console.print()
                    return 0
                except KeyboardInterrupt:
                    self.console.print()
                    return 0
                if not text.strip():
                    continue
                try:
                    if not self.handle(text):
                        return 0
                except KeyboardInterrupt:  # second Ctrl-C during a reply, or during a command
                    self.console.print(Text("interrupted", style="yellow"))
                except MedusaChatError as err:
                    self.error(str(err))
                except Exception:  # never let a bug end the chat: show it, keep the conversation
                    self.console.print_exception(max_frames=5)
                    self.error("internal error (above); the conversation is kept")
        finally:
            self.save_history()

    # Errors and notes can quote conversation titles, file contents and model text: stripped like replies.
    def error(self, message: str) -> None:
        self.console.print(Text(f"error: {strip_controls(message)}", style="bold red"))

    def note(self, message: str, style: str = "dim") -> None:
        self.console.print(Text(strip_controls(message), style=style))

    def handle(self, text: str) -> bool:
        """Run one input; False means exit."""
        if text.startswith("//"):
            text = text[1:]  # an escaped slash: send it as a message
        elif text.startswith("/"):
            name, arg = (text.split(None, 1) + [""])[:2]
            name = ALIASES.get(name.lower(), name.lower())
            if name == "/exit":
                return False
            handler: Callable[[str], None] | None = getattr(self, "cmd_" + name[1:], None)
            if handler is None or name not in COMMANDS_NAMES:
                self.error(f"unknown command {name}")
                self.console.print(help_table())
                return True
            handler(arg.strip())
            return True
        self.stream_reply(lambda: self.session.send(text))
        return True

    # ---- replies ------------------------------------------------------------------------------------------
    def _on_sigint(self, signum: int, frame: Any) -> None:
        self._interrupts += 1
        self.session.stop()
        if self._interrupts > 1:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def _ctrl_c_stops(self) -> Iterator[None]:
        self._interrupts = 0
        try:
            previous = signal.signal(signal.SIGINT, self._on_sigint)
        except ValueError:  # not the main thread: Ctrl-C keeps its default meaning
            yield
            return
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def stream_reply(self, start: Callable[[], Iterator[StepEvent | ReplySummary]]) -> None:
        stream = start()  # BusyError / PromptError surface here, before anything is drawn
        events: list[StepEvent] = []
        summary: ReplySummary | None = None
        try:
            with self._ctrl_c_stops():
                if self.interactive:
                    summary = self._stream_live(stream, events)
                else:
                    summary = self._stream_plain(stream, events)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
            for notice in self.session.notices:
                self.note(notice, "yellow")
        if summary is not None and self.interactive and len(events) > 1:
            self.console.print(
                Text(
                    "accepted tokens by step (shading alternates per step, bold = several "
                    "tokens in one step):",
                    style="dim",
                )
            )
            self.console.print(accepted_tokens_text(events))

    def _status(self, ev: StepEvent | None, summary: ReplySummary | None) -> Text:
        mode = summary.accept_mode if summary else self.session.settings.accept_mode
        if summary is not None:
            tps, per_step, n, reason = (
                summary.decode_tokens_per_s,
                summary.tokens_per_step,
                summary.new_tokens,
                summary.stop_reason,
            )
        elif ev is not None:
            tps, per_step, n, reason = ev.decode_tokens_per_s, ev.tokens_per_step, ev.new_tokens_total, ""
        else:
            tps, per_step, n, reason = 0.0, 0.0, 0, ""
        return status_text(
            tps, per_step, self.session.speedup(tps, per_step), mode, n, reason, stopping=self._interrupts > 0
        )

    def _stream_live(
        self, stream: Iterator[StepEvent | ReplySummary], events: list[StepEvent]
    ) -> ReplySummary | None:
        text = ""
        last: StepEvent | None = None
        summary: ReplySummary | None = None

        def view() -> RenderableType:
            return Group(ReplyMarkdown(text or "..."), self._status(last, summary))

        # The reply decodes in its own thread and the screen is redrawn here, at most 4-8 times a second (updates_per_s)
        # (chat/updates.py: each update carries every step since the previous one), so the redraw (Markdown of
        # the whole reply) never holds up a step. While streaming only the tail that fits the screen is drawn
        # (Live cannot redraw lines that scrolled away); the final frame, drawn when Live stops, is the whole
        # reply.
        with (
            Live(TailView(view()), console=self.console, auto_refresh=False) as live,
            updates(stream) as feed,
        ):
            for update in feed:
                events.extend(update.steps)
                last = update.last or last
                text += update.text
                if update.summary is not None:
                    summary = update.summary
                    text = summary.text
                live.update(TailView(view()) if summary is None else view(), refresh=True)
            self.screen_updates = feed.coalescer.emitted
        if summary is not None and summary.message:
            self.note(summary.message, "yellow")
        return summary

    def _stream_plain(
        self, stream: Iterator[StepEvent | ReplySummary], events: list[StepEvent]
    ) -> ReplySummary | None:
        summary: ReplySummary | None = None
        for item in stream:
            if isinstance(item, ReplySummary):
                summary = item
            else:
                events.append(item)
                self.out.write(strip_controls(item.text))  # the model's text, never its escape codes
                self.out.flush()
        self.out.write("\n")
        if summary is not None:
            self.out.write(f"[{self._status(None, summary).plain.strip()}]\n")
            if summary.message:
                self.out.write(f"[{strip_controls(summary.message)}]\n")
        self.out.flush()
        return summary

    # ---- commands -----------------------------------------------------------------------------------------
# ------------------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------------------
def add_chat_args(parser: argparse.ArgumentParser) -> None:
    """Options of the chat command beyond the model options that cli.py defines."""
    g = parser.add_argument_group("chat")
    g.add_argument("--system", default=None, help="system prompt")
    add_generation_args(g, "chat")  # each changes the session's setting only where given
    g.add_argument(
        "--resume", metavar="NAME", default=None, help="continue a saved conversation (id or name)"
    )
    g.add_argument("--plain", action="store_true", help="plain text output even on a terminal")
    g.add_argument(
        "--baseline",
        action="store_true",
        help="measure plain decoding at start, so speedups are measured, not estimated",
    )


add_arguments = add_chat_args  # the hook name cli.py looks for in a sub-command's module


def _arg(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    # cli.py may or may not have called add_chat_args: every extra option is optional here.
    value = getattr(args, name, default)
    return default if value is None else value


def main(args: argparse.Namespace) -> int:
    from medusa_chat.chat.session import SessionManager, SessionOptions

    interactive = sys.stdin.isatty() and sys.stdout.isatty() and not _arg(args, "plain", False)
    console = (
        Console(highlight=False) if interactive else Console(highlight=False, no_color=True, soft_wrap=True)
    )
    # Plain mode keeps stdout for the conversation; loading chatter goes to stderr.
    info_console = (
        console if interactive else Console(stderr=True, highlight=False, no_color=True, soft_wrap=True)
    )
    data_dir = _arg(args, "data_dir", None)
    session = SessionManager(SessionOptions.from_args(args), data_dir=Path(data_dir) if data_dir else None)
    # MedusaChatError (unknown model, offline, no GPU, ...) propagates: cli.py prints it as one line.
    _load(session, info_console, interactive)
    changes = given_settings(args)  # the generation options given, over the session's defaults
    if changes:
        session.update_settings(**changes)
    if _arg(args, "system", None):
        session.conversation.system_prompt = args.system  # saved with the first message
    if _arg(args, "resume", None):
        conv = session.load_conversation(args.resume)
        info_console.print(Text(f"resumed {conv.display_title()!r} ({len(conv.messages)} messages)"))
    if _arg(args, "baseline", False):
        tps = session.measure_baseline()
        info_console.print(Text(f"plain decoding: {tps:.1f} tokens/s (speedups are measured)"))
    info_console.print(info_panel(session.info))
    try:
        return TerminalChat(session, console, interactive).run()
    finally:
        session.close()  # a calibration still running after the last reply stops, saving nothing


def _load(session: SessionManager, console: Console, interactive: bool) -> None:
    started = time.perf_counter()
    name = session.model_name
    asked = session.info  # before loading: what was asked for, so a slow download says what it is for
    console.print(
        Text(
            f"medusa-chat: {name} (heads {asked['heads'] or 'default'}, quant {asked['quant']}, "
            f"device {asked['device']}, tree {asked['tree']}"
            + (f"[:{asked['tree_size']}]" if asked["tree_size"] else "")
            + ")",
            style="bold",
        )
    )
    if interactive:
        with console.status(f"loading {name}...") as status:

            def progress(msg: str) -> None:
                status.update(f"loading {name}: {msg}")
                console.print(Text(msg, style="dim"))

            session.load(progress)
    else:
        session.load(lambda msg: console.print(Text(f"loading: {msg}")))
    console.print(Text(f"loaded in {time.perf_counter() - started:.1f} s", style="dim"))


if __name__ == "__main__":  # pragma: no cover - `python -m medusa_chat.ui.terminal` for quick tries
    parser = argparse.ArgumentParser()
    for flag, default in (
        ("--model", "smollm2-135m"),
        ("--heads", None),
        ("--quant", "auto"),
        ("--dtype", "auto"),
        ("--device", "auto"),
        ("--tree", None),
    ):
        parser.add_argument(flag, default=default)
    parser.add_argument("--tree-size", type=int, default=None)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--data-dir", default=None)
    add_chat_args(parser)
    raise SystemExit(main(parser.parse_args()))
