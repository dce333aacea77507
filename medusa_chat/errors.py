"""One exception family, so every UI can show a clear one-line message instead of a stack trace."""

from __future__ import annotations


class MedusaChatError(Exception):
    """An error a user can act on. str(err) is the whole message, written for a person."""


class ModelNotFoundError(MedusaChatError):
    """Unknown model name, or a Hub repo / local path that does not exist."""


class OfflineError(MedusaChatError):
    """A file is needed from the Hub but the Hub cannot be reached (or offline mode is on)."""


class HeadsError(MedusaChatError):
    """Medusa heads missing, corrupt, or not matching the backbone."""


class TreeError(MedusaChatError):
    """A tree layout that cannot be used with these heads."""


class DeviceError(MedusaChatError):
    """The requested device / quantization is not available here (e.g. no CUDA GPU)."""


class PromptError(MedusaChatError):
    """Empty prompt, or a prompt that does not fit the model's context window."""


class SettingError(MedusaChatError, ValueError):
    """An environment variable (envvars.py) with a value the app cannot use: named, with the values it takes."""


class BusyError(MedusaChatError):
    """A reply is already being generated in this session."""
