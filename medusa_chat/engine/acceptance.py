"""Acceptance rules: which tree nodes the backbone agrees with, and the bonus token that ends a step.

Three modes (`GenerationSettings.accept_mode`):

- ``greedy`` (temperature 0): a node is accepted when its token is the argmax of its parent's logits. The reply
  is plain greedy decoding, token for token.
- ``typical`` (temperature > 0, the paper's default): accept a node when the parent gives its token a
  probability above ``min(epsilon, delta * exp(-H))``; the bonus token is sampled. Fast, but the reply no longer
  follows the model's sampling distribution: it leans towards the heads' guesses (tests/test_exact_sampling.py
  measures the bias).
- ``exact`` (temperature > 0): distribution-preserving verification. The reply has exactly the law of plain
  autoregressive sampling with the same temperature and top-p (up to the float noise of the tree forward).

The ``exact`` rule
------------------
Every reply draws its randomness up front: one uniform ``u[k]`` per reply position k, from the engine's seeded
``torch.Generator``. Token k of the reply is always ``F_k^{-1}(u[k])``: the inverse CDF of the model's
distribution at that position (softmax(logits / T), nucleus-filtered exactly like plain `sample`) evaluated at
``u[k]``. A step therefore does this, for a tree whose root is the last emitted token (reply position L-1):

1. At every node v with children (depth d, it stands for reply position L-1+d), draw ``y_v = F_v^{-1}(u[L+d])``
   from the node's target distribution ``p_v``. All such nodes are drawn at once, on the device.
2. A child c of v is accepted iff its token equals ``y_v`` (if two siblings carry the same token, only the
   first counts).
3. Walk from the root along accepted children (`best_path`: at most one child of a node is accepted, so the
   longest accepted run *is* the walk). At the last node reached, the bonus token is ``y_last`` if that node has
   children (then ``y_last`` matched none of them), else a fresh draw ``F_last^{-1}(u[L+count])`` from the
   logits the engine computes there anyway.

Why the output distribution equals plain sampling. Along the walked path every token is accepted, so the
path's tokens are the reply's tokens and the logits at a path node are the model's logits for exactly that
context (tree attention: a node sees the prefix and its ancestors only). Hence every token the step emits, the
accepted ones and the bonus, is ``F_k^{-1}(u[k])`` with ``F_k`` the model's distribution given all earlier reply
tokens. The drafts only decide *how many* of these values one forward pass can reveal; they never change one.
Since the ``u[k]`` are independent uniforms, ``F_k^{-1}(u[k])`` has law ``p(. | reply[:k])`` given the past, so
the reply is distributed exactly as plain sampling. Stronger: it is *pathwise* the reply that the plain loop
(a root-only tree) produces with the same seed, which the tests check token for token (fp32). All of this holds
up to the float noise between the tree forward's logits and a plain forward's: ~1e-6 in fp32, bf16 rounding in
bf16, where a same-seed reply leaves the plain loop's once a uniform lands within that noise of a CDF boundary.

Relation to SpecInfer's multi-draft speculative sampling. With deterministic (point-mass) drafts
``q_i = delta(c_i)`` the residual scheme reads: accept child ``c_1`` with probability ``min(1, r_0(c_1) /
q_1(c_1)) = p(c_1)``; on rejection the residual becomes ``r_1 = norm(max(0, r_0 - q_1))``, i.e. ``p`` with
``c_1``'s mass removed and renormalised; try ``c_2`` with probability ``r_1(c_2)``, and so on; when every child
is rejected, the bonus is drawn from the last residual, ``p`` restricted to the non-children. The probability of
moving to ``c_i`` is ``prod_{j<i}(1 - r_{j-1}(c_j)) * r_{i-1}(c_i) = p(c_i)`` and the bonus token ``x`` (not a
child) comes out with probability ``p(x)``: the scheme is the same random experiment as drawing one
``y ~ p`` and following the child equal to ``y``, with ``y`` itself as the bonus when no child matches (its
conditional law given "no child matches" is exactly the final residual). The single draw needs one inverse-CDF
per node instead of a loop over children, and couples the reply to plain sampling as described above.

Costs: per step one softmax (+ nucleus sort when top_p < 1) and one float64 cumulative sum over the internal
nodes' rows, a `searchsorted`, and the comparisons: no extra forward pass, no extra host sync (the engine's one
`.tolist()` per step reads the result).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from medusa_chat.settings import EXACT, GREEDY, TYPICAL
from medusa_chat.tree import TreeBuffers

if TYPE_CHECKING:
    from medusa_chat.events import GenerationSettings

# ------------------------------------------------------------------------------------------------------------
# Target distributions and samplers
# ------------------------------------------------------------------------------------------------------------
def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` [..., V] with every token outside the top_p nucleus set to 0 (not renormalised).

    The nucleus is the smallest set of most likely tokens whose mass reaches top_p; the top token is always
    kept. Every sampler here (plain `sample`, the typical rule's nucleus check, the exact rule) uses this one
    function, so they agree on which tokens may appear."""
    if top_p >= 1.0:
        return probs
    if probs.device.type == "cpu" and probs.dim() <= 2:
        out = _nucleus_from_head(probs, top_p)
        if out is not None:
            return out
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = (
        sorted_p.cumsum(-1) - sorted_p < top_p
    )  # mass strictly before a token < top_p: always keeps the top
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p * keep)


