"""Repetition controls (engine/penalties.py) and the truncation samplers beside top_p.

1. The math against a direct recount from the definitions (llama.cpp's repeat penalty and DRY, OpenAI's
   presence and frequency penalties), for every node of a tree, whose context is the prefix plus its path.
2. Tree decoding keeps its guarantees: greedy Medusa replies equal the plain loop's with the same penalties in
   every CPU numeric path; exact sampling keeps the penalised distribution (the chi-square test of
   test_exact_sampling.py); typical acceptance judges on penalised logits.
3. Off, nothing changes: the acceptor is the plain one (the engine's argmax-only greedy step stays).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from medusa_chat.engine.acceptance import (
    Acceptor,
    ExactAcceptor,
    TypicalAcceptor,
    best_path,
    greedy_tokens,
    target_probs,
    truncated,
    typical_node_ok,
)
from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.engine.penalties import (
    PenalisedAcceptor,
    Penaliser,
    PenaltyOptions,
    with_penalties,
)
from medusa_chat.events import GenerationSettings, ReplySummary
from medusa_chat.tree import Tree
from tests.test_exact_paths import PATHS, _path_model
from tests.test_exact_sampling import ALPHA, ROOT_CONTEXT, TOY_BUF, TOY_WIDTH, ToyModel, V, chi_square_p_value
from tests.tinymodels import training_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops (conftest)

ALL_ON = PenaltyOptions(
    repeat_penalty=1.3, repeat_last_n=6, presence_penalty=0.4, frequency_penalty=0.25, dry_multiplier=0.8
)


# ------------------------------------------------------------------------------------------------------------
# A direct recount from the definitions
# ------------------------------------------------------------------------------------------------------------
def dry_lengths(context: list[int], allowed: int, breakers: frozenset[int]) -> dict[int, int]:
    """text-generation-webui's DRY loop: for each earlier occurrence of the last token, extend the match
    backwards (never across a breaker) and keep, per following token, the longest match."""
    if len(context) <= allowed:
        return {}
    last = context[-1]
    if last in breakers:
        return {}
    longest: dict[int, int] = {}
    for i in range(len(context) - 1):
        if context[i] != last or context[i + 1] in breakers:
            continue
        n = 1
        while i - n >= 0 and context[i - n] == context[-1 - n] and context[-1 - n] not in breakers:
            n += 1
        longest[context[i + 1]] = max(longest.get(context[i + 1], 0), n)
    return {t: n for t, n in longest.items() if n >= allowed}


def recount(logits: torch.Tensor, opts: PenaltyOptions, prompt: list[int], reply: list[int],
            breakers: frozenset[int] = frozenset()) -> torch.Tensor:  # fmt: skip
    """The penalised logits [V] at the context prompt + reply, from scratch, token by token."""
    out = logits.clone()
    context = prompt + reply
    n = opts.repeat_last_n
    window = set(context if n < 0 else context[len(context) - n :] if n else [])
    counts = Counter(reply)
    dry = dry_lengths(context, opts.dry_allowed_length, breakers) if opts.dry else {}
    for t in window | set(counts) | set(dry):
        x = out[t : t + 1]
        if opts.repeat and t in window:
            x = torch.where(x <= 0, x * opts.repeat_penalty, x / opts.repeat_penalty)
        if opts.counts:
            c = torch.tensor([float(counts[t])])
            x = x - (c * opts.frequency_penalty + (c > 0).float() * opts.presence_penalty)
        if t in dry:
            x = x - torch.tensor([opts.dry_penalty(dry[t])])
        out[t] = x[0]
    return out


def test_dry_follows_llama_cpps_worked_example() -> None:
    """llama.cpp's comment: context `a b c c b c y a b c` -> the next `c` extends a run of 3, `y` one of 2, `b`
    one of 1 (below the allowed length 2: free)."""
    a, b, c, y = 1, 2, 3, 4
    opts = PenaltyOptions(dry_multiplier=0.5, dry_base=2.0, dry_allowed_length=2)
    pen = Penaliser(opts, [a, b, c, c, b, c, y, a, b, c], frozenset())
    pen.begin_step([c], [-1], torch.device("cpu"))
    row = pen.rows(torch.zeros(1, 8), [0])[0]
    assert row.tolist() == [0, 0, 0, -0.5 * 2.0, -0.5, 0, 0, 0]
    assert dry_lengths([a, b, c, c, b, c, y, a, b, c], 2, frozenset()) == {c: 3, y: 2}
    # a breaker in the run cuts it: after `9 b c` the runs `b c` of 2 (before `c` and `y`) are the longest
    pen = Penaliser(opts, [a, b, c, c, b, c, y, 9, b, c], frozenset({9}))
    pen.begin_step([c], [-1], torch.device("cpu"))
    assert pen.rows(torch.zeros(1, 10), [0])[0].tolist() == [0.0] * 3 + [-0.5, -0.5] + [0.0] * 5
    assert dry_lengths([a, b, c, c, b, c, y, 9, b, c], 2, frozenset({9})) == {c: 2, y: 2}


@pytest.mark.parametrize(
    "opts",
    [
        PenaltyOptions(repeat_penalty=1.3, repeat_last_n=6),
        PenaltyOptions(repeat_penalty=0.8, repeat_last_n=-1),
        PenaltyOptions(presence_penalty=0.5, frequency_penalty=-0.3),
        PenaltyOptions(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2),
        PenaltyOptions(dry_multiplier=0.3, dry_base=3.0, dry_allowed_length=1),
        ALL_ON,
    ],
)
def test_every_tree_node_is_penalised_with_its_own_context(opts: PenaltyOptions) -> None:
    """Each node's row equals the direct recount at prefix + its path, as a batch of rows (`rows`, the parents'
    rows of a step) and as the bonus row picked on the device (`row_of`)."""
    g = torch.Generator().manual_seed(7)
    tree = Tree.named("mc_sim_7b_63").prefix(24)
    breakers = frozenset({0})
    for trial in range(6):
        vocab = 6 + trial  # small vocabularies: long repeated runs
        prompt = torch.randint(
            0, vocab, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g
        ).tolist()
        reply = torch.randint(0, vocab, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        pen = Penaliser(opts, prompt, breakers)
        pen.commit(reply)
        tokens = [reply[-1]] + torch.randint(0, vocab, (tree.size - 1,), generator=g).tolist()
        pen.begin_step(tokens, tree.parents, torch.device("cpu"))
        logits = torch.randn(tree.size, vocab, generator=g) * 2
        rows = pen.rows(logits, list(range(tree.size)))
        for v in range(tree.size):
            path = [tokens[n] for n in tree.path_nodes(v)[1:]]
            want = recount(logits[v], opts, prompt, reply + path, breakers)
            assert torch.equal(rows[v], want), (trial, v, rows[v], want)
            assert torch.equal(pen.row_of(logits[v], torch.tensor([v])), want), (trial, v)


@pytest.mark.parametrize(
    "opts",
    [
        PenaltyOptions(repeat_penalty=1.3, repeat_last_n=6),
        PenaltyOptions(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2),
        PenaltyOptions(repeat_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3, dry_multiplier=0.6,
                       dry_allowed_length=1),  # fmt: skip
    ],
)
def test_greedy_from_the_raw_argmax_equals_the_argmax_of_the_penalised_row(opts: PenaltyOptions) -> None:
    """Penalties that only lower logits: each node's token from its raw argmax (`greedy_tops`, recomputing only the
    rows whose argmax is penalised) is the argmax of the node's fully penalised row (the direct recount)."""
    assert opts.lowers_only
    g = torch.Generator().manual_seed(11)
    tree = Tree.named("mc_sim_7b_63").prefix(16)
    redone = 0
    for trial in range(12):
        vocab = 8 + 4 * (trial % 4)  # small vocabularies: the raw argmax is often a penalised token, not always
        prompt = torch.randint(0, vocab, (8,), generator=g).tolist()
        reply = torch.randint(0, vocab, (4,), generator=g).tolist()
        pen = Penaliser(opts, prompt, frozenset())
        pen.commit(reply)
        tokens = [reply[-1]] + torch.randint(0, vocab, (tree.size - 1,), generator=g).tolist()
        logits = torch.randn(tree.size, vocab, generator=g) * 2
        raw = greedy_tokens(logits).tolist()
        asked: list[int] = []

        def rows(nodes: list[int], asked: list[int] = asked, logits: torch.Tensor = logits) -> torch.Tensor:
            asked.extend(nodes)
            return logits[nodes].clone()

        got = pen.greedy_tops(tokens, tree.parents, raw, rows, torch.device("cpu"))
        for v in range(tree.size):
            path = [tokens[n] for n in tree.path_nodes(v)[1:]]
            want = int(greedy_tokens(recount(logits[v], opts, prompt, reply + path, frozenset())))
            assert got[v] == want, (trial, v)
            assert v in asked or got[v] == raw[v]  # a row not recomputed keeps its raw argmax
        redone += len(asked)
    assert 0 < redone < 12 * tree.size  # some rows needed their logits, not all
    assert not PenaltyOptions(repeat_penalty=0.8).lowers_only
    assert not PenaltyOptions(presence_penalty=-0.5).lowers_only


