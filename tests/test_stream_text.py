"""The live stream cuts at the last complete UTF-8 character (engine/text.py's StreamDecoder), with tokenizers
whose tokens write raw bytes: a byte-level BPE (GPT-2's alphabet, as SmolLM2, Qwen2, Llama 3) and a
SentencePiece byte-fallback one (<0xE2> tokens, as Llama 2 / Vicuna, Mistral), built here in memory.

After every push the stream holds back only a character that later bytes can still complete: a 4-byte emoji
split over 2-4 tokens appears on the push of its last byte, a byte that can never be (or continue) a character is
U+FFFD at once, and the text after it streams on. The expected text is computed apart from the decoder: strict
`bytes.decode` to tell whether the end can still become a character, and the tokenizers' own decode.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from medusa_chat.engine.text import StreamDecoder

# 16 bytes whose 256 pairs are the byte-level tokenizer's 2-byte tokens: the pieces of 🐍 (F0 9F 90 8D),
# 🚀 (F0 9F 9A 80), € (E2 82 AC) and é (C3 A9), ASCII, 0xFF (never in UTF-8) and 0xED (whose second byte may
# not be A0-BF: UTF-16 surrogates).
PAIR_BYTES = bytes([0x20, 0x6F, 0x6B, 0xF0, 0x9F, 0x90, 0x8D, 0x9A, 0x80, 0xE2, 0x82, 0xAC, 0xC3, 0xA9, 0xFF, 0xED])
SNAKE, ROCKET, EURO = "🐍".encode(), "🚀".encode(), "€".encode()


def byte_level_tokenizer() -> tuple[Any, list[bytes]]:
    """A GPT-2-style byte-level tokenizer of 512 tokens: ids 0-255 write one byte each, ids 256-511 the pairs of
    PAIR_BYTES; the EOS `<|end|>` (id 512) is special. Returns (tokenizer, the bytes of each id)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()  # byte -> the character the token's piece spells it with
    pieces = [bytes([b]) for b in range(256)] + [bytes([a, b]) for a in PAIR_BYTES for b in PAIR_BYTES]
    vocab = {"".join(alphabet[b] for b in piece): i for i, piece in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    assert fast.eos_token_id == 512
    return fast, pieces


def byte_fallback_tokenizer() -> Any:
    """A SentencePiece-style tokenizer: word pieces (▁ = a space), <0x00>-<0xFF> byte tokens, and the decoder
    Llama 2's tokenizer.json has (▁ -> space, byte fallback, the reply's first space stripped)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁Hello", "▁ok", "!", "é"]
    tok = Tokenizer(models.BPE(vocab={w: i for i, w in enumerate(words)}, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _can_complete(tail: bytes) -> bool:
    """Whether more bytes can make `tail` (which starts with a lead byte) one character."""
    for more in range(1, 4 - len(tail) + 1):
        for second in range(0x80, 0xC0):
            try:
                (tail + bytes([second]) + b"\x80" * (more - 1)).decode("utf-8")
                return True
            except UnicodeDecodeError:
                pass
    return False


def complete_text(data: bytes) -> str:
    """The text of `data` up to its last complete character: what a stream may show while more bytes can come."""
    for n in (1, 2, 3):
        tail = data[-n:]
        if len(tail) == n and tail[0] >= 0xC0 and _can_complete(tail):
            return data[:-n].decode("utf-8", "replace")
    return data.decode("utf-8", "replace")


def test_the_oracle_tells_an_incomplete_end_from_a_final_one() -> None:
    assert complete_text(b"ab" + SNAKE[:3]) == "ab"
    assert complete_text(b"ab\xe2\xe2") == "ab\ufffd"  # the first lead byte is followed by no continuation
    assert complete_text(b"ab\xff") == "ab\ufffd"  # never a UTF-8 byte
    assert complete_text(b"ab\xed\xa0") == "ab\ufffd\ufffd"  # a surrogate's first two bytes: no character
    assert complete_text(b"ab\xed\x9f") == "ab"  # ED 9F 80-BF is U+D7C0-U+D7FF


def _ids(pieces: list[bytes], *parts: bytes) -> list[int]:
    return [pieces.index(p) for p in parts]


def _stream(dec: StreamDecoder, ids: list[int], sizes: list[int]) -> list[tuple[list[int], str]]:
    """Push `ids` in chunks of `sizes` (cycled): [(ids pushed so far, text streamed so far)]."""
    out, shown, i, k = [], "", 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        shown += dec.push(ids[i : i + n])
        i, k = i + n, k + 1
        out.append((ids[:i], shown))
    return out


# ids as byte pieces: "Say", a 🐍 split 4 ways, then over 2 and 3 tokens, lone lead bytes before text, before
# another lead and before a split € , a lone continuation byte, 0xFF, a surrogate's start, a 🚀 over 4 tokens
CASES = {
    "emoji in 4 single bytes": [b"S", b"a", b"y", *(bytes([b]) for b in SNAKE), b"o", b"k"],
    "emoji in 2 pairs": [b"o", SNAKE[:2], SNAKE[2:], b" ", b"o"],
    "emoji over 3, space inside the first": [b" \xf0", b"\x9f", b"\x90\x8d", b" \xf0", b"\x9f\x9a", b"\x80"],
    "lone lead bytes": [b"o", b"\xe2", b"o", b"k", b"\xe2", b"\xe2", b"\xe2\x82", b"\xac", b"\xe2", b" "],
    "invalid bytes": [b"\x80", b"o", b"\xff", b"\xed", b"\xa0", b"\x80", b"\xed\x9f", b"\x80", b"\xc3", b"\xa9"],
    "rocket after a lone lead": [b"\xe2", b"\xf0", b"\x9f", b"\x9a", b"\x80", b"\xf0\x9f", b"\x90\x8d"],
    "ends mid-character": [b"o", b"k", b"\xf0\x9f", b"\x90"],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("sizes", [[1], [2], [3, 1], [1, 4, 2], [100]], ids=str)
def test_every_push_streams_every_complete_character(case: str, sizes: list[int]) -> None:
    """Byte-level tokens, pushed one at a time and in chunks: after every push the stream is the text of the
    bytes so far up to their last complete character (never less: no push is held back whole; never more: no
    text a later byte changes); after `flush` it is the tokenizer's own decode of the reply."""
    tok, pieces = byte_level_tokenizer()
    ids = _ids(pieces, *CASES[case])
    dec = StreamDecoder(tok)
    for pushed, shown in _stream(dec, ids, sizes):
        data = b"".join(pieces[i] for i in pushed)
        assert shown == complete_text(data), (pushed, shown)
        assert len(dec.pending) <= 3
    final = b"".join(pieces[i] for i in ids).decode("utf-8", "replace")
    assert dec.text + dec.flush() == final == tok.decode(ids, skip_special_tokens=True)
    assert dec.flush() == "" and dec.text == final


def test_a_split_emoji_shows_on_its_last_byte_and_a_stray_byte_at_once() -> None:
    tok, pieces = byte_level_tokenizer()
    dec = StreamDecoder(tok)
    pushes = [b"o", b"\xf0", b"\x9f", b"\x90", b"\x8d", b"\xe2", b"\xe2", b"\xff", b"\xf0\x9f", b"\x9a\x80", b" "]
    got = [dec.push(_ids(pieces, p)) for p in pushes]
    assert got == ["o", "", "", "", "🐍", "", "\ufffd", "\ufffd\ufffd", "", "🚀", " "]
    # a special token writes nothing and does not end a character split around it (the tokenizer skips it)
    dec = StreamDecoder(tok)
    assert [dec.push(x) for x in (_ids(pieces, SNAKE[:2]), [512], _ids(pieces, SNAKE[2:]))] == ["", "", "🐍"]


def test_byte_fallback_tokens_stream_every_complete_character() -> None:
    """SentencePiece byte-fallback tokens (<0xF0> ...) between word pieces: the word pieces keep their leading
    spaces (but the reply's first, which the tokenizer strips too), a split emoji appears with its last byte,
    and a lone lead byte is U+FFFD as soon as a word piece or another lead follows it. Where a run of byte
    tokens holds a stray byte before an emoji, the tokenizer's own decode makes every byte of the run U+FFFD;
    the stream keeps the emoji (what the bytes say), and only there do the two differ."""
    tok = byte_fallback_tokenizer()
    piece = tok.convert_tokens_to_ids

    def byte_ids(data: bytes) -> list[int]:
        return [piece(f"<0x{b:02X}>") for b in data]

    pushes = [
        [piece("▁Hello")],
        *([i] for i in byte_ids(SNAKE)),
        [piece("▁ok")],
        byte_ids(b"\xe2"),
        [piece("!")],
        byte_ids(b"\xe2"),
        *([i] for i in byte_ids(ROCKET)),
        [piece("▁ok"), *byte_ids(EURO[:2])],
        byte_ids(EURO[2:]) + [piece("é")],
    ]
    dec = StreamDecoder(tok)
    got = [dec.push(p) for p in pushes]
    assert got == ["Hello", "", "", "", "🐍", " ok", "", "\ufffd!", "", "\ufffd", "", "", "🚀", " ok", "€é"]
    ids = [i for p in pushes for i in p]
    assert dec.text + dec.flush() == "Hello🐍 ok\ufffd!\ufffd🚀 ok€é"
    assert tok.decode(ids, skip_special_tokens=True) == "Hello🐍 ok\ufffd!" + "\ufffd" * 5 + " ok€é"
    # without the stray bytes, every push's text is the tokenizer's decode of the complete part
    ids = [i for k, p in enumerate(pushes) if k not in (6, 8) for i in p]
    dec, shown = StreamDecoder(tok), ""
    for k, i in enumerate(ids):
        shown += dec.push([i])
        assert shown == tok.decode(ids[: k + 1 - len(dec.pending)], skip_special_tokens=True)
    assert shown + dec.flush() == tok.decode(ids, skip_special_tokens=True) == "Hello🐍 ok!🚀 ok€é"


def test_a_reply_cut_inside_a_character_flushes_it_as_one_replacement() -> None:
    tok, pieces = byte_level_tokenizer()
    dec = StreamDecoder(tok)
    assert dec.push(_ids(pieces, b"o", SNAKE[:2], SNAKE[2:3])) == "o"
    assert dec.pending == SNAKE[:3]
    assert dec.flush() == "\ufffd" and dec.text == "o\ufffd" == tok.decode(_ids(pieces, b"o", SNAKE[:2], SNAKE[2:3]))
    assert dec.pending == b"" and dec.flush() == ""


def test_the_engines_stream_never_stalls_on_a_model_writing_stray_bytes() -> None:
    """The engine end to end on the tiny test model, its tokens read as the byte-level tokenizer's: a reply that
    is mostly bytes that are no character, lead bytes and pieces of emoji. Every step streams the reply's bytes
    up to their last complete character; the steps add up to the reply's text, the tokenizer's decode of it."""
    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.events import GenerationSettings, ReplySummary
    from medusa_chat.tree import Tree
    from tests.tinymodels import tiny_loaded, training_prompts

    tok, pieces = byte_level_tokenizer()
    loaded = dataclasses.replace(tiny_loaded("llama"), tokenizer=tok)
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63").prefix(16))
    items = list(engine.generate(training_prompts()[0], GenerationSettings(max_new_tokens=64)))
    summary = items[-1]
    assert isinstance(summary, ReplySummary)
    reply, shown = [], ""
    for event in items[:-1]:
        reply += event.token_ids
        shown += event.text
        data = b"".join(pieces[i] for i in reply)
        assert shown == (data.decode("utf-8", "replace") if event is items[-2] else complete_text(data))
    data = b"".join(pieces[i] for i in reply)
    assert reply == summary.token_ids and shown == summary.text == tok.decode(reply, skip_special_tokens=True)
    # the reply does hold what the stream must not stall on
    assert "\ufffd" in summary.text and any(b >= 0xC0 for b in data)
