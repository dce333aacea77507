"""The `exact` acceptance mode keeps the model's own sampling distribution.

Two layers of evidence:

1. Statistical, on synthetic logits (fast: thousands of seeded runs in a few seconds). A toy language model over
   V = 4 tokens (logits depend on the last two tokens) and a Hydra-style drafter (each node's children are the
   top-k guesses of a fixed random table on the node's own context) feed the engine's acceptor objects exactly
   as `MedusaEngine.generate` does (judge -> best_path -> bonus). The joint distribution of the 3 tokens after a
   given root, which tree steps produce, is compared with its exact value under plain sampling (enumerated:
   4^3 cells) by a chi-square goodness-of-fit test. False-alarm rate: alpha = 1e-3 per test, i.e. a correct rule
   fails a given test for about 1 in 1000 seed choices; the seeds are fixed, so the outcome is deterministic.
   The same test must reject a deliberately broken rule (bonus drawn afresh instead of from the residual) and
   the paper's typical acceptance (its bias).
2. End to end, on the tiny planted Llama (tests/conftest.py): with the same seed, Medusa (and Hydra) `exact`
   replies are token for token the replies of the plain loop (root-only tree) -- the pathwise coupling the rule
   is built on (acceptance.py) -- while steps really accept several tokens; and a smaller statistical check of
   the engine against an independent sampler (torch.multinomial).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

from medusa_chat.engine.acceptance import (
    ExactAcceptor,
    TypicalAcceptor,
    _exact_tables,
    best_path,
    exact_node_ok,
    inverse_cdf_sample,
    make_acceptor,
    nucleus,
    target_probs,
    typical_node_ok,
)
from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.errors import MedusaChatError
from medusa_chat.events import GenerationSettings
from medusa_chat.model.forward.heads import HydraHeads
from medusa_chat.tree import Tree, TreeBuffers

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops (conftest)


ALPHA = 1e-3  # false-alarm rate of each goodness-of-fit test
CONFIGS = [(0.5, 1.0), (0.5, 0.9), (1.0, 1.0), (1.0, 0.9)]  # (temperature, top_p)


# ------------------------------------------------------------------------------------------------------------
# Statistics helpers
# ------------------------------------------------------------------------------------------------------------
def chi_square_p_value(observed: dict, expected_probs: dict, n: int) -> tuple[float, float, int]:
    """(p-value, statistic, degrees of freedom) of a chi-square goodness-of-fit test. Cells expected fewer than
    5 times are pooled into one, so the chi-square approximation holds. An observation in a cell of probability
    0 is an immediate failure (p-value 0)."""
    if any(expected_probs.get(k, 0.0) == 0.0 for k in observed):
        return 0.0, math.inf, 0
    stat, df = 0.0, -1
    pooled_o, pooled_e = 0, 0.0
    for key, p in expected_probs.items():
        e, o = p * n, observed.get(key, 0)
        if e < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        df += 1
    # chi2 survival function = regularized upper incomplete gamma Q(df/2, stat/2)
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    return p, stat, df


def total_variation(observed: dict, expected_probs: dict, n: int) -> float:
    keys = set(observed) | set(expected_probs)
    return 0.5 * sum(abs(observed.get(k, 0) / n - expected_probs.get(k, 0.0)) for k in keys)


# ------------------------------------------------------------------------------------------------------------
# A toy model and drafter on which the acceptors run exactly as in the engine
# ------------------------------------------------------------------------------------------------------------
V = 4
TOY_TREE = Tree.from_paths(
    [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]], name="toy"
)
ROOT_CONTEXT = (2, 1)  # (token before the root, root): the prompt's end


class ToyModel:
    """logits(prev, last) from a fixed random table; a drafter whose guesses at depth d for a node are the
    top-k of another random table on that node's (prev, last): path-dependent like Hydra heads."""

    def __init__(self, seed: int = 0, scale: float = 1.5) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(V, V, V, generator=g) * scale
        guess = torch.randn(TOY_TREE.depth, V, V, V, generator=g)
        self.guess_order = guess.argsort(dim=-1, descending=True).tolist()  # [d][prev][last] -> ranked tokens

    def draft(self, prev: int, root: int) -> list[int]:
        tokens = [root] + [0] * (TOY_TREE.size - 1)
        for node in range(1, TOY_TREE.size):
            p = TOY_TREE.parents[node]
            p_prev = prev if p == 0 else tokens[TOY_TREE.parents[p]]
            d = TOY_TREE.depths[node] - 1
            tokens[node] = self.guess_order[d][p_prev][tokens[p]][TOY_TREE.ranks[node]]
        return tokens

    def node_logits(self, prev: int, tokens: list[int]) -> torch.Tensor:
        prevs = [prev] + [tokens[p] for p in TOY_TREE.parents[1:]]
        return self.table[torch.tensor(prevs), torch.tensor(tokens)]

    def plain_joint(self, temperature: float, top_p: float, length: int = 3) -> dict[tuple[int, ...], float]:
        """Exact probabilities of every continuation of `length` tokens under plain sampling."""
        out: dict[tuple[int, ...], float] = {}

        def walk(prev: int, last: int, seq: tuple[int, ...], prob: float) -> None:
            if len(seq) == length:
                out[seq] = prob
                return
            p = target_probs(self.table[prev, last], temperature, top_p).double()
            p = p / p.sum()
            for x in range(V):
                if p[x] > 0:
                    walk(last, x, (*seq, x), prob * float(p[x]))

        walk(*ROOT_CONTEXT, (), 1.0)
        return out