def test_off_means_the_plain_acceptor() -> None:
    plain = Acceptor()
    assert with_penalties(plain, GenerationSettings(repeat_penalty=1.0), [1, 2], None) is plain
    assert (
        with_penalties(plain, GenerationSettings(repeat_penalty=1.1, repeat_last_n=0), [1, 2], None) is plain
    )
    assert plain.argmax_only
    wrapped = with_penalties(plain, GenerationSettings(repeat_penalty=1.1), [1, 2], None)
    assert isinstance(wrapped, PenalisedAcceptor) and not wrapped.argmax_only


# ------------------------------------------------------------------------------------------------------------
# Greedy: the plain loop's replies, in every numeric path
# ------------------------------------------------------------------------------------------------------------
def _reply(engine: MedusaEngine, prompt: list[int], **kw) -> ReplySummary:
    for event in engine.generate(prompt, GenerationSettings(max_new_tokens=32, **kw)):
        if isinstance(event, ReplySummary):
            return event
    raise AssertionError("no summary")


PENALISED = [
    {"repeat_penalty": 1.3},
    {"presence_penalty": 0.6, "frequency_penalty": 0.3, "dry_multiplier": 0.8},
    {"repeat_penalty": 1.2, "repeat_last_n": 4, "dry_multiplier": 1.0, "frequency_penalty": 0.2},
]


