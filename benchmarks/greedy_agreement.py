"""Greedy replies token by token: medusa-chat's plain loop on a GGUF file vs llama.cpp's `llama-completion` on the
same file vs the transformers float model of the checkpoint it was converted from, on the same prompt tokens.

    PYTHONPATH=. .venv/bin/python benchmarks/greedy_agreement.py MODELS/qwen2-0.5b-l4 --gguf qwen2-0.5b-l4-Q8_0.gguf \\
        --llama-cpp /path/to/llama.cpp --tokens 32

MODEL_DIR is a folder as `benchmarks/make_real_size_models.py --out` writes it: the checkpoint in `hf/` and the
GGUF files converted from it (`--gguf NAME` picks one; the only one there needs no flag). `--hf DIR` and `--gguf
PATH` name the two anywhere instead.

For each prompt (the fidelity text's user prompts in the model's chat template) and each pair of the three
replies: the tokens they share before the first difference, and at that position the two tokens' logit margin
under the float model and under medusa-chat's model (teacher-forced on the shared prefix), beside the float
logits' standard deviation and the float model's own top-1/top-2 gap. Random-weight models have flat logits: their
replies part at near-ties, and the margins say whether a difference is a tie broken by rounding (a margin far
below the logits' spread) or a real disagreement. `--hf-quant int4|int8`: medusa-chat from the checkpoint folder
(the cached quantized file) too. One JSON document on stdout (and in `--out`).

Random models' greedy replies often settle into one token repeated (each row reports its distinct tokens): then
agreement says little. So the same paths are also scored teacher-forced on the fidelity text (`--chunks` chunks of
128 tokens, the second half of each scored, as llama-perplexity does): top-1 agreement with the float model and the
mean KL divergence; for llama.cpp, `llama-perplexity --kl-divergence` of the file against `--f16-gguf` (the
converter's F16 file of the same checkpoint: the float model's values).

llama.cpp's tokens are read from its verbose log (`-v`: a `n_past = ...` line follows every token it prints; each
printed piece is mapped back to its token by its bytes), its prompt tokens checked against ours (`tokens: [...]`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LOG_LINE = re.compile(rb"\d+\.\d\d\.\d\d\d\.\d\d\d [DIWE] ([^\n]*)\n")


# ---- the three greedy decoders -------------------------------------------------------------------------------------
def ours(loaded: Any, prompt: list[int], n: int) -> list[int]:
    from medusa_chat.engine.engine import MedusaEngine, plain_tree
    from medusa_chat.events import GenerationSettings, ReplySummary

    engine = MedusaEngine(loaded, plain_tree())
    for event in engine.generate(prompt, GenerationSettings(max_new_tokens=n, temperature=0)):
        if isinstance(event, ReplySummary):
            return list(event.token_ids)
    raise RuntimeError("no reply")


def our_logits(loaded: Any, ids: list[int]) -> torch.Tensor:
    """medusa-chat's next-token logits after `ids` (a prefill through the step the engine runs)."""
    from medusa_chat.engine.engine import MedusaEngine, plain_tree

    engine = MedusaEngine(loaded, plain_tree())
    engine.fresh_cache(capacity=len(ids) + 16)
    t = torch.tensor(ids)
    with torch.inference_mode():
        hidden = engine.runner.forward(t, torch.arange(len(t)), engine.causal_mask(0, len(t)), engine.cache)
        return engine.runner.lm_head(hidden[-1:]).float()[0]


