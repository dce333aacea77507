"""`medusa-chat ask`: one prompt, the reply streamed to stdout, speed figures (or one JSON object) after it.

Same model, numeric path and tree as every other entry point (`tree_choice.resolve_tree`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from medusa_chat.bench.cli import load_from_args, progress_printer
from medusa_chat.bench.runs import describe
from medusa_chat.cliargs import add_generation_args, settings_from_args
from medusa_chat.events import ReplySummary, StepEvent


def add_ask_args(parser: argparse.ArgumentParser) -> None:
    """Options of `medusa-chat ask` (model/heads/quant/dtype/device/tree come from the common options)."""
    parser.add_argument(
        "prompt", nargs="?", default="", metavar="PROMPT", help="the message ('-' reads stdin)"
    )
    add_generation_args(parser, "ask")  # --temperature, --max-new-tokens, --top-p, --seed, --accept
    parser.add_argument("--system", default=None, metavar="TEXT", help="system message before the prompt")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the streamed text"
    )


def ask_main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.tuning.first_start import PROVISIONAL_SOURCE, resolve_tree

    err = Console(stderr=True)
    prompt = sys.stdin.read() if args.prompt == "-" else (args.prompt or "")
    if not prompt.strip():
        print(
            'error: the prompt is empty: give the message as an argument, e.g. medusa-chat ask "Hello"',
            file=sys.stderr,
        )
        return 2
    settings = settings_from_args(args)  # before the (slow) load: a bad option fails at once
    loaded = load_from_args(args, None if args.json else err)
    # A big model's first start answers first and calibrates this CPU after the reply (calibrate_after)
    tree, source = resolve_tree(
        loaded,
        getattr(args, "tree", None),
        getattr(args, "tree_size", None),
        progress_printer(err, args.json),
        defer=True,
    )
    deferred = source == PROVISIONAL_SOURCE
    engine = MedusaEngine(loaded, tree)
    source += engine.tree_note
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": prompt}
    ]
    prompt_ids = loaded.build_prompt(messages)
    summary: ReplySummary | None = None
    for item in engine.generate(prompt_ids, settings):
        if isinstance(item, StepEvent):
            if not args.json and item.text:
                sys.stdout.write(item.text)
                sys.stdout.flush()
        else:
            summary = item
    assert summary is not None  # the engine always ends with a summary
    if args.json:
        out = {
            **summary.to_dict(),
            **describe(loaded),
            "tree": tree.name,
            "tree_size": tree.size,
            "tree_source": source,
        }
        sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
        sys.stdout.flush()
        if deferred:
            engine.fresh_cache()  # the reply's KV cache goes before the calibration's engines come
            calibrate_after(loaded, err, quiet=True)
        return 0
    sys.stdout.write("\n")
    sys.stdout.flush()
    err.print(
        f"[dim]{summary.new_tokens} tokens, {summary.tokens_per_step:.2f} tokens/step, "
        f"{summary.decode_tokens_per_s:.1f} tokens/s, first token {summary.time_to_first_token_s * 1000:.0f} ms, "
        f"tree {tree.size} nodes ({source}), {summary.accept_mode}, stop: {summary.stop_reason}[/dim]"
    )
    if summary.message:
        err.print(f"[yellow]{summary.message}[/yellow]")
    if deferred:
        engine.fresh_cache()
        calibrate_after(loaded, err, quiet=False)
    return 0


def calibrate_after(loaded: Any, err: Any, quiet: bool) -> None:
    """The first start of a big model: the reply came first (plain decoding); now calibrate this CPU once, so
    every later start (ask, chat, web) uses the tree that is fastest here. Ctrl-C skips it (asked again next
    time); the reply is already out."""
    from medusa_chat.tuning.first_start import calibrate_first_start
    from medusa_chat.tuning.tree_choice import choose_tree

    if not quiet:
        err.print("[dim]calibrating the tree size for this CPU once, for the next starts (Ctrl-C skips)[/dim]")
    base, _ = choose_tree(loaded, None, None)
    try:
        tree, source = calibrate_first_start(loaded, base, None if quiet else progress_printer(err, False))
    except KeyboardInterrupt:
        err.print("[dim]calibration skipped; the next start asks again[/dim]")
        return
    if not quiet:
        err.print(f"[dim]next starts: tree {tree.size} node{'s' if tree.size != 1 else ''} ({source})[/dim]")


add_arguments = add_ask_args  # the hook cli.py looks for in a sub-command's module
