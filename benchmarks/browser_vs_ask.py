"""The web UI in a real browser against `ask`: the decode tokens/s the page's meter shows for a reply, and what
the engine measures for the same prompt run the way `ask` runs it (same model, numeric path and tree, greedy).

Why: the browser that shows the reply runs on the same cores as the decoder. Each page update costs the server
(Gradio's diff and send) and the browser (layout, paint); when the decoder waits for them, the page shows a
fraction of the speed (measured before: 160 tok/s on the page against 500+ for `ask` on 2 cores). The UIs now update
at a bounded rate from a decoding thread (medusa_chat/chat/updates.py), and the web page streams the reply into a
light element under the chat instead of the Chatbot (medusa_chat/ui/web.py); this measures what is left.

One process: the web UI (`medusa_chat.ui.web.launch`) on the embedded model, headless Debian Chromium driven by
playwright (`--chromium`, default /usr/bin/chromium as tests/test_browser.py; never `playwright install`), and the
ask-style engine. Runs alternate (ask, page, ask, page, ...) so a slow spell hits both; medians are printed.
Every page reply is checked token-identical to ask's.

    python benchmarks/browser_vs_ask.py                       # 3 rounds, 256 new tokens at most
    python benchmarks/browser_vs_ask.py --variants all         # also: what a page update costs the decoder

Variants (each page run sets MEDUSA_CHAT_UI_HZ / _PANEL_HZ / _DECODE_AHEAD / _LIVE_REPLY, read per reply):
    bounded   the app's defaults: the text streamed into the live reply element under the chat (the Chatbot gets
              the reply once, at the end), updated at most 4 times a second on 2 cores or fewer (else 8), the
              panels (meter + chart, tree, slider) at most 2, decoding in its own thread
    chatbot   as bounded, but the text streamed into the Chatbot (each update re-sends the message list and the
              browser re-renders it: the former default)
    text-8, text-15  the live element updated at most 8 / 15 times a second (panels 2)
    panels-15 15 text updates a second, the panels redrawn with each (the default before the rates were bounded
              lower)
    inline    at most 15 a second (panels too), but the UI pulls each step itself (the decoder waits while it
              renders)
    per-step  a page update after every step, pulled inline (what the cost of an update adds up to)
The variants other than chatbot stream into the live element.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("GRADIO_TEMP_DIR", tempfile.mkdtemp(prefix="medusa-gradio-bench-"))

CHROMIUM = "/usr/bin/chromium"  # Debian's; --chromium or $CHROMIUM for another
CHROMIUM_ARGS = [  # MEDUSA_FACTS section 12: offline, no sandbox in containers, nothing but the app reachable
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
]
ENV_NAMES = ("MEDUSA_CHAT_UI_HZ", "MEDUSA_CHAT_UI_PANEL_HZ", "MEDUSA_CHAT_UI_DECODE_AHEAD", "MEDUSA_CHAT_UI_LIVE_REPLY")
VARIANTS: dict[str, tuple[str | None, ...]] = {  # name: the values of ENV_NAMES; None: unset
    "bounded": (None, None, "1", "1"),  # the app's defaults
    "chatbot": (None, None, "1", "0"),
    "text-8": ("8", "2", "1", "1"),
    "text-15": ("15", "2", "1", "1"),
    "panels-15": ("15", "15", "1", "1"),
    "inline": ("15", "15", "0", "1"),
    "per-step": ("100000", "100000", "0", "1"),
}
PROMPT = (
    "Give me three tips for staying healthy."  # the reported prompt: a 141-token reply on the embedded model
)
METER_JS = """() => {
    const num = k => { const e = document.querySelector(`#meter .mc-num[data-key="${k}"]`);
                       return e ? parseFloat(e.getAttribute('data-value')) : null; };
    const s = document.querySelector('#meter .mc-status');
    return {tps: num('decode_tps'), tokens: num('new_tokens'), status: s ? s.innerText : ''};
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask_once(engine: Any, prompt_ids: list[int], settings: Any) -> Any:
    """`ask`'s loop (medusa_chat/ask.py) without printing: the summary of one reply."""
    summary = None
    for item in engine.generate(prompt_ids, settings):
        summary = item
    return summary


class StepThreads:
    """Counts an engine's decoding steps by the thread count its governor had (engine/threads.py): a burst of work
    from the browser during a step can make the governor drop the native step to its busy mode (the duet, or one
    thread) for a while."""

    def __init__(self, engine: Any) -> None:
        self.counts: dict[int, int] = {}
        self.busy = 1
        governor = getattr(engine, "threads", None)
        if governor is None or not governor.adaptive:
            return
        self.busy = governor.busy
        observe = governor.observe

        def counting(seconds: float, size: int) -> None:
            self.counts[governor.threads] = self.counts.get(governor.threads, 0) + 1
            observe(seconds, size)

        governor.observe = counting

    def take(self) -> str:
        """The counts since the previous take, as "; duet steps 12/80" (in the busy mode / all), "" when none."""
        counts, self.counts = self.counts, {}
        total = sum(counts.values())
        mode = "1-thread" if self.busy == 1 else "duet"
        return f"; {mode} steps {counts.get(self.busy, 0)}/{total}" if total else ""


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds used so far by this process: the web server and the decoder; by the browser's processes, the
    children of playwright's driver). Their difference over a reply says who took the cores."""
    import psutil

    me = psutil.Process()
    own = sum(me.cpu_times()[:2])
    browser = 0.0
    for child in me.children(recursive=True):
        try:
            if "chrom" in child.name().lower():
                browser += sum(child.cpu_times()[:2])
        except psutil.Error:  # a renderer that just ended
            pass
    return own, browser


RENDERER_METRICS = ("TaskDuration", "ScriptDuration", "LayoutDuration", "RecalcStyleDuration")


def renderer_seconds(cdp: Any) -> dict[str, float]:
    """The page's renderer main thread so far (Chrome DevTools Protocol Performance metrics), in seconds:
    all tasks, and of them script, layout and style."""
    metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    return {name: float(metrics.get(name, 0.0)) for name in RENDERER_METRICS}


def page_once(page: Any, app: Any, timeout_s: float) -> tuple[dict[str, Any], Any, int, float]:
    """One reply in the browser: (the meter's final figures, the session's summary, page updates, seconds)."""
    ui = app.medusa_web
    session = ui.session
    ui.clear()  # a new conversation: the same prompt as ask's, not a follow-up
    before = len(session.conversation.messages)
    page.fill("#msg textarea", PROMPT)
    t0 = time.monotonic()
    page.click("#send")
    deadline = t0 + timeout_s
    while len(session.conversation.messages) < before + 2 or session.busy:
        if time.monotonic() > deadline:
            raise SystemExit("the page's reply did not finish in time")
        time.sleep(0.02)
    summary = session.last_summary
    page.wait_for_function(
        f"() => {{ const e = document.querySelector('#meter .mc-num[data-key=\"new_tokens\"]'); "
        f"return e && parseFloat(e.getAttribute('data-value')) === {summary.new_tokens} "
        f"&& !document.querySelector('#meter').innerText.includes('streaming'); }}",
        timeout=timeout_s * 1000,
    )
    shown = page.evaluate(METER_JS)
    return shown, summary, ui.updates_sent, time.monotonic() - t0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="ask/page pairs (medians are printed)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=300, help="seconds a page reply may take")
    parser.add_argument(
        "--variants",
        default="bounded",
        help=f"comma-separated, or all: {', '.join(VARIANTS)} (default: bounded)",
    )
    parser.add_argument(
        "--chromium",
        default=os.environ.get("CHROMIUM", CHROMIUM),
        help="the Chromium binary playwright drives (default: $CHROMIUM, else %(default)s)",
    )
    args = parser.parse_args()
    args.variants = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(",")]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        raise SystemExit(f"--variants: choose from {', '.join(VARIANTS)} (or all)")
    if not Path(args.chromium).is_file():
        raise SystemExit(f"Chromium is needed at {args.chromium} (apt-get install chromium, or --chromium PATH)")
    return args


