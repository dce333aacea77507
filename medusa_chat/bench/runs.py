"""One timed run of each method (the engine, HF generate, HF prompt lookup), and how two replies compare."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.errors import MedusaChatError
from medusa_chat.events import GenerationSettings, StepEvent
from medusa_chat.paths import repo_path
from medusa_chat.settings import GREEDY

if TYPE_CHECKING:

    from medusa_chat.engine.engine import MedusaEngine


TIMING_NOTE = (
    "decode wall time: from the first new token to the end of the reply (prefill and first token excluded), "
    "measured the same way for every method; speedups are ratios of decode tokens/s"
)


LOOKUP_TOKENS = 10


NEAR_TIE = {"float32": 1e-4}  # top-2 logit gap under which a greedy flip counts as a tie (16-bit: 1e-2)


MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}


def tie_tolerance(dtype: str, top_logit: float) -> float:
    """A top-2 gap this small is a tie for arithmetic in `dtype`: the larger of the fixed tolerance and two
    units in the last place of the top logit (a 16-bit GEMM output is rounded to that grid, so two equally
    valid evaluation orders can differ by an ulp or two: at a bf16 logit of 16-32 one ulp is 0.125)."""
    bits = MANTISSA_BITS.get(dtype)
    ulp = 2.0 ** (math.floor(math.log2(abs(top_logit))) - bits) if bits and top_logit else 0.0
    return max(NEAR_TIE.get(dtype, 1e-2), 2 * ulp if dtype != "float32" else 0.0)


@dataclass
class Run:
    """One reply by one method, timed as described in TIMING_NOTE."""

    method: str
    token_ids: list[int]
    decode_tokens: int  # tokens produced after the first output
    decode_s: float
    ttft_s: float  # time to the first output (prefill)
    steps: int | None  # forward passes after the first output (None: not known)
    stop_reason: str = ""
    lookup_accepted: int = 0  # accepted tree nodes whose token came from context lookup
    accepted_lengths: list[int] = field(default_factory=list)  # per step, draft tokens accepted (engine runs)
    sized_steps: dict[int, int] = field(default_factory=dict)  # {tree prefix size: steps} (engine/tree_sizer.py)

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_step(self) -> float | None:
        return self.decode_tokens / self.steps if self.steps else None


def run_engine(engine: MedusaEngine, method: str, prompt_ids: list[int], settings: GenerationSettings) -> Run:
    engine.reset()  # every run pays a full prefill, like the HF baselines (no prefix reuse between methods)
    t0 = time.perf_counter()
    t_first, first_tokens, summary, lookup_accepted = t0, 1, None, 0
    for item in engine.generate(prompt_ids, settings):
        if isinstance(item, StepEvent):
            if item.step == 0:
                t_first, first_tokens = time.perf_counter(), len(item.token_ids)
            elif item.tree is not None and item.tree.lookup_nodes:
                # (a step cut short by the reply's cap or a stop keeps fewer tokens than it accepted)
                guessed = len(set(item.tree.lookup_nodes) & set(item.accepted_nodes))
                lookup_accepted += min(guessed, max(len(item.token_ids) - 1, 0))
        else:
            summary = item
    t_end = time.perf_counter()
    assert summary is not None
    return Run(
        method=method,
        token_ids=summary.token_ids,
        decode_tokens=max(len(summary.token_ids) - first_tokens, 0),
        decode_s=t_end - t_first,
        ttft_s=t_first - t0,
        steps=summary.steps,
        stop_reason=summary.stop_reason,
        lookup_accepted=lookup_accepted,
        accepted_lengths=list(summary.accepted_lengths),
        sized_steps=dict(summary.sized_steps),
    )


class _Clock:
    """A transformers streamer that only notes when tokens arrive. generate() first puts the prompt, then
    each step's new token(s): one put per forward pass, for greedy and for prompt lookup alike."""

    def __init__(self) -> None:
        self.puts: list[tuple[float, int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


def run_hf(
    loaded: Any, method: str, prompt_ids: list[int], settings: GenerationSettings, seed: int | None = None
) -> Run:
    """HF `generate` (method "hf") or prompt-lookup decoding ("lookup"), same dtype/device as the engine."""
    backbone = loaded.backbone
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=loaded.device)
    eos = list(loaded.eos_token_ids)
    pad = getattr(loaded.tokenizer, "pad_token_id", None)
    kw: dict[str, Any] = {
        "max_new_tokens": settings.max_new_tokens,
        "eos_token_id": eos or None,
        "pad_token_id": pad if pad is not None else (eos[0] if eos else 0),
        "do_sample": settings.accept_mode != GREEDY,
        "repetition_penalty": 1.0,  # a model's generation_config must not change what plain greedy means
    }
    if kw["do_sample"]:
        kw.update(temperature=settings.temperature, top_p=settings.top_p, top_k=0)
        if seed is not None:
            torch.manual_seed(seed)
    if method == "lookup":
        kw["prompt_lookup_num_tokens"] = LOOKUP_TOKENS
    clock = _Clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = backbone.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=clock, **kw)
    t_end = time.perf_counter()
    tokens = out[0, len(prompt_ids) :].tolist()
    outputs = clock.puts[1:]  # the first put is the prompt
    t_first, first_tokens = outputs[0] if outputs else (t_end, len(tokens))
    stop = "eos" if tokens and tokens[-1] in eos else "max_new_tokens"
    return Run(
        method=method,
        token_ids=tokens,
        decode_tokens=max(len(tokens) - first_tokens, 0),
        decode_s=t_end - t_first,
        ttft_s=t_first - t0,
        steps=len(outputs) - 1 if outputs else 0,
        stop_reason=stop,
    )


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where the two replies differ, comparing up to the shorter one (EOS tokens included, so a
    reply that ended where the other went on counts as a difference). None when they agree."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


