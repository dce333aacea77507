"""Repetition controls on a reply's logits, per tree node: each node is penalised with its own context.

The controls, defined as their anchors define them (docs/sampling.md):

- repeat penalty (llama.cpp's ``--repeat-penalty`` / ``--repeat-last-n``): a token among the context's last
  ``repeat_last_n`` tokens (the prompt counts, as llama.cpp feeds its prompt to the sampler; -1: the whole
  context, 0: off) has its logit divided by the penalty when positive, multiplied by it otherwise;
- ``presence_penalty`` / ``frequency_penalty`` (OpenAI's): ``logit -= presence * [c > 0] + frequency * c``,
  with ``c`` the token's count in the reply so far (OpenAI counts the sampled tokens, not the prompt);
- DRY (llama.cpp's and text-generation-webui's): where the context's end repeats an earlier run of at least
  ``dry_allowed_length`` tokens, the token that followed that run gets ``logit -= multiplier * base ** (length
  - allowed_length)`` (the longest such run per token; runs do not cross a sequence breaker, and a breaker
  token is never penalised). Breakers are matched inside single tokens (a token whose text contains one), which
  is llama.cpp's rule for one-character breakers such as the defaults; a breaker that only spans tokens is not
  seen. The window is the whole context (llama.cpp's default ``--dry-penalty-last-n -1``).

In llama.cpp's order: repeat / presence / frequency first, DRY second, then temperature and the truncation
samplers (acceptance.py).

Tree decoding. A node's logits predict the token after its path, so they are penalised with the node's own
context: prompt + reply so far + the path's tokens below the root. The committed context keeps its counts
(`ContextState`, updated by the tokens each step adds); a node differs from it only in the tokens of its path,
the window's oldest tokens its path pushes out, and its DRY matches (grown from its parent's by one token). Per
node that is a handful of entries, computed from the raw logits with the node's full state of each token,
while the committed context's own entries are applied to every row at once. A row's penalised values are
therefore exactly those the plain loop computes at the same context (the same elementwise float ops on the same
inputs), which keeps greedy replies bitwise equal to the plain loop's and exact sampling on the penalised law.

Off (the settings' neutral values), nothing here runs: the engine keeps its argmax-only greedy step.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.engine.acceptance import greedy_tokens
from medusa_chat.settings import GREEDY, OPTIONS

if TYPE_CHECKING:
    from medusa_chat.events import GenerationSettings
    from medusa_chat.tree import TreeBuffers

# log(FLT_MAX): DRY's exponent is clamped so that base ** exponent stays a finite float (as llama.cpp does)
_FLOAT_MAX_LOG = 88.7228391


@dataclass(frozen=True)
class PenaltyOptions:
    """A reply's repetition settings (settings.OPTIONS names them and gives their defaults; these defaults are
    the neutral values: nothing penalised)."""

    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[str, ...] = OPTIONS["dry_sequence_breakers"].default

    @classmethod
    def of(cls, settings: GenerationSettings) -> PenaltyOptions:
        return cls(**{name: getattr(settings, name) for name in cls.__dataclass_fields__})

    @property
    def repeat(self) -> bool:
        return self.repeat_penalty != 1.0 and self.repeat_last_n != 0

    @property
    def counts(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def dry(self) -> bool:
        return self.dry_multiplier != 0.0 and self.dry_base >= 1.0

    @property
    def active(self) -> bool:
        return self.repeat or self.counts or self.dry

    @property
    def lowers_only(self) -> bool:
        """No control raises a logit (a repeat penalty >= 1, presence and frequency >= 0, DRY): a row's penalised
        argmax is then its raw argmax unless that very token is penalised in the row."""
        return (
            (not self.repeat or self.repeat_penalty >= 1.0)
            and self.presence_penalty >= 0.0
            and self.frequency_penalty >= 0.0
            and (not self.dry or self.dry_multiplier >= 0.0)
        )

    def dry_penalty(self, length: int) -> float:
        exponent = length - self.dry_allowed_length
        if self.dry_base > 1.000001:
            exponent = min(exponent, int(_FLOAT_MAX_LOG / math.log(self.dry_base)))
        return self.dry_multiplier * self.dry_base**exponent


_BREAKERS: dict[tuple[int, tuple[str, ...]], frozenset[int]] = {}


def breaker_tokens(tokenizer: Any, breakers: tuple[str, ...]) -> frozenset[int]:
    """The tokens whose text contains a sequence breaker (cached per tokenizer and breakers)."""
    key = (id(tokenizer), breakers)
    if key not in _BREAKERS:
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        _BREAKERS[key] = frozenset(i for i, t in enumerate(texts) if any(b in t for b in breakers if b))
    return _BREAKERS[key]


# A token's penalty state at one context: (in the repeat window, count in the reply, DRY penalty)
State = tuple[bool, int, float]


class _Dry:
    """DRY's match lengths at one context, grown a token at a time: `z[i]` is the length of the longest run
    ending at position i that equals the run ending the context (capped at `limit`, the distance to the last
    breaker), for i before the context's last token; positions without a match are absent."""

    __slots__ = ("limit", "z")

    def __init__(self, z: dict[int, int], limit: int) -> None:
        self.z, self.limit = z, limit

    def grown(self, token: int, breaker: bool, before: list[int]) -> _Dry:
        """The matches after appending `token`, whose earlier positions are `before`."""
        if breaker:
            return _Dry({}, 0)
        limit, z = self.limit + 1, self.z
        return _Dry({i: min(1 + z.get(i - 1, 0), limit) for i in before}, limit)

    def penalties(
        self, opts: PenaltyOptions, token_at: Any, length: int, breakers: frozenset[int]
    ) -> dict[int, float]:
        """{token: penalty} for the tokens that would extend a repeated run (llama.cpp's DRY steps 3-4)."""
        allowed = opts.dry_allowed_length
        if length <= allowed or self.limit < allowed:
            return {}
        longest: dict[int, int] = {}
        for i, n in self.z.items():
            if n >= allowed:
                t = token_at(i + 1)
                if longest.get(t, 0) < n:
                    longest[t] = n
        return {t: opts.dry_penalty(n) for t, n in longest.items() if t not in breakers}


