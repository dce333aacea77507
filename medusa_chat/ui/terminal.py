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
from rich.table import Table
from rich.text import Text

from medusa_chat.errors import MedusaChatError
from medusa_chat.events import ReplySummary, StepEvent
from medusa_chat.ui.rich_render import (  # how things look; this module decides when
    ReplyMarkdown,
    TailView,
    accepted_tokens_text,
    info_panel,
    stats_table,
    status_text,
    strip_controls,
    tree_renderable,
)

if TYPE_CHECKING:  # the session (and torch) are imported only when main() runs
    from medusa_chat.chat.session import SessionManager

PROMPT_TTY = (
    "\001\033[1;36m\002you>\001\033[0m\002 "  # \001/\002 tell readline the colour codes take no width
)
CONT_TTY = "... "
PASTE_WAIT_S = 0.03  # lines arriving within this window after Enter are part of one paste

COMMANDS: dict[str, str] = {
    "/help": "this list",
    "/exit": "quit (also /quit, Ctrl-D, Ctrl-C at the prompt)",
    "/clear": "start a new conversation (keeps the system prompt; the old one stays saved)",
    "/undo": "remove the last exchange",
    "/regen": "answer the last message again",
    "/edit TEXT": "replace the last message and answer it",
    "/system [TEXT]": "show or set the system prompt (`/system -` clears it)",
    "/temp X": "temperature: 0 = greedy (identical to plain decoding), > 0 = sampling (see /accept)",
    "/accept typical|exact": "rule at temperature > 0: typical (fast, favours the heads' guesses) or exact "
    "(the model's own sampling distribution)",
    "/lookup on|off": "context lookup: guess repeated text from the conversation on the tree's main chain "
    "(greedy and exact sampling: same output, fewer steps; on by default)",
    "/max N": "max new tokens per reply",
    "/topp X": "nucleus sampling top_p (temperature > 0)",
    "/seed N|none": "sampling seed",
    "/stats": "statistics of the last reply",
    "/tree [N]": "the verified tree of the last step (or step N), accepted path highlighted",
    "/baseline": "measure plain decoding speed, so speedups are measured instead of estimated",
    "/info": "model, heads, device, tree",
    "/save [NAME]": "save now (conversations autosave anyway), optionally naming it",
    "/load NAME": "load a saved conversation (id, name, or number from /list)",
    "/list": "saved conversations",
    "/delete NAME": "delete a saved conversation",
    "/export PATH": "write the conversation as Markdown (.md) or JSON (.json)",
    "/multi": "multi-line input until a line `/end` (or end a line with \\ to continue it)",
}
ALIASES = {
    "/quit": "/exit",
    "/q": "/exit",
    "/regenerate": "/regen",
    "/temperature": "/temp",
    "/top_p": "/topp",
    "/h": "/help",
    "/?": "/help",
    "/new": "/clear",
}


def help_table() -> Table:
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for cmd, text in COMMANDS.items():
        table.add_row(cmd, text)
    table.add_row(
        "",
        Text(
            "Anything else is sent to the model. Start with // to send a line beginning with /.", style="dim"
        ),
    )
    return table


