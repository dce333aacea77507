"""Rich renderables for the terminal UI: pure functions of session events and info (no input, no session).

The REPL (terminal.py) decides what to show when; this module decides how it looks. Every text that came from
the model or from a file goes through `strip_controls` before it reaches the terminal. Tested with
Console(record=True).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from markdown_it import MarkdownIt
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.markdown import Markdown
from rich.panel import Panel
from rich.segment import Segment
from rich.style import Style
from rich.table import Table
from rich.text import Text
from rich.tree import Tree as RichTree

from medusa_chat.events import ReplySummary, StepEvent

INFO_ORDER = (
    "model",
    "heads",
    "quant",
    "device",
    "dtype",
    "params",
    "memory",
    "tree",
    "tree_size",
    "context_limit",
    "accept_mode",
)


# ------------------------------------------------------------------------------------------------------------
# Pure rendering: events -> Rich renderables (tested with Console(record=True))
# ------------------------------------------------------------------------------------------------------------
# Terminal control sequences in text that came from the model or from a file: a reply containing "\x1b]0;..." or
# "\x1b[2J" would retitle or clear the user's terminal (or worse: some terminals answer queries into the input).
# Whole sequences go first, so no half of one is left printed; then every other C0/C1 control except newline and
# tab. An unterminated string sequence (OSC, DCS, ...) is cut to the end of the text: a reply streams in pieces,
# and the part of a sequence in the next piece no longer has its ESC, so it prints as harmless characters.
_CONTROLS = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"  # CSI ... final byte (colours, cursor moves, clears, queries)
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"  # OSC/DCS/SOS/PM/APC
    r"|\x1b[ -/]*[0-~]"  # other escape sequences (charset switches, RIS "ESC c", save/restore cursor)
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]"  # any remaining C0 control but \t and \n, DEL, any C1 control
)


def strip_controls(text: str) -> str:
    """`text` without terminal control sequences or control characters (newline and tab are kept)."""
    return _CONTROLS.sub("", text)


class ReplyMarkdown(Markdown):
    """Rich Markdown for chat text: the model's line breaks are kept (a single newline is a hard break, as in
    GitHub comments, so a haiku or a list without blank lines keeps its lines), raw HTML is shown as the
    characters written instead of being dropped, and control sequences are stripped."""

    def __init__(self, markup: str, **kwargs: Any) -> None:
        markup = strip_controls(markup)
        super().__init__(markup, **kwargs)
        # Rich's parser renders inline HTML as nothing at all; with html off it is plain text, as typed.
        parser = MarkdownIt("commonmark", {"html": False}).enable("strikethrough").enable("table")
        self.parsed = parser.parse(markup)
        for token in self.parsed:
            for child in token.children or ():
                if child.type == "softbreak":
                    child.type = "hardbreak"


def visible(token_text: str) -> str:
    """A token's text with whitespace made visible (and controls stripped), for trees and token views."""
    return strip_controls(token_text.replace("\n", "⏎").replace("\t", "⇥").replace(" ", "·")) or "∅"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value)
    return str(value)