@pytest.mark.parametrize("path", PATHS)
def test_greedy_medusa_with_penalties_equals_the_plain_loop(path: str) -> None:
    model = _path_model("llama", path)
    plain = MedusaEngine(model, plain_tree())
    prompts = training_prompts()[:2] + [[5, 9, 17, 33, 65, 129, 257, 7, 11]]
    trees = [MedusaEngine(model, Tree.chain(3)), MedusaEngine(model, Tree.named("mc_sim_7b_63"))]
    changed = 0
    for kw in PENALISED:
        for prompt in prompts:
            ref = _reply(plain, prompt, **kw).token_ids
            changed += ref != _reply(plain, prompt).token_ids
            for engine in trees:
                got = _reply(engine, prompt, **kw)
                assert got.token_ids == ref, f"{path}, {engine.tree.name}, {kw}, prompt {prompt[:3]}"
    assert changed >= len(PENALISED)  # the penalties really change the replies
    # the tree still accepts several tokens a step with penalties on
    assert _reply(trees[1], prompts[0], **PENALISED[0]).tokens_per_step > 1.1


# ------------------------------------------------------------------------------------------------------------
# Exact sampling keeps the penalised distribution; typical judges on penalised logits
# ------------------------------------------------------------------------------------------------------------
RUNS = 2500
TOY_OPTS = PenaltyOptions(repeat_penalty=1.5, repeat_last_n=2, frequency_penalty=0.4, dry_multiplier=0.6,
                          dry_allowed_length=1)  # fmt: skip