class ContextState:
    """The penalty state of the committed context (prompt + reply so far), updated by `extend`."""

    def __init__(
        self, opts: PenaltyOptions, prompt: list[int], breakers: frozenset[int] = frozenset()
    ) -> None:
        self.opts, self.breakers = opts, breakers
        self.context: list[int] = []
        self.reply_start = len(prompt)
        last_n = opts.repeat_last_n if opts.repeat else 0
        self.window: deque[int] = deque(maxlen=None if last_n < 0 else max(last_n, 0))
        self.in_window: Counter[int] = Counter()
        self.reply: Counter[int] = Counter()
        self.where: dict[int, list[int]] = {}  # DRY: each token's positions
        self.dry = _Dry({}, 0)
        self.extend(prompt, reply=False)

    def extend(self, tokens: list[int], reply: bool = True) -> None:
        opts = self.opts
        for t in tokens:
            if opts.repeat:
                if self.window.maxlen is not None and len(self.window) == self.window.maxlen:
                    old = self.window[0]
                    self.in_window[old] -= 1
                    if not self.in_window[old]:
                        del self.in_window[old]
                self.window.append(t)
                self.in_window[t] += 1
            if reply and opts.counts:
                self.reply[t] += 1
            if opts.dry:
                before = self.where.setdefault(t, [])
                self.dry = self.dry.grown(t, t in self.breakers, before)
                before.append(len(self.context))
            self.context.append(t)

    def state(self, t: int) -> State:
        return (self.in_window.get(t, 0) > 0, self.reply.get(t, 0), 0.0)

    def base(self) -> dict[int, State]:
        """Every token the committed context penalises, with its state (DRY aside: per node)."""
        tokens = set(self.in_window) | set(self.reply)
        return {t: self.state(t) for t in tokens}

    def node_entries(self, tokens: list[int], parents: list[int]) -> list[dict[int, State]]:
        """For each tree node (node 0 = the root, the context's last token; `tokens` by node), the tokens whose
        state at the node's context (the context + its path below the root) differs from `base`, or that DRY
        penalises there, with their full state there. Parents come before their children."""
        opts, n_ctx = self.opts, len(self.context)
        window = list(self.window)
        cap = self.window.maxlen
        paths: list[list[int]] = [[]]
        drys = [self.dry]
        out: list[dict[int, State]] = []
        for v in range(len(tokens)):
            if v:
                paths.append([*paths[parents[v]], tokens[v]])
            path = paths[v]
            changed: dict[int, State] = {}
            if path:
                on_path = Counter(path)
                leaving: Counter[int] = Counter()
                if opts.repeat and cap is not None:  # the window's oldest tokens this path pushes out
                    k = max(0, len(window) + len(path) - cap)
                    leaving.update(window[:k] + path[: max(0, k - len(window))])
                for t in set(on_path) | set(leaving):
                    in_window = opts.repeat and self.in_window.get(t, 0) + on_path[t] - leaving[t] > 0
                    count = self.reply.get(t, 0) + (on_path[t] if opts.counts else 0)
                    changed[t] = (in_window, count, 0.0)
            if opts.dry:
                if v:
                    drys.append(self._grown(drys[parents[v]], path, n_ctx))
                token_at = self._token_at(path, n_ctx)
                for t, penalty in drys[v].penalties(opts, token_at, n_ctx + len(path), self.breakers).items():
                    changed[t] = (*changed.get(t, self.state(t))[:2], penalty)
            out.append(changed)
        return out

    def _grown(self, parent: _Dry, path: list[int], n_ctx: int) -> _Dry:
        t = path[-1]
        before = self.where.get(t, []) + [n_ctx + j for j, s in enumerate(path[:-1]) if s == t]
        return parent.grown(t, t in self.breakers, before)

    def _token_at(self, path: list[int], n_ctx: int) -> Any:
        context = self.context
        return lambda i: context[i] if i < n_ctx else path[i - n_ctx]


