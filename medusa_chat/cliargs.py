"""Command-line values every entry point reads alike: integer lists, and the reply settings from the options."""

from __future__ import annotations

import argparse
from typing import Any

from medusa_chat.events import GenerationSettings


def int_list(text: str) -> list[int]:
    """argparse type for options like `--tree-sizes 8,16,32`: positive integers, comma-separated."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """argparse type for counts like `--threads 2`."""
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from err
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def settings_from_args(args: Any) -> GenerationSettings:
    """The reply settings the options --max-new-tokens, --temperature, --top-p, --seed and --accept give,
    validated (before any slow load, so a bad option fails at once)."""
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=getattr(args, "seed", None),
        accept=getattr(args, "accept", "typical"),
    )
    settings.validate()
    return settings


def add_accept_arg(parser: argparse.ArgumentParser) -> None:
    """`--accept typical|exact`: the acceptance rule at temperature > 0 (chat, ask, bench)."""
    parser.add_argument(
        "--accept",
        choices=["typical", "exact"],
        default="typical",
        help="rule at temperature > 0: typical (the paper's, default: fast, favours the heads' guesses) or "
        "exact (replies keep the model's own sampling distribution)",
    )