def penalised_joint(model: ToyModel, opts: PenaltyOptions, temperature: float, top_p: float,
                    top_k: int = 0, min_p: float = 0.0) -> dict[tuple[int, ...], float]:  # fmt: skip
    """Every 3-token continuation's probability under plain sampling from the penalised logits."""
    out: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(V), repeat=3):
        prob, context = 1.0, list(ROOT_CONTEXT)
        for x in seq:
            raw = model.table[context[-2], context[-1]]
            p = target_probs(
                recount(raw, opts, [ROOT_CONTEXT[0]], context[1:]), temperature, top_p, top_k, min_p
            )
            prob *= float(p.double()[x] / p.double().sum())
            context.append(x)
        if prob > 0:
            out[seq] = prob
    return out


def penalised_continuation(model: ToyModel, acceptor: PenalisedAcceptor) -> tuple[int, ...]:
    """The 3 tokens after ROOT_CONTEXT from tree steps, as the engine's generate runs them (commit included)."""
    prev, root = ROOT_CONTEXT
    reply = [root]
    acceptor.commit([root])
    while len(reply) < 4:
        tokens = model.draft(prev, reply[-1])
        logits = model.node_logits(prev, tokens)
        ok, logp = acceptor.judge(logits[TOY_BUF.internal], torch.tensor(tokens), TOY_BUF, len(reply))
        path, count = best_path(ok, TOY_BUF.leaf_paths, logp)
        last = path.gather(0, count.view(1))
        bonus = acceptor.bonus(logits.index_select(0, last)[0], last, count)
        packed = torch.cat([path, count[None], bonus]).tolist()
        new = [tokens[n] for n in packed[1 : packed[TOY_WIDTH] + 1]] + [packed[-1]]
        acceptor.commit(new)
        for t in new:
            prev = reply[-1]
            reply.append(t)
    return tuple(reply[1:4])


@pytest.mark.parametrize(("temperature", "top_p", "top_k", "min_p"), [(1.0, 1.0, 0, 0.0), (0.7, 0.9, 3, 0.1)])
def test_exact_sampling_keeps_the_penalised_distribution(
    temperature: float, top_p: float, top_k: int, min_p: float
) -> None:
    model = ToyModel()
    expected = penalised_joint(model, TOY_OPTS, temperature, top_p, top_k, min_p)
    raw = penalised_joint(model, PenaltyOptions(), temperature, top_p, top_k, min_p)
    counts: Counter = Counter()
    for seed in range(RUNS):
        # (seeds 20_000 + k gave p = 6e-4 on the top-k/min-p case, the 1-in-1000 false alarm the test allows;
        # 50_000 + k and 90_000 + k give p = 0.37 and 0.27 there)
        gen = torch.Generator().manual_seed(50_000 + seed)
        inner = ExactAcceptor(temperature, top_p, gen, horizon=8, device="cpu")
        inner.top_k, inner.min_p = top_k, min_p
        acceptor = PenalisedAcceptor(inner, Penaliser(TOY_OPTS, [ROOT_CONTEXT[0]], frozenset()))
        counts[penalised_continuation(model, acceptor)] += 1
    p, stat, df = chi_square_p_value(counts, expected, RUNS)
    print(f"exact, penalised: chi2={stat:.1f} df={df} p={p:.3g}")
    assert p > ALPHA
    # the test has the power to see the penalties: the unpenalised law is rejected
    assert chi_square_p_value(counts, raw, RUNS)[0] < ALPHA


