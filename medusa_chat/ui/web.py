"""The Gradio web UI (`medusa-chat web`, `python run.py`): chat with streaming, Stop, regenerate, undo, edit,
system prompt and settings; a live speed meter; the accepted-tree visualiser; the model panel.

Everything here is presentation: the `SessionManager` owns the model, the conversation, the settings and the
stop flag; `render` turns its events into HTML. The app binds 127.0.0.1 unless another host is asked for, never
makes share links, sends no analytics, and needs no network (system fonts, no CDN).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from medusa_chat import envvars
from medusa_chat.paths import cache_root


def _configure_env() -> None:
    """Offline, private defaults; must run before gradio / huggingface_hub are imported."""
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("GRADIO_TEMP_DIR", str(cache_root() / "gradio"))
    os.environ.setdefault("GRADIO_SSR_MODE", "False")


_configure_env()

import gradio as gr  # noqa: E402  (after the environment above)

from medusa_chat.chat.updates import ReplyUpdates, panel_interval_s, updates  # noqa: E402
from medusa_chat.errors import BusyError, MedusaChatError  # noqa: E402
from medusa_chat.events import ReplySummary, StepEvent  # noqa: E402
from medusa_chat.ui import render, tree_panel  # noqa: E402
from medusa_chat.ui.web_layout import TREE_CHOICES_DEFAULT, StreamUpdate, build_blocks, edit_reset  # noqa: E402
from medusa_chat.ui.web_loader import ModelLoader, friendly_error  # noqa: E402

if TYPE_CHECKING:
    from medusa_chat.chat.session import SessionManager

STREAM_CURSOR = '<span class="mc-cursor">▌</span>'  # after the text while a reply streams in the Chatbot


def live_reply_default() -> bool:
    """Stream replies into the live reply element (the default); MEDUSA_CHAT_UI_LIVE_REPLY=0 streams them into the
    Chatbot as before (each update re-sends the message list and the browser re-renders it), for measuring the
    difference (benchmarks/browser_vs_ask.py)."""
    return envvars.enabled("MEDUSA_CHAT_UI_LIVE_REPLY")


def _message_text(content: Any) -> str:
    """Gradio 6 message content may be a string or a list of parts: flatten to text."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, (list, tuple)):
        return "".join(_message_text(p) for p in content)
    return "" if content is None else str(content)


