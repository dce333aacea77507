"""Self-distillation data: prompts -> the backbone's own greedy replies, saved in resumable shards.

Medusa-1 heads learn to predict the *backbone's* continuations, so the best training text is what the model
itself writes (self-distillation, Medusa paper section 3.2). Two prompt sources:

- a user jsonl file (`{"prompt": ...}` or `{"turns": [first, ...]}` per line), and
- Magpie-style self-generated user turns: render the chat template up to the start of a user message and let
  the aligned model sample the user turn (T=1, top-p 0.95). No data set is needed at all.

Layout of a distillation folder (everything written atomically, so a killed run resumes where it stopped):

    manifest.json          canonical, append-only prompt list + Magpie round counter + shard index
    data/shard-00012.pt    {"first", "ids", "reply_start", "finished"}: replies to prompts[first:first+count]

`ids[i]` is prompt ids + reply ids (the reply ends with EOS when `finished[i]`), `reply_start[i]` the length of
the prompt. Shards hold plain lists of ints, so `torch.load(..., weights_only=True)` reads them safely.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from medusa_chat.training.conversations import answer_entries, conversation_end
from medusa_chat.training.store import DistillStore, Log

EMBEDDED_ALIASES = {"smollm2-135m", "smollm2-135m-instruct", "embedded"}
HUB_NAME_OF_EMBEDDED = "HuggingFaceTB/SmolLM2-135M-Instruct"
_SENTINEL = "\u2063MEDUSA_CHAT_USER_TURN\u2063"  # invisible separator: will not occur in a real template


# ---------------------------------------------------------------------------------------------------------
# small utilities
# ---------------------------------------------------------------------------------------------------------
def make_logger(prefix: str = "", stream: Any = None, file: Path | None = None) -> Log:
    """A logger that stamps wall-clock time and seconds since creation (long runs are read from logs)."""
    t0 = time.time()

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{time.time() - t0:7.1f}s] {prefix}{msg}"
        print(line, file=stream, flush=True)
        if file is not None:
            with open(file, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")

    return log


def resolve_model_path(model: str | Path) -> Path:
    """A model folder for `model`: a local path, or an alias of the embedded model."""
    if str(model).lower() in EMBEDDED_ALIASES:
        from medusa_chat.model.sources.embedded import embedded_model_dir

        return Path(embedded_model_dir())
    path = Path(model).expanduser()
    if not path.exists():
        from medusa_chat.errors import ModelNotFoundError

        raise ModelNotFoundError(f"model folder {path} does not exist (or use 'smollm2-135m')")
    return path


def base_model_name(model: str | Path) -> str:
    """What goes into the heads' `base_model_name_or_path`."""
    return HUB_NAME_OF_EMBEDDED if str(model).lower() in EMBEDDED_ALIASES else str(model)


def load_for_training(
    model: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Any, Any]:
    """(model, tokenizer) for training: the app's own loader (frozen, eval mode, sdpa attention), unquantized."""
    from transformers import AutoTokenizer

    from medusa_chat.model.sources.backbones import load_backbone

    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(path)
    return load_backbone(path, torch.device(device), dtype, "none"), tok


def eos_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """The ids that end an assistant turn (ChatML: <|im_end|>), from the tokenizer and generation config."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    for i in extra if isinstance(extra, list) else [extra]:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    if not ids:
        raise ValueError("the tokenizer defines no EOS token: cannot tell where a reply ends")
    return ids


def _ids(encoded: Any) -> list[int]:
    """apply_chat_template returns a list in some versions and a BatchEncoding in others."""
    if isinstance(encoded, dict) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


def chat_prompt_ids(tokenizer: Any, user_text: str) -> list[int]:
    """Token ids of a one-turn conversation ready for the assistant's reply (the app's prompt format)."""
    msgs = [{"role": "user", "content": user_text}]
    return _ids(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))


def user_prefix_ids(tokenizer: Any) -> list[int]:
    """Ids of the template up to where a user message's text starts (system turn included if the template
    inserts a default one). Magpie samples from here, so the model writes a user turn itself."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], add_generation_prompt=False, tokenize=False
    )
    cut = text.find(_SENTINEL)
    if cut <= 0:
        raise ValueError("the chat template does not place the user message where it can be found")
    return [int(i) for i in tokenizer(text[:cut], add_special_tokens=False)["input_ids"]]


