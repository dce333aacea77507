"""Where medusa-chat keeps files it derives: the user cache dir (converted models, built kernels, calibrations)."""

from __future__ import annotations

from pathlib import Path

from medusa_chat import envvars


def cache_root() -> Path:
    """Where medusa-chat keeps converted models and other derived files (platformdirs user cache)."""
    env = envvars.value("MEDUSA_CHAT_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("medusa-chat"))
