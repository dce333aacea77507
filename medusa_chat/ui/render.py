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
from typing import Any

from markdown_it import MarkdownIt

from medusa_chat.events import ReplySummary, StepEvent

GREEDY_LABEL = "greedy: identical to plain decoding"
TYPICAL_LABEL = "typical acceptance"
EXACT_LABEL = "exact sampling"
# what each mode guarantees, shown under the label (kept in step with acceptance.ACCEPT_GUARANTEES)
MODE_GUARANTEES = {
    "greedy": "the reply is plain greedy decoding, token for token",
    "typical": "fast, but favours the heads' guesses: not the model's exact sampling distribution",
    "exact": "the reply follows the model's own sampling distribution (up to float rounding)",
}

# tokens produced by one step -> background colour of that step's text in the shaded reply
STEP_SHADES = ["#e2e8f0", "#c7d2fe", "#a5b4fc", "#818cf8", "#6366f1", "#4f46e5"]
PREFILL_SHADE = "#fde68a"

_NODE_W = 112
_NODE_H = 20
_COL_GAP = 34
_ROW_GAP = 4
_PAD = 10
_HEADER_H = 22


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


def mode_key(temperature: float | None, accept: str | None = "typical") -> str:
    """The mode key: "greedy" at temperature 0, else the chosen rule ("typical" or "exact")."""
    return "greedy" if not temperature or temperature <= 0 else ("exact" if accept == "exact" else "typical")


def mode_label(temperature: float | None, accept: str | None = "typical") -> str:
    """The acceptance mode the temperature (and the rule picked for temperature > 0) selects, as the UI says it."""
    return {"greedy": GREEDY_LABEL, "typical": TYPICAL_LABEL, "exact": EXACT_LABEL}[
        mode_key(temperature, accept)
    ]