TOY_BUF: TreeBuffers = TOY_TREE.buffers("cpu", torch.float32)
TOY_WIDTH = TOY_BUF.leaf_paths.shape[1]


def toy_continuation(model: ToyModel, acceptor, length: int = 3) -> tuple[tuple[int, ...], int]:
    """The `length` tokens after ROOT_CONTEXT produced by tree steps with `acceptor`, as the engine's accept
    block does them; and the number of steps it took."""
    prev, root = ROOT_CONTEXT
    reply = [root]
    steps = 0
    while len(reply) < 1 + length:
        tokens = model.draft(prev, reply[-1])
        logits = model.node_logits(prev, tokens)
        tok = torch.tensor(tokens)
        ok, logp = acceptor.judge(logits[TOY_BUF.internal], tok, TOY_BUF, len(reply))
        path, count = best_path(ok, TOY_BUF.leaf_paths, logp)
        last = path.gather(0, count.view(1))
        bonus = acceptor.bonus(logits.index_select(0, last)[0], last, count)
        packed = torch.cat([path, count[None], bonus]).tolist()
        accepted = packed[TOY_WIDTH]
        new = [tokens[n] for n in packed[1 : accepted + 1]] + [packed[-1]]
        for t in new:
            prev = reply[-1]
            reply.append(t)
        steps += 1
    return tuple(reply[1 : 1 + length]), steps


def toy_counts(make, runs: int, model: ToyModel) -> tuple[Counter, float]:
    counts: Counter = Counter()
    steps = 0
    for seed in range(runs):
        gen = torch.Generator().manual_seed(10_000 + seed)
        seq, s = toy_continuation(model, make(gen))
        counts[seq] += 1
        steps += s
    return counts, 3 * runs / steps  # tokens per step


class FreshBonusAcceptor(ExactAcceptor):
    """A plausible-looking bug: when the walk stops at a node with children, draw the bonus afresh from the
    node's full distribution instead of using the draw that matched no child (the residual). Children's tokens
    then come out too often."""

    def bonus(self, last_logits, last, count):
        fresh = torch.rand(1, dtype=torch.float64, generator=self.generator)
        return inverse_cdf_sample(self._probs(last_logits[None]), fresh)


RUNS = 2500  # per goodness-of-fit test of the exact rule
RUNS_BIASED = 1250  # deviations of the broken and typical rules are huge: half as many runs suffice


