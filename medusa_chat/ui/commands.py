"""The terminal chat's slash commands: the table `/help` shows, and one method per command (TerminalChat's base
class), each a call into the session."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from medusa_chat.errors import MedusaChatError
from medusa_chat.settings import ACCEPT_CHOICES, EXACT, GREEDY, MODE_TEXT, TYPICAL
from medusa_chat.ui.rich_render import (  # how things look; this module decides when
    info_panel,
    stats_table,
    strip_controls,
    tree_renderable,
)

if TYPE_CHECKING:  # the session (and torch) are imported only when main() runs
    from medusa_chat.chat.session import SessionManager


COMMANDS: dict[str, str] = {
    "/help": "this list",
    "/exit": "quit (also /quit, Ctrl-D, Ctrl-C at the prompt)",
    "/clear": "start a new conversation (keeps the system prompt; the old one stays saved)",
    "/undo": "remove the last exchange",
    "/regen": "answer the last message again",
    "/edit TEXT": "replace the last message and answer it",
    "/system [TEXT]": "show or set the system prompt (`/system -` clears it)",
    "/temp X": "temperature: 0 = greedy (identical to plain decoding), > 0 = sampling (see /accept)",
    f"/accept {ACCEPT_CHOICES}": f"rule at temperature > 0: {TYPICAL} (fast, favours the heads' guesses) or "
    f"{EXACT} (the model's own sampling distribution)",
    "/lookup on|off": "context lookup: guess repeated text from the conversation on the tree's main chain "
    "(greedy and exact sampling: same output, fewer steps; on by default)",
    "/max N": "max new tokens per reply",
    "/topp X": "nucleus sampling top_p (temperature > 0)",
    "/topk N": "sample among the N most likely tokens (temperature > 0; 0 = off)",
    "/minp X": "drop tokens below X times the top token's probability (temperature > 0; 0 = off)",
    "/repeat X [N]": "repeat penalty X over the last N tokens (1 = off; N = -1: all)",
    "/presence X": "presence penalty: subtract X from every token the reply has used",
    "/frequency X": "frequency penalty: subtract X times the token's count in the reply",
    "/dry X [BASE [LEN]]": "DRY: penalise repeating runs longer than LEN tokens (0 = off)",
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
    "/top_k": "/topk",
    "/min_p": "/minp",
    "/repeat_penalty": "/repeat",
    "/presence_penalty": "/presence",
    "/frequency_penalty": "/frequency",
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


COMMANDS_NAMES = {c.split()[0] for c in COMMANDS} | {"/exit"}


class SlashCommands:
    """The slash commands of TerminalChat (its base class)."""

    console: Console
    session: SessionManager

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
        text = MODE_TEXT[self.session.settings.accept_mode]
        return f"{text.label}: {text.guarantee}"

    def cmd_temp(self, arg: str) -> None:
        self._set("/temp X", temperature=arg)
        st = self.session.settings
        self.note(f"temperature {st.temperature:g} ({MODE_TEXT[st.accept_mode].headline})")

    def cmd_accept(self, arg: str) -> None:
        usage = f"/accept {ACCEPT_CHOICES}"
        if not arg:
            self.note(f"acceptance {self._mode_note()}; {usage} picks the rule for temperature > 0")
            return
        self._set(usage, accept=arg)
        st = self.session.settings
        later = "" if st.accept_mode != GREEDY else f" (applies at temperature > 0; now {st.temperature:g}: greedy)"
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

    def cmd_topk(self, arg: str) -> None:
        self._set("/topk N", top_k=arg)
        self.note(f"top_k {self.session.settings.top_k}")

    def cmd_minp(self, arg: str) -> None:
        self._set("/minp X", min_p=arg)
        self.note(f"min_p {self.session.settings.min_p:g}")

    def cmd_repeat(self, arg: str) -> None:
        usage = "/repeat X [N]"
        words = arg.split()
        if len(words) > 2:
            raise MedusaChatError(f"usage: {usage}")
        self._set(usage, **dict(zip(("repeat_penalty", "repeat_last_n"), words or [""], strict=False)))
        st = self.session.settings
        self.note(f"repeat penalty {st.repeat_penalty:g} over the last {st.repeat_last_n} tokens")

    def cmd_presence(self, arg: str) -> None:
        self._set("/presence X", presence_penalty=arg)
        self.note(f"presence penalty {self.session.settings.presence_penalty:g}")

    def cmd_frequency(self, arg: str) -> None:
        self._set("/frequency X", frequency_penalty=arg)
        self.note(f"frequency penalty {self.session.settings.frequency_penalty:g}")

    def cmd_dry(self, arg: str) -> None:
        usage = "/dry X [BASE [LEN]]"
        words = arg.split()
        if len(words) > 3:
            raise MedusaChatError(f"usage: {usage}")
        names = ("dry_multiplier", "dry_base", "dry_allowed_length")
        self._set(usage, **dict(zip(names, words or [""], strict=False)))
        st = self.session.settings
        self.note(f"DRY multiplier {st.dry_multiplier:g}, base {st.dry_base:g}, allowed length {st.dry_allowed_length}")

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