class WebApp:
    """State and handlers of one web UI over one session (a single-user app: one shared session)."""

    def __init__(self, session: SessionManager) -> None:
        self.session = session
        self.loader = ModelLoader(session)
        self.events: list[StepEvent] = []
        self.summary: ReplySummary | None = None
        self.streaming = False
        self._stop_asked = threading.Event()

    # ---- views --------------------------------------------------------------------------------------------
    def history(self, draft: list[dict[str, str]] | None = None) -> list[dict[str, str]]:
        """The conversation as Chatbot messages (a stopped reply is marked), or `draft` while streaming."""
        if draft is not None:
            return draft
        if self.loader.status == "error" and not self.session.conversation.messages:
            # the chat area, not only the model panel, says why nothing can be asked, and what fixes it
            return [{"role": "assistant", "content": render.load_failed_html(self.loader.error)}]
        out: list[dict[str, str]] = []
        for m in self.session.conversation.messages:
            content = render.chat_html(m.content)
            if m.role == "assistant":
                content += render.message_stats_html(m.stats, m.stopped)
            out.append({"role": m.role, "content": content})
        return out

    def meter(self, status: str = "") -> str:
        speed: float | None = None
        kind: str | None = None
        src = self.summary if self.summary is not None else (self.events[-1] if self.events else None)
        if src is not None and src.tokens_per_step > 0:
            try:
                speed, kind = self.session.speedup(src.decode_tokens_per_s, src.tokens_per_step)
            except Exception:  # noqa: BLE001 - a meter must never break the chat
                speed, kind = None, None
        return render.meter_html(
            self.events,
            self.summary,
            speedup=speed,
            speedup_kind=kind,
            status=status,
            accept_mode=self.session.settings.accept_mode,
        )

    def tree_panel(self, step: int | None = None, live: bool = False) -> str:
        note = ""
        if not self.events and any(m.role == "assistant" for m in self.session.conversation.messages):
            note = "Decoding steps are kept for replies made since the app started: send a message to see its tree."
        return tree_panel.tree_panel_html(self.events, step, live=live, note=note)

    def model_panel(self) -> str:
        try:
            info = self.session.info
        except Exception:  # noqa: BLE001
            info = {}
        return render.model_panel_html(info, self.loader.status, self.loader.lines)

    def step_slider(self, interactive: bool = True) -> dict:
        top = max((e.step for e in self.events), default=0)
        return gr.update(maximum=max(top, 1), value=top, interactive=interactive and top > 0)

    def conversation_choices(self) -> list[tuple[str, str]]:
        try:
            metas = self.session.list_conversations()
        except Exception:  # noqa: BLE001
            return []
        out = []
        for meta in metas:
            when = (meta.updated or meta.created or "")[:16].replace("T", " ")
            title = meta.title or "(untitled)"
            out.append((f"{title} · {when} · {meta.messages} msgs", meta.id))
        return out

    def conv_dropdown(self) -> dict:
        choices = self.conversation_choices()
        current = self.session.conversation.id
        value = current if any(v == current for _, v in choices) else None
        return gr.update(choices=choices, value=value)

    def _warn(self, err: BaseException) -> str:
        msg = friendly_error(err)
        if not isinstance(err, MedusaChatError):
            traceback.print_exception(err)
        gr.Warning(render.esc(msg))  # gradio shows toasts as HTML; a message may quote a file name or a title
        return render.error_html(msg)

    # ---- streaming a reply ----------------------------------------------------------------------------------
    def _wait_for_model(self) -> Iterator[str]:
        """Start the load if needed and yield progress text until the model is ready (raises on failure)."""
        self.loader.start()
        while not self.loader.wait(0.5):
            yield self.loader.lines[-1] if self.loader.lines else "loading…"
        if self.loader.status != "ready":
            raise MedusaChatError(self.loader.error or "the model failed to load")

    def stream(self, kind: str, message: str, edit_mode: bool = False) -> Iterator[StreamUpdate]:
        """Run one reply (`send`, `regenerate` or `edit`) and yield UI updates while it streams (StreamUpdate:
        chatbot, message box, meter, tree panel, step slider, error box, conversation list, edit state, send
        button, cancel-edit button, live reply; a field not given is left as it is).

        The Chatbot gets the user's message at once and the finished reply once, at the end (a stopped reply as
        far as it got, marked; after an error, the conversation as it stands). In between, the reply's text so
        far goes to the live reply element (escaped plain text), which the end empties.
        """
        skip = gr.skip()
        message = _message_text(message)
        if kind == "send" and edit_mode:
            kind = "edit"
        if kind in ("send", "edit") and not message.strip():
            gr.Warning("Type a message first.")
            yield StreamUpdate()
            return
        live = live_reply_default()
        self._stop_asked.clear()
        reset_edit = edit_reset()
        # Show the user's message at once, even while the model is still loading.
        base = self.history()
        shown = render.chat_html(message)
        if kind == "send":
            draft = [*base, {"role": "user", "content": shown}]
        elif kind == "edit":
            cut = max((i for i, m in enumerate(base) if m["role"] == "user"), default=len(base))
            draft = [*base[:cut], {"role": "user", "content": shown}]
        else:
            draft = base[:-1] if base and base[-1]["role"] == "assistant" else list(base)
        stream = None
        feed: ReplyUpdates | None = None
        try:
            for line in self._wait_for_model():
                yield StreamUpdate(draft, "", render.meter_html([], status=f"loading model: {line}"), error="",
                                   live_reply="", **reset_edit)  # fmt: skip
            if self._stop_asked.is_set():
                yield StreamUpdate(self.history(), meter=self.meter("stopped"), error="", live_reply="", **reset_edit)
                return
            if kind == "send":
                stream = self.session.send(message)
            elif kind == "edit":
                stream = self.session.edit_last(message)
            else:
                stream = self.session.regenerate()
            if self._stop_asked.is_set():  # Stop pressed while the reply was being set up
                self.session.stop()
            self.events, self.summary, self.streaming = [], None, True
            text = ""
            started = draft if live else draft + [{"role": "assistant", "content": ""}]
            yield StreamUpdate(started, "", self.meter("starting…"), self.tree_panel(live=True), error="",
                               live_reply="", **reset_edit)  # fmt: skip
            # The reply decodes in its own thread; the page gets at most 4-8 updates a second, each carrying
            # every step since the previous one (chat/updates.py). The final one is the yield after the loop.
            # The panels (meter, tree, slider) are redrawn at most ~2 times a second (panel_interval_s).
            feed = updates(stream)
            panel_every, panel_at = panel_interval_s(), float("-inf")
            for update in feed:
                self.events.extend(update.steps)
                text += update.text
                if update.summary is not None:
                    self.summary = update.summary
                last = update.last
                if update.final or last is None:
                    continue
                now = time.monotonic()
                panels = now - panel_at >= panel_every
                if panels:
                    panel_at = now
                if live:  # the text so far to the live element; the Chatbot is left as it is
                    chat, live_text = skip, render.live_reply_value(text)
                else:
                    chat = draft + [{"role": "assistant", "content": render.chat_html(text) + STREAM_CURSOR}]
                    live_text = skip
                yield StreamUpdate(
                    chatbot=chat,
                    meter=self.meter("streaming…") if panels else skip,
                    tree=self.tree_panel(live=True) if panels else skip,
                    step=gr.update(maximum=max(last.step, 1), value=last.step) if panels else skip,
                    live_reply=live_text,
                )
        except BusyError as err:  # another reply is running: leave its display alone, just say so
            yield StreamUpdate(error=self._warn(err))
            return
        except Exception as err:  # noqa: BLE001 - the app keeps running; the message goes to the browser
            self.streaming = False
            yield StreamUpdate(self.history(), skip, self.meter("error"), self.tree_panel(), self.step_slider(),
                               self._warn(err), self.conv_dropdown(), live_reply="")  # fmt: skip
            return
        finally:
            if stream is not None:
                self.streaming = False
                if feed is not None:
                    feed.close()  # ends the decoding thread (after its current step) and the reply's stream
                else:
                    stream.close()
        for notice in getattr(self.session, "notices", []) or []:
            gr.Info(render.esc(notice))
        reason = self.summary.stop_reason if self.summary is not None else "stopped"
        status = {
            "eos": "finished",
            "stop_string": "finished (stop string)",
            "context_limit": "context full",
        }.get(reason, reason.replace("_", " "))
        if self.summary is not None and self.summary.message:
            gr.Info(render.esc(self.summary.message))
        yield StreamUpdate(self.history(), skip, self.meter(status), self.tree_panel(),
                           self.step_slider(), "", self.conv_dropdown(), live_reply="")  # fmt: skip

    def send(self, message: str, edit_mode: bool = False) -> Iterator[StreamUpdate]:
        yield from self.stream("send", message, edit_mode)

    def regenerate(self) -> Iterator[StreamUpdate]:
        yield from self.stream("regenerate", "")

    # ---- simple actions -------------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop_asked.set()
        self.session.stop()

    def _after_change(self, action: Callable[[], object]) -> tuple:
        """Run an action that changes the conversation; returns chatbot, meter, tree, slider, error, list."""
        try:
            action()
        except Exception as err:  # noqa: BLE001
            return (self.history(), gr.skip(), gr.skip(), gr.skip(), self._warn(err), gr.skip())
        self.events, self.summary = list(self.session.last_events), self.session.last_summary
        return (self.history(), self.meter(), self.tree_panel(), self.step_slider(), "", self.conv_dropdown())

    def undo(self) -> tuple:
        return self._after_change(self.session.undo)

    def clear(self) -> tuple:
        return self._after_change(self.session.clear)

    def load_conversation(self, conv_id: str | None) -> tuple:
        if not conv_id:
            gr.Warning("Choose a conversation first.")
            return (gr.skip(),) * 5 + (gr.skip(), gr.skip())
        out = self._after_change(lambda: self.session.load_conversation(conv_id))
        return (*out, self.session.conversation.system_prompt)

    def delete_conversation(self, conv_id: str | None) -> tuple:
        if not conv_id:
            gr.Warning("Choose a conversation first.")
            return (gr.skip(),) * 6
        return self._after_change(lambda: self.session.delete_conversation(conv_id))

    def export(self, fmt: str) -> tuple:
        try:
            if not self.session.conversation.messages:
                raise MedusaChatError("nothing to export yet: the conversation is empty")
            folder = Path(os.environ["GRADIO_TEMP_DIR"]) / "exports" / time.strftime("%Y%m%d-%H%M%S")
            folder.mkdir(parents=True, exist_ok=True)
            ext = "json" if fmt == "json" else "md"
            path = self.session.export(folder / f"medusa-chat-{self.session.conversation.id}.{ext}", ext)
        except Exception as err:  # noqa: BLE001
            return gr.update(), self._warn(err)
        return gr.update(value=str(path), visible=True), ""

    def edit_last(self) -> tuple:
        """Put the last user message in the box; the next Send replaces it (and its reply)."""
        last = next(
            (m.content for m in reversed(self.session.conversation.messages) if m.role == "user"), None
        )
        if last is None:
            gr.Warning("There is no user message to edit yet.")
            return gr.skip(), False, gr.skip(), gr.skip()
        return last, True, gr.update(value="Resend edited"), gr.update(visible=True)

    @staticmethod
    def cancel_edit() -> tuple:
        return "", False, gr.update(value="Send"), gr.update(visible=False)

    def set_system(self, text: str) -> str:
        try:
            if text.strip() != self.session.conversation.system_prompt:
                self.session.set_system(text)
                gr.Info("System prompt set for this conversation.")
        except Exception as err:  # noqa: BLE001
            return self._warn(err)
        return ""

    def update_setting(self, name: str, value: Any) -> str:
        try:  # the seed control's -1 is "none" (settings.parse_settings)
            self.session.update_settings(**{name: value})
        except Exception as err:  # noqa: BLE001
            return self._warn(err)
        return ""

    def set_tree(self, name: str, size: float | None) -> tuple[str, str]:
        try:
            self.session.set_tree(None if not name or name == TREE_CHOICES_DEFAULT else name,
                                  int(size) if size else None)  # fmt: skip
        except Exception as err:  # noqa: BLE001
            return self.model_panel(), self._warn(err)
        gr.Info(
            render.esc(f"Tree: {self.session.info.get('tree')} ({self.session.info.get('tree_size')} nodes)")
        )
        return self.model_panel(), ""

    def measure_baseline(self) -> tuple[str, str, str]:
        try:
            for _ in self._wait_for_model():
                pass
            tps = self.session.measure_baseline()
        except Exception as err:  # noqa: BLE001
            return self.model_panel(), gr.skip(), self._warn(err)
        gr.Info(f"Plain decoding: {tps:.1f} tokens/s. Speedups are now measured.")
        return self.model_panel(), self.meter(), ""

    def tick(self) -> tuple[str, Any, Any]:
        """Timer: refresh the model panel while loading; stop polling once ready or failed (a failed load's reason
        then goes to the chat area, once: the timer stops with it)."""
        active = self.loader.status in ("loading", "idle")
        chat = self.history() if self.loader.status == "error" else gr.skip()
        return self.model_panel(), gr.Timer(active=active), chat

    def page_load(self) -> tuple:
        """A (re)loaded page shows the current state: conversation, meter, tree, model, saved chats. It starts a
        load that has not started; a failed one is retried by the Load / retry button only (a page load retrying
        it put the same failure in the log again)."""
        if self.loader.status == "idle":
            self.loader.start()
        return (
            self.model_panel(),
            gr.Timer(active=True),
            self.meter(),
            self.tree_panel(),
            self.history(),
            self.step_slider(),
            self.conv_dropdown(),
            self.session.conversation.system_prompt,
        )

    def retry_load(self) -> tuple[str, Any, Any]:
        self.loader.start()
        return self.model_panel(), gr.Timer(active=True), self.history()

    def show_step(self, step: float | None) -> str:
        return self.tree_panel(int(step) if step is not None else None, live=self.streaming)

    # ---- layout -----------------------------------------------------------------------------------------------
    def build(self) -> gr.Blocks:
        """The page (web_layout.py): its components and their events, wired to this object's handlers."""
        return build_blocks(self)