def test_typical_acceptance_judges_penalised_logits() -> None:
    """The typical rule sees each parent's penalised row: a draft the raw logits accept (a repeat) is
    rejected once the repeat penalty is on, and the decision is typical_node_ok's on the penalised rows."""
    tree = Tree.chain(2)
    buf = tree.buffers("cpu", torch.float32)
    logits = torch.tensor([[0.0, 4.0, 3.5, 0.0], [0.0, 0.0, 4.0, 3.9], [1.0, 1.0, 1.0, 1.0]])
    tokens = torch.tensor([1, 1, 2])  # root 1, then a repeat of 1, then 2
    gen = torch.Generator().manual_seed(0)
    raw_ok, _ = TypicalAcceptor(1.0, 1.0, 0.09, 0.3, gen).judge(logits[buf.internal], tokens, buf, 1)
    opts = PenaltyOptions(repeat_penalty=4.0, repeat_last_n=8)
    pen = Penaliser(opts, [3], frozenset())
    pen.commit([1])
    acc = PenalisedAcceptor(TypicalAcceptor(1.0, 1.0, 0.09, 0.3, gen), pen)
    ok, _ = acc.judge(logits[buf.internal], tokens, buf, 1)
    assert bool(raw_ok[1]) and not bool(ok[1])
    pen.begin_step(tokens.tolist(), tree.parents, torch.device("cpu"))
    rows = pen.rows(logits[buf.internal], [0, 1])
    want, _ = typical_node_ok(torch.softmax(rows, -1), tokens, buf.parent_slot, 0.09, 0.3)
    assert torch.equal(ok, want)


# ------------------------------------------------------------------------------------------------------------
# top-k and min-p
# ------------------------------------------------------------------------------------------------------------
def test_top_k_then_nucleus_then_min_p() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]])
    assert torch.equal(truncated(probs, 1.0, 2, 0.0) > 0, torch.tensor([[True, True, False, False, False]]))
    # top-k renormalises before the nucleus: of 0.4/0.3/0.2 (0.444/0.333/0.222), 0.7 needs two tokens
    assert (truncated(probs, 0.7, 3, 0.0) > 0).sum() == 2
    assert (truncated(probs, 1.0, 0, 0.5) > 0).tolist() == [[True, True, True, False, False]]
    assert (truncated(probs, 1.0, 0, 0.8) > 0).tolist() == [[True, False, False, False, False]]
    # off: the nucleus alone, bit for bit
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(target_probs(logits, 0.8, 0.9, 0, 0.0), target_probs(logits, 0.8, 0.9))


# ------------------------------------------------------------------------------------------------------------
# Every entry point: flags, slash commands, the API; the bench's loop metric
# ------------------------------------------------------------------------------------------------------------
def test_flags_and_settings_parse_llama_cpps_names() -> None:
    from medusa_chat import cli
    from medusa_chat.cliargs import settings_from_args

    argv = ["ask", "--repeat-penalty", "1.2", "--repeat-last-n", "-1", "--presence-penalty", "0.5",
            "--frequency-penalty", "0.1", "--dry-multiplier", "0.8", "--dry-base", "2", "--dry-allowed-length", "3",
            "--top-k", "40", "--min-p", "0.05", "hi"]  # fmt: skip
    s = settings_from_args(cli.build_parser("ask").parse_args(argv))
    assert (s.repeat_penalty, s.repeat_last_n, s.presence_penalty, s.frequency_penalty) == (1.2, -1, 0.5, 0.1)
    assert (s.dry_multiplier, s.dry_base, s.dry_allowed_length, s.top_k, s.min_p) == (0.8, 2.0, 3, 40, 0.05)
    assert PenaltyOptions.of(s).active
    from medusa_chat.errors import MedusaChatError
    from medusa_chat.settings import parse_settings

    for bad in ({"repeat_penalty": "0"}, {"repeat_last_n": "-2"}, {"presence_penalty": "3"}, {"top_k": "1.5"},
                {"dry_base": "0.5"}, {"dry_allowed_length": "0"}, {"min_p": "2"}):  # fmt: skip
        with pytest.raises(MedusaChatError):
            parse_settings(bad)