def mode_html(temperature: float | None, accept: str | None = "typical") -> str:
    cls = mode_key(temperature, accept)
    return (
        f'<div class="mc-mode mc-mode-{cls}" data-mode="{cls}">Acceptance: <b>{esc(mode_label(temperature, accept))}</b>'
        f'<div class="mc-mode-note">{esc(MODE_GUARANTEES[cls])}</div></div>'
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


# ---- the accepted tree ---------------------------------------------------------------------------------------
def _layout(parents: Sequence[int], depths: Sequence[int], ranks: Sequence[int]) -> list[int]:
    """Row of every node: columns by depth, nodes in depth-first order (children by rank), each node no
    higher than its parent, packed downwards, so branches stay next to where they came from."""
    n = len(parents)
    children: dict[int, list[int]] = {i: [] for i in range(n)}
    for i in range(1, n):
        if 0 <= parents[i] < n:
            children[parents[i]].append(i)
    order: list[int] = []
    stack = [0] if n else []
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(sorted(children[node], key=lambda c: (ranks[c], c), reverse=True))
    order += [i for i in range(n) if i not in seen]  # orphans (malformed input): still drawn
    rows = [0] * n
    next_free: dict[int, int] = {}
    for node in order:
        d = depths[node]
        parent_row = rows[parents[node]] if 0 <= parents[node] < n and parents[node] in seen else 0
        row = max(next_free.get(d, 0), parent_row)
        rows[node] = row
        next_free[d] = row + 1
    return rows


def tree_svg(event: StepEvent) -> str:
    """The verified tree of one step: a column per depth (root, head 1, head 2, ...), one box per node with its
    token text and rank, the accepted path highlighted and every rejected branch dimmed."""
    tree = event.tree
    if tree is None or not tree.tokens:
        return ""
    n = len(tree.tokens)
    rows = _layout(tree.parents, tree.depths, tree.ranks)
    accepted = set(event.accepted_nodes)
    lookup = set(tree.lookup_nodes)
    max_depth = max(tree.depths)
    max_row = max(rows)
    width = _PAD * 2 + (max_depth + 1) * _NODE_W + max_depth * _COL_GAP
    height = _PAD * 2 + _HEADER_H + (max_row + 1) * (_NODE_H + _ROW_GAP)

    def x_of(node: int) -> float:
        return _PAD + tree.depths[node] * (_NODE_W + _COL_GAP)

    def y_of(node: int) -> float:
        return _PAD + _HEADER_H + rows[node] * (_NODE_H + _ROW_GAP)

    out = [
        f'<svg class="mc-tree" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" data-nodes="{n}" data-accepted="{len(accepted)}" '
        f'aria-label="verified tree of step {event.step}">'
    ]
    for d in range(max_depth + 1):
        label = "root" if d == 0 else f"head {d}"
        out.append(
            f'<text class="mc-col" x="{_PAD + d * (_NODE_W + _COL_GAP) + _NODE_W / 2:.1f}" y="{_PAD + 12}" '
            f'text-anchor="middle">{label}</text>'
        )
    # edges first (under the boxes); the accepted ones last so they sit on top
    edges_dim, edges_hot = [], []
    for i in range(1, n):
        p = tree.parents[i]
        if not 0 <= p < n:
            continue
        x1, y1 = x_of(p) + _NODE_W, y_of(p) + _NODE_H / 2
        x2, y2 = x_of(i), y_of(i) + _NODE_H / 2
        mid = (x1 + x2) / 2
        hot = i in accepted and p in accepted
        path = (
            f'<path class="mc-edge{" accepted" if hot else ""}" '
            f'd="M{x1:.1f},{y1:.1f} C{mid:.1f},{y1:.1f} {mid:.1f},{y2:.1f} {x2:.1f},{y2:.1f}"/>'
        )
        (edges_hot if hot else edges_dim).append(path)
    out += edges_dim + edges_hot
    for i in range(n):
        is_acc = i in accepted
        text = tree.texts[i] if i < len(tree.texts) else ""
        rank = tree.ranks[i] if i < len(tree.ranks) else 0
        x, y = x_of(i), y_of(i)
        cls = "node accepted" if is_acc else ("node root" if i == 0 else "node rejected")
        rank_label = "" if i == 0 else ("ctx" if i in lookup else f"#{rank}")
        where = "root (the backbone's token)" if i == 0 else f"head {tree.depths[i]} guess, rank {rank}"
        if i in lookup:  # the main chain took the context lookup's guess instead of the head's (lookup.py)
            cls += " lookup"
            where = "context lookup guess: what followed the same tokens earlier in the conversation"
        title = f"{text!r} · token {tree.tokens[i]} · {where}" + (" · accepted" if is_acc else "")
        out.append(
            f'<g class="{cls}" data-node="{i}" data-depth="{tree.depths[i]}" data-rank="{rank}">'
            f"<title>{esc(title)}</title>"
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{_NODE_W}" height="{_NODE_H}" rx="5"/>'
            f'<text class="mc-tok" x="{x + 7:.1f}" y="{y + 14:.1f}">{esc(visible_token(text))}</text>'
            f'<text class="mc-rank" x="{x + _NODE_W - 6:.1f}" y="{y + 14:.1f}" text-anchor="end">'
            f"{esc(rank_label)}</text></g>"
        )
    out.append("</svg>")
    return "".join(out)


def _chip(text: str, cls: str, title: str = "") -> str:
    t = f' title="{esc(title)}"' if title else ""
    return f'<span class="mc-chip {cls}"{t}>{esc(visible_token(text, 24))}</span>'


def _after_tokens(text: str, pieces: Sequence[str]) -> str:
    """What is left of `text` after the token texts `pieces` (in order; the tokenizer may put spaces between
    them when it decodes them together). "" when they cannot be found."""
    pos = 0
    for piece in pieces:
        piece = piece.strip()
        if not piece:
            continue
        found = text.find(piece, pos)
        if found < 0:
            return ""
        pos = found + len(piece)
    return text[pos:]


def accepted_chain_html(event: StepEvent) -> str:
    """The step's outcome as a line: root -> accepted guesses -> bonus token."""
    tree = event.tree
    if tree is None:
        return ""
    chips = []
    for pos, node in enumerate(event.accepted_nodes):
        text = tree.texts[node] if node < len(tree.texts) else ""
        if pos == 0:
            chips.append(_chip(text, "root", "root: the token chosen by the previous step"))
        else:
            source = (
                "context lookup guess"
                if node in tree.lookup_nodes
                else f"head {tree.depths[node]} guess, rank {tree.ranks[node]}"
            )
            chips.append(_chip(text, "acc", f"{source}: accepted"))
    # the step's last token is the bonus one, sampled from the backbone at the last accepted node
    if len(event.token_ids) == len(event.accepted_nodes):
        bonus_text = _after_tokens(
            event.text, [tree.texts[n] for n in event.accepted_nodes[1:] if n < len(tree.texts)]
        )
        title = "bonus token: the backbone's own next token after the last accepted node"
        if bonus_text:
            chips.append(_chip(bonus_text, "bonus", title))
        else:
            chips.append(f'<span class="mc-chip bonus" title="{esc(title)}">+ bonus</span>')
    return '<div class="mc-chain">' + '<span class="mc-arrow">→</span>'.join(chips) + "</div>"


def step_header_html(event: StepEvent, total_steps: int | None = None) -> str:
    of = f" of {total_steps}" if total_steps is not None else ""
    if event.tree is None:
        return (
            f'<div class="mc-step-head"><b>Step {event.step}{of}</b> · prefill: the first token comes from the '
            "backbone alone, no tree is verified.</div>"
        )
    n = len(event.tree.tokens)
    return (
        f'<div class="mc-step-head"><b>Step {event.step}{of}</b> · verified {n} tree nodes in '
        f"{event.step_time_s * 1000:.0f} ms · accepted {event.accepted_length} guess"
        f"{'es' if event.accepted_length != 1 else ''} → "
        f"<b>{len(event.token_ids)} new token{'s' if len(event.token_ids) != 1 else ''}</b></div>"
    )


def shaded_reply_html(events: Sequence[StepEvent], selected_step: int | None = None) -> str:
    """The reply with its text shaded by the step that produced it (darker = more tokens in one step)."""
    if not events:
        return '<div class="mc-reply mc-empty">The reply, shaded by decoding step, appears here.</div>'
    spans = []
    for e in events:
        count = len(e.token_ids)
        shade = PREFILL_SHADE if e.step == 0 else STEP_SHADES[min(max(count, 1), len(STEP_SHADES)) - 1]
        fg = "#ffffff" if e.step > 0 and count >= 5 else "#0f172a"
        sel = " selected" if selected_step is not None and e.step == selected_step else ""
        what = "prefill (first token)" if e.step == 0 else f"{count} token{'s' if count != 1 else ''}"
        spans.append(
            f'<span class="mc-seg{sel}" data-step="{e.step}" data-tokens="{count}" '
            f'style="background:{shade};color:{fg}" title="step {e.step}: {what}">{esc(e.text)}</span>'
        )
    legend = (
        "".join(
            f'<span class="mc-sw" style="background:{c};color:{"#fff" if i >= 4 else "#0f172a"}">'
            f"{i + 1}{'+' if i == len(STEP_SHADES) - 1 else ''}</span>"
            for i, c in enumerate(STEP_SHADES)
        )
        + "</div>"
    )
    return (
        '<div class="mc-reply-box"><div class="mc-label">The reply, shaded by the step that produced it</div>'
        f'<div class="mc-reply">{"".join(spans)}</div>'
        f'<div class="mc-legend">tokens per step: <span class="mc-sw" style="background:{PREFILL_SHADE}">'
        f"prefill</span>{legend}</div>"
    )


def tree_panel_html(
    events: Sequence[StepEvent], step: int | None = None, *, live: bool = False, note: str = ""
) -> str:
    """The whole visualiser: header, accepted chain, tree SVG for the chosen (or latest) step, shaded reply."""
    if not events:
        msg = note or "Send a message: each decoding step's verified tree is drawn here."
        return f'<div class="mc-tree-panel mc-empty">{esc(msg)}</div>'
    by_step = {e.step: e for e in events}
    chosen = by_step.get(step) if step is not None else None
    if chosen is None:
        chosen = events[-1]
    total = max(by_step)
    live_badge = '<span class="mc-live">live</span>' if live else ""
    body = tree_svg(chosen)
    return (
        f'<div class="mc-tree-panel" data-step="{chosen.step}">'
        f"{live_badge}{step_header_html(chosen, total)}{accepted_chain_html(chosen)}"
        f'<div class="mc-tree-body"><div class="mc-tree-scroll">{body}</div>'
        f"{shaded_reply_html(events, chosen.step)}</div></div>"
    )


# ---- model panel ---------------------------------------------------------------------------------------------
def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _human_count(n: float) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.1f}{suffix}"
    return f"{n:.0f}"


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
            return _human_bytes(float(value))
        if "param" in k:
            return _human_count(float(value))
        return f"{value:g}" if isinstance(value, float) else str(value)
    return str(value)


