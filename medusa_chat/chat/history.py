"""A session's conversation between replies: its edits (undo, clear, the system prompt) and its files
(autosave after every change, save, list, load, delete, export; conversations.py's store and formats).

Apart from the turns (turns.py) because none of this decodes: it only has to wait for no reply to be running
(`_exclusive`). A part of SessionManager (chat/session.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from medusa_chat.chat.conversations import (
    Conversation,
    ConversationMeta,
    ConversationStore,
    export_conversation,
)
from medusa_chat.errors import BusyError, MedusaChatError
from medusa_chat.events import ReplySummary, StepEvent

if TYPE_CHECKING:
    import threading


class ConversationHistory:
    """The conversation part of SessionManager (a base class of it)."""

    store: ConversationStore
    conversation: Conversation
    notices: list[str]
    last_events: list[StepEvent]
    last_summary: ReplySummary | None
    _lock: threading.Lock

    if TYPE_CHECKING:  # SessionManager's: the reply lock, taken as a request takes it

        def _acquire(self, wait_s: float = 0.0) -> bool: ...

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Changes that must not interleave with a running reply."""
        if not self._acquire():
            raise BusyError("a reply is being generated: wait for it to finish or stop it first")
        try:
            yield
        finally:
            self._lock.release()

    def undo(self) -> None:
        """Remove the last exchange (the last reply and the user message it answered)."""
        with self._exclusive():
            msgs = self.conversation.messages
            if not msgs:
                raise MedusaChatError("nothing to undo")
            if msgs[-1].role == "assistant":
                msgs.pop()
            if msgs and msgs[-1].role == "user":
                msgs.pop()
            self.last_events, self.last_summary = [], None
            self._autosave()

    def clear(self) -> None:
        """Start a new, empty conversation with the same system prompt (the old one stays saved)."""
        with self._exclusive():
            old = self.conversation
            self.conversation = Conversation(system_prompt=old.system_prompt, model=old.model)
            self.last_events, self.last_summary = [], None
            self.notices = []

    def set_system(self, text: str) -> None:
        with self._exclusive():
            self.conversation.system_prompt = text.strip()
            self._autosave()

    def save(self, name: str | None = None) -> Path:
        """Save now (autosave does this anyway), optionally giving the conversation a title."""
        with self._exclusive():
            if name:
                self.conversation.title = name.strip()
            return self.store.save(self.conversation)

    def list_conversations(self) -> list[ConversationMeta]:
        return self.store.list_all()

    def load_conversation(self, id: str) -> Conversation:
        """Make a saved conversation current: by id, unique id prefix, title, or list number."""
        with self._exclusive():
            conv = self.store.load(self.store.resolve(id))
            self.conversation = conv
            self.last_events, self.last_summary = [], None
            return conv

    def delete_conversation(self, id: str) -> None:
        with self._exclusive():
            conv_id = self.store.resolve(id)
            self.store.delete(conv_id)
            if conv_id == self.conversation.id:
                old = self.conversation
                self.conversation = Conversation(system_prompt=old.system_prompt, model=old.model)
                self.last_events, self.last_summary = [], None

    def export(self, path: str | Path, fmt: str = "md") -> Path:
        return export_conversation(self.conversation, path, fmt)

    def _autosave(self) -> None:
        # An empty new conversation is not written (the list would fill with blanks); once it has a file,
        # every change (including undoing to empty) is written.
        conv = self.conversation
        if not conv.messages and not self.store.exists(conv.id):
            return
        # Autosave runs inside a reply's cleanup and before its generation: it must never raise. A disk error
        # (OSError) or a conversation the store refuses (MedusaChatError) becomes a notice; the conversation
        # stays in memory, whole, and /save or the next change tries again.
        try:
            self.store.save(conv)
        except (OSError, MedusaChatError) as err:
            self.notices.append(f"could not save the conversation ({err}); it is still here in memory")