def _penalised(
    opts: PenaltyOptions, x: torch.Tensor, rep: torch.Tensor, count: torch.Tensor, dry: torch.Tensor
) -> torch.Tensor:
    """The penalised logits of entries with raw logits `x` and their states (elementwise, float32): repeat
    penalty, then presence and frequency, then DRY, as llama.cpp applies them."""
    if opts.repeat:
        x = torch.where(rep, torch.where(x <= 0, x * opts.repeat_penalty, x / opts.repeat_penalty), x)
    if opts.counts:
        x = x - (count * opts.frequency_penalty + (count > 0).float() * opts.presence_penalty)
    if opts.dry:
        x = x - dry
    return x


@dataclass
class _Entries:
    """Flat penalty entries on the device: (row or node, token) and the token's state there."""

    rows: torch.Tensor
    cols: torch.Tensor
    rep: torch.Tensor
    count: torch.Tensor
    dry: torch.Tensor

    @classmethod
    def build(cls, items: list[tuple[int, int, State]], device: torch.device) -> _Entries:
        rows, cols, states = [r for r, _, _ in items], [c for _, c, _ in items], [s for _, _, s in items]
        return cls(
            torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(cols, dtype=torch.long, device=device),
            torch.tensor([s[0] for s in states], dtype=torch.bool, device=device),
            torch.tensor([float(s[1]) for s in states], dtype=torch.float32, device=device),
            torch.tensor([s[2] for s in states], dtype=torch.float32, device=device),
        )