def _heads_summary(heads: object) -> str:
    if not isinstance(heads, Mapping):
        return format_info_value("heads", heads)
    bits = []
    if heads.get("count") is not None:
        layers = heads.get("layers")
        kind = f"{layers}-layer " if layers else ""
        bits.append(f"{heads['count']} × {kind}{heads.get('format') or ''}".strip())
    if heads.get("dtype"):
        bits.append(str(heads["dtype"]))
    if heads.get("params"):
        bits.append(f"{_human_count(float(heads['params']))} params")  # type: ignore[arg-type]
    return ", ".join(bits) or format_info_value("heads", heads)


def _memory_summary(memory: object) -> str:
    if not isinstance(memory, Mapping):
        return format_info_value("memory", memory)
    total = memory.get("total_bytes")
    out = _human_bytes(float(total)) if isinstance(total, (int, float)) else ""  # type: ignore[arg-type]
    cuda = memory.get("cuda_allocated_bytes")
    if isinstance(cuda, (int, float)) and cuda:
        out += f" (GPU allocated {_human_bytes(float(cuda))})"
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


def error_html(message: str | None) -> str:
    if not message:
        return ""
    return f'<div class="mc-error" role="alert"><b>Error:</b> {esc(message)}</div>'


CSS = """
#meter, #accepted-tree, #model-panel { min-height: 0; }
.mc-meter { display: flex; flex-direction: column; gap: 8px; }
.mc-stats { display: grid; grid-template-columns: repeat(3, minmax(0, 1fr)); gap: 6px; }
.mc-stat { background: var(--block-background-fill); border: 1px solid var(--border-color-primary);
  border-radius: 8px; padding: 6px 8px; }
.mc-label { font-size: 11px; color: var(--body-text-color-subdued); text-transform: uppercase;
  letter-spacing: .03em; }
.mc-value { font-size: 19px; white-space: nowrap; font-weight: 650; font-variant-numeric: tabular-nums; line-height: 1.25; }
.mc-unit { font-size: 12px; font-weight: 400; margin-left: 3px; color: var(--body-text-color-subdued); }
.mc-note { display: inline-block; font-size: 10px; padding: 0 5px; border-radius: 6px; background: #eef2ff;
  color: #3730a3; }
.mc-chart-box { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 6px 8px; }
.mc-chart { display: block; background: transparent; }
.mc-legend-mean { color: #dc2626; text-transform: none; }
.mc-badges { display: flex; gap: 6px; flex-wrap: wrap; }
.mc-badge { font-size: 12px; padding: 1px 8px; border-radius: 10px; background: var(--background-fill-secondary);
  border: 1px solid var(--border-color-primary); }
.mc-mode { font-size: 13px; padding: 4px 8px; border-radius: 6px; }
.mc-mode-greedy { background: #ecfdf5; color: #065f46; }
.mc-mode-typical { background: #fff7ed; color: #9a3412; }
.mc-mode-exact { background: #eff6ff; color: #1e40af; }
.mc-mode-note { font-size: 12px; opacity: 0.85; }
.mc-tree-panel { display: flex; flex-direction: column; gap: 8px; position: relative; }
.mc-empty { color: var(--body-text-color-subdued); font-style: italic; padding: 8px 0; }
.mc-live { position: absolute; right: 0; top: 0; font-size: 11px; background: #dc2626; color: #fff;
  border-radius: 8px; padding: 0 7px; }
.mc-step-head { font-size: 14px; }
.mc-chain { display: flex; flex-wrap: wrap; align-items: center; gap: 4px; font-family: var(--font-mono);
  font-size: 13px; }
.mc-chip { padding: 1px 7px; border-radius: 5px; border: 1px solid #15803d; background: #dcfce7; color: #14532d;
  white-space: pre; }
.mc-chip.root { background: #f1f5f9; border-color: #64748b; color: #0f172a; }
.mc-chip.bonus { background: #fff; border-style: dashed; border-color: #4f46e5; color: #3730a3; }
.mc-arrow { color: #64748b; }
.mc-tree-body { display: flex; gap: 14px; align-items: flex-start; flex-wrap: wrap; }
.mc-tree-scroll { flex: 0 1 auto; max-width: 100%; overflow: auto; max-height: 620px; background: #ffffff;
  border: 1px solid #e2e8f0; border-radius: 8px; padding: 2px; }
.mc-reply-box { flex: 1 1 340px; min-width: 280px; display: flex; flex-direction: column; gap: 6px; }
.mc-tree { display: block; font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.mc-tree .mc-col { font-size: 11px; fill: #64748b; font-family: ui-sans-serif, system-ui, sans-serif;
  font-weight: 600; letter-spacing: .04em; }
.mc-tree .node rect { fill: #f8fafc; stroke: #cbd5e1; stroke-width: 1; }
.mc-tree .node.rejected { opacity: .42; }
.mc-tree .node.accepted rect { fill: #dcfce7; stroke: #15803d; stroke-width: 2; }
.mc-tree .node.accepted .mc-tok { font-weight: 700; fill: #14532d; }
.mc-tree .node.lookup rect { stroke-dasharray: 4 2; }
.mc-tree .mc-tok { font-size: 12px; fill: #0f172a; white-space: pre; }
.mc-tree .mc-rank { font-size: 10px; fill: #64748b; }
.mc-tree .mc-edge { fill: none; stroke: #94a3b8; stroke-width: 1; opacity: .5; }
.mc-tree .mc-edge.accepted { stroke: #15803d; stroke-width: 2.5; opacity: 1; }
.mc-reply { white-space: pre-wrap; line-height: 1.75; font-size: 14px; padding: 8px 10px; border-radius: 8px;
  border: 1px solid var(--border-color-primary); max-height: 560px; overflow: auto;
  background: var(--background-fill-primary); }
.mc-seg { border-radius: 3px; padding: 1px 0; margin-right: 1px; box-decoration-break: clone;
  -webkit-box-decoration-break: clone; }
.mc-seg.selected { outline: 2px solid #f97316; outline-offset: 1px; }
.mc-legend { font-size: 11px; color: var(--body-text-color-subdued); display: flex; gap: 4px;
  align-items: center; flex-wrap: wrap; }
.mc-sw { display: inline-block; min-width: 18px; text-align: center; border-radius: 3px; padding: 0 4px;
  color: #0f172a; }
.mc-model { font-size: 13px; }
.mc-model-head { font-weight: 650; margin-bottom: 4px; display: flex; align-items: center; gap: 6px; }
.mc-model.mc-ready .mc-model-head { color: #15803d; }
.mc-model.mc-error .mc-model-head { color: #b91c1c; }
.mc-info { width: 100%; border-collapse: collapse; border: none !important; margin: 0 !important; }
.mc-info tr, .mc-info th, .mc-info td { border: none !important; background: transparent !important; }
.mc-info th { text-align: left; font-weight: 500; color: var(--body-text-color-subdued); padding: 1px 8px 1px 0;
  white-space: nowrap; vertical-align: top; width: 1%; }
.mc-info td { padding: 1px 0; word-break: break-word; }
.mc-details summary { cursor: pointer; font-size: 12px; color: var(--body-text-color-subdued); }
.mc-note-line { font-size: 12px; color: #92400e; margin-top: 2px; }
.mc-progress { font-family: var(--font-mono); font-size: 12px; color: var(--body-text-color-subdued);
  margin-top: 4px; white-space: pre-wrap; }
.mc-spinner { width: 12px; height: 12px; border: 2px solid #c7d2fe; border-top-color: #4f46e5; border-radius: 50%;
  display: inline-block; animation: mc-spin 0.8s linear infinite; }
@keyframes mc-spin { to { transform: rotate(360deg); } }
/* the chat bubble is white-space: pre-wrap (made for plain text): the HTML's own newlines between tags must not
   show as extra blank lines; line breaks are <br> elements, code blocks keep theirs */
.mc-msg { white-space: normal; }
.mc-msg pre, .mc-msg code { white-space: pre-wrap; }
.mc-msg p { margin: 0 0 .5em 0; }
.mc-msg p:last-child { margin-bottom: 0; }
.mc-msg-stats { margin-top: 6px; font-size: 12px; font-style: italic; color: var(--body-text-color-subdued); }
.mc-image-link { font-style: italic; }
.mc-cursor { opacity: .6; }
.mc-error { background: #fef2f2; color: #991b1b; border: 1px solid #fecaca; border-radius: 8px;
  padding: 8px 10px; font-size: 14px; }
#mc-title h1 { margin: 0; font-size: 24px; }
#error-box:has(.mc-error) { margin: 4px 0; }
#send, #stop { min-height: 42px; }
#send { background: #4f46e5; color: #fff; border-color: #4338ca; }
#send:hover { background: #4338ca; }
#stop { background: #fee2e2; color: #b91c1c; border-color: #fecaca; }
#stop:hover { background: #fecaca; }
#tree-group { padding: 8px 12px; }
#tree-help p { margin-top: 0; color: var(--body-text-color-subdued); font-size: 13px; }
#mc-title p { margin: 0; color: var(--body-text-color-subdued); }
"""