class TerminalChat:
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

        # Rich Live redraws from its own thread; the loop only swaps the renderable. A modest frame rate keeps
        # the redraw (Markdown of the whole reply) from competing with the decode loop for the GIL. While
        # streaming only the tail that fits the screen is drawn (Live cannot redraw lines that scrolled
        # away); the final frame, drawn when Live stops, is the whole reply.
        with Live(TailView(view()), console=self.console, refresh_per_second=8) as live:
            for item in stream:
                if isinstance(item, ReplySummary):
                    summary = item
                    text = item.text
                else:
                    events.append(item)
                    last = item
                    text += item.text
                live.update(TailView(view()) if summary is None else view())
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
    def cmd_help(self, arg: str) -> None:
        self.console.print(help_table())

    def cmd_info(self, arg: str) -> None:
        self.console.print(info_panel(self.session.info))

    def cmd_clear(self, arg: str) -> None:
        self.session.clear()
        self.note("new conversation")

    def cmd_undo(self, arg: str) -> None:
        self.session.undo()
        self.note(f"removed the last exchange ({len(self.session.conversation.messages)} messages left)")

    def cmd_regen(self, arg: str) -> None:
        self.stream_reply(self.session.regenerate)

    def cmd_edit(self, arg: str) -> None:
        if not arg:
            raise MedusaChatError("usage: /edit TEXT")
        self.stream_reply(lambda: self.session.edit_last(arg))

    def cmd_system(self, arg: str) -> None:
        if not arg:
            current = self.session.conversation.system_prompt
            self.note(
                f"system prompt: {current}" if current else "no system prompt (the model's default applies)"
            )
            return
        self.session.set_system("" if arg == "-" else arg)
        self.note("system prompt cleared" if arg == "-" else "system prompt set")

    def _set(self, usage: str, **kw: Any) -> None:
        if any(v == "" for v in kw.values()):
            raise MedusaChatError(f"usage: {usage}")
        self.session.update_settings(**kw)

    def _mode_note(self) -> str:
        from medusa_chat.engine.acceptance import ACCEPT_GUARANTEES, ACCEPT_LABELS

        mode = self.session.settings.accept_mode
        return f"{ACCEPT_LABELS[mode]}: {ACCEPT_GUARANTEES[mode]}"

    def cmd_temp(self, arg: str) -> None:
        self._set("/temp X", temperature=arg)
        mode = self.session.settings.accept_mode
        short = {
            "greedy": "greedy: identical to plain decoding",
            "typical": "typical acceptance",
            "exact": "exact sampling: same distribution as plain sampling",
        }[mode]
        self.note(f"temperature {self.session.settings.temperature:g} ({short})")

    def cmd_accept(self, arg: str) -> None:
        if not arg:
            self.note(
                f"acceptance {self._mode_note()}; /accept typical|exact picks the rule for temperature > 0"
            )
            return
        self._set("/accept typical|exact", accept=arg)
        st = self.session.settings
        later = "" if st.temperature > 0 else f" (applies at temperature > 0; now {st.temperature:g}: greedy)"
        self.note(f"acceptance at temperature > 0: {st.accept}{later}; now {self._mode_note()}")

    def cmd_lookup(self, arg: str) -> None:
        if arg:
            self._set("/lookup on|off", context_lookup=arg)
        state = "on" if self.session.settings.context_lookup else "off"
        self.note(f"context lookup {state} (greedy and exact sampling; the output is the same either way)")

    def cmd_max(self, arg: str) -> None:
        self._set("/max N", max_new_tokens=arg)
        self.note(f"max new tokens {self.session.settings.max_new_tokens}")

    def cmd_topp(self, arg: str) -> None:
        self._set("/topp X", top_p=arg)
        self.note(f"top_p {self.session.settings.top_p:g}")

    def cmd_seed(self, arg: str) -> None:
        self._set("/seed N|none", seed=arg or "none")
        self.note(f"seed {self.session.settings.seed}")

    def cmd_stats(self, arg: str) -> None:
        s = self.session.last_summary
        if s is None:
            self.note("no reply yet")
            return
        sp = self.session.speedup(s.decode_tokens_per_s, s.tokens_per_step)
        self.console.print(stats_table(s, sp, self.session.notices))
        st = self.session.settings
        self.note(
            f"settings: temperature {st.temperature:g}, max {st.max_new_tokens}, top_p {st.top_p:g}, "
            f"seed {st.seed}, acceptance {st.accept_mode}; tree {self.session.info.get('tree')} ({self.session.info.get('tree_size')} "
            f"nodes); conversation {self.session.conversation.id}"
        )

    def cmd_tree(self, arg: str) -> None:
        events = self.session.last_events
        if not events:
            self.note("no reply yet")
            return
        if arg:
            try:
                step = int(arg)
            except ValueError:
                raise MedusaChatError("usage: /tree [STEP]") from None
            match = [e for e in events if e.step == step]
            if not match:
                raise MedusaChatError(f"no step {step}: the last reply has steps 0-{events[-1].step}")
            ev = match[0]
        else:
            with_tree = [e for e in events if e.tree is not None]
            ev = with_tree[-1] if with_tree else events[-1]
        self.console.print(tree_renderable(ev))

    def cmd_baseline(self, arg: str) -> None:
        self.note("measuring plain decoding (one token per step)...")
        tps = self.session.measure_baseline()
        self.note(f"plain decoding: {tps:.1f} tokens/s; speedups are now measured against it", "green")

    def cmd_save(self, arg: str) -> None:
        path = self.session.save(arg or None)
        self.note(
            f"saved {self.session.conversation.display_title()!r} as {self.session.conversation.id} ({path})"
        )

    def cmd_load(self, arg: str) -> None:
        if not arg:
            raise MedusaChatError("usage: /load NAME (see /list)")
        conv = self.session.load_conversation(arg)
        self.note(f"loaded {conv.display_title()!r} ({len(conv.messages)} messages)")
        for msg in conv.messages[-4:]:
            who = "you" if msg.role == "user" else "assistant"
            tail = " [stopped]" if msg.stopped else ""
            self.console.print(Text(f"{who}: ", style="bold"), Text(strip_controls(msg.content[:300]) + tail))

    def cmd_list(self, arg: str) -> None:
        metas = self.session.list_conversations()
        if not metas:
            self.note("no saved conversations yet")
            return
        table = Table(box=None, padding=(0, 2))
        for col in ("#", "id", "title", "messages", "updated"):
            table.add_column(col)
        current = self.session.conversation.id
        for i, m in enumerate(metas, 1):
            table.add_row(
                str(i),
                m.id,
                Text(strip_controls(m.title)),
                str(m.messages),
                m.updated.replace("T", " ")[:19],
                style="bold" if m.id == current else None,
            )
        self.console.print(table)

    def cmd_delete(self, arg: str) -> None:
        if not arg:
            raise MedusaChatError("usage: /delete NAME (see /list)")
        self.session.delete_conversation(arg)
        self.note("deleted")

    def cmd_export(self, arg: str) -> None:
        if not arg:
            raise MedusaChatError("usage: /export PATH (.md or .json)")
        fmt = "json" if arg.lower().endswith(".json") else "md"
        path = self.session.export(arg, fmt)
        self.note(f"exported to {path}")

    def cmd_multi(self, arg: str) -> None:  # reached only via a continued line; read_message handles /multi
        self.note("type /multi alone on a line to start multi-line input")