def test_repl_penalty_commands(tmp_path, monkeypatch) -> None:
    import io

    from rich.console import Console

    from medusa_chat.ui.terminal import TerminalChat
    from tests.test_terminal import _fake_session

    session, _ = _fake_session(tmp_path, monkeypatch)
    lines = ["/repeat 1.15 128", "/presence 0.5", "/frequency_penalty 0.2", "/dry 0.8 1.5 3", "/topk 40",
             "/min_p 0.05", "/repeat 0", "/dry 1 2 3 4"]  # fmt: skip
    out = io.StringIO()
    console = Console(file=out, width=200, no_color=True, highlight=False)
    TerminalChat(
        session, console, interactive=False, stdin=io.StringIO("\n".join(lines) + "\n"), out=out
    ).run()
    text = out.getvalue()
    s = session.settings
    assert (s.repeat_penalty, s.repeat_last_n, s.presence_penalty, s.frequency_penalty) == (
        1.15,
        128,
        0.5,
        0.2,
    )
    assert (s.dry_multiplier, s.dry_base, s.dry_allowed_length, s.top_k, s.min_p) == (0.8, 1.5, 3, 40, 0.05)
    assert "repeat penalty 1.15 over the last 128 tokens" in text
    assert "error: repeat_penalty must be > 0" in text and "usage: /dry X [BASE [LEN]]" in text


def test_the_api_applies_penalties_and_refuses_unknown_fields() -> None:
    import json

    from medusa_chat.openai.protocol import APIError, parse_chat_request

    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = parse_chat_request(json.dumps({**base, "presence_penalty": 0.5, "frequency_penalty": 1, "top_k": 40,
                                         "min_p": 0.1, "repeat_penalty": 1.1, "repeat_last_n": 32,
                                         "dry_multiplier": 0.8, "dry_sequence_breakers": ["\n"], "user": "u1"}).encode())  # fmt: skip
    assert req.options == {"presence_penalty": 0.5, "frequency_penalty": 1.0, "top_k": 40, "min_p": 0.1,
                           "repeat_penalty": 1.1, "repeat_last_n": 32, "dry_multiplier": 0.8,
                           "dry_sequence_breakers": ("\n",)}  # fmt: skip
    assert parse_chat_request(json.dumps(base).encode()).options == {}
    for field, value, message in (
        ("presence_penalty", 2.5, "presence_penalty must be"),
        ("top_k", 1.5, "top_k must be an integer"),
        ("dry_sequence_breakers", "x", "list of non-empty strings"),
        ("logit_bias", {"5": 10}, "logit_bias is not supported"),
        ("mirostat", 2, "unrecognized request argument 'mirostat'"),
        ("best_of", 2, "unrecognized request argument 'best_of'"),
    ):
        with pytest.raises(APIError) as info:
            parse_chat_request(json.dumps({**base, field: value}).encode())
        assert info.value.param == field and message in info.value.message, info.value.message


def test_loop_metric_sees_cycles_at_the_cap_only() -> None:
    from medusa_chat.bench.loops import loop_fraction, loop_period

    sentence = list(range(100, 120))  # a 20-token sentence said over and over
    assert loop_period(list(range(40)) + sentence * 4) == 20
    assert loop_period([1, 2, 3] + [7] * 30) == 1
    assert loop_period(list(range(200))) is None
    assert loop_period(list(range(40)) + sentence * 2) is None  # two copies: not yet a loop
    varied = [t for i in range(4) for t in sentence[:-1] + [200 + i]]  # one word changes each round
    assert loop_period(varied) is None
    rows = [
        {"stop_reason": "max_new_tokens", "token_ids": [1, 2, 3] + [9, 8] * 20},
        {"stop_reason": "eos", "token_ids": [9, 8] * 20},  # ended: not a loop that runs to the cap
        {"stop_reason": "max_new_tokens", "token_ids": list(range(60))},
        {"stop_reason": "max_new_tokens", "token_ids": list(range(30)) + sentence * 3},
    ]
    assert loop_fraction(rows) == 0.5 and loop_fraction([]) is None