@pytest.mark.parametrize(("temperature", "top_p"), CONFIGS)
def test_exact_rule_joint_distribution_matches_plain_sampling(temperature: float, top_p: float) -> None:
    model = ToyModel()
    expected = model.plain_joint(temperature, top_p)
    counts, per_step = toy_counts(
        lambda g: ExactAcceptor(temperature, top_p, g, horizon=8, device="cpu"), RUNS, model
    )
    p, stat, df = chi_square_p_value(counts, expected, RUNS)
    tv = total_variation(counts, expected, RUNS)
    print(
        f"T={temperature} top_p={top_p}: chi2={stat:.1f} df={df} p={p:.3g} TV={tv:.3f} tok/step={per_step:.2f}"
    )
    assert p > ALPHA, (
        f"exact rule deviates from plain sampling: chi2={stat:.1f}, df={df}, p={p:.2e}, TV={tv:.3f}"
    )
    assert per_step > 1.3  # the drafts are really accepted: the tree part of the rule is exercised


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.5, 0.9)])
def test_a_broken_rule_fails_the_same_test(temperature: float, top_p: float) -> None:
    model = ToyModel()
    expected = model.plain_joint(temperature, top_p)

    def make(g: torch.Generator) -> FreshBonusAcceptor:
        acc = FreshBonusAcceptor(temperature, top_p, g, horizon=8, device="cpu")
        acc.generator = g
        return acc

    counts, _ = toy_counts(make, RUNS_BIASED, model)
    p, stat, df = chi_square_p_value(counts, expected, RUNS_BIASED)
    print(f"broken rule T={temperature} top_p={top_p}: chi2={stat:.1f} df={df} p={p:.3g}")
    assert p < ALPHA


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.5, 0.9)])
def test_typical_acceptance_is_biased_towards_the_drafts(temperature: float, top_p: float) -> None:
    """The paper's rule accepts any plausible-enough guess, so sequences the drafter proposes come out more
    often than the model samples them: the goodness-of-fit test rejects it clearly."""
    model = ToyModel()
    expected = model.plain_joint(temperature, top_p)
    counts, per_step = toy_counts(
        lambda g: TypicalAcceptor(temperature, top_p, 0.09, 0.3, g), RUNS_BIASED, model
    )
    p, stat, df = chi_square_p_value(counts, expected, RUNS_BIASED)
    tv = total_variation(counts, expected, RUNS_BIASED)
    print(
        f"typical T={temperature} top_p={top_p}: chi2={stat:.1f} df={df} p={p:.3g} TV={tv:.3f} tok/step={per_step:.2f}"
    )
    assert p < 1e-6 and tv > 0.05
    # what it over-represents: its most frequent output is one of the sequences the drafter proposed (a
    # full-depth tree path; the rule's tie-break picks the most likely accepted path), far above its probability
    prev, root = ROOT_CONTEXT
    tokens = model.draft(prev, root)
    drafted = {tuple(tokens[n] for n in TOY_TREE.path_nodes(leaf)[1:]) for leaf in TOY_TREE.leaves}
    top, n_top = counts.most_common(1)[0]
    print(
        f"typical's favourite {top}: {n_top / RUNS_BIASED:.3f} of replies, plain sampling {expected.get(top, 0.0):.3f}"
    )
    assert top in drafted
    assert n_top / RUNS_BIASED > expected.get(top, 0.0) + 0.1


# ------------------------------------------------------------------------------------------------------------
# Unit checks of the pieces
# ------------------------------------------------------------------------------------------------------------
def test_inverse_cdf_sampler_is_exact_on_a_grid_and_never_returns_a_zero_probability_token() -> None:
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0], [0.5, 0.0, 0.0, 0.0, 0.0, 0.5]])
    m = 10_000
    u = (torch.arange(m, dtype=torch.float64) + 0.5) / m
    for row in range(2):
        picks = inverse_cdf_sample(probs[row].expand(m, -1), u)
        freq = torch.bincount(picks, minlength=6).double() / m
        torch.testing.assert_close(freq, probs[row].double(), atol=2 / m, rtol=0)
    # u at the very top (and unnormalised rows): still the last token with mass, never a zero one
    top = torch.tensor([1.0 - 2**-53, 0.0], dtype=torch.float64)
    assert inverse_cdf_sample(probs * 3.7, top).tolist() == [4, 0]


def test_nucleus_matches_plain_sample_and_is_batched() -> None:
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), -1)
    kept = nucleus(probs, 0.8)
    for r in range(3):
        sorted_p, order = probs[r].sort(descending=True)
        n_keep = int(((sorted_p.cumsum(0) - sorted_p) < 0.8).sum())
        assert set(kept[r].nonzero().flatten().tolist()) == set(order[:n_keep].tolist())
    assert nucleus(probs, 1.0) is probs


def test_exact_node_ok_keeps_only_the_first_of_equal_siblings() -> None:
    tree = Tree.from_paths([[0], [1], [0, 0]])
    buf = tree.buffers("cpu", torch.float32)
    acc = ExactAcceptor(1.0, 1.0, torch.Generator().manual_seed(0), horizon=4, device="cpu")
    tables = _exact_tables(buf)
    tokens = torch.tensor([5, 7, 7, 9])  # nodes 1 and 2 are siblings with the same token
    draws = torch.tensor([7, 9])  # root drew 7, node 1 drew 9
    ok = exact_node_ok(draws, tokens, buf.parent_slot, tables.sibling_before)
    assert ok[1:].tolist() == [True, False, True]
    assert acc.accept_mode == "exact"


