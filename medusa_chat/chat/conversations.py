"""Conversations on disk: one JSON file each, written atomically, listed, loaded, deleted and exported.

Every save goes through `medusa_chat.atomic` (a temporary file in the same folder, fsync'ed, then
`os.replace`d over the old file), so a crash or a kill at any moment leaves either the old conversation or the new
one, never half of one. The file name is the conversation's id: a file whose stored id says something else (copied,
renamed, edited by hand) is loaded under its file name, so saving it can never overwrite another conversation.
This module knows nothing about models: it stores plain text turns and the per-reply statistics as dicts.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from medusa_chat import envvars
from medusa_chat.atomic import TMP_PREFIX, atomic_write_text
from medusa_chat.errors import MedusaChatError
from medusa_chat.settings import GREEDY, TYPICAL

FORMAT_VERSION = 1
APP_NAME = "medusa-chat"
# Ids become file names: keep them to a safe alphabet so "/load ../../x" can never leave the folder.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,80}$")


def default_data_dir() -> Path:
    """The user data folder (platformdirs), or $MEDUSA_CHAT_DATA when set (tests, portable installs)."""
    env = envvars.value("MEDUSA_CHAT_DATA")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir(APP_NAME))


def new_conversation_id() -> str:
    """Sortable by creation time and unique enough for one user: 20250101-120000-a1b2c3."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


@dataclass
class Message:
    """One turn. `stats` holds the reply's ReplySummary numbers (assistant turns only)."""

    role: str  # "user" | "assistant"
    content: str
    stats: dict | None = None
    stopped: bool = False  # the user stopped this reply before it ended by itself

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Message:
        """A turn from a file, checked: a hand-edited or foreign file must fail here with a clear error, not
        later inside a UI (stats that are not a dict are dropped: they are informational)."""
        if not isinstance(data, dict):
            raise ValueError(f"a message is {type(data).__name__}, not an object")
        role = data.get("role")
        if role not in ("user", "assistant"):
            raise ValueError(f"a message has role {role!r} (expected 'user' or 'assistant')")
        content = data.get("content", "")
        stats = data.get("stats")
        return cls(
            role=role,
            content=content if isinstance(content, str) else str(content),
            stats=stats if isinstance(stats, dict) else None,
            stopped=bool(data.get("stopped", False)),
        )


@dataclass
class Conversation:
    id: str = field(default_factory=new_conversation_id)
    title: str = ""
    created: str = field(default_factory=_now)
    system_prompt: str = ""
    messages: list[Message] = field(default_factory=list)
    updated: str = field(default_factory=_now)
    model: str = ""  # the model that wrote the replies (informational)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["format"] = FORMAT_VERSION
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Conversation:
        if not isinstance(data, dict) or "id" not in data or not isinstance(data.get("messages", []), list):
            raise ValueError("not a medusa-chat conversation")
        return cls(
            id=str(data["id"]),
            title=str(data.get("title", "")),
            created=str(data.get("created", "")),
            system_prompt=str(data.get("system_prompt", "")),
            messages=[Message.from_dict(m) for m in data.get("messages", [])],
            updated=str(data.get("updated", data.get("created", ""))),
            model=str(data.get("model", "")),
        )

    def display_title(self) -> str:
        if self.title:
            return self.title
        first = next((m.content for m in self.messages if m.role == "user"), "")
        first = " ".join(first.split())
        return (first[:48] + "...") if len(first) > 48 else (first or "(empty)")

    def turns(self) -> list[dict[str, str]]:
        """The chat-template messages, system first (omitted when empty: templates then use their default)."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return out + [{"role": m.role, "content": m.content} for m in self.messages]


@dataclass
class ConversationMeta:
    id: str
    title: str
    created: str
    updated: str
    messages: int
    path: Path


class ConversationStore:
    """A folder of `<id>.json` files."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else default_data_dir() / "conversations"

    def path_for(self, conv_id: str) -> Path:
        if not _ID_RE.match(conv_id):
            raise MedusaChatError(f"invalid conversation id {conv_id!r}")
        return self.root / f"{conv_id}.json"

    def exists(self, conv_id: str) -> bool:
        return _ID_RE.match(conv_id) is not None and self.path_for(conv_id).is_file()

    def save(self, conv: Conversation) -> Path:
        """Write `conv` to `<id>.json` (private to this user: 0600). MedusaChatError for an id that cannot be a
        file name, OSError when the disk refuses; the old file is intact either way."""
        path = self.path_for(conv.id)
        conv.updated = _now()
        atomic_write_text(path, json.dumps(conv.to_dict(), ensure_ascii=False, indent=1), mode=0o600)
        return path

    @staticmethod
    def _read(path: Path) -> Conversation:
        conv = Conversation.from_dict(json.loads(path.read_text(encoding="utf-8")))
        # The file name is the id (see the module docstring): a stored id that differs, or is not a valid id at
        # all, must not send the next save to another file.
        conv.id = path.stem
        return conv

    def load(self, conv_id: str) -> Conversation:
        path = self.path_for(conv_id)
        try:
            return self._read(path)
        except FileNotFoundError:
            raise MedusaChatError(
                f"no saved conversation {conv_id!r} (see the list of conversations)"
            ) from None
        except (OSError, ValueError, KeyError, TypeError) as err:  # JSONDecodeError is a ValueError
            raise MedusaChatError(f"cannot read conversation file {path}: {err}") from err

    def list_all(self) -> list[ConversationMeta]:
        """Saved conversations, most recently updated first. Unreadable files are skipped, not fatal."""
        out: list[ConversationMeta] = []
        if not self.root.is_dir():
            return out
        for path in self.root.glob("*.json"):
            if path.name.startswith(TMP_PREFIX) or not _ID_RE.match(path.stem):
                continue  # a temp file left by a crash mid-write: never a conversation
            try:
                conv = self._read(path)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            out.append(
                ConversationMeta(
                    id=conv.id,
                    title=conv.display_title(),
                    created=conv.created,
                    updated=conv.updated,
                    messages=len(conv.messages),
                    path=path,
                )
            )
        out.sort(key=lambda m: (m.updated, m.id), reverse=True)
        return out

    def resolve(self, name: str) -> str:
        """An id from an exact id, a unique id prefix, an exact title, or a list number (1 = newest)."""
        name = name.strip()
        if not name:
            raise MedusaChatError("which conversation? give its id, title or number from the list")
        if self.exists(name):
            return name
        metas = self.list_all()
        if name.isdigit() and 1 <= int(name) <= len(metas):
            return metas[int(name) - 1].id
        for matches in (
            [m for m in metas if m.title == name],
            [m for m in metas if m.title.lower() == name.lower()],
            [m for m in metas if m.id.startswith(name)],
        ):
            if len(matches) == 1:
                return matches[0].id
            if len(matches) > 1:
                raise MedusaChatError(
                    f"{name!r} matches {len(matches)} conversations: use the id ({', '.join(m.id for m in matches[:5])})"
                )
        raise MedusaChatError(f"no saved conversation {name!r} (see the list of conversations)")

    def delete(self, conv_id: str) -> None:
        path = self.path_for(conv_id)
        try:
            path.unlink()
        except FileNotFoundError:
            raise MedusaChatError(f"no saved conversation {conv_id!r}") from None


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def hard_line_breaks(text: str) -> str:
    """`text` with every line break inside a paragraph made a Markdown hard break (two trailing spaces), so any
    Markdown viewer shows the lines the model wrote (a haiku, an address, a list without blank lines) instead of
    joining them. Code fences are left exactly as they are; blank lines and lines that already end in a hard
    break are unchanged."""
    lines = text.split("\n")
    out: list[str] = []
    fence: str | None = None  # the opening fence's characters while inside a fenced block
    for i, line in enumerate(lines):
        match = _FENCE.match(line)
        if fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = None
            out.append(line)
            continue
        if match:
            fence = match.group(1)
            out.append(line)
            continue
        soft = i + 1 < len(lines) and line.strip() and lines[i + 1].strip() and not _FENCE.match(lines[i + 1])
        if soft and not line.endswith(("  ", "\\")):
            line = line.rstrip(" ") + "  "
        out.append(line)
    return "\n".join(out)


