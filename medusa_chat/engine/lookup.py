"""Context lookup drafts: when the text so far ends with a few tokens it already contained, guess that what
followed them then follows them again (prompt lookup decoding, Saxena 2023; the n-gram drafter of vLLM and
transformers' `prompt_lookup_num_tokens`).

Chat replies repeat themselves and their prompt: names, code identifiers, list scaffolding ("1. **", "\\n\\n2.
**"), phrases the question used. There the lookup guesses runs of tokens the heads miss. The engine puts the
lookup's guess on the tree's main chain (the top-1 path) when the context's last `min_match`..`max_match`
tokens occurred before, and keeps the heads' guesses everywhere else; verification is unchanged, so greedy
output is still the plain loop's token for token and the exact sampling rule keeps its law (the guesses
depend only on tokens already emitted). Typical acceptance does not use it: that rule keeps any plausible
guess, so it would tilt sampled replies towards repeating themselves. Measured with `bench` on this project's
2-core CPU, all 80 Vicuna-bench first turns, greedy, the 3-node chain: 1.60 -> 1.71 tokens per step (README).

The index maps every 2..4-gram of the context to the position after its latest occurrence, updated as tokens
are committed: O(1) per token and per lookup, no scan of the context.
"""

from __future__ import annotations

from collections.abc import Iterable

# The longest run of context-lookup guesses one step verifies, where the context's last `max_match` (4) tokens
# occurred before (the text is being copied: a name, code, a list's scaffolding, a quoted sentence). Measured on
# this project's 2-core CPU (40 Vicuna-bench replies, the backbone's greedy continuations): after a 4-token match
# the lookup's next 1 / 2 / 3 / 4 tokens were all right 78 / 61 / 48 / 39% of the time, after a 2-token match 54
# / 31 / 23 / 17%, so the long chain pays only after the long match, and a weak match keeps the tree's chain (2
# nodes by default). Three: root + 3 guesses are 4 rows, one tile of the block kernel; a 5th row starts a second
# tile (~0.6 ms there against ~0.2-0.4 for the 2nd-4th). Side by side (benchmarks/ab_engines.py, all 80 prompts):
# runs of 3 / 4 / 6 gave 1.345x / 1.334x / 1.321x the plain loop, no runs 1.331x; at 1000-2000 tokens of
# conversation 3 and 4 were even (1.40x / 1.39x, 1.89x / 1.86x), no runs 1.27x / 1.83x.
LOOKUP_RUN = 3


class ContextLookup:
    """The n-gram index of one reply's context (prompt + reply so far)."""

    def __init__(self, tokens: Iterable[int] = (), min_match: int = 2, max_match: int = 4) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match (got {min_match}, {max_match})")
        self.min_match, self.max_match = min_match, max_match
        self.tokens: list[int] = []
        # k -> {k tokens: index of the token after their latest occurrence}
        self._follower: dict[int, dict[tuple[int, ...], int]] = {
            k: {} for k in range(min_match, max_match + 1)
        }
        self.matched = 0  # how many tokens the last `continuation` matched (0: none)
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        seq = self.tokens
        for token in tokens:
            seq.append(int(token))
            i = len(seq) - 1  # the new token follows the k tokens before it
            for k, index in self._follower.items():
                if i >= k:
                    index[tuple(seq[i - k : i])] = i

    def continuation(self, count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the longest matching suffix
        (`max_match` down to `min_match` tokens); [] when the suffix never occurred before. `matched` says how
        long the matching suffix was."""
        seq = self.tokens
        for k in range(self.max_match, self.min_match - 1, -1):
            if len(seq) <= k:
                continue
            follower = self._follower[k].get(tuple(seq[-k:]))
            if follower is not None:
                self.matched = k
                return seq[follower : follower + count]
        self.matched = 0
        return []
