"""A chat: the session (turns, settings, history) and saved conversations."""
