"""The session manager: one conversation, its settings and statistics, driving one MedusaEngine.

Both UIs (Rich REPL, Gradio) and the HTTP API talk only to this class. It imports no UI code and holds no
decoding logic. Its jobs:
- this module: the model and engine (built on `load()`), the tree and its calibration on a first start, the
  settings, the reply lock that keeps one reply at a time, and the changes between replies, each under that lock;
- turns.py (its base class): a turn: the prompt within the context window, the engine's reply streamed, kept;
- it holds its history (history.py: the conversation between replies, undo, clear, the system prompt, and its
  files) and its speed meter (speed.py: measured or estimated speedup).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from medusa_chat import compute, envvars
from medusa_chat.chat.conversations import Conversation, ConversationMeta, ConversationStore, default_data_dir
from medusa_chat.chat.history import ConversationHistory
from medusa_chat.chat.speed import BASELINE_TOKENS, SpeedMeter
from medusa_chat.chat.turns import ReplyTurns
from medusa_chat.errors import BusyError
from medusa_chat.events import GenerationSettings, ReplySummary, StepEvent
from medusa_chat.settings import parse_settings
from medusa_chat.tree import Tree

if TYPE_CHECKING:
    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.model.sources.loading import LoadedModel


@dataclasses.dataclass(frozen=True)
class SessionOptions:
    """What a session loads: the model, its heads, the numeric path (quant, dtype, device) and the tree (a name or
    file, and a size), as the common model options (cli.add_model_options) name them."""

    model: str = "smollm2-135m"
    heads: str | None = None
    quant: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    tree: str | None = None
    tree_size: int | None = None
    trust_remote_code: bool = False

    @classmethod
    def from_args(cls, args: Any) -> SessionOptions:
        """The options from parsed flags; a flag a sub-command lacks (or leaves unset) keeps its default."""
        return cls(
            model=getattr(args, "model", None) or "smollm2-135m",
            heads=getattr(args, "heads", None),
            quant=getattr(args, "quant", None) or "auto",
            dtype=getattr(args, "dtype", None) or "auto",
            device=getattr(args, "device", None) or "auto",
            tree=getattr(args, "tree", None),
            tree_size=getattr(args, "tree_size", None),
            trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
        )


class SessionManager(ReplyTurns):
    """One chat session. Not a model wrapper: the model and engine are built on `load()`. Its turns (send, ...)
    are turns.ReplyTurns'; it holds its conversation's edits and files (`history`) and its speed meter (`speed`).

    `loaded`: a model already loaded (the options' model fields then only name it); `data_dir`: where the
    conversations are saved; `auto_calibrate`: None follows MEDUSA_CHAT_AUTO_CALIBRATE."""

    def __init__(
        self,
        options: SessionOptions | None = None,
        data_dir: Path | None = None,
        loaded: LoadedModel | None = None,
        auto_calibrate: bool | None = None,
    ) -> None:
        o = options or SessionOptions()
        self.options = o
        self.model_name = o.model
        self.heads_arg = o.heads
        self.quant_arg = o.quant
        self.dtype_arg = o.dtype
        self.device_arg = o.device
        self.trust_remote_code = o.trust_remote_code
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        self.history = ConversationHistory(ConversationStore(self.data_dir / "conversations"), Conversation(model=o.model))
        self.speed = SpeedMeter()
        self.loaded: LoadedModel | None = loaded
        self.engine: MedusaEngine | None = None
        self.settings = GenerationSettings.for_entry("chat")  # the app's reply defaults (DRY on: settings.py)
        self.last_events: list[StepEvent] = []
        self.last_summary: ReplySummary | None = None
        # Things the UI should tell the user about the last action (dropped turns, failed autosave, ...).
        self.notices: list[str] = []
        self._tree_request: tuple[str | None, int | None] = (o.tree, o.tree_size)
        if auto_calibrate is None:  # MEDUSA_CHAT_AUTO_CALIBRATE=0 turns it off (the test suite does)
            auto_calibrate = envvars.auto_calibrate()
        self.auto_calibrate = auto_calibrate
        self._lock = threading.Lock()  # held for the whole of a reply
        self._load_lock = threading.Lock()
        self._stop = threading.Event()
        # A big model's first start answers with plain decoding and calibrates this CPU afterwards, while the
        # user reads the reply (first_start.resolve_tree's `defer`): under the reply lock, in its own thread, and
        # a new request cancels it (it is tried again after that reply).
        self.calibration_pending = False
        self._calibration_cancel = threading.Event()
        self._calibration_thread: threading.Thread | None = None

    @classmethod
    def from_args(cls, args: Any) -> SessionManager:
        """A session from the common model options (cli.add_model_options), as web and serve build it."""
        return cls(SessionOptions.from_args(args))

    # ---- model ----------------------------------------------------------------------------------------------
    def load(self, progress: Callable[[str], None] | None = None) -> None:
        """Load the model and build the engine; a no-op when already done. Runs on the compute thread, where the
        replies run too (compute.py)."""
        compute.run(self._load, progress)

    def _load(self, progress: Callable[[str], None] | None) -> None:
        with self._load_lock:
            if self.engine is not None:
                return
            if self.loaded is None:
                from medusa_chat.model.sources.loading import load_model

                self.loaded = load_model(
                    model=self.model_name,
                    heads=self.heads_arg,
                    quant=self.quant_arg,
                    dtype=self.dtype_arg,
                    device=self.device_arg,
                    progress=progress,
                    trust_remote_code=self.trust_remote_code,
                )
            from medusa_chat.engine.engine import MedusaEngine

            tree = self._resolve_tree(*self._tree_request, progress)
            if progress is not None:
                progress(f"tree {tree.name} ({tree.size} node{'s' if tree.size != 1 else ''})")
            self.engine = MedusaEngine(self.loaded, tree=tree)
            self.conversation.model = self.loaded.spec.name
            self.speed.recall_baseline(self.loaded)

    @property
    def is_loaded(self) -> bool:
        return self.engine is not None

    def _require_engine(self) -> MedusaEngine:
        if self.engine is None:
            self.load()
        assert self.engine is not None
        return self.engine

    def _resolve_tree(
        self, name: str | None, size: int | None, progress: Callable[[str], None] | None = None
    ) -> Tree:
        # One rule for every entry point (first_start.resolve_tree): --tree/--tree-size, else this machine's
        # cached calibration, else (on a CPU) calibrate once now, or for a big model after its first reply.
        # The reason is shown in the UIs' model panel.
        from medusa_chat.tuning.first_start import PROVISIONAL_SOURCE, resolve_tree
        from medusa_chat.tuning.tree_choice import choose_tree

        assert self.loaded is not None
        try:
            tree, self.tree_source = resolve_tree(
                self.loaded, name, size, progress, self.auto_calibrate, defer=True
            )
        except (OSError, RuntimeError, ValueError) as err:  # a failed timing must not stop the chat
            self.notices.append(f"tree calibration failed ({err}); using the default tree")
            tree, self.tree_source = choose_tree(self.loaded, name, size)
        self.calibration_pending = self.tree_source == PROVISIONAL_SOURCE
        self.speed.read_latencies(self.loaded)  # read once here, not per streamed step
        return tree

    # ---- calibration after the first reply ------------------------------------------------------------------
    @property
    def calibrating(self) -> bool:
        thread = self._calibration_thread
        return thread is not None and thread.is_alive()

    def _acquire(self, wait_s: float = 0.0) -> bool:
        """The reply lock for a request: a background calibration holding it is cancelled and waited for (it
        stops within a decoding step); a reply holding it is waited for `wait_s`, else refused."""
        if self._lock.acquire(blocking=False):
            return True
        if self.calibrating:
            self._calibration_cancel.set()
            return self._lock.acquire(timeout=max(wait_s, 120.0))
        return self._lock.acquire(timeout=wait_s) if wait_s > 0 else False

    def _release_reply(self) -> None:
        self._lock.release()
        self._calibrate_when_idle()

    def _calibrate_when_idle(self) -> None:
        if not self.calibration_pending or self.loaded is None or self.calibrating:
            return
        self._calibration_cancel.clear()
        # A thread of its own, not the compute thread: a reply must be able to start (and cancel it) meanwhile.
        # Its OpenMP team ends with it (compute.py), so replies after it run at full speed again.
        self._calibration_thread = threading.Thread(
            target=self._calibrate_in_background, name="medusa-chat-calibration", daemon=True
        )
        self._calibration_thread.start()

    def _calibrate_in_background(self) -> None:
        from medusa_chat.tuning.calibrate import CalibrationCancelled
        from medusa_chat.tuning.first_start import calibrate_first_start
        from medusa_chat.tuning.tree_choice import choose_tree

        if not self._lock.acquire(blocking=False):
            return  # a new reply came first: tried again after it
        try:
            if not self.calibration_pending or self.loaded is None or self.engine is None:
                return
            base, why = choose_tree(self.loaded, *self._tree_request)
            if why != "default":  # the user chose a tree meanwhile
                self.calibration_pending = False
                return
            try:
                tree, source = calibrate_first_start(self.loaded, base, cancel=self._calibration_cancel)
            except CalibrationCancelled:
                return  # still pending: after the next reply
            except (OSError, RuntimeError, ValueError) as err:
                self.calibration_pending = False
                self.notices.append(f"tree calibration failed ({err}); staying with plain decoding")
                return
            self.engine.set_tree(tree)
            self.tree_source = source
            self.speed.read_latencies(self.loaded)
            self.calibration_pending = False
        finally:
            self._lock.release()

    def wait_for_calibration(self, timeout_s: float | None = None) -> bool:
        """Block until a background calibration ends (ask, and tests); True when none is running after."""
        thread = self._calibration_thread
        if thread is not None:
            thread.join(timeout_s)
        return not self.calibrating

    def close(self) -> None:
        """Cancel a background calibration (the app is closing): nothing half-measured is saved."""
        self._calibration_cancel.set()
        self.wait_for_calibration(30.0)

    @property
    def tree(self) -> Tree | None:
        return self.engine.tree if self.engine is not None else None

    @property
    def info(self) -> dict[str, Any]:
        """LoadedModel.info() plus the tree and the acceptance mode (before load: what was asked for)."""
        if self.loaded is not None:
            out = dict(self.loaded.info())
            out.setdefault("context_limit", self.loaded.context_limit)
        else:
            out = {
                "model": self.model_name,
                "heads": self.heads_arg,
                "quant": self.quant_arg,
                "device": self.device_arg,
                "dtype": self.dtype_arg,
            }
        tree = self.tree
        out["tree"] = tree.name if tree is not None else (self._tree_request[0] or "default")
        note = self.engine.tree_note if self.engine is not None else ""  # ", shaped per step by the draft"
        out["tree_source"] = getattr(self, "tree_source", "default") + note
        out["tree_size"] = tree.size if tree is not None else self._tree_request[1]
        out["accept_mode"] = self.settings.accept_mode
        out["context_lookup"] = self.settings.context_lookup
        out["baseline_tokens_per_s"] = self.baseline_tokens_per_s
        return out

    # ---- settings -------------------------------------------------------------------------------------------
    def update_settings(self, **changes: Any) -> GenerationSettings:
        """Change settings for the next reply (a running reply keeps its own copy). Each value is converted and
        checked by its option (settings.parse_settings); unknown names and bad values raise MedusaChatError
        and leave the settings unchanged."""
        new = dataclasses.replace(self.settings, **parse_settings(changes))
        new.validate()
        self.settings = new
        return new

    def set_tree(self, name_or_file: str | None, size: int | None) -> None:
        """Switch the tree between replies: a published name, chain-N, a JSON file, or None (model default);
        `size` takes the first `size` nodes."""
        with self._exclusive():
            if self.loaded is None:
                self._tree_request = (name_or_file, size)  # applied by load()
                return
            tree = self._resolve_tree(name_or_file, size)  # a bad name raises here, before anything changes
            self._tree_request = (name_or_file, size)
            if self.engine is None:
                self.load()  # e.g. the first load failed on the tree: retry with this one
            else:
                self.engine.set_tree(tree)


    # ---- the conversation between replies (history.py), each change under the reply lock ------------------------
    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Changes that must not interleave with a running reply."""
        if not self._acquire():
            raise BusyError("a reply is being generated: wait for it to finish or stop it first")
        try:
            yield
        finally:
            self._lock.release()

    @property
    def conversation(self) -> Conversation:
        return self.history.conversation

    @conversation.setter
    def conversation(self, conversation: Conversation) -> None:
        self.history.conversation = conversation

    @property
    def store(self) -> ConversationStore:
        return self.history.store

    def _forget_reply(self) -> None:
        self.last_events, self.last_summary = [], None

    def _autosave(self) -> None:
        notice = self.history.autosave()
        if notice:
            self.notices.append(notice)

    def undo(self) -> None:
        """Remove the last exchange (the last reply and the user message it answered)."""
        with self._exclusive():
            self.history.undo()
            self._forget_reply()
            self._autosave()

    def clear(self) -> None:
        """Start a new, empty conversation with the same system prompt (the old one stays saved)."""
        with self._exclusive():
            self.history.start_new()
            self._forget_reply()
            self.notices = []

    def set_system(self, text: str) -> None:
        with self._exclusive():
            self.history.set_system(text)
            self._autosave()

    def save(self, name: str | None = None) -> Path:
        """Save now (autosave does this anyway), optionally giving the conversation a title."""
        with self._exclusive():
            return self.history.save(name)

    def list_conversations(self) -> list[ConversationMeta]:
        return self.history.list_all()

    def load_conversation(self, id: str) -> Conversation:
        """Make a saved conversation current: by id, unique id prefix, title, or list number."""
        with self._exclusive():
            conv = self.history.load(id)
            self._forget_reply()
            return conv

    def delete_conversation(self, id: str) -> None:
        with self._exclusive():
            if self.history.delete(id):
                self._forget_reply()

    def export(self, path: str | Path, fmt: str = "md") -> Path:
        return self.history.export(path, fmt)

    # ---- speed (speed.py) ----------------------------------------------------------------------------------------
    @property
    def baseline_tokens_per_s(self) -> float | None:
        return self.speed.baseline_tokens_per_s

    @baseline_tokens_per_s.setter
    def baseline_tokens_per_s(self, value: float | None) -> None:
        self.speed.baseline_tokens_per_s = value

    def speedup(self, tokens_per_s: float, tokens_per_step: float) -> tuple[float, str]:
        """(speedup, "measured" | "estimated"): SpeedMeter.speedup for the engine's tree."""
        size = self.engine.tree.size if self.loaded is not None and self.engine is not None else None
        return self.speed.speedup(tokens_per_s, tokens_per_step, size)

    def measure_baseline(self, max_new_tokens: int = BASELINE_TOKENS) -> float:
        """Plain decoding speed on a fixed prompt (SpeedMeter.measure_baseline); later speedups are "measured"."""
        with self._exclusive():
            engine = self._require_engine()
            assert self.loaded is not None
            return self.speed.measure_baseline(engine, self.loaded, self._stop, max_new_tokens)
