"""The one way this package replaces a file on disk (atomically and durably), and reads a JSON file back.

`atomic_write(path, write)` calls `write(fh)` on a new temporary file in the same folder (a unique name, so two
writers never share one), flushes and fsyncs it, `os.replace`s it over `path`, then fsyncs the folder. A reader,
a crash or a SIGKILL at any moment sees the old file or the new one, never a mix; a failed write removes its
temporary file and leaves the old one untouched. Conversations, exports, the calibration cache, trained heads
and their config/tree files, and the distillation store all go through here.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from medusa_chat.errors import MedusaChatError

# Temporary files start with this prefix (and end in TMP_SUFFIX): a listing that globs "*.json" never sees them,
# and one that looks at every file can tell a crash's leftover from real data.
TMP_PREFIX = ".tmp-"
TMP_SUFFIX = ".part"


def temp_path_for(path: Path) -> Path:
    """A fresh, unique temporary name next to `path` (same folder, so os.replace never crosses filesystems)."""
    return path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}")


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX). Windows cannot open a folder for fsync; it does not need to."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path | str, write: Callable[[IO[bytes]], Any], *, mode: int = 0o666) -> Path:
    """Replace `path` with what `write(fh)` writes to a binary file handle; see the module docstring.

    `mode` is the new file's permission before the umask (0o666 gives what `open()` would; conversations pass
    0o600 because chats are private)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(path)
    # O_EXCL: never write through a file (or a symlink) that somebody else put at the temporary name.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())  # the data must be on disk before the rename makes it visible
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: Path | str, data: bytes, *, mode: int = 0o666) -> Path:
    return atomic_write(path, lambda fh: fh.write(data), mode=mode)


def atomic_write_text(path: Path | str, text: str, *, mode: int = 0o666) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def atomic_write_json(path: Path | str, obj: Any, *, mode: int = 0o666, indent: int | None = 1) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False), mode=mode)


def replace_folder(out: Path, write: Callable[[Path], Any], prefix: str = ".tmp-") -> Path:
    """Build a folder with `write(tmp)` in a temporary folder beside `out`, then put it in `out`'s place: a crash
    or an error mid-way leaves the old folder (or none), never a half-written one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    try:
        write(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; {} when the file does not exist."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as err:
        raise MedusaChatError(f"cannot read {path}: {err}") from err
    if not isinstance(data, dict):
        raise MedusaChatError(f"{path} is not a JSON object")
    return data
