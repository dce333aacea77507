"""The session manager: one conversation, its settings and statistics, driving one MedusaEngine.

Both UIs (Rich REPL, Gradio) talk only to this class. It builds prompts with the model's chat template (dropping
the oldest turns when the conversation outgrows the context window), serialises replies (one at a time), forwards
the engine's events unchanged, keeps a stopped reply (marked stopped), and autosaves the conversation atomically
after every change. It imports no UI code and holds no decoding logic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.chat.conversations import (
    Conversation,
    ConversationMeta,
    ConversationStore,
    Message,
    default_data_dir,
    export_conversation,
)
from medusa_chat.chat.speed import MEASURED_BASELINES, SpeedMeter
from medusa_chat.chat.stream import Item, ReplyStream
from medusa_chat.errors import BusyError, MedusaChatError, PromptError
from medusa_chat.events import GenerationSettings, ReplySummary, StepEvent
from medusa_chat.tree import Tree

if TYPE_CHECKING:
    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.model.loading import LoadedModel


_OOM = torch.OutOfMemoryError  # CUDA's and the CPU allocator's (torch >= 2.5, the package's floor)


_STATS_DROP = ("text", "token_ids")  # the reply's text is the message itself; ids are not worth storing


class SessionManager(SpeedMeter):
    """One chat session. Not a model wrapper: the model and engine are built on `load()`."""

    def __init__(
        self,
        model: str = "smollm2-135m",
        heads: str | None = None,
        quant: str = "auto",
        dtype: str = "auto",
        device: str = "auto",
        tree: str | None = None,
        tree_size: int | None = None,
        data_dir: Path | None = None,
        trust_remote_code: bool = False,
        loaded: LoadedModel | None = None,
        auto_calibrate: bool | None = None,
    ) -> None:
        self.model_name = model
        self.heads_arg = heads
        self.quant_arg = quant
        self.dtype_arg = dtype
        self.device_arg = device
        self.trust_remote_code = trust_remote_code
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        self.store = ConversationStore(self.data_dir / "conversations")
        self.loaded: LoadedModel | None = loaded
        self.engine: MedusaEngine | None = None
        self.settings = GenerationSettings()
        self.conversation = Conversation(model=model)
        self.last_events: list[StepEvent] = []
        self.last_summary: ReplySummary | None = None
        # Things the UI should tell the user about the last action (dropped turns, failed autosave, ...).
        self.notices: list[str] = []
        self.baseline_tokens_per_s: float | None = None
        self._tree_request: tuple[str | None, int | None] = (tree, tree_size)
        # This device's calibrated step latency by tree size: read when the tree or the calibration changes,
        # not per step (the speedup is shown while a reply streams).
        self._latency_by_size: dict[int, float] = {}
        if auto_calibrate is None:  # MEDUSA_CHAT_AUTO_CALIBRATE=0 turns it off (the test suite does)
            auto_calibrate = os.environ.get("MEDUSA_CHAT_AUTO_CALIBRATE", "1") != "0"
        self.auto_calibrate = auto_calibrate
        self._lock = threading.Lock()  # held for the whole of a reply
        self._load_lock = threading.Lock()
        self._stop = threading.Event()
        # A big model's first start answers with plain decoding and calibrates this CPU afterwards, while the
        # user reads the reply (calibrate.resolve_tree's `defer`): under the reply lock, in its own thread, and
        # a new request cancels it (it is tried again after that reply).
        self.calibration_pending = False
        self._calibration_cancel = threading.Event()
        self._calibration_thread: threading.Thread | None = None

    @classmethod
    def from_args(cls, args: Any) -> SessionManager:
        """A session from the common model options (cli.add_model_options), as web and serve build it."""
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

    # ---- model ----------------------------------------------------------------------------------------------
    def load(self, progress: Callable[[str], None] | None = None) -> None:
        """Load the model and build the engine; a no-op when already done."""
        with self._load_lock:
            if self.engine is not None:
                return
            if self.loaded is None:
                from medusa_chat.model.loading import load_model

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
            self.baseline_tokens_per_s = MEASURED_BASELINES.get(self._baseline_key())

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
        # One rule for every entry point (calibrate.resolve_tree): --tree/--tree-size, else this machine's
        # cached calibration, else (on a CPU) calibrate once now, or for a big model after its first reply.
        # The reason is shown in the UIs' model panel.
        from medusa_chat.tuning.calibrate import PROVISIONAL_SOURCE, resolve_tree
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
        self._latency_by_size = self._read_latencies()  # read once here, not per streamed step
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
        self._calibration_thread = threading.Thread(
            target=self._calibrate_in_background, name="medusa-chat-calibration", daemon=True
        )
        self._calibration_thread.start()

    def _calibrate_in_background(self) -> None:
        from medusa_chat.tuning.calibrate import CalibrationCancelled, calibrate_first_start
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
            self._latency_by_size = self._read_latencies()
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
        """Change settings for the next reply (a running reply keeps its own copy). Validated; unknown names
        and bad values raise MedusaChatError and leave the settings unchanged."""
        names = {f.name: f for f in dataclasses.fields(GenerationSettings)}
        coerced: dict[str, Any] = {}
        for key, value in changes.items():
            if key not in names:
                raise MedusaChatError(f"unknown setting {key!r} (known: {', '.join(names)})")
            try:
                if key == "max_new_tokens":
                    value = int(value)
                elif key == "seed":
                    value = None if value in (None, "", "none", "None") else int(value)
                elif key == "stop_strings":
                    value = tuple(str(s) for s in value)
                elif key == "accept":
                    value = str(value).strip().lower()
                elif key == "context_lookup":
                    value = _switch(value)
                else:
                    value = float(value)
                    if not math.isfinite(value):
                        raise ValueError
            except (TypeError, ValueError):
                raise MedusaChatError(f"bad value for {key}: {value!r}") from None
            coerced[key] = value
        new = dataclasses.replace(self.settings, **coerced)
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

    # ---- replies --------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """A reply is decoding (a background calibration does not count: a request cancels it)."""
        return self._lock.locked() and not self.calibrating

    def stop(self) -> None:
        """Ask the running reply to end; the engine checks this every step and keeps what it produced."""
        self._stop.set()

    def send(self, message: str) -> ReplyStream:
        """Add a user message and stream the reply: StepEvent..., then one ReplySummary."""
        if not message or not message.strip():
            raise PromptError("the message is empty")
        return self._reply(lambda msgs: msgs.append(Message("user", message)))

    def regenerate(self) -> ReplyStream:
        """Replace the last reply with a new one (or answer the last user message if its reply failed)."""

        def edit(msgs: list[Message]) -> None:
            if msgs and msgs[-1].role == "assistant":
                msgs.pop()
            if not msgs or msgs[-1].role != "user":
                raise MedusaChatError("nothing to regenerate yet: send a message first")

        return self._reply(edit)

    def edit_last(self, message: str) -> ReplyStream:
        """Replace the last user message (dropping its reply) and answer the new text."""
        if not message or not message.strip():
            raise PromptError("the message is empty")

        def edit(msgs: list[Message]) -> None:
            if msgs and msgs[-1].role == "assistant":
                msgs.pop()
            if not msgs or msgs[-1].role != "user":
                raise MedusaChatError("there is no user message to edit yet")
            msgs[-1] = Message("user", message)

        return self._reply(edit)

    def _reply(self, edit: Callable[[list[Message]], None]) -> ReplyStream:
        # Non-blocking: a second request while a reply runs gets a clear answer instead of queueing silently.
        if not self._acquire():
            raise BusyError("a reply is already being generated: wait for it to finish or stop it first")
        try:
            engine = self._require_engine()
            self._stop.clear()  # cleared here, not when iteration starts, so an early stop() is not lost
            self.notices = []
            before = list(self.conversation.messages)
            edit(self.conversation.messages)
            try:
                prompt_ids, dropped = self._prompt_ids()
            except PromptError:
                self.conversation.messages[:] = before  # a message that can never fit is not kept
                raise
            self._autosave()  # the user's message is on disk before the (fallible) generation starts
            settings = dataclasses.replace(self.settings)  # the reply keeps its own copy
            gen = self._generate(engine, prompt_ids, settings, dropped)
        except BaseException:
            self._lock.release()
            raise
        return ReplyStream(gen, self._release_reply, self.stop)

    def complete(
        self,
        messages: Sequence[dict[str, Any]],
        settings: GenerationSettings,
        *,
        stop: threading.Event | None = None,
        wait_s: float = 0.0,
    ) -> ReplyStream:
        """Answer `messages` (role/content dicts, e.g. from the HTTP API) without touching the conversation.

        Stateless: the conversation, the notices and `last_events`/`last_summary` (what the UIs show) stay as
        they are; the same exclusive lock as `send` keeps it from interleaving with a UI reply, and the engine's
        prefix reuse copes with the changed prompt. `stop` (a per-reply flag, so a UI's Stop does not end it)
        is checked every step; `wait_s` > 0 waits that long for a running reply to finish before BusyError.
        A prompt that leaves no room in the context window raises PromptError (never truncated silently).
        """
        if not self._acquire(wait_s):
            raise BusyError("a reply is already being generated: wait for it to finish or stop it first")
        stop = stop if stop is not None else threading.Event()
        try:
            settings.validate()
            engine = self._require_engine()
            assert self.loaded is not None
            try:
                prompt_ids = self.loaded.build_prompt(list(messages))
            except PromptError:
                raise
            except Exception as err:  # e.g. a jinja TemplateError: "roles must alternate user/assistant"
                raise PromptError(f"the model's chat template cannot format these messages: {err}") from err
            limit = int(self.loaded.context_limit)
            if len(prompt_ids) + 1 >= limit:
                raise PromptError(
                    f"the messages are too long: {len(prompt_ids)} prompt tokens, but the model's context "
                    f"window is {limit}"
                )
            gen = self._generate_detached(engine, prompt_ids, dataclasses.replace(settings), stop)
        except BaseException:
            self._lock.release()
            raise
        return ReplyStream(gen, self._release_reply, stop.set)

    def _generate_detached(
        self, engine: MedusaEngine, prompt_ids: list[int], settings: GenerationSettings, stop: threading.Event
    ) -> Generator[Item, None, None]:
        gen = engine.generate(prompt_ids, settings, stop)
        try:
            yield from gen
        except GeneratorExit:  # closed between two steps: a clean point, the cache is consistent
            raise
        except _OOM as err:
            with contextlib.suppress(Exception):
                engine.reset()
            self._free_memory()
            raise MedusaChatError(
                "out of memory while generating: try fewer max tokens, shorter messages, a smaller tree "
                "(--tree-size 16) or 4-bit weights (--quant nf4)"
            ) from err
        except BaseException:
            # A step may have died half-way through writing the cache: the next prompt starts from scratch.
            with contextlib.suppress(Exception):
                engine.reset()
            raise
        finally:
            with contextlib.suppress(Exception):
                gen.close()

    def _prompt_ids(self) -> tuple[list[int], int]:
        """The templated prompt, dropping the oldest turns (never the system prompt) until it leaves room for
        max_new_tokens. Returns (ids, number of messages dropped)."""
        assert self.loaded is not None
        limit = int(self.loaded.context_limit)
        budget = limit - self.settings.max_new_tokens
        turns = self.conversation.turns()
        system = turns[:1] if turns and turns[0]["role"] == "system" else []
        rest = turns[len(system) :]
        # Cut points: drop whole exchanges from the front, so the kept history still starts with a user turn
        # (some templates insist on alternation). The last cut keeps only the newest user message.
        cuts = sorted({0, *(i for i, m in enumerate(rest) if m["role"] == "user")})
        ids = self.loaded.build_prompt(system + rest)
        dropped = 0
        if len(ids) > budget and len(cuts) > 1:
            # Prompt length falls as cuts move forward: binary search for the smallest cut that fits, so a
            # long conversation costs O(log n) tokenizations, not one per dropped turn.
            lo, hi = 1, len(cuts) - 1
            best = self.loaded.build_prompt(system + rest[cuts[hi] :])
            while lo < hi:
                mid = (lo + hi) // 2
                candidate = self.loaded.build_prompt(system + rest[cuts[mid] :])
                if len(candidate) <= budget:
                    hi, best = mid, candidate
                else:
                    lo = mid + 1
            ids, dropped = best, cuts[hi]  # the newest user message alone when nothing else fits
        if len(ids) + 1 >= limit:
            raise PromptError(
                f"the message is too long: {len(ids)} prompt tokens, but the model's context window is {limit}"
            )
        if dropped:
            self.notices.append(
                f"dropped the {dropped} oldest message{'s' if dropped > 1 else ''} to fit the model's context "
                f"window ({limit} tokens, {self.settings.max_new_tokens} kept free for the reply)"
            )
        if len(ids) > budget:
            self.notices.append(
                f"only {limit - len(ids)} tokens of the context window are left for the reply"
            )
        return ids, dropped

    def _generate(
        self, engine: MedusaEngine, prompt_ids: list[int], settings: GenerationSettings, dropped: int
    ) -> Generator[Item, None, None]:
        self.last_events = []
        self.last_summary = None
        parts: list[str] = []
        summary: ReplySummary | None = None
        error: str | None = None
        gen = engine.generate(prompt_ids, settings, self._stop)
        try:
            for item in gen:
                if isinstance(item, ReplySummary):
                    summary = item
                    self.last_summary = item
                else:
                    self.last_events.append(item)
                    parts.append(item.text)
                yield item
        except _OOM as err:
            error = "out of memory"
            raise MedusaChatError(
                "out of memory while generating: try a smaller tree (--tree-size 16), fewer new tokens (/max), "
                "a shorter conversation (/clear), or 4-bit weights (--quant nf4)"
            ) from err
        except MedusaChatError as err:
            error = str(err)
            raise
        except Exception as err:  # a bug: re-raised as is, but the conversation must survive it
            error = f"{type(err).__name__}: {err}"
            raise
        except GeneratorExit:  # the consumer closed the stream between two steps: a clean point
            raise
        except BaseException:
            # e.g. KeyboardInterrupt raised inside a forward pass: the reply is kept (as stopped) below, but
            # the engine's cache may be half-written, so the next prompt is prefilled from scratch.
            with contextlib.suppress(Exception):
                engine.reset()
            raise
        finally:
            with contextlib.suppress(Exception):
                gen.close()
            self._finish_reply(engine, parts, summary, error, dropped)

    def _finish_reply(
        self,
        engine: MedusaEngine,
        parts: list[str],
        summary: ReplySummary | None,
        error: str | None,
        dropped: int,
    ) -> None:
        msgs = self.conversation.messages
        if summary is not None:
            stats = {k: v for k, v in summary.to_dict().items() if k not in _STATS_DROP}
            value, kind = self.speedup(summary.decode_tokens_per_s, summary.tokens_per_step)
            stats.update(
                speedup=round(value, 3), speedup_kind=kind, tree=engine.tree.name, dropped_messages=dropped
            )
            if self.notices:
                stats["notices"] = list(self.notices)
            msgs.append(Message("assistant", summary.text, stats, stopped=summary.stop_reason == "stopped"))
        elif error is not None:
            # The engine failed: keep the user's message (regenerate retries it) and start the next prompt
            # from a clean cache, since a step may have died half-way through writing it.
            self.notices.append(f"the reply failed ({error}); your message is kept: /regen retries it")
            with contextlib.suppress(Exception):
                engine.reset()
            if error == "out of memory":
                self._free_memory()
        else:
            # The caller abandoned the stream (closed it, or an interrupt hit the consumer): keep what was
            # produced, marked stopped, exactly as if stop() had been called.
            if parts:  # at least one step arrived (its text may be empty, e.g. a special token)
                text = "".join(parts)
                made = self.last_events[-1].new_tokens_total if self.last_events else None
                msgs.append(
                    Message("assistant", text, {"stop_reason": "stopped", "new_tokens": made}, stopped=True)
                )
        self._autosave()

    @staticmethod
    def _free_memory() -> None:
        if torch.cuda.is_available():
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()

    # ---- conversation ---------------------------------------------------------------------------------------
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


def _switch(value: Any) -> bool:
    """A yes/no setting from a bool or the words people type (on/off, true/false, 1/0, yes/no)."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in ("on", "true", "1", "yes"):
        return True
    if word in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"expected on or off, got {value!r}")