class Penaliser:
    """A reply's penalties: the committed context's state, and per step the tree nodes' entries."""

    def __init__(self, opts: PenaltyOptions, prompt: list[int], breakers: frozenset[int]) -> None:
        self.opts = opts
        self.state = ContextState(opts, prompt, breakers)
        self._base: _Entries | None = None
        self._base_tokens: frozenset[int] = frozenset()  # the tokens `_base` penalises (host)
        self._nodes: list[dict[int, State]] = [{}]
        self._flat: _Entries | None = None  # every node's entries, rows = node

    def commit(self, tokens: list[int]) -> None:
        self.state.extend(tokens)
        self._base = None

    def begin_step(self, tokens: list[int], parents: list[int], device: torch.device, flat: bool = True) -> None:
        """This step's tree: its tokens (host) and parents (`flat`: also every node's entries on the device, for
        `every_row` and `row_of`)."""
        if self._base is None:
            base = self.state.base()
            self._base = _Entries.build([(0, t, s) for t, s in base.items()], device)
            self._base_tokens = frozenset(base)
        self._nodes = self.state.node_entries(tokens, parents)
        if flat:
            items = [(v, t, s) for v, entries in enumerate(self._nodes) for t, s in entries.items()]
            self._flat = _Entries.build(items, device)

    def greedy_tops(self, tokens: list[int], parents: list[int], tops: list[int], row_logits: Any,
                    device: torch.device) -> list[int]:  # fmt: skip
        """Each node's penalised argmax from its raw argmax `tops` (penalties that only lower logits): a row keeps
        its raw argmax unless that token is penalised there; only those rows' logits are computed
        (`row_logits(nodes)` -> [R, V] float32, a fresh tensor), penalised and searched again."""
        self.begin_step(tokens, parents, device, flat=False)
        base = self._base_tokens
        redo = [v for v, t in enumerate(tops) if t in base or t in self._nodes[v]]
        if not redo:
            return tops
        fixed = greedy_tokens(self.rows(row_logits(redo), redo, in_place=True)).tolist()
        out = list(tops)
        for v, t in zip(redo, fixed, strict=True):
            out[v] = t
        return out

    def rows(self, logits: torch.Tensor, nodes: list[int], in_place: bool = False) -> torch.Tensor:
        """`logits` [R, V] penalised, row r the logits of node `nodes[r]` (a copy, or the float32 tensor itself
        changed in place where the caller owns it)."""
        slot = {v: r for r, v in enumerate(nodes)}
        items = [(slot[v], t, s) for v in nodes for t, s in self._nodes[v].items()]
        return self._apply(logits, _Entries.build(items, logits.device) if items else None, in_place)

    def every_row(self, logits: torch.Tensor) -> None:
        """Penalise the step's logits [N, V] (row v: node v) in place, each row with its node's context."""
        self._apply(logits, self._flat if self._flat is not None and self._flat.rows.numel() else None, True)

    def row_of(self, logits: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
        """The penalised logits [V] of the node `node` ([1], on the device: no host read): the other nodes'
        entries are sent to a padding column."""
        flat = self._flat
        assert flat is not None
        vocab = logits.shape[-1]
        padded = torch.cat([logits.view(1, vocab), logits.new_zeros(1, 1)], dim=1)
        mine = _Entries(flat.rows.new_zeros(flat.rows.shape), torch.where(flat.rows == node, flat.cols, vocab),
                        flat.rep, flat.count, flat.dry)  # fmt: skip
        return self._apply(padded, mine)[0, :vocab]

    def _apply(self, logits: torch.Tensor, nodes: _Entries | None, in_place: bool = False) -> torch.Tensor:
        assert self._base is not None
        out = logits if in_place and logits.dtype == torch.float32 else logits.float().clone()
        raw = out[nodes.rows, nodes.cols] if nodes is not None else None  # before any entry is written
        base = self._base
        if base.cols.numel():
            x = out[:, base.cols]
            out[:, base.cols] = _penalised(self.opts, x, base.rep, base.count, base.dry)
        if nodes is not None and raw is not None:
            out[nodes.rows, nodes.cols] = _penalised(self.opts, raw, nodes.rep, nodes.count, nodes.dry)
        return out


class PenalisedAcceptor:
    """An acceptor (acceptance.py) whose logits are penalised first, each row with its node's context."""

    argmax_only = False  # the engine's greedy step must hand over logits, not argmaxes

    def __init__(self, inner: Any, penaliser: Penaliser) -> None:
        self.inner, self.penaliser = inner, penaliser
        self.accept_mode = inner.accept_mode

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        self.penaliser.begin_step([0], [-1], logits.device)  # the prompt's end: the base entries alone
        return self.inner.first(self.penaliser.rows(logits.view(1, -1), [0])[0])

    def commit(self, tokens: list[int]) -> None:
        self.penaliser.commit(tokens)

    def judge(
        self, parent_logits: torch.Tensor, tokens: torch.Tensor, buf: TreeBuffers, position: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tree = buf.tree
        self.penaliser.begin_step(tokens.tolist(), tree.parents, tokens.device)
        if len(buf.internal):  # the engine's rows of this step: changed in place, not copied
            parent_logits = self.penaliser.rows(parent_logits, sorted(set(tree.parents[1:])), in_place=True)
        return self.inner.judge(parent_logits, tokens, buf, position)

    @property
    def greedy_from_argmax(self) -> bool:
        """Greedy under penalties that only lower logits: the engine may start from the raw argmaxes."""
        return self.inner.accept_mode == GREEDY and self.penaliser.opts.lowers_only

    def greedy_tops(self, tokens: list[int], buf: TreeBuffers, tops: list[int], row_logits: Any,
                    device: torch.device) -> list[int]:  # fmt: skip
        return self.penaliser.greedy_tops(tokens, buf.tree.parents, tops, row_logits, device)

    def penalise_step(self, logits: torch.Tensor, tokens: torch.Tensor, buf: TreeBuffers) -> Any:
        """Penalise every row of the step's logits [N, V] in place (row v with node v's context) and return the
        inner rule, which then judges them as raw logits: for small trees, whose every row the engine computes
        at once, this replaces `judge` and `bonus` (one pass, no copies; greedy keeps its argmax-only walk).
        Reads the tree's tokens to the host: the nodes' penalty entries are built there."""
        self.penaliser.begin_step(tokens.tolist(), buf.tree.parents, logits.device)
        self.penaliser.every_row(logits)
        return self.inner

    def bonus(self, last_logits: torch.Tensor, last: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return self.inner.bonus(self.penaliser.row_of(last_logits, last), last, count)


def with_penalties(acceptor: Any, settings: GenerationSettings, prompt: list[int], tokenizer: Any) -> Any:
    """`acceptor` itself when the settings penalise nothing, else the same rule on penalised logits."""
    opts = PenaltyOptions.of(settings)
    if not opts.active:
        return acceptor
    breakers = breaker_tokens(tokenizer, opts.dry_sequence_breakers) if opts.dry else frozenset()
    return PenalisedAcceptor(acceptor, Penaliser(opts, prompt, breakers))


__all__ = [
    "ContextState",
    "PenalisedAcceptor",
    "Penaliser",
    "PenaltyOptions",
    "breaker_tokens",
    "with_penalties",
]
