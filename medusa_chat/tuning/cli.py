"""`medusa-chat calibrate`: its options and entry point."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from medusa_chat.cliargs import int_list
from medusa_chat.errors import MedusaChatError
from medusa_chat.tree import Tree
from medusa_chat.tuning.calibrate import CPU_SIZES, DEFAULT_SIZES, StepTiming, calibrate, calibrate_on_replies
from medusa_chat.tuning.first_start import calibration_is_long
from medusa_chat.tuning.measure import CALIBRATION_PROMPTS, DEFAULT_PREFIX_TOKENS
from medusa_chat.tuning.tree_choice import (  # the runtime half (what the session needs), re-exported here
    describe_calibration,
    save_calibration,
)


def add_calibrate_args(parser: argparse.ArgumentParser) -> None:
    """Options of `medusa-chat calibrate` (model/heads/quant/dtype/device/tree come from the common options)."""
    parser.add_argument(
        "--sizes",
        type=int_list,
        default=None,
        help=f"tree sizes to time, capped at the tree's size (default: {list(DEFAULT_SIZES)} for trial steps, "
        f"{list(CPU_SIZES)} for replies)",
    )
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        default=DEFAULT_PREFIX_TOKENS,
        help="tokens already in the KV cache while timing (default: %(default)s)",
    )
    parser.add_argument(
        "--reps", type=int, default=8, help="timed steps per size; the median is used (default: %(default)s)"
    )
    parser.add_argument(
        "--accuracy",
        type=Path,
        default=None,
        metavar="TREE_JSON",
        help="tree.json with expected_tokens_per_step (default: the heads folder's tree.json)",
    )
    parser.add_argument(
        "--timing",
        choices=("auto", "steps", "replies"),
        default="auto",
        help="what is timed per size: trial steps with a cached prefix, or real greedy replies to built-in prompts "
        "(slower, but a reply's own steps: its lookup runs, its host work); auto: replies on a CPU for a model "
        "of the embedded one's size, as the first start does (default: %(default)s)",
    )
    parser.add_argument(
        "--measure-replies",
        type=int,
        default=None,
        help="greedy replies: to measure tokens/step when no tree.json has it (steps, default 4), or timed per "
        "size (replies, default all 12 built-in prompts)",
    )
    parser.add_argument(
        "--measure-tokens", type=int, default=64, help="tokens per measuring reply (default: %(default)s)"
    )
    parser.add_argument(
        "--measure-accuracy",
        action="store_true",
        help="measure tokens/step with greedy replies even when tree.json has expected values",
    )
    parser.add_argument("--no-save", action="store_true", help="print the result but do not cache it")
    parser.add_argument("--json", action="store_true", help="print the calibration record as JSON")


def calibrate_main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from medusa_chat.model.sources.loading import load_from_args

    err = Console(stderr=True)
    out = Console()
    try:
        loaded = load_from_args(args, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
        base = Tree.named(args.tree) if getattr(args, "tree", None) else loaded.default_tree
        if getattr(args, "tree_size", None):
            base = base.prefix(min(args.tree_size, base.size))
        progress = lambda m: err.print(f"[dim]{m}[/dim]")  # noqa: E731
        timing = args.timing
        if timing == "auto":
            small = not calibration_is_long(loaded)
            drafted = loaded.heads is not None
            timing = "replies" if loaded.device.type == "cpu" and small and drafted else "steps"
        if timing == "replies":
            result = calibrate_on_replies(
                loaded,
                base,
                sizes=args.sizes,
                replies=args.measure_replies or len(CALIBRATION_PROMPTS),
                reply_tokens=args.measure_tokens,
                timing=StepTiming(args.prefix_tokens, args.reps, progress, None),
            )
        else:
            result = calibrate(
                loaded,
                base,
                sizes=args.sizes or DEFAULT_SIZES,
                prefix_tokens=args.prefix_tokens,
                reps=args.reps,
                accuracy_file=args.accuracy,
                measure_replies=args.measure_replies or 4,
                measure_tokens=args.measure_tokens,
                progress=progress,
                measure_accuracy=args.measure_accuracy,
            )
    except MedusaChatError as e:
        err.print(f"[red]error:[/red] {e}")
        return 1
    if not args.no_save:
        path = save_calibration(result, result["model"], loaded.device, result["quant"], result["dtype"])
        result["saved_to"] = str(path)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
        return 0
    table = Table(
        title=f"{result['model']} on {result['device_name']} ({result['quant']}, {result['dtype']}), "
        + (
            "greedy replies to built-in prompts"
            if result.get("timing") == "replies"
            else f"{result['prefix_tokens']}-token context"
        )
    )
    for col in ("nodes", "step ms", "tokens/step", "est. tokens/s", "est. speedup"):
        table.add_column(col, justify="right")
    for row in result["sizes"]:
        mark = " <" if row["size"] == result["tree_size"] else ""
        table.add_row(
            str(row["size"]) + mark,
            f"{row['latency_s'] * 1000:.1f}",
            f"{row['tokens_per_step']:.2f}",
            f"{row['tokens_per_s_est']:.1f}",
            f"{row['speedup_est']:.2f}x",
        )
    out.print(table)
    out.print(f"tokens/step from {result['accuracy_source']}")
    if result.get("replies_identical") is False:
        out.print("[red]the sizes' greedy replies differ: a tree step is not exact on this path[/red]")
    out.print(
        f"chosen: {describe_calibration(result)} - first {result['tree_size']} nodes of {result['tree']}"
    )
    if "saved_to" in result:
        out.print(f"saved to {result['saved_to']}")
    if not math.isfinite(result["speedup_est"]) or result["speedup_est"] <= 1.0:
        out.print("[yellow]no tree beats plain decoding on this device by the estimate[/yellow]")
    return 0


add_arguments = add_calibrate_args  # the hook cli.py looks for in a sub-command's module