def info_panel(info: dict[str, Any]) -> Panel:
    """The startup panel: loading's own summary lines when `info` is a full LoadedModel.info(), with the
    tree actually in use and the acceptance mode; otherwise (tests, partial info) a generic key/value grid."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    try:
        from medusa_chat.model.sources.loaded import summary_lines

        lines = summary_lines(info)
    except (KeyError, TypeError, ImportError):
        lines = None
    if lines is not None:
        for line in lines:
            key, _, value = line.partition(" ")
            if key == "tree":
                continue  # the model's default tree; the one in use is below
            grid.add_row(key, Text(strip_controls(value.strip())))
        source = f", {info['tree_source']}" if info.get("tree_source") else ""
        grid.add_row(
            "tree",
            Text(
                f"{info.get('tree')} ({info.get('tree_size')} node{'s' if info.get('tree_size') != 1 else ''}){source}"
            ),
        )
        grid.add_row("acceptance", Text(str(info.get("accept_mode"))))
        if "context_lookup" in info:
            grid.add_row("context lookup", Text("on" if info["context_lookup"] else "off"))
    else:
        keys = [k for k in INFO_ORDER if k in info] + [k for k in info if k not in INFO_ORDER]
        for key in keys:
            if info[key] is None or key == "baseline_tokens_per_s":
                continue
            grid.add_row(key.replace("_", " "), Text(strip_controls(_fmt(info[key]))))
    return Panel(grid, title="medusa-chat", subtitle="/help for commands", expand=False, border_style="cyan")


def status_text(
    tokens_per_s: float,
    tokens_per_step: float,
    speedup: tuple[float, str],
    mode: str,
    new_tokens: int,
    stop_reason: str = "",
    stopping: bool = False,
) -> Text:
    """The one-line meter under a reply."""
    value, kind = speedup
    parts = [
        f"{tokens_per_s:.1f} tok/s" if tokens_per_s > 0 else "- tok/s",
        f"{tokens_per_step:.2f} tokens/step",
        f"{value:.2f}x speedup ({kind})",
        mode,
        f"{new_tokens} tokens",
    ]
    text = Text(" · ".join(parts), style="dim")
    if stopping and not stop_reason:
        text.append("  stopping...", style="yellow")
    if stop_reason == "stopped":
        text.append("  [stopped]", style="bold yellow")
    elif stop_reason in ("max_new_tokens", "context_limit"):
        text.append(f"  [{stop_reason.replace('_', ' ')}]", style="yellow")
    return text


STEP_STYLES = ("on grey23", "on grey35")


def accepted_tokens_text(events: Iterable[StepEvent]) -> Text:
    """The reply's text shaded by the step that produced it (alternating shades); steps that produced more
    than one token (heads' guesses accepted) are bold, so multi-token jumps stand out."""
    out = Text()
    for i, ev in enumerate(events):
        style = STEP_STYLES[i % 2] + (" bold bright_white" if len(ev.token_ids) > 1 else "")
        if ev.step == 0:
            style += " italic"
        out.append(strip_controls(ev.text).replace("\n", "⏎ ") if ev.text else "∅", style=style)
    return out


def tree_renderable(event: StepEvent) -> RenderableType:
    """The tree verified in one step, accepted path highlighted; each node: token text and rank."""
    tv = event.tree
    if tv is None:
        return Text(f"step {event.step} is the prefill: it has no tree (its token: {visible(event.text)})")
    accepted = set(event.accepted_nodes)
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tv.parents):
        if parent >= 0:
            children.setdefault(parent, []).append(node)

    def label(node: int) -> Text:
        ok = node in accepted
        t = Text(visible(tv.texts[node]), style="bold green" if ok else "dim")
        if node == 0:
            t.append("  root", style="cyan")
        else:
            source = "lookup" if node in tv.lookup_nodes else f"head {tv.depths[node]} r{tv.ranks[node]}"
            t.append(f"  {source}", style="green" if ok else "dim")
        if ok:
            t.append(" ✓", style="bold green")
        return t

    title = Text(
        f"step {event.step}: {len(tv.tokens)} nodes verified, {event.accepted_length} accepted + 1 bonus -> ",
        style="bold",
    )
    title.append(visible(event.text), style="bold green")
    root = RichTree(label(0), guide_style="dim")
    stack: list[tuple[int, RichTree]] = [(0, root)]
    while stack:  # iterative, so deep chains cannot hit the recursion limit
        node, branch = stack.pop()
        for child in children.get(node, []):
            stack.append(
                (child, branch.add(label(child), guide_style="green" if child in accepted else "dim"))
            )
    return Group(title, root)


def stats_table(summary: ReplySummary, speedup: tuple[float, str], notices: list[str] | None = None) -> Table:
    table = Table(title="last reply", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("new tokens", summary.new_tokens),
        ("decode steps", summary.steps),
        ("tokens/step", f"{summary.tokens_per_step:.2f}"),
        ("decode speed", f"{summary.decode_tokens_per_s:.1f} tokens/s"),
        ("speedup", f"{speedup[0]:.2f}x ({speedup[1]})"),
        ("time to first token", f"{summary.time_to_first_token_s * 1000:.0f} ms"),
        ("decode time", f"{summary.decode_s:.2f} s"),
        ("prompt tokens", f"{summary.prompt_tokens} ({summary.reused_prefix_tokens} reused from cache)"),
        ("acceptance", summary.accept_mode),
        ("tree size", summary.tree_size),
        (
            "ended by",
            summary.stop_reason + (f" ({strip_controls(summary.message)})" if summary.message else ""),
        ),
    ]
    if summary.threads:
        rows.append(("threads", summary.threads))
    if summary.sized_steps:  # the sizes the steps chose as the reply ran (engine/tree_sizer.py)
        rows.append(("steps by tree size", ", ".join(f"{n}: {k}" for n, k in summary.sized_steps.items())))
    if summary.accepted_lengths:
        counts: dict[int, int] = {}
        for n in summary.accepted_lengths:
            counts[n] = counts.get(n, 0) + 1
        hist = ", ".join(f"{n}: {counts[n]}" for n in sorted(counts))
        rows.append(("accepted per step", hist))
    for name, value in rows:
        table.add_row(name, Text(str(value)))
    for note in notices or []:
        table.add_row("note", Text(strip_controls(note), style="yellow"))
    return table


class TailView:
    """Draws only the last lines of a renderable that fit the screen (with a marker when cut)."""

    def __init__(self, renderable: RenderableType) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = console.render_lines(self.renderable, options, pad=False)
        room = max(options.size.height - 2, 3)
        if len(lines) > room:
            lines = [[Segment("↑ (the start of the reply is above)", Style(dim=True))], *lines[-(room - 1) :]]
        for i, line in enumerate(lines):
            yield from line
            if i < len(lines) - 1:
                yield Segment.line()


# ------------------------------------------------------------------------------------------------------------
# The REPL
# ------------------------------------------------------------------------------------------------------------