def start_web_app(loaded: Any, max_new_tokens: int, tree: Any) -> tuple[Any, Any]:
    """The web UI on `loaded` in this process, its model ready, greedy with `max_new_tokens`; its stream counts
    the page updates the server sends (in `ui.updates_sent`). Returns (app, ui)."""
    from medusa_chat.chat.session import SessionManager
    from medusa_chat.ui import web

    session = SessionManager(loaded=loaded, data_dir=Path(tempfile.mkdtemp(prefix="medusa-bench-data-")))
    app = web.launch(session, port=free_port(), block=False, quiet=True)
    ui = app.medusa_web
    if not (ui.loader.wait(600) and ui.loader.status == "ready"):
        raise SystemExit(f"the web UI's model did not load: {ui.loader.error}")
    session.update_settings(max_new_tokens=max_new_tokens, temperature=0)
    if session.engine is None or session.engine.tree.paths != tree.paths:
        print("note: the web session chose another tree than ask's", file=sys.stderr)
    # count the page updates the server sends (WebApp.send looks `stream` up per call)
    ui.updates_sent = 0
    real_stream = ui.stream

    def counting(*a: Any, **k: Any) -> Iterator[Any]:
        ui.updates_sent = 0
        for out in real_stream(*a, **k):
            ui.updates_sent += 1
            yield out

    ui.stream = counting
    return app, ui


def set_variant(variant: str) -> None:
    """The variant's UI switches, read per reply."""
    for name, value in zip(ENV_NAMES, VARIANTS[variant], strict=True):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@dataclass
class Figures:
    """Per variant: the page's decode tok/s, the updates sent, the renderer main thread's task seconds."""

    pages: dict[str, list[float]]
    updates_sent: dict[str, list[int]]
    renderer: dict[str, list[float]]

    @classmethod
    def empty(cls, variants: list[str]) -> Figures:
        return cls({v: [] for v in variants}, {v: [] for v in variants}, {v: [] for v in variants})


