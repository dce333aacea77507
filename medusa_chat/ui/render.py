"""Pure rendering for the web UI: chat messages, step events -> HTML / inline SVG strings.

No gradio, no torch: every function takes plain data (the dataclasses in `medusa_chat.events`, dicts,
numbers) and returns a string, so it is cheap to test. Every piece of text that came from the model or from a
file (token texts, reply text, message statistics, model info) goes through `esc` (html.escape) or through
`chat_html`, whose Markdown renderer has raw HTML turned off: a reply that reads `<img src=x onerror=alert(1)>`
is shown as those characters, never parsed as markup, and nothing in a message makes the browser fetch anything.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from markdown_it import MarkdownIt

from medusa_chat.events import ReplySummary, StepEvent
from medusa_chat.settings import DEFAULT_ACCEPT, MODE_TEXT, accept_mode
from medusa_chat.units import human_bytes, human_count

# tokens produced by one step -> background colour of that step's text in the shaded reply
STEP_SHADES = ["#e2e8f0", "#c7d2fe", "#a5b4fc", "#818cf8", "#6366f1", "#4f46e5"]
PREFILL_SHADE = "#fde68a"


def esc(text: object) -> str:
    """Escape anything for use in HTML text or a quoted attribute (also valid in inline SVG)."""
    return html.escape(str(text), quote=True)


def visible_token(text: str, limit: int = 12) -> str:
    """A token's text made visible in one short line: spaces, newlines and tabs get symbols (not escaped)."""
    if text == "":
        return "∅"
    shown = text.replace("\r", "").replace("\n", "↵").replace("\t", "⇥").replace(" ", "␣")
    if len(shown) > limit:
        shown = shown[: limit - 1] + "…"
    return shown


