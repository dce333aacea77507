"""The web UI's page: its components (the chat column, the side column with the meter, settings and
conversations, the accepted-tree panel) and the events that connect them to WebApp's handlers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple

import gradio as gr

from medusa_chat.settings import ACCEPT_MODES, ACCEPT_SHORT_HELP
from medusa_chat.ui import render

if TYPE_CHECKING:
    from medusa_chat.ui.web import WebApp

TREE_CHOICES_DEFAULT = "model default"


class StreamUpdate(NamedTuple):
    """One update of the page while a reply streams (WebApp.stream), a value or gr.update per output; a field left
    out is gr.skip() (that output stays as it is). The fields are the reply events' outputs, in their order."""

    chatbot: Any = gr.skip()
    message: Any = gr.skip()  # the message box
    meter: Any = gr.skip()
    tree: Any = gr.skip()  # the accepted-tree panel
    step: Any = gr.skip()  # the step slider
    error: Any = gr.skip()  # the error box
    conversations: Any = gr.skip()  # the saved-conversations list
    edit_mode: Any = gr.skip()  # the edit state: the next send replaces the last message
    send_button: Any = gr.skip()
    cancel_edit_button: Any = gr.skip()
    live_reply: Any = gr.skip()  # the streaming reply's text so far (escaped plain text)


def edit_reset() -> dict[str, Any]:
    """The StreamUpdate fields that leave edit mode: the state off, the button "Send", "cancel edit" hidden."""
    return {"edit_mode": False, "send_button": gr.update(value="Send"), "cancel_edit_button": gr.update(visible=False)}


def build_blocks(app: WebApp) -> gr.Blocks:
    """The Gradio app of `app` (not launched)."""
    s = app.session.settings
    info = {}
    try:
        info = app.session.info
    except Exception:  # noqa: BLE001
        pass
    tree_names = [TREE_CHOICES_DEFAULT, *_published_tree_names(), *(f"chain-{d}" for d in range(1, 6))]
    with gr.Blocks(title="medusa-chat", analytics_enabled=False) as demo:
        c = SimpleNamespace(edit_state=gr.State(False))
        with gr.Row(equal_height=False):
            gr.Markdown(
                "# medusa-chat\nLocal chat that answers faster with **Medusa tree decoding**: "
                "each step verifies a tree of guesses from the Medusa heads and keeps the longest "
                "accepted path.",
                elem_id="mc-title",
            )
        with gr.Row(equal_height=False):
            with gr.Column(scale=7, min_width=420):
                _chat_column(app, c)
            with gr.Column(scale=5, min_width=340):
                _side_column(app, c, s, info, tree_names)
        with gr.Group(elem_id="tree-group"):
            _tree_group(app, c)
        c.timer = gr.Timer(1.0, active=True)
        _wire_events(app, demo, c)
    demo.medusa_web = app  # type: ignore[attr-defined]  (launch() starts the loader through it)
    return demo


def _chat_column(app: WebApp, c: SimpleNamespace) -> None:
    """The chat, the message box and its buttons, the model panel."""
    c.chatbot = gr.Chatbot(
        value=app.history(),
        elem_id="chat",
        height=520,
        show_label=False,
        buttons=["copy", "copy_all"],
        # Messages arrive as HTML made by render.chat_html (Markdown rendered on the server with
        # raw HTML off, images as links). The browser-side Markdown would parse raw HTML in
        # the text (only sanitised, so <img src=http://...> would still load), so it is off;
        # gradio's sanitiser stays on as a second line; no LaTeX rendering of "$" in replies.
        render_markdown=False,
        sanitize_html=True,
        latex_delimiters=[],
        placeholder="Ask anything. Replies stream here; the meter and the tree update live.",
    )
    # While a reply streams, its text goes here (escaped plain text, render.live_reply_value), not to the Chatbot,
    # which gets the finished reply once; empty (and hidden) otherwise.
    c.live_reply = gr.HTML(
        "",
        elem_id="live-reply",
        html_template=render.LIVE_REPLY_TEMPLATE,
        js_on_load=None,
        container=False,
        padding=False,
    )
    c.error_box = gr.HTML("", elem_id="error-box", container=False, padding=False)
    with gr.Row(equal_height=True):
        c.msg = gr.Textbox(
            placeholder="Type a message and press Enter (Shift+Enter for a new line)",
            show_label=False,
            lines=1,
            max_lines=8,
            scale=8,
            elem_id="msg",
            autofocus=True,
        )
        c.send_btn = gr.Button("Send", variant="primary", scale=1, min_width=96, elem_id="send")
        c.stop_btn = gr.Button("Stop", variant="stop", scale=1, min_width=96, elem_id="stop")
    with gr.Row():
        c.regen_btn = gr.Button("↻ Regenerate", size="sm", elem_id="regen")
        c.undo_btn = gr.Button("↶ Undo", size="sm", elem_id="undo")
        c.edit_btn = gr.Button("✎ Edit last", size="sm", elem_id="edit")
        c.cancel_edit_btn = gr.Button(
            "Cancel edit", size="sm", visible=False, elem_id="cancel-edit"
        )
        c.clear_btn = gr.Button("✕ Clear", size="sm", elem_id="clear")
    with gr.Accordion("Model", open=True):
        c.model_panel = gr.HTML(app.model_panel(), elem_id="model-panel")
        with gr.Row():
            c.baseline_btn = gr.Button("Measure plain decoding", size="sm", elem_id="baseline")
            c.retry_btn = gr.Button("Load / retry", size="sm", elem_id="retry-load")


