"""Which imported samples a run keeps (`--import-select`): rules over the user's turn, so a store of replies to
real conversations can be cut to one kind of prompt (short single questions, say) without generating anew.

A rule is a comma-separated list of conditions, all of which a prompt entry must meet:

- ``first-turns``: conversations' first user turns only (no follow-ups);
- ``max-chars=N``: a user turn of at most N characters;
- ``no-code``: no code or error text in the turn (fences, tracebacks, common keywords and markup).

A dropped turn drops its conversation's later turns too: a follow-up is answered after the turns above it, and
the store keeps a conversation's turns together (conversations.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from medusa_chat.training.conversations import is_follow, user_text

# What marks a prompt as code or an error report: a fence, a traceback, a keyword of the common languages,
# markup, an arrow function or a closing brace. Deliberately coarse: it sorts prompts, it does not parse them.
CODE_PATTERN = re.compile(
    r"```|Traceback|\bdef |\bimport |#include|function\s*\(|=>|\};|</|SELECT |\bconst |\bpublic "
)


@dataclass(frozen=True)
class SampleRule:
    first_turns: bool = False
    max_chars: int | None = None
    no_code: bool = False

    @classmethod
    def parse(cls, spec: str) -> SampleRule:
        """`first-turns,max-chars=400,no-code` -> the rule; ValueError names what it does not know."""
        first_turns, max_chars, no_code = False, None, False
        for part in (p.strip() for p in spec.split(",")):
            name, _, value = part.partition("=")
            if part == "first-turns":
                first_turns = True
            elif part == "no-code":
                no_code = True
            elif name == "max-chars" and value.isdigit() and int(value) > 0:
                max_chars = int(value)
            else:
                raise ValueError(
                    f"unknown selection {part!r} in {spec!r}: use first-turns, max-chars=N (N > 0), no-code"
                )
        return cls(first_turns, max_chars, no_code)

    def keeps(self, entry: Any) -> bool:
        """Does the rule keep this prompt entry, judged on its own?"""
        if self.first_turns and is_follow(entry):
            return False
        text = user_text(entry)
        if self.max_chars is not None and len(text) > self.max_chars:
            return False
        return not (self.no_code and CODE_PATTERN.search(text))


def kept_rows(entries: list[Any], rule: SampleRule) -> list[int]:
    """Indices of the entries `rule` keeps, in order; a follow-up stays only while its conversation does."""
    rows: list[int] = []
    alive = False  # is the conversation the entry continues still kept?
    for i, entry in enumerate(entries):
        alive = (alive or not is_follow(entry)) and rule.keeps(entry)
        if alive:
            rows.append(i)
    return rows