def theme() -> gr.themes.Base:
    """System fonts only: nothing is fetched from a font CDN, so the page renders the same offline."""
    return gr.themes.Soft(
        primary_hue="indigo",
        secondary_hue="emerald",
        neutral_hue="slate",
        font=["ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "Roboto", "sans-serif"],
        font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"],
    )


def build_app(session: SessionManager) -> gr.Blocks:
    """The Gradio app over `session` (not launched; the model is not loaded until launch or first use)."""
    return WebApp(session).build()


def launch(
    session: SessionManager,
    host: str = "127.0.0.1",
    port: int | None = None,
    open_browser: bool = False,
    *,
    block: bool = True,
    quiet: bool = False,
    api_key: str | None = None,
) -> gr.Blocks:
    """Start the web UI. Binds 127.0.0.1 unless `host` says otherwise (with a warning); never shares.
    The model loads in a background thread at once, its progress shown in the browser. With `block=False`
    the server runs in a background thread and the launched app is returned (tests; `app.close()` ends it).
    The OpenAI-compatible API (medusa_chat.openai.server) is served at /v1 on the same port and session."""
    from medusa_chat.openai.server import host_warning

    warning = host_warning(host, api_key, "this chat (there is no login) and the API")
    if warning:
        print(warning, file=sys.stderr)
    Path(os.environ["GRADIO_TEMP_DIR"]).mkdir(parents=True, exist_ok=True)
    app = build_app(session)
    app.medusa_web.loader.start()  # type: ignore[attr-defined]
    app.queue(default_concurrency_limit=1)
    app.launch(
        server_name=host,
        server_port=port,
        share=False,
        inbrowser=open_browser,
        prevent_thread_lock=True,
        quiet=True,
        show_error=True,
        footer_links=[],
        ssr_mode=False,
        mcp_server=False,
        pwa=False,
        enable_monitoring=False,
        theme=theme(),
        css=render.CSS,
        js=render.COPY_JS,
    )
    from medusa_chat.openai.routes import mount_api

    # Mounted on the running server (routes are looked up per request): one process, one model, one session.
    mount_api(app.app, session, api_key=api_key)
    if not quiet:
        print(f"medusa-chat web UI: {app.local_url}  (Ctrl-C stops it)", flush=True)
        print(f"OpenAI-compatible API: {app.local_url.rstrip('/')}/v1", flush=True)
    if block:
        app.block_thread()
    return app


def add_web_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--host / --port / --open-browser for `medusa-chat web` and run.py."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; anything else is reachable by others)",
    )
    parser.add_argument("--port", type=int, default=None, help="port (default: first free one from 7860)")
    parser.add_argument("--open-browser", action="store_true", help="open the app in the default web browser")
    from medusa_chat.openai.server import add_api_key_argument

    add_api_key_argument(parser)
    return parser


add_arguments = add_web_args  # the name medusa_chat.cli looks for


def main(args: argparse.Namespace) -> int:
    """`medusa-chat web`: build the session from the CLI's options and serve it until Ctrl-C."""
    from medusa_chat.chat.session import SessionManager
    from medusa_chat.openai.server import resolve_api_key

    session = SessionManager.from_args(args)
    try:
        launch(
            session,
            host=getattr(args, "host", None) or "127.0.0.1",
            port=getattr(args, "port", None),
            open_browser=bool(getattr(args, "open_browser", False)),
            api_key=resolve_api_key(args),
        )
    except KeyboardInterrupt:
        pass
    except OSError as err:
        print(f"error: cannot start the web server: {err}", file=sys.stderr)
        return 1
    finally:
        session.close()
    return 0