def test_typical_rejects_a_candidate_outside_the_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    tokens = torch.tensor([0, 2, 1])
    parent = torch.tensor([0, 0, 0])
    ok_full, _ = typical_node_ok(probs, tokens, parent, 0.09, 0.3)
    ok_nucleus, _ = typical_node_ok(probs, tokens, parent, 0.09, 0.3, top_p=0.7)
    assert ok_full[1:].tolist() == [True, True]  # 0.15 and 0.3 pass the typical threshold (0.09)
    assert ok_nucleus[1:].tolist() == [False, True]  # but 0.15 is outside the 0.7-nucleus {0, 1}


def test_settings_accept_mode_and_validation() -> None:
    assert GenerationSettings().accept_mode == "greedy"
    assert GenerationSettings(temperature=0.7).accept_mode == "typical"
    assert GenerationSettings(temperature=0.7, accept="exact").accept_mode == "exact"
    assert GenerationSettings(temperature=0.0, accept="exact").accept_mode == "greedy"  # greedy is exact
    with pytest.raises(MedusaChatError, match="accept"):
        GenerationSettings(temperature=0.7, accept="lossless").validate()
    g = torch.Generator().manual_seed(0)
    assert make_acceptor(GenerationSettings(temperature=0.7, accept="exact"), g, "cpu", 8).accept_mode == "exact"


# ------------------------------------------------------------------------------------------------------------
# End to end: the engine
# ------------------------------------------------------------------------------------------------------------
def _reply(engine: MedusaEngine, prompt: list[int], **kw):
    return list(engine.generate(prompt, GenerationSettings(**kw)))[-1]


@pytest.mark.parametrize(("temperature", "top_p"), CONFIGS)
def test_engine_exact_replies_equal_the_plain_loop_with_the_same_seed(
    make_loaded_model, temperature: float, top_p: float
) -> None:
    """Medusa exact with seed s gives, token for token, the plain loop's reply with seed s: every token is the
    model's inverse CDF at that position evaluated at the same uniform (acceptance.py)."""
    loaded = make_loaded_model("llama")
    medusa = MedusaEngine(loaded, Tree.named("mc_sim_7b_63").prefix(24))
    plain = MedusaEngine(loaded, plain_tree())
    prompt = loaded.build_prompt([{"role": "user", "content": "tell me a story"}])
    per_step = []
    for seed in range(4):
        kw = dict(max_new_tokens=24, temperature=temperature, top_p=top_p, seed=seed, accept="exact")
        a, b = _reply(medusa, prompt, **kw), _reply(plain, prompt, **kw)
        assert a.token_ids == b.token_ids, f"seed {seed}"
        assert a.accept_mode == "exact"
        per_step.append(a.tokens_per_step)
    if temperature == 0.5:  # a peaked model: the heads' guesses are accepted, the tree path is exercised
        assert sum(per_step) / len(per_step) > 2.0, per_step
    else:
        assert max(per_step) > 1.0, per_step


def test_engine_exact_with_hydra_heads_equals_the_plain_loop(make_loaded_model) -> None:
    loaded = make_loaded_model("llama")
    hidden = loaded.backbone.config.hidden_size
    vocab = loaded.backbone.config.vocab_size
    torch.manual_seed(0)
    heads = HydraHeads(hidden, vocab, 3, 1, torch.arange(vocab)).eval().requires_grad_(False)
    with torch.no_grad():
        for p in heads.draft.parameters():
            p.normal_(0, 0.05)  # a non-zero cell: each node's guesses depend on its own path
    hydra = replace(loaded, heads=heads)
    medusa = MedusaEngine(hydra, Tree.named("mc_sim_7b_63").prefix(16))
    plain = MedusaEngine(hydra, plain_tree())
    prompt = loaded.build_prompt([{"role": "user", "content": "hello"}])
    for seed in range(3):
        kw = dict(max_new_tokens=20, temperature=0.7, top_p=0.95, seed=seed, accept="exact")
        assert _reply(medusa, prompt, **kw).token_ids == _reply(plain, prompt, **kw).token_ids