def _nucleus_from_head(probs: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """`nucleus` on a CPU from each row's head: the tokens of probability >= (1 - top_p) / (2 V). Together
    those hold at least top_p + (1 - top_p) / 2 of the mass (the rest is below V x the cut), so the nucleus lies
    among them: they come first in the descending order, in the same order (a stable sort of the same values,
    taken in index order), so their running sums and the kept set are the full sort's, bit for bit. Sorting all
    49k probabilities of a row took ~2.8 ms on a 2-core CPU, as much as a decoding step of the embedded model;
    the head is a few hundred to a few thousand tokens. None (the full sort) when a row's head does not reach
    the mass it must (probabilities that do not sum to ~1)."""
    rows = probs.reshape(-1, probs.shape[-1])
    cut = (1.0 - top_p) / (2 * rows.shape[-1])
    out = torch.zeros_like(rows)
    for r in range(rows.shape[0]):
        index = (rows[r] >= cut).nonzero()[:, 0]
        if index.numel() == 0:
            return None
        head = rows[r].index_select(0, index)
        sorted_p, order = head.sort(descending=True, stable=True)
        before = sorted_p.cumsum(0) - sorted_p
        if not float(before[-1] + sorted_p[-1]) >= top_p + (1.0 - top_p) / 4:
            return None
        out[r].index_copy_(0, index.index_select(0, order), sorted_p * (before < top_p))
    return out.view_as(probs)


def target_probs(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0
) -> torch.Tensor:
    """The distribution plain sampling draws from: softmax(logits / T), then top-k, the nucleus and min-p
    (unnormalised; `truncated`)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return truncated(probs, top_p, top_k, min_p) if top_k > 0 or min_p > 0 else nucleus(probs, top_p)


def truncated(probs: torch.Tensor, top_p: float, top_k: int, min_p: float) -> torch.Tensor:
    """`probs` [..., V] after the truncation samplers in llama.cpp's order: top-k (the k most likely tokens,
    ties at the k-th kept; renormalised, so the nucleus is a share of what top-k kept), the nucleus, then min-p
    (tokens below min_p x the most likely token's probability dropped). Unlike llama.cpp, which applies the
    temperature last, they see the tempered distribution, as top-p always has here (and as in HF
    transformers and vLLM)."""
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = probs * (probs >= kth)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    probs = nucleus(probs, top_p)
    if min_p > 0:
        probs = probs * (probs >= min_p * probs.amax(dim=-1, keepdim=True))
    return probs


def sample(probs: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """Sample one token from a [V] distribution with nucleus (top_p) filtering; stays on the device.

    By the inverse CDF of one uniform from `generator` (`inverse_cdf_sample`: exact for any categorical
    distribution): torch.multinomial over a 49k vocabulary took ~1.1 ms a token on a 2-core CPU (a fifth of a
    plain sampling step), this ~0.08 ms."""
    u = torch.rand(1, generator=generator, device=probs.device)
    return inverse_cdf_sample(nucleus(probs, top_p)[None], u)[0]


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row r's token `F_r^{-1}(u[r])` for unnormalised probabilities `probs` [R, V] and uniforms `u` [R] in
    [0, 1): the first token whose cumulative mass exceeds `u * total`. Exact for any categorical distribution,
    and a token of probability 0 (outside the nucleus, or an underflowed softmax) is never returned.

    The cumulative sum is in float64 so that summing tens of thousands of probabilities does not shift the
    boundaries by float32 rounding (~1e-7 per term)."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    # x < total strictly (u * total may round up to total): then the first index with cdf > x exists and its
    # cdf rose there, i.e. its probability is > 0.
    x = torch.minimum(u.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True)[:, 0]


# ------------------------------------------------------------------------------------------------------------
# Per-node rules ([N] bool "accepted given its parent"; the root's value is never read)
# ------------------------------------------------------------------------------------------------------------
def greedy_node_ok(top: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """Node accepted iff its token is the argmax of its parent's logits. [N] bool (root's value unused).

    `top` holds argmaxes of the internal nodes' logit rows, indexed by `parent` (`TreeBuffers.parent_slot`).
    The engine's small greedy trees use `greedy_path`, the same rule on the host."""
    return tokens == top.index_select(0, parent)