COMMANDS_NAMES = {c.split()[0] for c in COMMANDS} | {"/exit"}


# ------------------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------------------
def add_chat_args(parser: argparse.ArgumentParser) -> None:
    """Options of the chat command beyond the model options that cli.py defines."""
    g = parser.add_argument_group("chat")
    g.add_argument("--system", default=None, help="system prompt")
    g.add_argument(
        "--temperature",
        "--temp",
        type=float,
        default=None,
        dest="temperature",
        help="0 = greedy (default), > 0 = sampling (rule: --accept)",
    )
    g.add_argument("--max-new-tokens", type=int, default=None, help="max new tokens per reply (default 512)")
    g.add_argument(
        "--top-p", type=float, default=None, dest="top_p", help="nucleus sampling (temperature > 0)"
    )
    g.add_argument("--seed", type=int, default=None, help="sampling seed (temperature > 0)")
    g.add_argument(
        "--accept",
        choices=["typical", "exact"],
        default=None,
        help="rule at temperature > 0: typical (default: fast, favours the heads' guesses) or exact (the "
        "model's own sampling distribution)",
    )
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
    from medusa_chat.chat.session import SessionManager

    interactive = sys.stdin.isatty() and sys.stdout.isatty() and not _arg(args, "plain", False)
    console = (
        Console(highlight=False) if interactive else Console(highlight=False, no_color=True, soft_wrap=True)
    )
    # Plain mode keeps stdout for the conversation; loading chatter goes to stderr.
    info_console = (
        console if interactive else Console(stderr=True, highlight=False, no_color=True, soft_wrap=True)
    )
    data_dir = _arg(args, "data_dir", None)
    session = SessionManager(
        model=_arg(args, "model", "smollm2-135m"),
        heads=_arg(args, "heads", None),
        quant=_arg(args, "quant", "auto"),
        dtype=_arg(args, "dtype", "auto"),
        device=_arg(args, "device", "auto"),
        tree=_arg(args, "tree", None),
        tree_size=_arg(args, "tree_size", None),
        data_dir=Path(data_dir) if data_dir else None,
        trust_remote_code=bool(_arg(args, "trust_remote_code", False)),
    )
    # MedusaChatError (unknown model, offline, no GPU, ...) propagates: cli.py prints it as one line.
    _load(session, info_console, interactive)
    settings = {
        name: getattr(args, name)
        for name in ("temperature", "max_new_tokens", "top_p", "seed", "accept")
        if getattr(args, name, None) is not None
    }
    if settings:
        session.update_settings(**settings)
    if _arg(args, "system", None):
        session.conversation.system_prompt = args.system  # saved with the first message
    if _arg(args, "resume", None):
        conv = session.load_conversation(args.resume)
        info_console.print(Text(f"resumed {conv.display_title()!r} ({len(conv.messages)} messages)"))
    if _arg(args, "baseline", False):
        tps = session.measure_baseline()
        info_console.print(Text(f"plain decoding: {tps:.1f} tokens/s (speedups are measured)"))
    info_console.print(info_panel(session.info))
    return TerminalChat(session, console, interactive).run()


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
