"""Multi-turn prompts for self-distillation: each later user turn answered after the model's own earlier replies.

A conversation enters the distillation store as consecutive prompt entries: its first user turn as a plain
string (like any single-turn prompt), each later turn as `{"follow": text}`, meaning "the next user turn of the
conversation above". The reply to a follow-up is generated with the conversation so far rendered through the
chat template, the assistant turns being the model's own greedy replies to the earlier entries (decoded to text
and re-rendered, as the app renders a chat history). Shards never split a conversation, so each shard is
self-contained and resumable. One sample per entry keeps the store's layout (`ids` = rendered context + reply,
`reply_start` = context length).
"""

from __future__ import annotations

from typing import Any

FOLLOW = "follow"
Entry = str | dict[str, str]


def expand(conversation: list[str]) -> list[Entry]:
    """A conversation's user turns as store entries."""
    return [t if i == 0 else {FOLLOW: t} for i, t in enumerate(conversation)]


def is_follow(entry: Any) -> bool:
    return isinstance(entry, dict) and FOLLOW in entry


def user_text(entry: Entry) -> str:
    return entry[FOLLOW] if isinstance(entry, dict) else entry


def conversation_end(entries: list[Entry], end: int) -> int:
    """`end` moved past the follow-ups that continue the conversation it would cut."""
    while end < len(entries) and is_follow(entries[end]):
        end += 1
    return min(end, len(entries))


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(enc, dict) or hasattr(enc, "keys"):
        enc = enc["input_ids"]
    return [int(i) for i in enc]


def answer_entries(
    tokenizer: Any,
    entries: list[Entry],
    generate: Any,
    max_prompt_tokens: int,
    stop: set[int],
) -> tuple[list[list[int]], list[tuple[list[int], bool]]]:
    """(context ids, (reply ids, finished)) per entry. `generate(list of prompt ids)` gives the greedy replies in
    order (batched); `stop`: the ids that end a reply. Turn k of every conversation in `entries` goes in one batch, after turn k - 1's replies.

    A context longer than `max_prompt_tokens` gets an empty reply (kept so prompt indices stay aligned; it trains
    nothing), and so do the conversation's later turns. A leading follow-up (no conversation above it in
    `entries`) starts a conversation of its own.
    """
    n = len(entries)
    ctx: list[list[int]] = [[] for _ in range(n)]
    replies: list[tuple[list[int], bool]] = [([], False)] * n
    history: dict[int, list[dict[str, str]]] = {}  # conversation (its first entry) -> messages so far
    conv_of, turn_of = [0] * n, [0] * n
    for i, e in enumerate(entries):
        follows = is_follow(e) and i > 0
        conv_of[i] = conv_of[i - 1] if follows else i
        turn_of[i] = turn_of[i - 1] + 1 if follows else 0
    dead: set[int] = set()
    for turn in range(max(turn_of, default=-1) + 1):
        batch = []
        for i in range(n):
            if turn_of[i] != turn:
                continue
            if conv_of[i] in dead:  # a non-empty context all the same: every sample has ids
                ctx[i] = _render(tokenizer, [{"role": "user", "content": user_text(entries[i])}])
                continue
            msgs = history.get(conv_of[i], []) + [{"role": "user", "content": user_text(entries[i])}]
            ids = _render(tokenizer, msgs)
            ctx[i] = ids
            if len(ids) > max_prompt_tokens:
                dead.add(conv_of[i])
                continue
            history[conv_of[i]] = msgs
            batch.append(i)
        if not batch:
            continue
        for i, rep in zip(batch, generate([ctx[i] for i in batch]), strict=True):
            replies[i] = rep
            body = rep[0][:-1] if rep[1] and rep[0] and rep[0][-1] in stop else rep[0]
            text = tokenizer.decode(body, skip_special_tokens=True).strip()
            history[conv_of[i]] = history[conv_of[i]] + [{"role": "assistant", "content": text}]
    return ctx, replies

