"""Command-line values every entry point reads alike: integer lists, and the generation options (their flags
from medusa_chat/settings.py, the reply settings from their values)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from medusa_chat.events import GenerationSettings
from medusa_chat.settings import ENTRY_OPTIONS, OPTIONS, OVERRIDE_ONLY, parse_settings


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


def add_generation_args(parser: Any, entry: str) -> None:
    """The generation options `entry` takes (settings.ENTRY_OPTIONS), each from its one definition
    (settings.OPTIONS): flags, default (the entry point's own where it differs on purpose), check and help.
    `parser` is an ArgumentParser or an argument group. In an override-only entry point (chat) every flag
    defaults to None: only what is given changes the session's settings."""
    override = entry in OVERRIDE_ONLY
    for name in ENTRY_OPTIONS[entry]:
        option = OPTIONS[name]
        default = None if override else option.default_for(entry)
        help_text = option.help.replace("%(default)s", str(option.default_for(entry))) if override else option.help
        if option.switch_off:
            parser.add_argument(*option.flags, dest=name, action="store_false", help=help_text)
            continue
        parser.add_argument(
            *option.flags, dest=name, type=option.type, choices=option.choices, default=default, help=help_text
        )


def given_settings(args: Any) -> dict[str, Any]:
    """The generation options given in `args` (every OPTIONS name `args` has, None = not given), as given: what
    converts and checks them is settings.parse_settings, once, here (settings_from_args) or in the session
    (SessionManager.update_settings)."""
    return {name: getattr(args, name) for name in OPTIONS if getattr(args, name, None) is not None}


def settings_from_args(args: Any, base: GenerationSettings | None = None) -> GenerationSettings:
    """The reply settings `args`' generation options give over `base` (default: GenerationSettings()),
    validated (before any slow load, so a bad option fails at once)."""
    settings = dataclasses.replace(base or GenerationSettings(), **parse_settings(given_settings(args)))
    settings.validate()
    return settings