def _side_column(app: WebApp, c: SimpleNamespace, s: Any, info: dict[str, Any], tree_names: list[str]) -> None:
    """The speed meter, the reply settings, the saved conversations."""
    c.meter = gr.HTML(app.meter(), elem_id="meter")
    with gr.Accordion("Settings", open=True):
        c.system = gr.Textbox(
            label="System prompt",
            value=app.session.conversation.system_prompt,
            lines=2,
            max_lines=6,
            placeholder="(model default): press Enter or leave the box to apply",
            elem_id="system",
        )
        c.temperature = gr.Slider(
            0.0,
            1.5,
            value=s.temperature,
            step=0.05,
            label="Temperature",
            elem_id="temperature",
        )
        c.accept = gr.Radio(
            list(ACCEPT_MODES),
            value=s.accept,
            label="Sampling rule at temperature > 0",
            info=ACCEPT_SHORT_HELP,
            elem_id="accept",
        )
        c.mode = gr.HTML(render.mode_html(s.temperature, s.accept), elem_id="mode")
        c.max_new = gr.Slider(
            1, 4096, value=s.max_new_tokens, step=1, label="Max new tokens", elem_id="max-new"
        )
        with gr.Accordion("Advanced", open=False):
            c.top_p = gr.Slider(0.05, 1.0, value=s.top_p, step=0.01, label="top_p")
            _penalty_controls(c, s)
            c.typical_epsilon = gr.Slider(
                0.0, 1.0, value=s.typical_epsilon, step=0.01, label="typical epsilon"
            )
            c.typical_delta = gr.Slider(
                0.0, 1.0, value=s.typical_delta, step=0.01, label="typical delta"
            )
            c.seed = gr.Number(
                value=s.seed if s.seed is not None else -1,
                precision=0,
                label="seed (-1 = random)",
            )
            c.lookup = gr.Checkbox(
                value=s.context_lookup,
                label="context lookup",
                info="guess repeated text from the conversation on the tree's main chain "
                "(greedy and exact sampling: same output, fewer steps)",
                elem_id="context-lookup",
            )
            c.tree_name = gr.Dropdown(tree_names, value=TREE_CHOICES_DEFAULT, label="tree")
            c.tree_size = gr.Slider(
                1, 64, value=int(info.get("tree_size") or 64), step=1, label="tree size"
            )
            c.tree_btn = gr.Button("Apply tree", size="sm")
    with gr.Accordion("Conversations", open=True):
        c.conv_list = gr.Dropdown(
            app.conversation_choices(), label="Saved conversations", elem_id="conv-list"
        )
        with gr.Row():
            c.refresh_btn = gr.Button("Refresh", size="sm")
            c.load_btn = gr.Button("Open", size="sm")
            c.delete_btn = gr.Button("Delete", size="sm", variant="stop")
        with gr.Row(equal_height=True):
            c.fmt = gr.Radio(["md", "json"], value="md", label="Export format", scale=2)
            c.export_btn = gr.Button("Export", size="sm", scale=1, elem_id="export")
        c.export_file = gr.File(label="Download", visible=False, interactive=False)