def test_engine_exact_is_seedable_and_varies_without_a_seed(make_loaded_model) -> None:
    loaded = make_loaded_model("llama")
    engine = MedusaEngine(loaded, Tree.named("mc_sim_7b_63").prefix(16))
    prompt = loaded.build_prompt([{"role": "user", "content": "hi"}])
    kw = dict(max_new_tokens=16, temperature=1.0, accept="exact")
    assert _reply(engine, prompt, seed=3, **kw).token_ids == _reply(engine, prompt, seed=3, **kw).token_ids
    assert len({tuple(_reply(engine, prompt, **kw).token_ids) for _ in range(4)}) > 1


def two_sample_p_value(a: Counter, b: Counter, runs: int, min_count: int = 10) -> tuple[float, float, int]:
    """Chi-square two-sample test (equal sizes) on sequences seen >= min_count times in both samples together,
    the rest pooled into one cell. (p-value, statistic, degrees of freedom)."""
    common = [k for k in set(a) | set(b) if a[k] + b[k] >= min_count]
    rows = [(a[k], b[k]) for k in common]
    rows.append((runs - sum(r[0] for r in rows), runs - sum(r[1] for r in rows)))
    rows = [(x, y) for x, y in rows if x + y > 0]
    stat = sum((x - y) ** 2 / (x + y) for x, y in rows)
    df = len(rows) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    return p, stat, df


def test_engine_exact_first_tokens_match_an_independent_sampler(make_loaded_model) -> None:
    """The engine (Medusa tree, exact) against the plain loop sampling with torch.multinomial (typical mode on a
    root-only tree is plain sampling): a two-sample chi-square test on the first 3 reply tokens, rare
    sequences pooled, false-alarm rate ALPHA. Smaller than the synthetic tests (an engine reply costs
    milliseconds) and this model's replies are one dominant sequence plus a long tail, so it catches
    engine-level mistakes that move mass (positions of the uniforms, the bonus, the commit); the same test on
    the same engine rejects typical acceptance, which shows it has the power to."""
    loaded = make_loaded_model("llama")
    medusa = MedusaEngine(loaded, Tree.named("mc_sim_7b_63").prefix(16))
    plain = MedusaEngine(loaded, plain_tree())
    prompt = loaded.build_prompt([{"role": "user", "content": "go"}])
    runs, kw = 600, dict(max_new_tokens=3, temperature=0.7, top_p=0.95)
    a = Counter(tuple(_reply(medusa, prompt, seed=s, accept="exact", **kw).token_ids) for s in range(runs))
    b = Counter(tuple(_reply(plain, prompt, seed=50_000 + s, **kw).token_ids) for s in range(runs))
    p, stat, df = two_sample_p_value(a, b, runs)
    print(f"engine exact vs plain multinomial: chi2={stat:.1f} df={df} p={p:.3g}")
    assert df >= 2 and p > ALPHA
    c = Counter(tuple(_reply(medusa, prompt, seed=s, accept="typical", **kw).token_ids) for s in range(runs))
    p_typ, stat_typ, df_typ = two_sample_p_value(c, b, runs)
    print(f"engine typical vs plain multinomial: chi2={stat_typ:.1f} df={df_typ} p={p_typ:.3g}")
    print("most common: exact", a.most_common(2), "typical", c.most_common(2), "plain", b.most_common(2))
    assert p_typ < ALPHA