@torch.inference_mode()
def top2_gap(loaded: Any, prompt_ids: list[int], reference: list[int], index: int) -> tuple[float, float]:
    """The reference model's top-2 logit gap where its token `index` was chosen, and the top logit: a tiny
    gap is a near-tie, where different (but equally valid) arithmetic may pick the other token."""
    ids = torch.tensor([prompt_ids + reference[:index]], dtype=torch.long, device=loaded.device)
    logits = loaded.backbone(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1]), float(top[0])


def read_prompts(path: Path, limit: int | None = None) -> list[str]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise MedusaChatError(f"cannot read prompts file {path}: {err.strerror or err}") from err
    prompts: list[str] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise MedusaChatError(f"{path}:{n}: not JSON ({err.msg})") from err
        text = None
        if isinstance(obj, dict):
            turns = obj.get("turns")
            text = turns[0] if isinstance(turns, list) and turns else obj.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise MedusaChatError(
                f"{path}:{n}: expected an object with `turns` (list of strings) or `prompt`"
            )
        prompts.append(text)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise MedusaChatError(f"{path} holds no prompts")
    return prompts


METHODS = ("hf", "plain", "lookup", "heads", "medusa")


# llamacpp: llama-bench on the same GGUF (peer.py); heads: Medusa without context lookup (an ablation, opt-in);
# llamacpp-spec: llama-server's plain and speculative modes and `medusa-chat serve`, through their API (opt-in:
# server_peers.py)
BASELINES = ("hf", "plain", "lookup", "llamacpp", "heads", "llamacpp-spec")


DEFAULT_BASELINES = ("hf", "plain", "lookup", "llamacpp")


def describe(loaded: Any) -> dict[str, Any]:
    from medusa_chat.tuning.tree_choice import dtype_name

    spec = getattr(loaded, "spec", None)
    return {
        "model": repo_path(getattr(spec, "name", None) or "model"),
        "device": str(loaded.device),
        "dtype": dtype_name(getattr(loaded, "dtype", loaded.backbone.get_input_embeddings().weight.dtype)),
        "quant": getattr(loaded, "quant", "none"),
    }