def _number(value: object) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None  # type: ignore[arg-type]


def _stats_markdown(stats: dict | None) -> str:
    """The statistics line under an exported reply, from numbers only: a file edited by hand can hold anything
    in `stats`, and that must neither break the export nor put markup into it."""
    if not stats:
        return ""
    new, per_step, tps = (
        _number(stats.get(k)) for k in ("new_tokens", "tokens_per_step", "decode_tokens_per_s")
    )
    if not new:
        return ""
    bits = [f"{new:.0f} tokens"]
    if per_step is not None:
        bits.append(f"{per_step:.2f} tokens/step")
    if tps is not None:
        bits.append(f"{tps:.1f} tokens/s")
    if stats.get("accept_mode") in (GREEDY, TYPICAL):
        bits.append(str(stats["accept_mode"]))
    return "<sub>" + ", ".join(bits) + "</sub>"


def to_markdown(conv: Conversation) -> str:
    lines = [
        f"# {conv.display_title()}",
        "",
        f"*{conv.created}*" + (f" - {conv.model}" if conv.model else ""),
        "",
    ]
    if conv.system_prompt:
        system = hard_line_breaks(conv.system_prompt)
        lines += ["**System:**", ""] + [f"> {ln}" for ln in system.splitlines()] + [""]
    for msg in conv.messages:
        lines += [f"**{msg.role.capitalize()}:**", "", hard_line_breaks(msg.content), ""]
        if msg.stopped:
            lines += ["*(stopped)*", ""]
        stats_line = _stats_markdown(msg.stats)
        if stats_line:
            lines += [stats_line, ""]
    return "\n".join(lines).rstrip() + "\n"


def export_conversation(conv: Conversation, path: Path | str, fmt: str = "md") -> Path:
    """Write `conv` as Markdown ("md") or JSON ("json") to `path` (atomically, like the autosave)."""
    path = Path(path).expanduser()
    fmt = fmt.lower().lstrip(".")
    if fmt in ("md", "markdown"):
        text = to_markdown(conv)
    elif fmt == "json":
        text = json.dumps(conv.to_dict(), ensure_ascii=False, indent=1) + "\n"
    else:
        raise MedusaChatError(f"unknown export format {fmt!r}: use md or json")
    try:
        atomic_write_text(path, text)
    except OSError as err:
        raise MedusaChatError(f"cannot write {path}: {err}") from err
    return path
