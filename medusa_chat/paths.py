"""Where medusa-chat keeps files it derives: the user cache dir (converted models, built kernels, calibrations)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from medusa_chat import envvars


def cache_root() -> Path:
    """Where medusa-chat keeps converted models and other derived files (platformdirs user cache)."""
    env = envvars.value("MEDUSA_CHAT_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("medusa-chat"))


_REPO = Path(__file__).resolve().parents[1]  # the checkout holding this package


def repo_path(value: str) -> str:
    """A path as a result JSON keeps it: relative to the repository (`assets/smollm2-135m/...`, a model beside it
    `../models/m.gguf`), a temp folder's `<tmp>/...`. What is not an absolute path (a Hub id, a registry alias,
    a path given relative) is kept as given. Outside a checkout (an installed wheel) paths are relative to the
    working directory."""
    if not value or not os.path.isabs(value):
        return value
    path = Path(os.path.realpath(value))
    base = _REPO if (_REPO / "pyproject.toml").is_file() else Path.cwd().resolve()
    if not path.is_relative_to(base):
        tmp = Path(os.path.realpath(tempfile.gettempdir()))
        if path.is_relative_to(tmp):
            return "<tmp>/" + path.relative_to(tmp).as_posix()
    try:
        return Path(os.path.relpath(path, base)).as_posix()
    except ValueError:  # another drive (Windows): no relative path exists
        return path.name
