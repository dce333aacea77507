"""A reply's text: streamed token by token (StreamDecoder), held back where it could be the start of a stop
string, cut at the first stop string, and where a reply ends (EOS, the token limit)."""

from __future__ import annotations

from typing import Any


class StreamDecoder:
    """Incremental detokenization in O(new tokens) per step (the TGI/vLLM method).

    Decoding the whole reply every step would cost O(reply) per step. Instead decode a short window twice:
    from `prefix` to the previous end and from `prefix` to the new end, and emit the difference. Starting the
    window a step back keeps SentencePiece's leading spaces and multi-token characters right.

    An incomplete UTF-8 character decodes to U+FFFD at the end: that end is held back until a later token
    completes it, while the text before it streams on. A U+FFFD with tokens of at least 3 more bytes after it is
    final (a character has at most 4 bytes): it is streamed like any text, and the window moves past it, so a
    reply that keeps ending in stray bytes neither stalls the stream nor grows the window.
    """

    SETTLED_BYTES = 3  # tokens this far from the end cannot change what a character before them decodes to

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.shown = 0  # characters of the window's text after `before` (ids[prefix:read]) already streamed
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        ready = after.rstrip("\ufffd")  # the text that can be streamed now
        settle = None  # where the next window's `read` goes, if the window moves
        if len(ready) == len(after):
            if len(after) > len(before):  # (else nothing printable yet: a special token)
                settle = len(self.ids)
        elif len(self.ids) - self.read > self.SETTLED_BYTES:
            # half a character at the end: the text up to SETTLED_BYTES tokens back is final where it is a
            # prefix of `after` (no character split at that token), its own U+FFFDs included
            cut = len(self.ids) - self.SETTLED_BYTES
            final = self._decode(self.ids[self.prefix : cut])
            if after.startswith(final):
                settle, ready = cut, max(ready, final, key=len)
        done = len(before) + self.shown
        delta = ready[done:]
        self.text += delta
        if settle is None:
            self.shown += len(delta)
            return delta
        pending = len(after) - max(len(ready), done)  # the held end, the same characters in the next window
        self.prefix, self.read = self.read, settle
        if settle == len(self.ids) and pending <= 0:
            self.shown = 0
        else:  # streamed so far, counted in the next window (decoded from its own start)
            whole = self._decode(self.ids[self.prefix :])
            self.shown = len(whole) - pending - len(self._decode(self.ids[self.prefix : self.read]))
        return delta

    def flush(self) -> str:
        """At the end of a reply: the held end (half a character that no token will complete, stray bytes' U+FFFDs),
        so that the deltas add up to the whole decode. One decode of the reply (once per reply)."""
        whole = self._decode(self.ids)
        delta = whole[len(self.text) :] if whole.startswith(self.text) else ""
        self.text += delta
        return delta


def keep_until_end(new: list[int], done: int, eos: set[int], max_new: int) -> tuple[list[int], str]:
    """The new tokens up to and including an EOS, within the reply's length limit; and why it ends ("")."""
    kept: list[int] = []
    for t in new:
        if done + len(kept) >= max_new:
            return kept, "max_new_tokens"
        kept.append(t)
        if t in eos:
            return kept, "eos"
    return kept, "max_new_tokens" if done + len(kept) >= max_new else ""


def limit_reason(reason: str, made: int, max_new: int) -> str:
    """`keep_until_end` reports any length limit as "max_new_tokens"; a reply shorter than max_new_tokens
    that hit it was stopped by the context window."""
    return "context_limit" if reason == "max_new_tokens" and made < max_new else reason


def release_held(pending: str, stop_strings: tuple[str, ...], final: bool) -> tuple[str, str, bool]:
    """Split the not yet streamed text into (stream now, hold back, a stop string was found).

    A stop string can span two steps ("US" then "ER:"); streaming its first half would show text the final
    reply cuts off. So the longest end of `pending` that could still grow into a stop string is held back;
    the next step's text is appended to it and settles it (released, or cut with the stop string). `final`
    (the reply ends this step for another reason) releases everything. Everything before a stop string was
    released or held in an earlier step, so searching `pending` (held + new text) finds the same first
    occurrence as searching the whole reply, at O(new text + longest stop string) per step.
    """
    if not stop_strings:
        return pending, "", False
    cut = stop_string_cut(pending, stop_strings)
    if cut is not None:
        return pending[:cut], "", True
    keep = 0 if final else partial_stop_suffix(pending, stop_strings)
    return pending[: len(pending) - keep], pending[len(pending) - keep :], False


def partial_stop_suffix(text: str, stop_strings: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a stop string (0 if none): what a
    stream holds back until the next step settles it (the engine's and the HTTP API's streams)."""
    best = 0
    for s in stop_strings:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def stop_string_cut(text: str, stop_strings: tuple[str, ...]) -> int | None:
    cuts = [i for s in stop_strings if s and (i := text.find(s)) >= 0]
    return min(cuts) if cuts else None