# First words of a user turn, one per kind of request a chat user makes (not taken from any benchmark): the model
# writes the rest. Kinds: writing, explaining, advice, reasoning, maths, code, role play, rewriting, extraction,
# comparison, planning, opinion, counterfactuals, estimation.
TASK_OPENERS = (
    "Write a",
    "Write a short story about",
    "Write a poem",
    "Compose an email",
    "Draft a",
    "Explain",
    "Explain how",
    "Describe",
    "What is the difference between",
    "Why do",
    "How does",
    "How can I",
    "What are the",
    "Give me",
    "List",
    "Summarize",
    "Rewrite the following",
    "Translate",
    "Compare",
    "Imagine you are",
    "Pretend to be",
    "As a",
    "Solve",
    "Calculate",
    "If a train",
    "A store sells",
    "Write a Python function",
    "Implement a",
    "Write a program",
    "Debug this code:",
    "What would happen if",
    "What if",
    "Estimate how many",
    "Create a plan",
    "Suggest",
    "Design a",
    "Is it true that",
    "Discuss",
    "What do you think about",
    "Tell me about",
    "How many",
    "Why is it that",
    "What are the pros and cons of",
    "What are some ways to",
    "Can you explain",
    "How would you",
    "Write a blog post",
    "Write a persuasive",
    "Develop a",
    "Describe a day in the life of",
    "What would you say to",
    "Find the",
)

BENCH_GUARD = ("shared/bench", "vicuna_bench_question", "mt_bench", "question.jsonl")


def read_prompt_file(path: str | Path) -> list[str | list[str]]:
    """Prompts from a jsonl file: first user turns (`prompt` or `turns[0]`, else `instruction`/`text`), or whole
    conversations' user turns (`conversation`: a list, answered turn by turn; see conversations.py)."""
    path = Path(path).expanduser()
    if any(g in str(path.resolve()) for g in BENCH_GUARD):
        # The bench prompts measure the heads: training on them would inflate every number we report.
        raise ValueError(f"{path} looks like a benchmark prompt file: never train on benchmark prompts")
    out: list[str | list[str]] = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not JSON ({err})") from err
            if isinstance(rec, str):
                text = rec
            elif isinstance(rec, dict):
                conv, turns = rec.get("conversation"), rec.get("turns")
                if isinstance(conv, list) and len(conv) > 1 and all(isinstance(t, str) and t.strip() for t in conv):
                    out.append([t.strip() for t in conv])
                    continue
                text = (conv[0] if isinstance(conv, list) and conv else None) or rec.get("prompt")
                text = text or (turns[0] if isinstance(turns, list) and turns else None)
                text = text or rec.get("instruction") or rec.get("text")
            else:
                text = None
            if isinstance(text, str) and text.strip():
                out.append(text.strip())
    return out


# ---------------------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------------------
def _gen_config(
    tokenizer: Any, model: Any, max_new_tokens: int, sample: bool, top_p: float, temperature: float
):
    from transformers import GenerationConfig

    stop = eos_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    kw: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens, eos_token_id=stop, pad_token_id=pad, use_cache=True
    )
    if sample:
        # top_k=0 disables the default top-50 cut: Magpie's diversity comes from plain top-p sampling.
        kw.update(do_sample=True, top_p=top_p, temperature=temperature, top_k=0)
    else:
        kw.update(do_sample=False)
    return GenerationConfig(**kw), stop, pad


def _left_pad(batch: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, width - len(x) :] = torch.tensor(x, dtype=torch.long)
        mask[i, width - len(x) :] = 1
    return ids.to(device), mask.to(device)


def _cut_at_eos(row: list[int], stop: set[int]) -> tuple[list[int], bool]:
    for j, t in enumerate(row):
        if t in stop:
            return row[: j + 1], True
    return row, False