# ---- chat messages ---------------------------------------------------------------------------------------------
def _render_image(renderer: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
    """`![alt](url)` becomes a link, never an <img>: an image in a reply would be fetched the moment it is shown,
    which lets a reply (or a prompt-injected document it quotes) send data to any server ("markdown image
    exfiltration"). A link is fetched only if the person clicks it."""
    token = tokens[idx]
    src = str(token.attrGet("src") or "")
    alt = "".join(child.content for child in token.children or ()) or src
    return (
        f'<a class="mc-image-link" href="{esc(src)}" rel="noopener noreferrer nofollow" target="_blank" '
        f'title="image, not loaded: {esc(src)}">[image: {esc(alt)}]</a>'
    )


def _render_link_open(renderer: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
    # Links open in a new tab without a referrer or a handle back to this page.
    href = str(tokens[idx].attrGet("href") or "")
    return f'<a href="{esc(href)}" rel="noopener noreferrer nofollow" target="_blank">'


def _chat_markdown_parser() -> MarkdownIt:
    # CommonMark with raw HTML off (tags are text), GitHub-style line breaks (a newline in a reply is a line
    # break, as the model meant it), tables and strikethrough; links keep markdown-it's scheme check, which
    # refuses javascript:, vbscript:, file: and non-image data: URLs.
    md = MarkdownIt("commonmark", {"html": False, "breaks": True, "linkify": False, "typographer": False})
    md.enable(["strikethrough", "table"])
    md.add_render_rule("image", _render_image)
    md.add_render_rule("link_open", _render_link_open)
    return md


_CHAT_MD = _chat_markdown_parser()


def chat_html(text: str) -> str:
    """A chat message (user's or model's) as safe HTML for the Chatbot, which shows it as is (the app turns the
    browser-side Markdown off: it would parse raw HTML). Markdown formatting works; markup in the text is shown
    as the characters written; no element that loads anything is produced. The message's own text rides along
    in `data-source` (escaped), which the copy buttons put on the clipboard instead of this HTML (COPY_JS)."""
    return f'<div class="mc-msg" data-source="{esc(text)}">' + _CHAT_MD.render(text) + "</div>"


# ---- the live reply ----------------------------------------------------------------------------------------------
# While a reply streams, its text goes to a light gr.HTML element under the chat (web_layout.py), not to the Chatbot:
# a Chatbot update makes the browser rebuild the message list (sanitising, layout), on the decoder's cores. The
# element's value is the reply so far as escaped plain text: every token becomes characters, never markup, and as a
# reply only grows its escaped text only grows, so Gradio's streaming diff sends just the new text. The finished
# reply is rendered once (Markdown, chat_html) into the Chatbot and the element is emptied (then hidden, web.css).
# (The box lays its children out bottom-up, so that it stays scrolled to the end of the text: the filler first takes
# the free space under a text shorter than the box.)
LIVE_REPLY_TEMPLATE = (
    '<div class="mc-live-reply"><div class="mc-live-fill"></div><div class="mc-live-text">${value}</div></div>'
)


def live_reply_value(text: str) -> str:
    """The live reply element's value for the reply text so far (escaped; "" hides the element)."""
    return esc(text)


# Gradio's copy buttons (one per message, and "copy all") write the message's *content* to the clipboard, and a
# message's content here is the HTML above. On page load this wraps `navigator.clipboard.writeText` once: text
# that holds our messages is parsed (DOMParser: an inert document, nothing loads or runs) and each message is
# replaced by its `data-source`, i.e. the text the user typed or the model wrote (Markdown as written). Any other
# text goes through unchanged.
COPY_JS = """() => {
  const clip = navigator.clipboard;
  if (!clip || clip.mcPlainText) return;
  const write = clip.writeText.bind(clip);
  const plain = (s) => {
    if (typeof s !== "string" || !s.includes('class="mc-msg"')) return s;
    const doc = new DOMParser().parseFromString(s, "text/html");
    doc.querySelectorAll(".mc-msg-stats").forEach((e) => e.remove());
    doc.querySelectorAll(".mc-msg").forEach((e) => e.replaceWith(doc.createTextNode(e.dataset.source ?? e.textContent)));
    return doc.body.textContent;
  };
  clip.writeText = (s) => write(plain(s));
  clip.mcPlainText = true;
}"""


def _stat_number(value: object, digits: int) -> str | None:
    """A statistic from a conversation file, formatted, or None when it is not a finite number (a hand-edited
    file can hold anything there)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return f"{value:.{digits}f}"


def message_stats_html(stats: Mapping[str, object] | None, stopped: bool) -> str:
    """The line under a reply: stopped mark, tokens, tokens/step, tok/s, speedup; every value escaped."""
    bits = []
    if stopped:
        bits.append("■ stopped")
    if isinstance(stats, Mapping):
        for key, fmt in (("new_tokens", "{} tokens"), ("tokens_per_step", "{} tok/step"),
                         ("decode_tokens_per_s", "{} tok/s")):  # fmt: skip
            digits = {"new_tokens": 0, "tokens_per_step": 2, "decode_tokens_per_s": 1}[key]
            shown = _stat_number(stats.get(key), digits)
            if shown is not None and float(shown) != 0:
                bits.append(fmt.format(shown))
        speed = _stat_number(stats.get("speedup"), 2)
        if speed is not None and float(speed) != 0:
            kind = stats.get("speedup_kind")
            bits.append(f"{speed}× {kind if isinstance(kind, str) else ''}".rstrip())
    if not bits:
        return ""
    return f'<div class="mc-msg-stats">{esc(" · ".join(bits))}</div>'


def mode_label(temperature: float | None, accept: str | None = DEFAULT_ACCEPT) -> str:
    """The acceptance mode the temperature (and the rule picked for temperature > 0) selects, as the UI says it."""
    return MODE_TEXT[accept_mode(temperature, accept)].headline


def mode_html(temperature: float | None, accept: str | None = DEFAULT_ACCEPT) -> str:
    mode = accept_mode(temperature, accept)
    return (
        f'<div class="mc-mode mc-mode-{mode}" data-mode="{mode}">Acceptance: <b>{esc(mode_label(temperature, accept))}</b>'
        f'<div class="mc-mode-note">{esc(MODE_TEXT[mode].detail)}</div></div>'
    )


# ---- numbers -------------------------------------------------------------------------------------------------
def _num(value: float | None, digits: int = 1) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:.{digits}f}"


def _stat(key: str, label: str, value: float | None, unit: str, digits: int = 1, note: str = "") -> str:
    shown = _num(value, digits)
    data = "" if value is None or not math.isfinite(value) else f' data-value="{value:.{max(digits, 3)}f}"'
    note_html = f'<span class="mc-note">{esc(note)}</span>' if note else ""
    return (
        f'<div class="mc-stat" data-key="{esc(key)}">'
        f'<div class="mc-label">{esc(label)}</div>'
        f'<div class="mc-value"><span class="mc-num" data-key="{esc(key)}"{data}>{esc(shown)}</span>'
        f'<span class="mc-unit">{esc(unit)}</span></div>{note_html}</div>'
    )


def step_token_counts(events: Sequence[StepEvent]) -> list[int]:
    """Tokens produced by each decode step (the prefill's first token is not a step)."""
    return [len(e.token_ids) for e in events if e.step > 0]


def tokens_chart_svg(counts: Sequence[int], width: int = 300, height: int = 64) -> str:
    """Bar chart of tokens per step over the reply, with the running mean as a dashed line."""
    n = len(counts)
    top = max([*counts, 1])
    top = max(top, 2)
    parts = [
        f'<svg class="mc-chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="100%" height="{height}" preserveAspectRatio="none" role="img" '
        f'aria-label="tokens per step over the reply" data-steps="{n}">'
    ]
    for level in range(1, top + 1):
        y = height - level * (height - 4) / top
        parts.append(
            f'<line x1="0" x2="{width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#94a3b8" stroke-opacity="0.25" '
            f'stroke-width="1" vector-effect="non-scaling-stroke"/>'
        )
    if n:
        bar_w = width / n
        gap = min(bar_w * 0.2, 1.5)
        for i, c in enumerate(counts):
            h = c * (height - 4) / top
            shade = STEP_SHADES[min(max(c, 2), len(STEP_SHADES)) - 1]
            parts.append(
                f'<rect class="mc-bar" x="{i * bar_w:.2f}" y="{height - h:.2f}" width="{max(bar_w - gap, 0.5):.2f}" '
                f'height="{h:.2f}" fill="{shade}" stroke="#4f46e5" stroke-opacity="0.35" stroke-width="0.5" '
                f'vector-effect="non-scaling-stroke"><title>step {i + 1}: {c} tokens</title></rect>'
            )
        mean = sum(counts) / n
        y = height - mean * (height - 4) / top
        parts.append(
            f'<line class="mc-mean" x1="0" x2="{width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#dc2626" '
            f'stroke-width="1.5" stroke-dasharray="4 3" vector-effect="non-scaling-stroke"/>'
        )
    parts.append("</svg>")
    return "".join(parts)


def speedup_note(kind: str | None) -> str:
    return {"measured": "measured", "estimated": "estimated"}.get(kind or "", "")


def meter_html(
    events: Sequence[StepEvent],
    summary: ReplySummary | None = None,
    *,
    speedup: float | None = None,
    speedup_kind: str | None = None,
    status: str = "",
    accept_mode: str | None = None,
) -> str:
    """The live meter: decode tok/s, tokens/step, speedup (measured or estimated), TTFT, new tokens, chart."""
    last = events[-1] if events else None
    if summary is not None:
        tps: float | None = summary.decode_tokens_per_s
        tpstep: float | None = summary.tokens_per_step
        ttft: float | None = summary.time_to_first_token_s
        new: float | None = float(summary.new_tokens)
        steps = summary.steps
        accept_mode = summary.accept_mode
    elif last is not None:
        tps = last.decode_tokens_per_s
        tpstep = last.tokens_per_step
        first = next((e for e in events if e.step == 0), None)
        ttft = first.elapsed_s if first is not None else None
        new = float(last.new_tokens_total)
        steps = max(e.step for e in events)
    else:
        tps = tpstep = ttft = new = None
        steps = 0
    if speedup is None:
        speed_html = _stat("speedup", "Speedup", None, "×", 2, note="needs a reply")
    else:
        speed_html = _stat("speedup", "Speedup", speedup, "×", 2, note=speedup_note(speedup_kind))
    counts = step_token_counts(events)
    if not counts and summary is not None and summary.accepted_lengths:
        counts = [a + 1 for a in summary.accepted_lengths]
    badges = []
    if accept_mode:
        badges.append(f'<span class="mc-badge" data-key="mode">{esc(accept_mode)}</span>')
    badges.append(f'<span class="mc-badge" data-key="steps">{steps} steps</span>')
    if summary is not None and len(summary.sized_steps) > 1:  # the tree sizes chosen as the reply ran
        sizes = summary.sized_steps
        most = max(sizes, key=sizes.__getitem__)
        badges.append(
            f'<span class="mc-badge" data-key="sizes">{min(sizes)}-{max(sizes)} nodes, mostly {most}</span>'
        )
    if status:
        badges.append(f'<span class="mc-badge mc-status" data-key="status">{esc(status)}</span>')
    return (
        '<div class="mc-meter">'
        '<div class="mc-stats">'
        + _stat("decode_tps", "Decode", tps, "tok/s", 1)
        + _stat("tokens_per_step", "Tokens/step", tpstep, "", 2)
        + speed_html
        + _stat("ttft", "First token", ttft, "s", 2)
        + _stat("new_tokens", "New tokens", new, "", 0)
        + "</div>"
        f'<div class="mc-chart-box"><div class="mc-label">Tokens per step over the reply '
        f'<span class="mc-legend-mean">— mean</span></div>{tokens_chart_svg(counts)}</div>'
        f'<div class="mc-badges">{"".join(badges)}</div>'
        "</div>"
    )


# ---- model panel ---------------------------------------------------------------------------------------------
def format_info_value(key: str, value: object) -> str:
    """One model-info value as short plain text (not escaped)."""
    k = key.lower()
    if isinstance(value, Mapping):
        return ", ".join(f"{sub}: {format_info_value(str(sub), v)}" for sub, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(format_info_value(k, v) for v in value)
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, (int, float)):
        if any(w in k for w in ("memory", "bytes", "size_b")):
            return human_bytes(float(value), binary=True)
        if "param" in k:
            return human_count(float(value))
        return f"{value:g}" if isinstance(value, float) else str(value)
    return str(value)


def _heads_summary(heads: object) -> str:
    if not isinstance(heads, Mapping):
        return format_info_value("heads", heads)
    if heads.get("count") == 0 and heads.get("note"):  # no heads: context lookup only, and how to train heads
        return str(heads["note"])
    bits = []
    if heads.get("count") is not None:
        layers = heads.get("layers")
        kind = f"{layers}-layer " if layers else ""
        bits.append(f"{heads['count']} × {kind}{heads.get('format') or ''}".strip())
    if heads.get("dtype"):
        bits.append(str(heads["dtype"]))
    if heads.get("params"):
        bits.append(f"{human_count(float(heads['params']))} params")  # type: ignore[arg-type]
    return ", ".join(bits) or format_info_value("heads", heads)


def _memory_summary(memory: object) -> str:
    if not isinstance(memory, Mapping):
        return format_info_value("memory", memory)
    total = memory.get("total_bytes")
    out = human_bytes(float(total), binary=True) if isinstance(total, (int, float)) else ""  # type: ignore[arg-type]
    cuda = memory.get("cuda_allocated_bytes")
    if isinstance(cuda, (int, float)) and cuda:
        out += f" (GPU allocated {human_bytes(float(cuda), binary=True)})"
    return out or format_info_value("memory", memory)


def model_panel_html(info: Mapping[str, object] | None, status: str, progress: Sequence[str] = ()) -> str:
    """Model, heads, quantization, device, memory, tree, plain-decoding baseline; the load / download
    progress while loading; everything else the loader reports under "details"."""
    state = {"ready": "ready", "loading": "loading", "error": "error"}.get(status, "idle")
    head = {
        "ready": "Model ready",
        "loading": "Loading model…",
        "error": "Model failed to load",
        "idle": "Model not loaded yet",
    }[state]
    rest = dict(info or {})
    rest.pop("accept_mode", None)  # the meter and the temperature label say it
    main: dict[str, str] = {}
    if rest.get("model") is not None:
        main["model"] = format_info_value("model", rest.pop("model"))
    if rest.get("heads") is not None:
        main["heads"] = _heads_summary(rest.pop("heads"))
    for key in ("quant", "device", "dtype"):
        if rest.get(key) is not None:
            main[key] = format_info_value(key, rest.pop(key))
    if rest.get("params") is not None:
        main["params"] = format_info_value("params", rest.pop("params"))
    if rest.get("memory") is not None:
        main["memory"] = _memory_summary(rest.pop("memory"))
    tree, size = rest.pop("tree", None), rest.pop("tree_size", None)
    source = rest.pop("tree_source", None)
    if tree is not None:
        main["tree"] = (f"{tree} ({size} node{'s' if size != 1 else ''})" if size else str(tree)) + (
            f", {source}" if source else ""
        )
    if "baseline_tokens_per_s" in rest:
        base = rest.pop("baseline_tokens_per_s")
        main["plain decoding"] = (
            f"{base:.1f} tok/s (measured)" if isinstance(base, (int, float)) and base else "not measured yet"
        )
    if rest.get("context_limit") is not None:
        main["context"] = f"{rest.pop('context_limit')} tokens"
    notes = rest.pop("notes", None) or []

    def rows(items: Mapping[str, object]) -> str:
        return "".join(
            f'<tr><th>{esc(k)}</th><td data-key="{esc(k)}">{esc(v if isinstance(v, str) else format_info_value(k, v))}'
            "</td></tr>"
            for k, v in items.items()
            if v not in (None, "", [], {})
        )

    table = f'<table class="mc-info">{rows(main)}</table>' if main else ""
    details = rows(rest)
    if details:
        table += f'<details class="mc-details"><summary>details</summary><table class="mc-info">{details}</table></details>'
    note_html = "".join(f'<div class="mc-note-line">{esc(n)}</div>' for n in notes if isinstance(n, str))
    prog = ""
    if progress and state != "ready":
        prog = '<div class="mc-progress">' + "<br>".join(esc(p) for p in progress[-6:]) + "</div>"
    spinner = '<span class="mc-spinner"></span>' if state == "loading" else ""
    return (
        f'<div class="mc-model mc-{state}" data-status="{state}">'
        f'<div class="mc-model-head">{spinner}{esc(head)}</div>{table}{note_html}{prog}</div>'
    )


def load_failed_html(message: str | None) -> str:
    """The chat area's message when the model did not load: why (the error says what fixes it) and how to go on."""
    return chat_html(
        f"**The model did not load.** {message or 'unknown error'}\n\n"
        "When that is fixed, press **Load / retry** in the model panel."
    )


def error_html(message: str | None) -> str:
    if not message:
        return ""
    return f'<div class="mc-error" role="alert"><b>Error:</b> {esc(message)}</div>'


# The web UI's stylesheet (web.css, package data next to this module)
CSS = "\n" + resources.files("medusa_chat.ui").joinpath("web.css").read_text()