def _tree_group(app: WebApp, c: SimpleNamespace) -> None:
    """The accepted tree of a step, and the slider that picks the step."""
    gr.Markdown(
        "### Accepted tree\nColumns are depths (head *k* guesses the token *k* positions ahead); "
        "each box is a candidate token with its rank in that head's top-k. The accepted path is "
        "green, rejected branches are dimmed. Drag the step slider to look at any step of the reply.",
        elem_id="tree-help",
    )
    c.step = gr.Slider(0, 1, value=0, step=1, label="Step", interactive=False, elem_id="step")
    c.tree_html = gr.HTML(app.tree_panel(), elem_id="accepted-tree")


def _wire_events(app: WebApp, demo: gr.Blocks, c: SimpleNamespace) -> None:
    """Every component's events, to WebApp's handlers."""
    _wire_reply_events(app, c)
    _wire_setting_events(app, c)
    _wire_panel_events(app, demo, c)


def _wire_reply_events(app: WebApp, c: SimpleNamespace) -> None:
    """Sending, stopping and changing replies."""
    edit_state, chatbot, error_box, msg, send_btn = c.edit_state, c.chatbot, c.error_box, c.msg, c.send_btn
    stop_btn, regen_btn, undo_btn, edit_btn, cancel_edit_btn = c.stop_btn, c.regen_btn, c.undo_btn, c.edit_btn, c.cancel_edit_btn
    clear_btn, meter, system, conv_list, step = c.clear_btn, c.meter, c.system, c.conv_list, c.step
    tree_html, live_reply = c.tree_html, c.live_reply
    stream_outs = list(StreamUpdate(chatbot, msg, meter, tree_html, step, error_box, conv_list, edit_state, send_btn,
                                    cancel_edit_btn, live_reply))  # fmt: skip
    reply_kw: dict[str, Any] = {"concurrency_limit": None, "show_progress": "hidden"}
    send_btn.click(
        app.send,
        [msg, edit_state],
        stream_outs,
        api_name="send",
        **reply_kw,
    )
    msg.submit(
        app.send,
        [msg, edit_state],
        stream_outs,
        api_visibility="private",
        **reply_kw,
    )
    regen_btn.click(
        app.regenerate,
        None,
        stream_outs,
        api_name="regenerate",
        **reply_kw,
    )
    stop_btn.click(
        app.stop, None, None, api_name="stop", concurrency_limit=None, show_progress="hidden"
    )
    change_outs = [chatbot, meter, tree_html, step, error_box, conv_list]
    undo_btn.click(app.undo, None, change_outs, api_name="undo", concurrency_limit=None)
    clear_btn.click(app.clear, None, change_outs, api_name="clear", concurrency_limit=None)
    edit_btn.click(
        app.edit_last, None, [msg, edit_state, send_btn, cancel_edit_btn], api_visibility="private"
    )
    cancel_edit_btn.click(
        app.cancel_edit, None, [msg, edit_state, send_btn, cancel_edit_btn], api_visibility="private"
    )
    system.submit(app.set_system, system, error_box, api_name="set_system")
    system.blur(app.set_system, system, error_box, api_visibility="private")


def _penalty_controls(c: SimpleNamespace, s: Any) -> None:
    """top-k, min-p and the repetition controls (engine/penalties.py), in the Advanced panel; `c.penalty_controls`
    pairs each with its setting's name."""
    c.penalty_controls = [
        (gr.Number(value=s.top_k, precision=0, minimum=0, label="top_k (0 = off)", elem_id="top-k"), "top_k"),
        (gr.Slider(0.0, 1.0, value=s.min_p, step=0.01, label="min_p", elem_id="min-p"), "min_p"),
        (gr.Slider(0.5, 2.0, value=s.repeat_penalty, step=0.01, label="repeat penalty (1 = off)",
                   elem_id="repeat-penalty"), "repeat_penalty"),
        (gr.Number(value=s.repeat_last_n, precision=0, minimum=-1, label="repeat last n (-1 = all, 0 = off)",
                   elem_id="repeat-last-n"), "repeat_last_n"),
        (gr.Slider(-2.0, 2.0, value=s.presence_penalty, step=0.05, label="presence penalty",
                   elem_id="presence-penalty"), "presence_penalty"),
        (gr.Slider(-2.0, 2.0, value=s.frequency_penalty, step=0.05, label="frequency penalty",
                   elem_id="frequency-penalty"), "frequency_penalty"),
        (gr.Slider(0.0, 5.0, value=s.dry_multiplier, step=0.05, label="DRY multiplier (0 = off)",
                   elem_id="dry-multiplier"), "dry_multiplier"),
        (gr.Slider(1.0, 4.0, value=s.dry_base, step=0.05, label="DRY base", elem_id="dry-base"), "dry_base"),
        (gr.Number(value=s.dry_allowed_length, precision=0, minimum=1, label="DRY allowed length",
                   elem_id="dry-allowed-length"), "dry_allowed_length"),
    ]  # fmt: skip