def float_greedy(model: Any, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    out: list[int] = []
    with torch.inference_mode():
        res = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            if tok in eos:
                break
            res = model(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return out


def float_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()


def piece_ids(tokenizer: Any) -> dict[bytes, int]:
    """Each token's bytes as llama.cpp prints them (byte-level BPE symbols decoded; special tokens as text)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decode = {c: b for b, c in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_tokens) | {
        t.content for t in tokenizer.added_tokens_decoder.values() if t.special
    }
    out: dict[bytes, int] = {}
    for token, i in tokenizer.get_vocab().items():
        if token in special or any(c not in decode for c in token):
            raw = token.encode()
        else:
            raw = bytes(decode[c] for c in token)
        out.setdefault(raw, i)
    return out


def llama_greedy(
    completion: Path, gguf: Path, tokenizer: Any, prompt: list[int], n: int, threads: int
) -> tuple[list[int], list[int]]:
    """(llama-completion's greedy tokens, its prompt tokens) for the prompt text of `prompt`."""
    # -p, not -f: llama.cpp drops a prompt file's last newline (a chat prompt ends with one); --no-escape: the
    # text as is; -sp: special tokens printed as their text (so they map back)
    cmd = [str(completion), "-m", str(gguf), "-p", tokenizer.decode(prompt), "--no-escape", "-n", str(n + 1),
           "--temp", "0", "-no-cnv", "-sp", "-v", "--no-warmup", "-t", str(threads), "-c", "2048",
           "--no-display-prompt"]  # fmt: skip
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"llama-completion failed: {done.stdout[-400:]!r}")
    log = done.stdout
    m = re.search(rb"D tokens: \[ (.*?) \]\n", log, re.S)
    prompt_ids = [int(x) for x in re.findall(rb"':(\d+)", m.group(1))] if m else []
    start = log.index(b"D embd_inp.size()")
    pieces, last = [], None
    for match in LOG_LINE.finditer(log, start):
        if match.group(1).startswith(b"n_past = "):
            if last is not None:  # the first n_past line follows the prompt's evaluation (no piece)
                pieces.append(log[last : match.start()])
            last = match.end()
        elif last is not None and match.group(1).startswith(b"n_remain"):
            last = match.end()
    table = piece_ids(tokenizer)
    ids = []
    for p in pieces[:n]:
        if p not in table:
            raise RuntimeError(f"llama.cpp printed {p!r}, no token of the vocabulary")
        ids.append(table[p])
    return ids, prompt_ids


# ---- comparison ----------------------------------------------------------------------------------------------------
def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def margins(prefix: list[int], a: int, b: int, float_model: Any, loaded: Any) -> dict[str, float]:
    ref = float_logits(float_model, prefix)
    mine = our_logits(loaded, prefix)
    top2 = ref.topk(2).values
    return {
        "float_margin": round(float(ref[a] - ref[b]), 4),  # > 0: the float model prefers a
        "ours_margin": round(float(mine[a] - mine[b]), 4),
        "float_top_gap": round(float(top2[0] - top2[1]), 4),
        "float_std": round(float(ref.std()), 4),
    }


def compare(
    name_a: str, a: list[int], name_b: str, b: list[int], prompt: list[int], float_model: Any, loaded: Any
) -> dict[str, Any]:
    k = first_difference(a, b)
    row: dict[str, Any] = {"pair": f"{name_a} vs {name_b}", "agree": k, "of": min(len(a), len(b))}
    if k < min(len(a), len(b)):
        row["at"] = {"tokens": [a[k], b[k]], **margins(prompt + a[:k], a[k], b[k], float_model, loaded)}
    return row


def llama_teacher_forced(perplexity: Path, gguf: Path, f16: Path, text: str, chunks: int, threads: int) -> Any:
    """llama.cpp's top-1 agreement and KL divergence of `gguf` against the F16 file, on the same chunks."""
    from medusa_chat.bench.fidelity import _parse_kld
    from medusa_chat.model.sources.fidelity import CHUNK

    with tempfile.TemporaryDirectory() as tmp:
        text_file, base = Path(tmp) / "text.txt", Path(tmp) / "base.kld"
        text_file.write_text(text, encoding="utf-8")
        common = [str(perplexity), "-f", str(text_file), "-c", str(CHUNK), "-t", str(threads), "--chunks", str(chunks)]
        for model, extra in ((f16, []), (gguf, ["--kl-divergence"])):
            done = subprocess.run(
                [*common, "-m", str(model), "--kl-divergence-base", str(base), *extra],
                capture_output=True, text=True, timeout=1800,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"llama-perplexity failed: {(done.stderr or done.stdout).strip()[-300:]}")
    return _parse_kld(done.stdout + done.stderr)


def teacher_forced(args: argparse.Namespace, loaded: Any, extra: Any, float_model: Any) -> dict[str, Any]:
    from medusa_chat.model.sources.fidelity import compare as score
    from medusa_chat.model.sources.fidelity import fixed_text, scored_logprobs, text_chunks

    chunks = text_chunks(loaded.tokenizer, fixed_text(), limit=args.chunks)
    with torch.inference_mode():
        ref = [float_model(torch.tensor([c])).logits[0, len(c) // 2 : len(c) - 1].float().log_softmax(-1) for c in chunks]
    out: dict[str, Any] = {"tokens_scored": sum(r.shape[0] for r in ref)}
    ref_all = torch.cat(ref)
    gaps = ref_all.topk(2, dim=-1).values
    std = ref_all.std(dim=-1)  # log-softmax differs from the logits by a per-row constant: same gaps, same std
    out["float_top_gap_over_std_median"] = round(float(((gaps[:, 0] - gaps[:, 1]) / std).median()), 4)

    def scored(model: Any) -> dict[str, Any]:
        got = list(scored_logprobs(model, chunks))
        row = score(ref, got).as_dict()
        a, b = ref_all.argmax(-1), torch.cat(got).argmax(-1)
        split = (a != b).nonzero().flatten()
        margin = (ref_all[split, a[split]] - ref_all[split, b[split]]) / std[split]
        row["split_margin_over_std"] = [round(float(m), 4) for m in margin]  # the float model's, where they part
        return row

    out["ours"] = scored(loaded)
    if extra is not None:
        out[f"ours-hf-{args.hf_quant}"] = scored(extra)
    perplexity = args.llama_cpp / "build" / "bin" / "llama-perplexity" if args.llama_cpp else None
    if perplexity is not None and perplexity.is_file() and args.f16_gguf:
        out["llama.cpp (vs its F16 file)"] = llama_teacher_forced(
            perplexity, args.gguf, args.f16_gguf, fixed_text(), len(chunks), args.threads
        )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from medusa_chat.bench.fidelity import text_prompts
    from medusa_chat.bench.runs import repo_path
    from medusa_chat.model.sources.fidelity import fixed_text
    from medusa_chat.model.sources.loading import load_model

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    loaded = load_model(str(args.gguf), device="cpu")
    extra = load_model(str(args.hf), quant=args.hf_quant, device="cpu") if args.hf_quant else None
    float_model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    completion = args.llama_cpp / "build" / "bin" / "llama-completion" if args.llama_cpp else None
    eos = set(loaded.eos_token_ids)
    prompts = text_prompts(fixed_text())[: args.prompts]
    rows = []
    for text in prompts:
        prompt = loaded.build_prompt([{"role": "user", "content": text}])
        replies = {"ours": ours(loaded, prompt, args.tokens), "float": float_greedy(float_model, prompt, args.tokens, eos)}
        if extra is not None:
            replies[f"ours-hf-{args.hf_quant}"] = ours(extra, prompt, args.tokens)
        row: dict[str, Any] = {"prompt": text, "prompt_tokens": len(prompt)}
        row["distinct_tokens"] = {name: len(set(r)) for name, r in replies.items()}
        if completion is not None:
            got, llama_prompt = llama_greedy(completion, args.gguf, loaded.tokenizer, prompt, args.tokens, args.threads)
            row["same_prompt_tokens"] = llama_prompt == prompt
            replies["llama.cpp"] = got
            row["distinct_tokens"]["llama.cpp"] = len(set(got))
        names = list(replies)
        row["pairs"] = [
            compare(x, replies[x], y, replies[y], prompt, float_model, loaded)
            for i, x in enumerate(names)
            for y in names[i + 1 :]
        ]
        row["replies"] = replies
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "replies"}), file=sys.stderr, flush=True)
    summary: dict[str, Any] = {}
    for pair in rows[0]["pairs"]:
        name = pair["pair"]
        found = [p for r in rows for p in r["pairs"] if p["pair"] == name]
        summary[name] = {
            "agree_tokens": [p["agree"] for p in found],
            "median_agree": statistics.median(p["agree"] for p in found),
            "identical": sum(p["agree"] == p["of"] for p in found),
            "margin_over_std_at_split": [
                round(abs(p["at"]["float_margin"]) / p["at"]["float_std"], 3) for p in found if "at" in p
            ],
        }
    tf = teacher_forced(args, loaded, extra, float_model)
    return {
        "teacher_forced": tf,
        "gguf": repo_path(str(args.gguf)),
        "hf": repo_path(str(args.hf)),
        "tokens": args.tokens,
        "prompts": len(prompts),
        "summary": summary,
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def model_files(folder: Path | None, hf: Path | None, gguf: Path | None) -> tuple[Path, Path]:
    """The checkpoint folder and the GGUF file: as given, else found in `folder` (`hf/`; the GGUF named, or the
    folder's only one that is not the converter's F16 file)."""
    if folder is not None:
        hf = hf or folder / "hf"
        if gguf is not None and not gguf.is_absolute() and not gguf.exists():
            gguf = folder / gguf
        if gguf is None:
            found = sorted(p for p in folder.glob("*.gguf") if not p.stem.upper().endswith("F16"))
            if len(found) != 1:
                names = ", ".join(p.name for p in found) or "none"
                raise ValueError(f"{folder}: pick the GGUF with --gguf NAME (found: {names})")
            gguf = found[0]
    if hf is None or gguf is None:
        raise ValueError("give MODEL_DIR, or both --hf and --gguf")
    for path in (hf, gguf):
        if not path.exists():
            raise ValueError(f"{path} does not exist")
    return hf, gguf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, nargs="?", help="a folder holding hf/ and the GGUF files")
    parser.add_argument("--hf", type=Path, help="the checkpoint folder the GGUF was converted from (MODEL_DIR/hf)")
    parser.add_argument("--gguf", type=Path, help="the GGUF file, or its name inside MODEL_DIR")
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp source tree with build/bin/llama-completion")
    parser.add_argument("--hf-quant", choices=["int4", "int8"], help="also medusa-chat from the folder")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=4, help="teacher-forced: chunks of the fidelity text")
    parser.add_argument("--f16-gguf", type=Path, help="the F16 GGUF of the checkpoint (llama.cpp's reference)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        args.hf, args.gguf = model_files(args.model_dir, args.hf, args.gguf)
    except ValueError as err:
        parser.error(str(err))
    doc = run(args)
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.write_text(text)
    print(json.dumps({"summary": doc["summary"], "teacher_forced": doc["teacher_forced"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