@torch.inference_mode()
def greedy_replies(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    batch_size: int,
    max_new_tokens: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[tuple[list[int], bool]]:
    """Greedy replies (ids incl. the EOS when finished, finished flag) for prompt id lists, in input order.

    Batched with left padding; prompts are sorted by length first so batches waste little padding.
    """
    device = next(model.parameters()).device
    cfg, stop, pad = _gen_config(tokenizer, model, max_new_tokens, sample=False, top_p=1.0, temperature=1.0)
    stop_set = set(stop)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[tuple[list[int], bool] | None] = [None] * len(prompts)
    done = 0
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        ids, mask = _left_pad([prompts[i] for i in idx], pad, device)
        seqs = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        gen = seqs[:, ids.shape[1] :].tolist()
        for i, row in zip(idx, gen, strict=True):
            out[i] = _cut_at_eos(row, stop_set)
        done += len(idx)
        if progress:
            progress(done, len(prompts))
    return [o for o in out if o is not None]


@torch.inference_mode()
def sample_user_turns(
    model: Any,
    tokenizer: Any,
    n: int,
    seed: int,
    max_new_tokens: int = 48,
    top_p: float = 0.95,
    temperature: float = 1.0,
    min_chars: int = 12,
    opener_frac: float = 0.0,
) -> tuple[list[str], int]:
    """One Magpie round: sample `n` user turns from the template's user prefix in one batch.

    Returns (clean texts, number sampled). A sample is kept only if it ends at EOS within the budget (a cut-off
    question is a bad prompt), contains no other special token, and is not near-empty. The caller re-seeds each
    round with a new seed: with a fixed seed the model repeats itself.

    `opener_frac` of the rows start the user turn with a task opener ("Write a", "Explain", "Imagine you
    are", ...; `TASK_OPENERS`) that the model then completes. A small model left to itself writes mostly
    "Can you help me plan ..." requests; its replies to stories, emails, code, maths or role play are what the
    heads then never see (measured: held-out top-1 .48 on its own prompts, .31 on Vicuna-bench replies).
    """
    device = next(model.parameters()).device
    cfg, stop, pad = _gen_config(
        tokenizer, model, max_new_tokens, sample=True, top_p=top_p, temperature=temperature
    )
    stop_set = set(stop)
    special = set(tokenizer.all_special_ids) - stop_set
    prefix = user_prefix_ids(tokenizer)
    rng = random.Random(seed)
    openers = [rng.choice(TASK_OPENERS) if rng.random() < opener_frac else "" for _ in range(n)]
    rows = [prefix + (_ids(tokenizer(o, add_special_tokens=False)) if o else []) for o in openers]
    ids, mask = _left_pad(rows, pad, device)
    torch.manual_seed(seed)  # seeds CPU and every CUDA device
    seqs = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    texts = []
    width = ids.shape[1]
    for row, start in zip(seqs.tolist(), rows, strict=True):
        body, clean = _cut_at_eos(row[width:], stop_set)
        if not clean or any(t in special for t in body):
            continue
        opener_ids = start[len(prefix) :]
        text = tokenizer.decode(opener_ids + body[:-1], skip_special_tokens=False).strip()
        if len(text) >= min_chars and len(text.split()) >= 3:
            texts.append(text)
    return texts, n


# ---------------------------------------------------------------------------------------------------------
# the pipeline
# ---------------------------------------------------------------------------------------------------------
@dataclass
class DistillSettings:
    magpie: int = 2000  # target number of unique Magpie prompts (0: none)
    prompt_file: str | None = None
    max_new_tokens: int = 160
    batch_size: int = 64  # reply generation
    magpie_batch: int = 64  # samples per Magpie round (one generate call)
    magpie_max_tokens: int = 48
    shard_size: int = 256  # prompts per shard: the unit of resumption
    seed: int = 0
    max_reply_tokens: int | None = None  # stop once this many reply tokens exist
    max_prompt_tokens: int = 512  # longer prompts are skipped (heads learn from replies; keep batches lean)
    opener_frac: float = 0.5  # Magpie rows that start from a task opener (see sample_user_turns)


def distill(
    model: Any,
    tokenizer: Any,
    store: DistillStore,
    settings: DistillSettings,
    deadline: float | None = None,
    log: Log = print,
    replies: Callable[[list[list[int]]], list[tuple[list[int], bool]]] | None = None,
) -> DistillStore:
    """Fill `store` with prompts and greedy replies until the targets are met or `deadline` (time.time()) nears.

    `replies` answers a list of prompt ids (default: batched transformers `generate` on `model`; the engine's own
    loop: engine_replies.EngineReplies).

    Magpie rounds and reply shards interleave, so whatever has been done when the run stops is usable training
    data. Each unit of work starts only if the last one of its kind would still finish before the deadline.
    """
    if settings.prompt_file:
        n = store.add_prompts(
            read_prompt_file(settings.prompt_file), source=f"file:{Path(settings.prompt_file).name}"
        )
        if n:
            store.save()
            log(f"prompts: +{n} from {settings.prompt_file} ({len(store.prompts)} in all)")
    last: dict[str, float] = {"magpie": 0.0, "shard": 0.0}
    empty_rounds = 0
    budget_hit = False

    def time_ok(kind: str) -> bool:
        return deadline is None or time.time() + last[kind] < deadline

    while True:
        if settings.max_reply_tokens is not None and store.reply_tokens >= settings.max_reply_tokens:
            log(f"reached {store.reply_tokens} reply tokens: data done")
            break
        n_magpie = sum(1 for s in store.sources if s == "magpie")
        want_magpie = n_magpie < settings.magpie and empty_rounds < 5
        pending = len(store.prompts) - store.next_prompt_index()
        # Out of time for another round; but with no data at all, one round and one shard still run.
        no_data = not store.shards and pending == 0
        if want_magpie and (
            budget_hit or (pending < settings.shard_size and not time_ok("magpie") and not no_data)
        ):
            if not budget_hit:
                log("time budget: no more Magpie rounds")
            want_magpie, budget_hit = False, True
        if pending >= settings.shard_size or (pending > 0 and not want_magpie):
            if not last["shard"] and last["magpie"]:
                # No shard timed yet: guess from the Magpie round (same kind of batched generation).
                batches = math.ceil(min(pending, settings.shard_size) / settings.batch_size)
                last["shard"] = (
                    last["magpie"] * batches * settings.max_new_tokens / settings.magpie_max_tokens
                )
            if store.shards and not time_ok("shard"):  # the first shard always runs: some data beats none
                log("time budget: not starting another reply shard")
                break
            t = time.time()
            first = store.next_prompt_index()
            texts = store.prompts[first : conversation_end(store.prompts, first + settings.shard_size)]

            def generate(batch: list[list[int]]) -> list[tuple[list[int], bool]]:
                if replies is not None:
                    return replies(batch)
                return greedy_replies(model, tokenizer, batch, settings.batch_size, settings.max_new_tokens)

            # Over-long prompts get an empty reply (kept, so prompt indices stay aligned; they train nothing).
            p_ids, answers = answer_entries(
                tokenizer, texts, generate, settings.max_prompt_tokens, set(eos_ids(tokenizer, model))
            )
            info = store.write_shard(
                first,
                [p + r for p, (r, _) in zip(p_ids, answers, strict=True)],
                [len(p) for p in p_ids],
                [f for _, f in answers],
            )
            last["shard"] = dt = time.time() - t
            fin = sum(f for _, f in answers)
            log(
                f"{info.name}: {info.count} replies, {info.tokens} tokens ({info.tokens / max(dt, 1e-9):.1f} tok/s, "
                f"{fin}/{len(answers)} ended at EOS), total {store.reply_tokens} reply tokens"
            )
            continue
        if want_magpie:
            t = time.time()
            r = store.magpie_rounds
            texts, sampled = sample_user_turns(
                model,
                tokenizer,
                settings.magpie_batch,
                seed=settings.seed * 1_000_003 + r,
                max_new_tokens=settings.magpie_max_tokens,
                opener_frac=settings.opener_frac,
            )
            added = store.add_prompts(texts, source="magpie")
            store.magpie_rounds += 1
            store.magpie_sampled += sampled
            store.save()
            empty_rounds = empty_rounds + 1 if added == 0 else 0
            last["magpie"] = dt = time.time() - t
            log(
                f"magpie round {r}: {sampled} sampled, {len(texts)} clean, {added} new "
                f"({sampled * settings.magpie_max_tokens / max(dt, 1e-9):.0f} token-slots/s), "
                f"{n_magpie + added} magpie prompts"
            )
            continue
        if budget_hit:
            log("time budget: data generation stopped")
        break
    return store


