"""The accepted tree of one step as HTML/SVG: the tree drawing, the accepted chain, and the reply shaded by the
step that wrote each token (pure functions of StepEvents; the web UI shows them)."""

from __future__ import annotations

from collections.abc import Sequence

from medusa_chat.events import StepEvent
from medusa_chat.ui.render import PREFILL_SHADE, STEP_SHADES, esc, visible_token

_NODE_W = 112


_NODE_H = 20


_COL_GAP = 34


_ROW_GAP = 4


_PAD = 10


_HEADER_H = 22


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
