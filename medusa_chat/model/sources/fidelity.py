"""How close a numeric path stays to the float model: teacher-forced agreement on a fixed text.

Tree decoding adds no error (greedy replies are bitwise the engine's own plain loop), so what a path's replies
owe to the model is decided by the plain loop's arithmetic: 8-bit activations in the block kernels, the fp16
KV cache of the native step, the quantized weights. This module measures that loss the way llama.cpp's
`llama-perplexity --kl-divergence` does, so the two are comparable on the same text:

- the text is tokenized as plain text (no special tokens; a BOS at each chunk's start where the tokenizer
  adds one) and cut into chunks of `chunk` tokens;
- each chunk is one causal block from an empty cache; the second half of its positions is scored (the first
  half is context), comparing the path's next-token distribution with the float model's: top-1 agreement and
  KL(float || path), mean and 99th percentile.

The float model is the same checkpoint in fp32 with float activations (`--quant none`; for a GGUF, its own
blocks dequantized: the reference llama.cpp's F32 conversion of the file also gives). Greedy replies' agreement
with the float model's (characters before the first difference) is in bench/fidelity_bench (it needs the
engine); this module only needs a forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

import torch

from medusa_chat import envvars

CHUNK = 128  # tokens per chunk, as `llama-perplexity -c 128`
TEXT_RESOURCE = "fidelity_text.txt"
PROBE_CHUNKS = 9  # chunks the `--quant auto` choice scores (half the text: a few seconds for the embedded model)


@dataclass
class Fidelity:
    """Teacher-forced agreement of a path with the float model over `tokens` scored positions."""

    top1: float  # fraction of positions where the path's most likely token is the float model's
    mean_kl: float  # mean KL(float || path) in nats per token
    p99_kl: float
    tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}

    def line(self) -> str:
        return f"top-1 {self.top1 * 100:.1f}%, KL {self.mean_kl:.4f} nats/token ({self.tokens} tokens)"


def fixed_text() -> str:
    """The shipped fidelity text: held-out prompts and the embedded model's float greedy replies, as plain text."""
    return (resources.files("medusa_chat") / "data" / TEXT_RESOURCE).read_text(encoding="utf-8")


def text_chunks(tokenizer: Any, text: str, chunk: int = CHUNK, limit: int | None = None) -> list[list[int]]:
    """`text` as llama-perplexity reads it: plain-text tokens (special-token strings are not parsed), whole
    chunks only, each starting with BOS where the tokenizer adds one."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    probe = tokenizer("a")["input_ids"]
    bos = tokenizer.bos_token_id if probe and probe[0] == tokenizer.bos_token_id else None
    chunks = [ids[i : i + chunk] for i in range(0, len(ids) - chunk + 1, chunk)]
    if bos is not None:
        chunks = [[bos, *c[1:]] for c in chunks]
    return chunks[:limit] if limit else chunks


def _causal_mask(count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    mask = torch.zeros(count, count, dtype=dtype, device=device)
    mask.masked_fill_(torch.ones(count, count, dtype=torch.bool, device=device).triu(1), torch.finfo(dtype).min)
    return mask[None, None]


@torch.inference_mode()
def scored_logits(loaded: Any, chunks: Sequence[list[int]]) -> Iterator[torch.Tensor]:
    """Per chunk, the raw logits [chunk // 2 - 1, vocab] at the scored positions, computed by the forward the
    engine decodes with (the native C step, the lean forward or transformers')."""
    from medusa_chat.model.forward.kv_cache import TreeKVCache
    from medusa_chat.model.forward.runner import BackboneRunner

    runner = BackboneRunner(loaded.backbone)
    layers = loaded.backbone.config.num_hidden_layers
    act = loaded.backbone.get_input_embeddings().weight.dtype
    for ids in chunks:
        n = len(ids)
        x = torch.tensor(ids, dtype=torch.long, device=loaded.device)
        hidden = runner.forward(
            x, torch.arange(n, device=loaded.device), _causal_mask(n, act, loaded.device), TreeKVCache(layers)
        )
        yield runner.lm_head(hidden[n // 2 : n - 1]).float()


def scored_logprobs(loaded: Any, chunks: Sequence[list[int]]) -> Iterator[torch.Tensor]:
    """Per chunk, the path's log-probabilities at the scored positions (`scored_logits`, normalised)."""
    for logits in scored_logits(loaded, chunks):
        yield logits.log_softmax(-1)


def compare(reference: Sequence[torch.Tensor], path: Sequence[torch.Tensor]) -> Fidelity:
    """Agreement of `path`'s scored log-probabilities with the float `reference`'s."""
    kl, same = [], []
    for ref, got in zip(reference, path, strict=True):
        kl.append((ref.exp() * (ref - got)).sum(-1))
        same.append(ref.argmax(-1) == got.argmax(-1))
    kls, agree = torch.cat(kl), torch.cat(same).float()
    return Fidelity(float(agree.mean()), float(kls.mean()), float(kls.quantile(0.99)), int(agree.numel()))


def measure(
    paths: dict[str, Callable[[], Any]], reference: Callable[[], Any], limit: int | None = None
) -> dict[str, Fidelity]:
    """Teacher-forced fidelity of each path (a loader of a LoadedModel) against the float model (a loader too),
    on the shipped text. The float model's log-probabilities are computed once; models load one at a time."""
    ref_model = reference()
    chunks = text_chunks(ref_model.tokenizer, fixed_text(), limit=limit)
    ref = list(scored_logprobs(ref_model, chunks))
    del ref_model
    return {name: compare(ref, list(scored_logprobs(load(), chunks))) for name, load in paths.items()}


def agreement_chars(reply: str, reference: str) -> int:
    """Characters `reply` shares with `reference` before the first difference (the whole reply if none)."""
    n = 0
    for a, b in zip(reply, reference, strict=False):
        if a != b:
            break
        n += 1
    return n


# ---- `--quant auto`'s fidelity probe (used by loading.load_model) ------------------------------------------
def fidelity_probe(
    load: Callable[[str], Any],
    params: int,
    say: Callable[[str], None],
) -> Callable[[list[str]], dict[str, Any]] | None:
    """For `--quant auto`: a probe that scores the candidate paths against the float model (model/sources/fidelity.py), or
    None where it cannot run: first-start measurements are off (MEDUSA_CHAT_AUTO_CALIBRATE=0), or the float
    model and a quantized copy would not fit in memory beside each other. `load(quant)` loads the model with
    that numeric path on the CPU (loading.load_model; passed in, as loading imports this module)."""

    from medusa_chat.machine import available_memory

    if not envvars.auto_calibrate():
        return None
    need = params * 4 * 1.5  # fp32 reference + a quantized copy + activations
    avail = available_memory()
    if avail is not None and need > 0.6 * avail:
        say(f"fidelity of the numeric paths not measured: the float model needs ~{need / 2**30:.1f} GB")
        return None

    def probe(modes: list[str]) -> dict[str, Any]:
        say(f"Scoring {', '.join(modes)} against the float model once (teacher-forced, {PROBE_CHUNKS} chunks)")

        def loader(quant: str) -> Callable[[], Any]:
            return lambda: load(quant)

        results = measure({m: loader(m) for m in modes}, loader("none"), limit=PROBE_CHUNKS)
        return {m: r.as_dict() for m, r in results.items()}

    return probe
