"""What the decoding engine emits and what it is told: plain data, no torch, no UI.

The engine yields one `StepEvent` per decoding step and a final `ReplySummary`; the session manager forwards
them, and the UIs (Rich REPL, Gradio) render them. Nothing flows back except `GenerationSettings` and a stop
flag (`threading.Event`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationSettings:
    """Per-reply settings. temperature == 0 -> greedy (identical to plain greedy decoding);
    temperature > 0 -> `accept` picks the rule: "typical" (the paper's typical acceptance, bonus token sampled;
    fast but biased towards the heads' guesses) or "exact" (the reply has the model's own sampling
    distribution with this temperature and top_p; see medusa_chat/engine/acceptance.py)."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    typical_epsilon: float = 0.09  # "posterior_threshold" in the reference implementation
    typical_delta: float = 0.3  # "posterior_alpha"
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    accept: str = "typical"  # the rule for temperature > 0: "typical" | "exact"
    # put context-lookup guesses on the tree's main chain where the context repeats itself (lookup.py), in
    # greedy and exact mode, where the output is the same either way (only the tokens per step change); typical
    # acceptance never uses them (it would favour repeating earlier text)
    context_lookup: bool = True

    @property
    def accept_mode(self) -> str:
        """The rule this reply uses: "greedy" at temperature 0 (already exact), else `accept`."""
        return "greedy" if self.temperature <= 0 else self.accept

    def validate(self) -> None:
        from medusa_chat.errors import MedusaChatError

        if self.max_new_tokens < 1:
            raise MedusaChatError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if self.temperature < 0:
            raise MedusaChatError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise MedusaChatError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not (0 <= self.typical_epsilon <= 1 and 0 <= self.typical_delta <= 1):
            raise MedusaChatError("typical epsilon and delta must be in [0, 1]")
        if self.accept not in ("typical", "exact"):
            raise MedusaChatError(f"accept must be 'typical' or 'exact' (got {self.accept!r})")


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
    accept_mode: str  # "greedy" | "typical" | "exact"
    stop_reason: str  # "eos" | "stop_string" | "max_new_tokens" | "context_limit" | "stopped"
    tree_size: int
    message: str = ""  # human-readable note (e.g. why the context limit stopped the reply)
    accepted_lengths: list[int] = field(default_factory=list)  # per step, candidates accepted
    threads: str = ""  # what ran the steps on a CPU (engine/threads.py), "" elsewhere

    def to_dict(self) -> dict:
        return asdict(self)