# ------------------------------------------------------------------------------------------------------------
# Settings plumbing: CLI, REPL
# ------------------------------------------------------------------------------------------------------------
def test_ask_and_bench_take_accept_exact_and_report_it(
    make_loaded_model, tmp_path, capsys, monkeypatch
) -> None:
    import json

    from medusa_chat import cli
    from tests.test_bench import model_args

    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    loaded = make_loaded_model()
    common = [*model_args(loaded), "--max-new-tokens", "12", "--temperature", "0.7", "--accept", "exact"]
    assert cli.main(["ask", *common, "--seed", "5", "--json", "Hello"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["accept_mode"] == "exact" and out["new_tokens"] == 12

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Count from one to ten."}) + "\n")
    doc_path = tmp_path / "bench.json"
    args = ["bench", *common, "--prompts", str(prompts), "--baselines", "plain", "--warmup", "0"]
    assert cli.main([*args, "--json", str(doc_path)]) == 0
    doc = json.loads(doc_path.read_text())
    assert doc["accept_mode"] == "exact" and doc["summary"]["tokens_per_step"] >= 1.0
    # exact mode: the plain loop with the same seed wrote the same reply
    assert doc["summary"]["exact_identical_to_plain_fraction"] == 1.0
    assert "tokens/step" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse refuses any other rule
        cli.main([*args, "--accept", "lossless"])


def test_repl_accept_command(tmp_path, monkeypatch) -> None:
    import io

    from rich.console import Console

    from medusa_chat.ui.terminal import TerminalChat
    from tests.test_terminal import _fake_session

    session, _ = _fake_session(tmp_path, monkeypatch)
    lines = ["/accept", "/accept exact", "/temp 0.8", "/accept bogus", "/accept typical"]
    out = io.StringIO()
    console = Console(file=out, width=200, no_color=True, highlight=False)
    TerminalChat(
        session, console, interactive=False, stdin=io.StringIO("\n".join(lines) + "\n"), out=out
    ).run()
    text = out.getvalue()
    assert "acceptance greedy: identical to plain greedy decoding" in text
    assert "acceptance at temperature > 0: exact (applies at temperature > 0" in text
    assert "temperature 0.8 (exact sampling: same distribution as plain sampling)" in text
    assert "error: accept must be 'typical' or 'exact'" in text
    assert session.settings.accept == "typical" and session.settings.accept_mode == "typical"


def test_repl_lookup_command(tmp_path, monkeypatch) -> None:
    import io

    from rich.console import Console

    from medusa_chat.ui.terminal import TerminalChat
    from tests.test_terminal import _fake_session

    session, _ = _fake_session(tmp_path, monkeypatch)
    out = io.StringIO()
    console = Console(file=out, width=200, no_color=True, highlight=False)
    stdin = io.StringIO("/lookup\n/lookup off\n/lookup sideways\n")
    TerminalChat(session, console, interactive=False, stdin=stdin, out=out).run()
    text = out.getvalue()
    assert "context lookup on (greedy and exact sampling; the output is the same either way)" in text
    assert "context lookup off" in text and "error: bad value for context_lookup" in text
    assert session.settings.context_lookup is False


def test_the_cpu_nucleus_from_the_head_is_the_full_sorts_bit_for_bit() -> None:
    """`nucleus` on a CPU sorts only each row's head (probabilities >= (1 - top_p) / 2V): the kept set and
    values must be the full descending sort's exactly, peaked or flat rows, 1-D or batched, ties included."""
    from medusa_chat.engine.acceptance import _nucleus_from_head

    def full(probs: torch.Tensor, top_p: float) -> torch.Tensor:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p
        return torch.zeros_like(probs).scatter_(-1, order, sorted_p * keep)

    g = torch.Generator().manual_seed(7)
    for trial in range(60):
        scale, temp, top_p = (0.5, 1, 3, 8)[trial % 4], (0.3, 0.7, 1.0, 1.5)[trial % 4], (0.5, 0.9, 0.95, 0.99)[trial % 3]
        logits = torch.randn(3, 49152, generator=g) * scale
        logits[:, :40] = logits[:, :1]  # ties, at the top
        probs = torch.softmax(logits / temp, dim=-1)
        assert _nucleus_from_head(probs, top_p) is not None
        assert torch.equal(nucleus(probs, top_p), full(probs, top_p))
        assert torch.equal(nucleus(probs[1], top_p), full(probs[1], top_p))
    assert _nucleus_from_head(torch.full((1, 100), 1e-4), 0.9) is None  # unnormalised: the full sort decides


def test_sample_draws_from_the_nucleus_distribution() -> None:
    """`sample` (the typical mode's and the first token's sampler): frequencies match the renormalised nucleus
    within binomial error, tokens outside the nucleus never appear, and one seed gives one sequence."""
    from medusa_chat.engine.acceptance import sample

    probs = torch.softmax(torch.randn(40, generator=torch.Generator().manual_seed(5)) * 2, -1)
    kept = nucleus(probs, 0.9)
    g = torch.Generator().manual_seed(11)
    m = 20000
    picks = torch.stack([sample(probs, 0.9, g) for _ in range(m)])
    freq = torch.bincount(picks, minlength=40).double() / m
    target = (kept / kept.sum()).double()
    assert bool((freq[kept == 0] == 0).all())
    torch.testing.assert_close(freq, target, atol=4 * (0.25 / m) ** 0.5, rtol=0)
    again = torch.Generator().manual_seed(11)
    assert torch.equal(torch.stack([sample(probs, 0.9, again) for _ in range(200)]), picks[:200])