def page_run(page: Any, app: Any, cdp: Any, args: argparse.Namespace, variant: str, figures: Figures) -> tuple:
    """One page reply under `variant`: its figures kept, (the reply's summary, the log text) returned."""
    set_variant(variant)
    own0, browser0 = cpu_seconds()
    main0 = renderer_seconds(cdp)
    shown, summary, n_updates, wall = page_once(page, app, args.timeout)
    own1, browser1 = cpu_seconds()
    main = {k: v - main0[k] for k, v in renderer_seconds(cdp).items()}
    figures.pages[variant].append(shown["tps"])
    figures.updates_sent[variant].append(n_updates)
    figures.renderer[variant].append(main["TaskDuration"])
    text = (
        f"{variant} page {shown['tps']:.1f} tok/s ({n_updates} updates in {wall:.2f} s; CPU s: server "
        f"and decoder {own1 - own0:.2f}, browser {browser1 - browser0:.2f}; renderer main thread "
        f"s: tasks {main['TaskDuration']:.2f}, script {main['ScriptDuration']:.2f}, layout "
        f"{main['LayoutDuration']:.2f}, style {main['RecalcStyleDuration']:.2f}"
    )
    return summary, text


def print_table(
    asks: list[float], figures: Figures, args: argparse.Namespace, tree: Any, source: str, tokens: int
) -> None:
    a_med = statistics.median(asks)
    print(
        f"embedded model, tree {tree.size} nodes ({source}), greedy, {tokens} new tokens, {os.cpu_count()} CPUs"
    )
    if tokens < 128:
        print(f"note: the reply has only {tokens} tokens (< 128)")
    print(f"prompt: {PROMPT!r}; {args.rounds} rounds, medians; the page's figure is its meter's decode tok/s")
    print(f"{'':>34}{'tok/s':>10}{'x ask':>8}{'updates':>9}{'renderer s':>12}")
    print(f"{'ask (engine, as medusa-chat ask)':>34}{a_med:10.1f}{1.0:8.2f}{'':>9}{'':>12}")
    for v in args.variants:
        p_med = statistics.median(figures.pages[v])
        print(
            f"{'web UI in Chromium, ' + v:>34}{p_med:10.1f}{p_med / a_med:8.2f}"
            f"{statistics.median(figures.updates_sent[v]):9.0f}{statistics.median(figures.renderer[v]):12.2f}"
        )
    print("renderer s: the page's renderer main thread (all tasks) during the reply, median")
    print("target: bounded page >= 0.8x ask")


def main() -> None:
    args = parse_args()
    variants = args.variants
    from playwright.sync_api import sync_playwright

    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.events import GenerationSettings
    from medusa_chat.model.sources.loading import load_model
    from medusa_chat.tuning.first_start import resolve_tree

    loaded = load_model()  # the embedded model, the default numeric path (as `ask` with no options)
    tree, source = resolve_tree(loaded)
    engine = MedusaEngine(loaded, tree)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, temperature=0.0)
    prompt_ids = loaded.build_prompt([{"role": "user", "content": PROMPT}])
    app, ui = start_web_app(loaded, args.max_new_tokens, tree)
    ask_threads, page_threads = StepThreads(engine), StepThreads(ui.session.engine)
    xdg = Path(tempfile.mkdtemp(prefix="medusa-bench-xdg-"))
    env = {**os.environ, "XDG_CONFIG_HOME": str(xdg / "config"), "XDG_CACHE_HOME": str(xdg / "cache")}
    asks: list[float] = []
    figures = Figures.empty(variants)
    tokens = 0
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS, env=env)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(app.local_url)
            page.wait_for_selector("#msg textarea")
            page.wait_for_function("document.querySelector('#model-panel').innerText.includes('Model ready')")
            cdp = page.context.new_cdp_session(page)
            cdp.send("Performance.enable")
            ask_once(engine, prompt_ids, settings)  # warm-up, both ways
            page_once(page, app, args.timeout)
            ask_threads.take(), page_threads.take()
            for r in range(args.rounds):
                engine.reset()
                own0, _ = cpu_seconds()
                t0 = time.monotonic()
                a = ask_once(engine, prompt_ids, settings)
                ask_cpu, ask_wall = cpu_seconds()[0] - own0, time.monotonic() - t0
                asks.append(a.decode_tokens_per_s)
                tokens = a.new_tokens
                line = [
                    f"round {r + 1}: ask {a.decode_tokens_per_s:.1f} tok/s ({ask_wall:.2f} s, CPU s {ask_cpu:.2f}"
                    f"{ask_threads.take()})"
                ]
                for v in variants[r % len(variants) :] + variants[: r % len(variants)]:  # rotated per round
                    s, text = page_run(page, app, cdp, args, v, figures)
                    if s.token_ids != a.token_ids:
                        raise SystemExit(f"round {r + 1} ({v}): the page's reply differs from ask's")
                    line.append(text + f"{page_threads.take()})")
                print(", ".join(line), file=sys.stderr, flush=True)
            browser.close()
    finally:
        app.close()
    print_table(asks, figures, args, tree, source, tokens)


if __name__ == "__main__":
    main()
