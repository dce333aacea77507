"""A reply's text: streamed token by token (StreamDecoder), held back where it could be the start of a stop
string, cut at the first stop string, and where a reply ends (EOS, the token limit)."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from typing import Any

from medusa_chat.events import TreeView
from medusa_chat.tree import Tree

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback token of one byte


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable bytes stand for themselves, the others (in byte
    order) for the characters from U+0100 up: the table tokenizers' ByteLevel decoder reads."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(0x100 + k): b for k, b in enumerate(moved)}


_BYTE_LEVEL = _byte_level_chars()


def _decoder_types(tokenizer: Any) -> set[str]:
    """The kinds of step in a fast tokenizer's decoder (a Sequence's members), e.g. {"ByteLevel"}; empty when it
    has none that can be read (a slow or duck-typed tokenizer)."""
    try:
        state = json.loads(tokenizer.backend_tokenizer.decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return set()
    steps = state.get("decoders") or [state]
    return {str(step.get("type")) for step in steps if isinstance(step, dict)}


def token_bytes_reader(tokenizer: Any) -> Callable[[int], bytes | None]:
    """For a tokenizer, id -> the raw bytes the token writes, or None for a token that writes whole characters
    (decoded by the tokenizer itself, in context).

    Raw bytes: every token of a byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2: its pieces are bytes spelled in
    GPT-2's alphabet), SentencePiece's byte-fallback tokens (<0xE2>), and tokens a tokenizer gives as bytes
    (tiktoken-based ones). These are the tokens that can end inside a character. A special token writes b""
    (a reply's text skips it). Tokens added to a vocabulary are written as they are, so they are text.
    """
    to_piece = getattr(tokenizer, "convert_ids_to_tokens", None)
    if to_piece is None:
        return lambda _id: None
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", None) or ()}
    special |= {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
    # the byte-level table only where the decoder does nothing else to the text (no cleanup of spaces)
    byte_level = _decoder_types(tokenizer) == {"ByteLevel"} and not getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    )
    cache: dict[int, bytes | None] = {}

    def read(token: int) -> bytes | None:
        if token in cache:
            return cache[token]
        piece = None if token in added else to_piece(token)
        out: bytes | None = None
        if token in special:
            out = b""
        elif isinstance(piece, bytes):
            out = piece
        elif isinstance(piece, str) and byte_level and all(c in _BYTE_LEVEL for c in piece):
            out = bytes(_BYTE_LEVEL[c] for c in piece)
        elif isinstance(piece, str) and (m := _BYTE_PIECE.fullmatch(piece)) is not None:
            out = bytes([int(m.group(1), 16)])
        cache[token] = out
        return out

    return read


class StreamDecoder:
    """Incremental detokenization in O(new tokens) per step, cut at the last complete UTF-8 character.

    Tokens that write raw bytes (token_bytes_reader) go through one incremental UTF-8 decoder: each push streams
    every character its bytes complete, and holds back only the at most 3 bytes of a character still incomplete
    at the end. A byte that cannot be (or continue) a character is final at once, as U+FFFD, and the text after
    it streams on: a reply whose tokens keep ending mid-character never stalls, and nothing already streamed is
    ever taken back. Tokens that write whole characters (SentencePiece's word pieces, added tokens, a tokenizer
    of another kind) are decoded by the tokenizer after the last token that wrote something (its context: it
    keeps SentencePiece's leading spaces, which a decode from the token itself would strip), and end any
    incomplete bytes before them (U+FFFD, as the tokenizer's own decode shows them).

    `flush` at the reply's end writes what is still held (half a character no token will complete) as U+FFFD,
    so that the deltas add up to the reply's text.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = ""  # everything streamed: the deltas joined
        self._bytes_of = token_bytes_reader(tokenizer)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # the last token that wrote something (or the reply's first word token) and what it decodes to alone
        # ("" until a word token needs it)
        self._context: int | None = None
        self._context_text = ""

    @property
    def pending(self) -> bytes:
        """The bytes held back: the start of a character that no token has completed yet (at most 3)."""
        return self._utf8.getstate()[0]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        """The reply's next tokens: the text they complete (every character up to the last complete one)."""
        parts: list[str] = []
        words: list[int] = []  # consecutive tokens that write whole characters, decoded together
        for token in ids:
            raw = self._bytes_of(token)
            if raw is None:
                words.append(token)
                continue
            if words:
                parts.append(self._words(words))
                words = []
            if raw:
                parts.append(self._bytes(raw))
                self._context, self._context_text = token, ""  # decoded only if a word token follows
        if words:
            parts.append(self._words(words))
        delta = "".join(parts)
        self.text += delta
        return delta

    def _bytes(self, raw: bytes) -> str:
        text = self._utf8.decode(raw)
        held = self.pending
        if len(held) == 2 and held[0] == 0xED and held[1] >= 0xA0:
            # a UTF-16 surrogate's first two bytes, no character in UTF-8: final now (Python's decoder waits for
            # the third byte, for its surrogatepass handler)
            text += self._end_bytes()
        return text

    def _words(self, words: list[int]) -> str:
        """The text of tokens that write whole characters, after whatever came before them."""
        cut = self._end_bytes()  # a word token ends an incomplete character: the tokenizer shows it as U+FFFD
        start = self._context is None
        if start:  # the reply's start: decoded as the whole reply's decode starts (its first space stripped)
            text = self._decode(words)
        else:
            if not self._context_text:
                self._context_text = self._decode([self._context])
            whole = self._decode([self._context, *words])
            before = self._context_text
            text = whole[len(before) :] if whole.startswith(before) else self._decode(words)
        if text or start:  # (at the start even a token that writes nothing: the stripping has happened there)
            self._context, self._context_text = words[-1], ""
        return cut + text

    def _end_bytes(self) -> str:
        """The held bytes as U+FFFD (no later byte can complete them), and the byte decoder reset."""
        tail = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return tail

    def flush(self) -> str:
        """At the end of a reply: the held end (half a character that no token will complete) as U+FFFD, so that
        the deltas add up to the reply's text."""
        delta = self._end_bytes()
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


def pushed_text(detok: StreamDecoder, tokens: list[int], stop_reason: str) -> str:
    """The stream's text for these tokens; on the reply's last step also what the decoder held back (a character
    no later token completes), so the stream and the reply's text are the same."""
    text = detok.push(tokens)
    return text + detok.flush() if stop_reason else text


def reply_text(text: str, stop_strings: tuple[str, ...], held: str) -> str:
    """The reply's text: the decoder's (the stream's deltas add up to it; at a normal end it is the whole
    decode, StreamDecoder.flush), cut at a stop string."""
    if stop_strings:
        cut = stop_string_cut(text, stop_strings)
        text = text if cut is None else text[:cut]
    if held and text.endswith(held):
        # Stopped by the flag between two steps: no step is left to release the held text in, and a
        # stopped reply keeps exactly what was shown (as a reply whose stream is abandoned does).
        text = text[: -len(held)]
    return text


class TreeViews:
    """A step's tree as the accepted-tree visualiser shows it (events.TreeView): each node's token and text (each
    token decoded once per engine), its place in the tree and which nodes hold context-lookup guesses."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    def view(self, tree: Tree, lookup_nodes: list[int], tokens: list[int]) -> TreeView:
        return TreeView(
            tokens=tokens,
            texts=[self.text(t) for t in tokens],
            parents=tree.parents,
            depths=tree.depths,
            ranks=tree.ranks,
            lookup_nodes=lookup_nodes,
        )
