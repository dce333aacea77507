"""What the decoding engine emits and what it is told: plain data, no torch, no UI.

The engine yields one `StepEvent` per decoding step and a final `ReplySummary`; the session manager forwards
them, and the UIs (Rich REPL, Gradio) render them. Nothing flows back except `GenerationSettings` and a stop
flag (`threading.Event`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from medusa_chat.settings import OPTIONS, accept_mode


def _default(name: str) -> Any:
    return OPTIONS[name].default


@dataclass
class GenerationSettings:
    """Per-reply settings. temperature == 0 -> greedy (identical to plain greedy decoding);
    temperature > 0 -> `accept` picks the rule (medusa_chat/settings.py: the modes, and each field's default,
    check and help; medusa_chat/engine/acceptance.py: the rules themselves)."""

    max_new_tokens: int = _default("max_new_tokens")
    temperature: float = _default("temperature")
    top_p: float = _default("top_p")
    typical_epsilon: float = _default("typical_epsilon")
    typical_delta: float = _default("typical_delta")
    seed: int | None = _default("seed")
    stop_strings: tuple[str, ...] = _default("stop_strings")
    accept: str = _default("accept")  # the rule for temperature > 0, one of settings.ACCEPT_MODES
    # put context-lookup guesses on the tree's main chain where the context repeats itself (lookup.py), in
    # greedy and exact mode, where the output is the same either way (only the tokens per step change); typical
    # acceptance never uses them (it would favour repeating earlier text)
    context_lookup: bool = _default("context_lookup")
    # truncation beside top_p, and the repetition controls (engine/penalties.py); settings.py: their meaning
    top_k: int = _default("top_k")
    min_p: float = _default("min_p")
    repeat_penalty: float = _default("repeat_penalty")
    repeat_last_n: int = _default("repeat_last_n")
    presence_penalty: float = _default("presence_penalty")
    frequency_penalty: float = _default("frequency_penalty")
    dry_multiplier: float = _default("dry_multiplier")
    dry_base: float = _default("dry_base")
    dry_allowed_length: int = _default("dry_allowed_length")
    dry_sequence_breakers: tuple[str, ...] = _default("dry_sequence_breakers")

    @classmethod
    def for_entry(cls, entry: str) -> GenerationSettings:
        """The reply settings an entry point starts from (settings.ENTRY_OPTIONS, each option's default there):
        the dataclass's own defaults are the engine's (no penalty), the app's replies add its mild DRY."""
        from medusa_chat.settings import ENTRY_OPTIONS, defaults_for

        defaults = defaults_for(entry)
        return cls(**{name: defaults[name] for name in ENTRY_OPTIONS[entry] if name in cls.__dataclass_fields__})

    @property
    def accept_mode(self) -> str:
        """The rule this reply uses (settings.accept_mode): greedy at temperature 0 (already exact), else
        `accept`."""
        return accept_mode(self.temperature, self.accept)

    def validate(self) -> None:
        """Every field against its option's check; the first bad one raises MedusaChatError."""
        from medusa_chat.errors import MedusaChatError

        for name, option in OPTIONS.items():
            message = option.error(getattr(self, name))
            if message is not None:
                raise MedusaChatError(message)


@dataclass
class TreeView:
    """The tree verified in one step, as lists indexed by node (node 0 = root)."""

    tokens: list[int]  # token id of each node
    texts: list[str]  # decoded text of each node's token (raw; UIs must escape it)
    parents: list[int]  # parent node index (-1 for the root)
    depths: list[int]  # 0 for the root; depth d = guess of head d-1
    ranks: list[int]  # rank of the token in its head's top-k (root: 0)
    lookup_nodes: list[int] = field(default_factory=list)  # nodes whose token came from context lookup


@dataclass
class StepEvent:
    """One decoding step: what was verified, what was accepted, and the text it produced."""

    step: int  # 0 = the prefill (first token), then 1, 2, ...
    token_ids: list[int]  # tokens this step added to the reply (accepted candidates + bonus token)
    text: str  # the reply's new text this step (incremental; joins to the full reply)
    accepted_nodes: list[int]  # tree node indices on the accepted path, root first ([] for step 0)
    tree: TreeView | None  # None for step 0 (prefill has no tree)
    step_time_s: float
    new_tokens_total: int  # reply length so far
    elapsed_s: float  # since the reply started (prefill included)
    decode_tokens_per_s: float  # tokens after the first / decode time so far (0 until known)
    tokens_per_step: float  # decode tokens so far / decode steps so far

    @property
    def accepted_length(self) -> int:
        """Candidates accepted beyond the root this step (tokens this step = accepted_length + 1)."""
        return max(len(self.accepted_nodes) - 1, 0)


@dataclass
class ReplySummary:
    """Totals for one reply; the last item the engine yields."""

    text: str
    token_ids: list[int]
    new_tokens: int
    steps: int  # decode steps (tree verifications), prefill not counted
    tokens_per_step: float  # tokens produced by decode steps / steps (prefill's first token not counted)
    decode_tokens_per_s: float
    time_to_first_token_s: float
    prefill_s: float
    decode_s: float
    prompt_tokens: int
    reused_prefix_tokens: int  # prompt tokens whose KV cache was kept from the previous reply
    accept_mode: str  # one of settings.MODES
    stop_reason: str  # "eos" | "stop_string" | "max_new_tokens" | "context_limit" | "stopped"
    tree_size: int
    message: str = ""  # human-readable note (e.g. why the context limit stopped the reply)
    accepted_lengths: list[int] = field(default_factory=list)  # per step, candidates accepted
    threads: str = ""  # what ran the steps on a CPU (engine/threads.py), "" elsewhere
    # {tree prefix size: steps} where the tree's size was chosen as the reply ran (engine/tree_sizer.py), else {}
    sized_steps: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)
