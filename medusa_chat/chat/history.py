"""A session's conversation between replies: its edits (undo, clear, the system prompt) and its files
(autosave after every change, save, list, load, delete, export; conversations.py's store and formats).

Apart from the turns (turns.py) because none of this decodes: the session only has to wait for no reply to be
running (`SessionManager._exclusive`) around each change.
"""

from __future__ import annotations

from pathlib import Path

from medusa_chat.chat.conversations import (
    Conversation,
    ConversationMeta,
    ConversationStore,
    export_conversation,
)
from medusa_chat.errors import MedusaChatError


class ConversationHistory:
    """The conversation a session keeps between replies, and its files. SessionManager holds one
    (`session.history`) and makes each change under its reply lock (`SessionManager._exclusive`)."""

    def __init__(self, store: ConversationStore, conversation: Conversation) -> None:
        self.store = store
        self.conversation = conversation

    def undo(self) -> None:
        """Remove the last exchange (the last reply and the user message it answered)."""
        msgs = self.conversation.messages
        if not msgs:
            raise MedusaChatError("nothing to undo")
        if msgs[-1].role == "assistant":
            msgs.pop()
        if msgs and msgs[-1].role == "user":
            msgs.pop()

    def start_new(self) -> None:
        """A new, empty conversation with the same system prompt (the old one stays saved)."""
        old = self.conversation
        self.conversation = Conversation(system_prompt=old.system_prompt, model=old.model)

    def set_system(self, text: str) -> None:
        self.conversation.system_prompt = text.strip()

    def save(self, name: str | None = None) -> Path:
        """Save now (autosave does this anyway), optionally giving the conversation a title."""
        if name:
            self.conversation.title = name.strip()
        return self.store.save(self.conversation)

    def list_all(self) -> list[ConversationMeta]:
        return self.store.list_all()

    def load(self, id: str) -> Conversation:
        """Make a saved conversation current: by id, unique id prefix, title, or list number."""
        self.conversation = self.store.load(self.store.resolve(id))
        return self.conversation

    def delete(self, id: str) -> bool:
        """Delete a saved conversation; True where it was the current one (a new one starts)."""
        conv_id = self.store.resolve(id)
        self.store.delete(conv_id)
        if conv_id != self.conversation.id:
            return False
        self.start_new()
        return True

    def export(self, path: str | Path, fmt: str = "md") -> Path:
        return export_conversation(self.conversation, path, fmt)

    def autosave(self) -> str | None:
        """Write the conversation; None, or what to tell the user where that failed."""
        # An empty new conversation is not written (the list would fill with blanks); once it has a file,
        # every change (including undoing to empty) is written.
        conv = self.conversation
        if not conv.messages and not self.store.exists(conv.id):
            return None
        # Autosave runs inside a reply's cleanup and before its generation: it must never raise. A disk error
        # (OSError) or a conversation the store refuses (MedusaChatError) becomes a notice; the conversation
        # stays in memory, whole, and /save or the next change tries again.
        try:
            self.store.save(conv)
        except (OSError, MedusaChatError) as err:
            return f"could not save the conversation ({err}); it is still here in memory"
        return None