def _wire_setting_events(app: WebApp, c: SimpleNamespace) -> None:
    """The reply settings and the tree."""
    error_box, model_panel, temperature, accept, mode = c.error_box, c.model_panel, c.temperature, c.accept, c.mode
    max_new, top_p, typical_epsilon, typical_delta, seed = c.max_new, c.top_p, c.typical_epsilon, c.typical_delta, c.seed
    lookup, tree_name, tree_size, tree_btn = c.lookup, c.tree_name, c.tree_size, c.tree_btn
    quiet: dict[str, Any] = {"show_progress": "hidden", "concurrency_limit": None}
    for evt in (temperature.input, temperature.change, accept.change):
        evt(render.mode_html, [temperature, accept], mode, api_visibility="private", **quiet)
    lookup.change(
        lambda v: app.update_setting("context_lookup", v),
        lookup,
        error_box,
        api_visibility="private",
        **quiet,
    )
    accept.change(
        lambda v: app.update_setting("accept", v),
        accept,
        error_box,
        api_visibility="private",
        **quiet,
    )
    temperature.change(
        lambda v: app.update_setting("temperature", v), temperature, error_box,
        api_visibility="private", **quiet,
    )  # fmt: skip
    for comp, name in ((max_new, "max_new_tokens"), (top_p, "top_p"), (typical_epsilon, "typical_epsilon"),
                       (typical_delta, "typical_delta"), (seed, "seed"), *c.penalty_controls):  # fmt: skip
        comp.change(
            (lambda n: lambda v: app.update_setting(n, v))(name), comp, error_box,
            api_visibility="private", **quiet,
        )  # fmt: skip
    tree_btn.click(
        app.set_tree, [tree_name, tree_size], [model_panel, error_box], api_visibility="private"
    )


def _wire_panel_events(app: WebApp, demo: gr.Blocks, c: SimpleNamespace) -> None:
    """Saved conversations, the step slider, the model panel and the page load."""
    chatbot, error_box, model_panel, baseline_btn, retry_btn = c.chatbot, c.error_box, c.model_panel, c.baseline_btn, c.retry_btn
    meter, system, conv_list, refresh_btn, load_btn = c.meter, c.system, c.conv_list, c.refresh_btn, c.load_btn
    delete_btn, fmt, export_btn, export_file, step = c.delete_btn, c.fmt, c.export_btn, c.export_file, c.step
    tree_html, timer = c.tree_html, c.timer
    quiet: dict[str, Any] = {"show_progress": "hidden", "concurrency_limit": None}
    change_outs = [chatbot, meter, tree_html, step, error_box, conv_list]
    refresh_btn.click(lambda: app.conv_dropdown(), None, conv_list, api_visibility="private")
    load_btn.click(
        app.load_conversation, conv_list, [*change_outs, system], api_visibility="private"
    )
    delete_btn.click(app.delete_conversation, conv_list, change_outs, api_visibility="private")
    export_btn.click(app.export, fmt, [export_file, error_box], api_visibility="private")

    step.input(app.show_step, step, tree_html, api_visibility="private", trigger_mode="always_last",
               **quiet)  # fmt: skip
    baseline_btn.click(
        app.measure_baseline, None, [model_panel, meter, error_box], api_name="baseline"
    )
    retry_btn.click(app.retry_load, None, [model_panel, timer, chatbot], api_visibility="private")
    timer.tick(app.tick, None, [model_panel, timer, chatbot], api_visibility="private", **quiet)
    demo.load(
        app.page_load,
        None,
        [model_panel, timer, meter, tree_html, chatbot, step, conv_list, system],
        api_visibility="private",
    )


def _published_tree_names() -> list[str]:
    try:
        from medusa_chat.tree import published_trees

        return sorted(published_trees())
    except Exception:  # noqa: BLE001
        return []
