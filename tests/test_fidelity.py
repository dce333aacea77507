"""Fidelity to the float model (model/sources/fidelity.py, bench/fidelity.py, the `--quant auto` floor): each CPU path's
next-token distributions stay within a floor of its float reference, and a path that drifts fails it."""

from __future__ import annotations

import pytest
import torch

from medusa_chat.bench.fidelity import _parse_kld, agreement, text_prompts
from medusa_chat.model.sources.fidelity import (
    Fidelity,
    agreement_chars,
    compare,
    fixed_text,
    scored_logprobs,
    text_chunks,
)
from medusa_chat.model.sources.numeric_path import faithful, pick
from tests.tinymodels import VOCAB, block_loaded, tiny_loaded

# The floors each path must meet against its float reference on the tiny model, teacher-forced on random text of
# its vocabulary (top-1 min, mean KL max). Its next-token distributions there are flat (many near-ties), so KL
# is the sharp measure. Measured: int8 top-1 96%, KL 1e-4; int4 top-1 72%, KL 0.009.
FLOORS = {"int8": (0.9, 5e-4), "int4": (0.6, 0.02)}


def _chunks(n: int = 8, length: int = 64) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (n, length), generator=gen).tolist()


def test_compare_identical_and_shifted() -> None:
    ref = [torch.randn(5, 11).log_softmax(-1) for _ in range(3)]
    same = compare(ref, ref)
    assert same.top1 == 1.0 and abs(same.mean_kl) < 1e-6 and same.tokens == 15
    flipped = [r.flip(-1) for r in ref]  # another distribution with another top-1
    other = compare(ref, flipped)
    assert other.top1 < 1.0 and other.mean_kl > 0.01


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_block_path_meets_its_fidelity_floor(quant: str) -> None:
    chunks = _chunks()
    ref = list(scored_logprobs(tiny_loaded("llama", heads="hydra"), chunks))
    got = compare(ref, list(scored_logprobs(block_loaded(quant), chunks)))
    top1, kl = FLOORS[quant]
    assert got.top1 >= top1 and got.mean_kl <= kl, got


def test_a_drifting_path_fails_the_floor() -> None:
    """The floor is not vacuous: an int8 path whose first norm is tilted (a drift of the kind a wrong kernel
    makes) falls far below it."""
    chunks = _chunks()
    base = tiny_loaded("llama", heads="hydra")
    ref = list(scored_logprobs(base, chunks))
    bad = block_loaded("int8")  # a copy of its own
    with torch.no_grad():  # the first layer's input norm tilted by +-50%
        layer = bad.backbone.model.layers[0]
        layer.input_layernorm.weight.mul_(torch.linspace(0.5, 1.5, layer.input_layernorm.weight.numel()))
    got = compare(ref, list(scored_logprobs(bad, chunks)))
    assert got.mean_kl > 10 * FLOORS["int8"][1], got


def test_auto_choice_keeps_the_fastest_faithful_path() -> None:
    measured = {m: {"step_s": {"1": t}} for m, t in (("none", 0.03), ("int8", 0.004), ("int4", 0.005))}
    # speed alone: int8
    assert pick(measured) == "int8"
    # int8 with 1.45x int4's KL (the embedded GGUF's Q4_1 blocks re-quantized as Q8_0): out, int4 kept
    fidelity = {"int8": {"top1": 0.966, "mean_kl": 0.0039}, "int4": {"top1": 0.970, "mean_kl": 0.0027}}
    assert faithful(fidelity) == {"none", "int4"}
    assert pick(measured, fidelity) == "int4"
    # within the slack: the faster one stays
    close = {"int8": {"top1": 0.97, "mean_kl": 0.0030}, "int4": {"top1": 0.97, "mean_kl": 0.0027}}
    assert pick(measured, close) == "int8"
    # only the float path is always faithful
    assert pick({"none": {"step_s": {"1": 0.03}}, "int4": {"excluded": "x"}}, fidelity) == "none"


def test_text_chunks_are_whole_and_start_with_bos() -> None:
    class Tok:
        bos_token_id = 1

        def __call__(self, text: str, **_: object) -> dict[str, list[int]]:
            ids = [ord(c) for c in text]
            return {"input_ids": [1, *ids] if _.get("add_special_tokens", True) else ids}

    chunks = text_chunks(Tok(), "x" * 300, chunk=128)
    assert len(chunks) == 2 and all(len(c) == 128 and c[0] == 1 for c in chunks)


def test_fixed_text_and_its_prompts() -> None:
    text = fixed_text()
    prompts = text_prompts(text)
    assert len(prompts) == 16 and all(p.strip() for p in prompts)
    assert text.count("Assistant: ") == 16


def test_agreement_counts() -> None:
    assert agreement_chars("hello world", "hello there") == 6
    assert agreement_chars("same", "same") == 4
    doc = agreement(["abc", "abd", "x"], ["abc", "abc", "y"])
    assert doc["chars"] == [3, 2, 0] and doc["median_chars"] == 2 and doc["identical"] == 1


def test_parse_llama_perplexity_summary() -> None:
    out = "Mean    KLD:   0.002654 ±   0.000085\n99.0%   KLD:   0.014701\nSame top p: 96.649 ± 0.535 %\n"
    assert _parse_kld(out) == {"top1": pytest.approx(0.96649), "mean_kl": 0.002654, "p99_kl": 0.014701}
    with pytest.raises(RuntimeError):
        _parse_kld("nothing")


@pytest.mark.slow
def test_embedded_default_path_is_as_faithful_as_llama_cpp() -> None:
    """The embedded model's int4 path (its GGUF's own Q4_1 blocks, native C step) against its float model on half
    the shipped text. llama.cpp's Q4_1 on the whole text through llama-perplexity: top-1 96.6%, KL 0.00265."""
    from medusa_chat.model.sources.fidelity import PROBE_CHUNKS, measure
    from medusa_chat.model.sources.loading import load_model

    results = measure({"int4": lambda: load_model(quant="int4")}, lambda: load_model(quant="none"),
                             limit=PROBE_CHUNKS)  # fmt: skip
    got: Fidelity = results["int4"]
    assert got.top1 >= 0.95 and got.mean_kl <= 0.0035, got