def greedy_path(tokens: list[int], tops: list[int], children: list[list[int]]) -> list[int]:
    """The greedy rule on the host, for small trees whose tokens and argmaxes the step already synced: the
    longest path from the root along which every node's token is its parent's argmax (`tops[node]`), root
    first. As long as the path `best_path(greedy_node_ok(...))` picks (tested); siblings with equal tokens are
    all followed. Equally long accepted paths carry the same tokens (each is the argmax of the one before), so
    which one is kept never changes the reply."""
    best, stack = [0], [[0]]
    while stack:
        path = stack.pop()
        if len(path) > len(best):
            best = path
        want = tops[path[-1]]
        stack.extend(path + [c] for c in reversed(children[path[-1]]) if tokens[c] == want)
    return best


def typical_node_ok(
    probs: torch.Tensor,
    tokens: torch.Tensor,
    parent: torch.Tensor,
    typical_epsilon: float,
    typical_delta: float,
    top_p: float = 1.0,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Typical acceptance: accept x when p(x) > min(epsilon, delta * exp(-H(p))) (epsilon, delta: the settings'
    typical_epsilon and typical_delta), p = parent's distribution,
    and (top_p < 1) x is inside the parent's nucleus, so that an accepted candidate is always a token plain
    sampling could have produced there (the threshold itself still uses the full distribution's entropy, as in
    the paper).

    Returns ([N] bool accepted, [N] log p(token | parent)) for tie-breaking between equally long paths.
    """
    entropy = -(probs * torch.log(probs.clamp_min(1e-20))).sum(dim=-1)
    threshold = torch.minimum(torch.full_like(entropy, typical_epsilon), typical_delta * torch.exp(-entropy))
    p_child = probs[parent, tokens]
    ok = p_child > threshold[parent]
    if kept is not None:  # top-k / min-p as well: the tokens plain sampling keeps (`truncated`)
        ok &= kept[parent, tokens] > 0
    elif top_p < 1.0:
        ok &= nucleus(probs, top_p)[parent, tokens] > 0
    return ok, torch.log(p_child.clamp_min(1e-20))


def exact_node_ok(
    draws: torch.Tensor, tokens: torch.Tensor, parent_slot: torch.Tensor, sibling_before: torch.Tensor
) -> torch.Tensor:
    """Exact rule: node accepted iff its token equals the draw made at its parent (`draws` [I], one per
    internal node, indexed by `parent_slot`). `sibling_before` [N, N] (j is an earlier sibling of i) keeps
    only the first of several siblings carrying the same token: choosing between two equal-token branches by
    how far each got would favour the longer one and bias the reply. Medusa and Hydra drafts never repeat a
    token among siblings (they are one top-k), so this is a guard for other drafters."""
    ok = tokens == draws[parent_slot]
    duplicate = ((tokens[:, None] == tokens[None, :]) & sibling_before).any(dim=1)
    return ok & ~duplicate


def best_path(
    node_ok: torch.Tensor, leaf_paths: torch.Tensor, node_logp: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the leaf path with the longest accepted prefix. Returns (path node indices [D+1], accepted count).

    `leaf_paths` is padded with N; the padding reads a False appended to `node_ok`. Among paths accepting
    the same number of tokens, the one with the largest summed log-probability wins (typical mode).
    """
    ok = torch.cat([node_ok, node_ok.new_zeros(1)])[leaf_paths[:, 1:]]
    run = ok.to(torch.int32).cumprod(dim=1)
    accepted = run.sum(dim=1)
    score = accepted.to(torch.float32)
    if node_logp is not None:
        logp = torch.cat([node_logp, node_logp.new_zeros(1)])[leaf_paths[:, 1:]]
        score = score * 1e4 + (logp.float() * run).sum(dim=1)
    best = score.argmax().view(1)
    # index_select keeps the choice on the device (no host sync until the engine's one .tolist() per step)
    return leaf_paths.index_select(0, best)[0], accepted.index_select(0, best)[0]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension (the first index of the maximum, as `torch.argmax`), via `max(dim)`.

    Why not `argmax`: on a CPU `max(dim)` finds the same index about 3x faster (measured on [1-3, 49152] fp32
    rows: 20 vs 60 us a row), and a greedy step takes one per tree node. Both return the first maximal index, so
    the token is the same (tests/test_tree.py checks it on ties)."""
    return logits.max(dim=-1).indices


# ------------------------------------------------------------------------------------------------------------
# Acceptors: one per reply, the engine's accept + bonus block calls them
# ------------------------------------------------------------------------------------------------------------
class Acceptor:
    """A reply's acceptance rule. Per step the engine calls `judge` (which nodes are accepted), `best_path`,
    then `bonus` with the logits at the last accepted node. Everything stays on the device."""

    accept_mode = GREEDY
    argmax_only = True  # greedy on raw logits: the engine may hand over argmaxes instead of logit rows
    top_k, min_p = 0, 0.0  # truncation beside top_p (`truncated`); greedy keeps the argmax whatever they are

    def commit(self, tokens: list[int]) -> None:
        """The reply's new tokens (a stateless rule ignores them; penalties.py keeps counts)."""

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """The reply's first token [1] from the prefill's next-token logits [V]."""
        return greedy_tokens(logits).view(1)

    def judge(
        self, parent_logits: torch.Tensor, tokens: torch.Tensor, buf: TreeBuffers, position: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([N] bool accepted nodes, optional [N] log-probabilities for ties) for a tree whose internal nodes
        have the logits `parent_logits` [I, V] and whose root is reply token `position - 1`."""
        if not len(buf.internal):
            return tokens != tokens, None
        return greedy_node_ok(greedy_tokens(parent_logits), tokens, buf.parent_slot), None

    def bonus(self, last_logits: torch.Tensor, last: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """The bonus token [1] after the accepted path; `last` [1] is the last accepted node, `count` [] the
        number of accepted candidates, `last_logits` [V] the logits at `last`."""
        return greedy_tokens(last_logits).view(1)


class TypicalAcceptor(Acceptor):
    accept_mode = TYPICAL

    def __init__(
        self,
        temperature: float,
        top_p: float,
        typical_epsilon: float,
        typical_delta: float,
        generator: torch.Generator,
    ) -> None:
        self.temperature, self.top_p = temperature, top_p
        self.typical_epsilon, self.typical_delta = typical_epsilon, typical_delta
        self.generator = generator

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        if self.top_k > 0 or self.min_p > 0:
            u = torch.rand(1, generator=self.generator, device=logits.device)
            return inverse_cdf_sample(self._truncated(logits[None]), u)
        return sample(torch.softmax(logits / self.temperature, -1), self.top_p, self.generator)[None]

    def _truncated(self, logits: torch.Tensor) -> torch.Tensor:
        return target_probs(logits, self.temperature, self.top_p, self.top_k, self.min_p)

    def judge(
        self, parent_logits: torch.Tensor, tokens: torch.Tensor, buf: TreeBuffers, position: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not len(buf.internal):
            return tokens != tokens, None
        probs = torch.softmax(parent_logits / self.temperature, dim=-1)
        kept = self._truncated(parent_logits) if self.top_k > 0 or self.min_p > 0 else None
        return typical_node_ok(
            probs, tokens, buf.parent_slot, self.typical_epsilon, self.typical_delta, self.top_p, kept
        )

    def bonus(self, last_logits: torch.Tensor, last: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return self.first(last_logits)


@dataclass
class _ExactTables:
    """Per-tree index tensors of the exact rule (built once per TreeBuffers)."""

    node_slot: torch.Tensor  # [N] long: a node's row in `internal`, or I for nodes without children
    sibling_before: torch.Tensor  # [N, N] bool: j is an earlier sibling of i (same parent, j < i, not root)


_TABLES: dict[int, tuple[TreeBuffers, _ExactTables]] = {}


def _exact_tables(buf: TreeBuffers) -> _ExactTables:
    hit = _TABLES.get(id(buf))
    if hit is not None and hit[0] is buf:
        return hit[1]
    tree, device = buf.tree, buf.internal.device
    # from the host-side tree, as TreeBuffers.build orders `internal` (no device read, not even once per tree)
    n, internal = tree.size, sorted(set(tree.parents[1:]))
    slot = [len(internal)] * n
    for i, node in enumerate(internal):
        slot[node] = i
    before = torch.zeros(n, n, dtype=torch.bool)
    for i in range(1, n):
        for j in range(1, i):
            before[i, j] = tree.parents[i] == tree.parents[j]
    tables = _ExactTables(torch.tensor(slot, dtype=torch.long, device=device), before.to(device))
    if len(_TABLES) >= 16:  # a handful of trees per process; the entry keeps `buf` alive so ids stay unique
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[id(buf)] = (buf, tables)
    return tables


class ExactAcceptor(Acceptor):
    """Distribution-preserving verification (module docstring): token k of the reply is `F_k^{-1}(u[k])`."""

    accept_mode = EXACT

    def __init__(
        self,
        temperature: float,
        top_p: float,
        generator: torch.Generator,
        horizon: int,
        device: torch.device | str,
    ) -> None:
        self.temperature, self.top_p = temperature, top_p
        # One uniform per reply position, drawn once from the seeded generator: the whole reply's randomness.
        self.u = torch.rand(horizon, generator=generator, device=device, dtype=torch.float64)
        self._draws: torch.Tensor | None = None
        self._u_step: torch.Tensor | None = None
        self._tables: _ExactTables | None = None

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        return target_probs(logits, self.temperature, self.top_p, self.top_k, self.min_p)

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        return inverse_cdf_sample(self._probs(logits[None]), self.u[:1])

    def judge(
        self, parent_logits: torch.Tensor, tokens: torch.Tensor, buf: TreeBuffers, position: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # the uniforms of reply positions position .. position + depth (a python slice: no sync)
        self._u_step = self.u[position : position + buf.tree.depth + 1]
        self._tables = _exact_tables(buf)
        if not len(buf.internal):
            self._draws = parent_logits.new_zeros(0, dtype=torch.long)
            return tokens != tokens, None
        # a node at depth d draws the token at reply position `position + d` (its children's position)
        u = self._u_step[buf.depth.index_select(0, buf.internal)]
        self._draws = inverse_cdf_sample(self._probs(parent_logits), u)
        return exact_node_ok(self._draws, tokens, buf.parent_slot, self._tables.sibling_before), None

    def bonus(self, last_logits: torch.Tensor, last: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        assert self._draws is not None and self._u_step is not None and self._tables is not None
        # a leaf (or a node whose draw we do not have): a fresh draw with the uniform of its position
        fresh = inverse_cdf_sample(
            self._probs(last_logits[None]), self._u_step.index_select(0, count.view(1))
        )
        # an internal node: its own draw, which matched none of its children (the residual sample)
        return torch.cat([self._draws, fresh]).index_select(0, self._tables.node_slot.index_select(0, last))


def reply_generator(settings: GenerationSettings, device: torch.device | str) -> torch.Generator | None:
    """The reply's random generator, seeded from `settings.seed` or from the OS (None at temperature 0)."""
    if settings.accept_mode == GREEDY:
        return None
    generator = torch.Generator(device=device)
    seed = settings.seed if settings.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return generator.manual_seed(seed)


def make_acceptor(
    settings: GenerationSettings, generator: torch.Generator | None, device: torch.device | str, horizon: int
) -> Acceptor:
    """The acceptor for one reply. `horizon` bounds the reply positions a step can reach (max_new_tokens +
    tree depth + 1); `generator` is the reply's seeded generator (None at temperature 0)."""
    mode = settings.accept_mode
    if mode == GREEDY:
        return Acceptor()
    assert generator is not None
    acceptor: Acceptor
    if mode == EXACT:
        acceptor = ExactAcceptor(settings.temperature, settings.top_p, generator, horizon, device)
    else:
        acceptor = TypicalAcceptor(
            settings.temperature, settings.top_p, settings.typical_epsilon, settings.typical_delta, generator
        )
    acceptor.top_k, acceptor.min_p = settings.top_k, settings.min_p
    return acceptor


__all__ = [
    "Acceptor",
    "ExactAcceptor",
    "TypicalAcceptor",
    "best_path",
    "exact_node_ok",
    "greedy_node_ok",
    "inverse_cdf_sample",
    "make_acceptor",
    "nucleus",
    "sample",
    "target_probs",
    "truncated",
    "typical_node_ok",
]
