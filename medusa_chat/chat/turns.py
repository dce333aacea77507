"""A session's turns: build the prompt within the context window, stream the engine's reply, and keep it.

`send`, `regenerate` and `edit_last` change the conversation and answer it; `complete` answers messages given
by the caller (the HTTP API) and leaves the conversation alone. A reply holds the session's lock from the request
to the stream's end (chat/stream.py's ReplyStream), so a second request fails at once; a stopped, abandoned or
failed reply leaves the conversation whole (kept marked stopped, or the user's message kept for a retry).

A part of SessionManager (chat/session.py), apart from the model and settings it reads and from the
conversation's edits and files (history.py), which it builds on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.chat.conversations import Conversation, Message
from medusa_chat.chat.stream import Item, ReplyStream
from medusa_chat.errors import BusyError, MedusaChatError, PromptError
from medusa_chat.events import GenerationSettings, ReplySummary, StepEvent

if TYPE_CHECKING:
    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.model.sources.loading import LoadedModel


_OOM = torch.OutOfMemoryError  # CUDA's and the CPU allocator's (torch >= 2.5, the package's floor)


_STATS_DROP = ("text", "token_ids")  # the reply's text is the message itself; ids are not worth storing


class ReplyTurns:
    """The replies part of SessionManager (its base class)."""

    loaded: LoadedModel | None
    settings: GenerationSettings
    notices: list[str]
    last_events: list[StepEvent]
    last_summary: ReplySummary | None
    _lock: threading.Lock
    _stop: threading.Event

    if TYPE_CHECKING:  # SessionManager's: the model, the conversation (its history's), the reply lock, the speed

        @property
        def calibrating(self) -> bool: ...

        @property
        def conversation(self) -> Conversation: ...

        def _require_engine(self) -> MedusaEngine: ...

        def _release_reply(self) -> None: ...

        def _autosave(self) -> None: ...

        def speedup(self, tokens_per_s: float, tokens_per_step: float) -> tuple[float, str]: ...

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
