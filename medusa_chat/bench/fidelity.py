"""`medusa-chat bench --fidelity`: how close each numeric path stays to the float model, beside llama.cpp.

Two measures, each against the same checkpoint in fp32 with float activations (`--quant none`):
- teacher-forced, on the shipped fixed text (fidelity.py: llama-perplexity's chunks, top-1 agreement and KL);
  for llama.cpp the same text through `llama-perplexity --kl-divergence` against an F32 copy of the GGUF (its
  own float reference), so both sides are scored on the same tokens by the same rule;
- greedy replies to the text's prompts: characters each path's reply shares with the float model's before the
  first difference (median and per prompt); for llama.cpp its `llama-completion` at temperature 0.

Greedy agreement is a noisy, all-or-nothing measure (one near-tie flipped early ends it): the teacher-forced
numbers are the ones to compare paths by; the greedy ones say what a user sees.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
from pathlib import Path
from typing import Any

import torch

from medusa_chat.model.sources.fidelity import (
    CHUNK,
    agreement_chars,
    compare,
    fixed_text,
    scored_logprobs,
    text_chunks,
)
from medusa_chat.paths import cache_root

PROMPT_RE = re.compile(r"^User: (.*)$", re.MULTILINE)


def text_prompts(text: str) -> list[str]:
    """The user prompts of the fixed text (its `User: ...` lines)."""
    return PROMPT_RE.findall(text)


def greedy_replies(loaded: Any, prompts: list[str], max_new: int) -> list[str]:
    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.events import GenerationSettings, ReplySummary

    engine = MedusaEngine(loaded)
    out = []
    for prompt in prompts:
        ids = loaded.build_prompt([{"role": "user", "content": prompt}])
        settings = GenerationSettings(max_new_tokens=max_new)
        out.append(next(i for i in engine.generate(ids, settings) if isinstance(i, ReplySummary)).text)
    return out


def agreement(replies: list[str], reference: list[str]) -> dict[str, Any]:
    chars = [agreement_chars(a, b) for a, b in zip(replies, reference, strict=True)]
    whole = sum(a == b for a, b in zip(replies, reference, strict=True))
    return {"median_chars": statistics.median(chars), "chars": chars, "identical": whole}


# ---- llama.cpp on the same text ------------------------------------------------------------------------------------
def llama_tools(bench_binary: str | None) -> tuple[Path | None, Path | None]:
    """llama-perplexity and llama-completion beside the llama-bench binary bench finds (same build)."""
    from medusa_chat.bench.peer import find_llama_bench

    bench = find_llama_bench(bench_binary)
    if bench is None:
        return None, None
    found = [bench.parent / name for name in ("llama-perplexity", "llama-completion")]
    return tuple(p if p.is_file() else None for p in found)  # type: ignore[return-value]


def write_float_gguf(src: Path, dst: Path) -> None:
    """An F32 copy of a GGUF (its blocks dequantized, metadata and tokenizer kept): llama.cpp's float model of the
    same weights, the reference of its KL measure."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(dst), bytes(arch.parts[arch.data[0]]).decode())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = f.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = f.types[1]
            if sub == gguf.GGUFValueType.STRING:
                value: Any = [bytes(f.parts[i]).decode("utf-8", errors="surrogateescape") for i in f.data]
            else:
                value = [f.parts[i].tolist()[0] for i in f.data]
            writer.add_key_value(key, value, kind, sub_type=sub)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_key_value(key, bytes(f.parts[f.data[0]]).decode("utf-8"), kind)
        else:
            writer.add_key_value(key, f.parts[f.data[0]].tolist()[0], kind)
    for t in reader.tensors:
        shape = [int(x) for x in reversed(list(t.shape))]
        writer.add_tensor(t.name, dequantize(t.data, t.tensor_type).reshape(shape).astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _parse_kld(out: str) -> dict[str, Any]:
    kl = re.search(r"Mean\s+KLD:\s+([-\d.]+)", out)
    p99 = re.search(r"99\.0%\s+KLD:\s+([-\d.]+)", out)
    top = re.search(r"Same top p:\s+([\d.]+)", out)
    if not (kl and top):
        raise RuntimeError("llama-perplexity printed no KL summary")
    return {
        "top1": float(top.group(1)) / 100,
        "mean_kl": float(kl.group(1)),
        "p99_kl": float(p99.group(1)) if p99 else None,
    }


def llama_teacher_forced(perplexity: Path, gguf: Path, text: str, threads: int) -> dict[str, Any]:
    # the F32 copy is written once and kept in the cache (hundreds of MB: not rewritten per run)
    work = cache_root() / "fidelity"
    work.mkdir(parents=True, exist_ok=True)
    f32 = work / f"{gguf.stem}.f32.gguf"
    if not f32.is_file():
        partial = f32.with_suffix(".partial")
        write_float_gguf(gguf, partial)
        partial.replace(f32)
    text_file, base = work / "fidelity_text.txt", work / "fidelity_base.kld"
    text_file.write_text(text, encoding="utf-8")
    common = [str(perplexity), "-f", str(text_file), "-c", str(CHUNK), "-t", str(threads)]
    for model, extra in ((f32, []), (gguf, ["--kl-divergence"])):
        done = subprocess.run(
            [*common, "-m", str(model), "--kl-divergence-base", str(base), *extra],
            capture_output=True, text=True, errors="replace", timeout=1800,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"llama-perplexity failed: {(done.stderr or done.stdout).strip()[-200:]}")
    return _parse_kld(done.stdout + done.stderr)


def llama_greedy(completion: Path, gguf: Path, loaded: Any, prompts: list[str], max_new: int, threads: int) -> list[str]:
    """llama-completion's greedy replies to the chat-formatted prompts (the same prompt tokens as ours)."""
    out = []
    for prompt in prompts:
        text = loaded.tokenizer.decode(loaded.build_prompt([{"role": "user", "content": prompt}]))
        done = subprocess.run(
            [str(completion), "-m", str(gguf), "-p", text, "-n", str(max_new), "--temp", "0", "-no-cnv",
             "--no-display-prompt", "--no-escape", "-t", str(threads), "-c", "2048"],
            capture_output=True, text=True, errors="replace", timeout=600,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"llama-completion failed: {(done.stderr or done.stdout).strip()[-200:]}")
        out.append(done.stdout)
    return out


# ---- the command ------------------------------------------------------------------------------------------------------
def run_fidelity(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    from medusa_chat.bench.peer import model_gguf
    from medusa_chat.model.sources.loading import load_model

    text = fixed_text()
    prompts = text_prompts(text)[: args.limit] if args.limit else text_prompts(text)
    paths = [p for p in args.fidelity_paths.split(",") if p] if args.fidelity_paths else [args.quant]

    def loader(quant: str) -> Any:
        return lambda: load_model(args.model, args.heads, quant=quant, dtype=args.dtype, device=args.device)

    say("float reference: teacher-forced log-probabilities and greedy replies")
    reference = loader("none")()
    chunks = text_chunks(reference.tokenizer, text)
    ref_logprobs = list(scored_logprobs(reference, chunks))  # once, for every path
    ref_replies = greedy_replies(reference, prompts, args.max_new_tokens)
    rows: dict[str, Any] = {}
    for quant in paths:
        say(f"path {quant}")
        model = loader(quant)()
        tf = compare(ref_logprobs, list(scored_logprobs(model, chunks)))
        rows[f"medusa-chat {model.quant}"] = {
            "teacher_forced": tf.as_dict(),
            "greedy": agreement(greedy_replies(model, prompts, args.max_new_tokens), ref_replies),
        }
        del model
    scored = sum(r.shape[0] for r in ref_logprobs)
    doc: dict[str, Any] = {"text_tokens_scored": scored, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    perplexity, completion = llama_tools(getattr(args, "llamacpp_bench", None))
    gguf = model_gguf(reference)
    if gguf is None or perplexity is None or completion is None:
        doc["llamacpp_note"] = "llama.cpp skipped: " + (
            "the model is not a GGUF" if gguf is None else "no llama-perplexity/llama-completion beside llama-bench"
        )
    else:
        say("llama.cpp on the same text and prompts")
        threads = torch.get_num_threads()
        tf_llama = llama_teacher_forced(perplexity, gguf, text, threads)
        replies = llama_greedy(completion, gguf, reference, prompts, args.max_new_tokens, threads)
        rows[f"llama.cpp {gguf.name}"] = {
            "teacher_forced": {**tf_llama, "tokens": doc["text_tokens_scored"]},
            "greedy": agreement(replies, ref_replies),
        }
    doc["paths"] = rows
    return doc


def print_fidelity(console: Any, doc: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"Fidelity to the float model ({doc['text_tokens_scored']} teacher-forced tokens, "
                        f"{doc['prompts']} greedy replies of <= {doc['max_new_tokens']} tokens)")  # fmt: skip
    for col in ("path", "top-1", "KL nats/token", "KL p99", "greedy agreement (median chars)", "identical"):
        table.add_column(col)
    for name, row in doc["paths"].items():
        tf, gr = row["teacher_forced"], row["greedy"]
        p99 = f"{tf['p99_kl']:.4f}" if tf.get("p99_kl") is not None else "-"
        table.add_row(name, f"{tf['top1'] * 100:.1f}%", f"{tf['mean_kl']:.5f}", p99, f"{gr['median_chars']:.1f}",
                      f"{gr['identical']}/{len(gr['chars'])}")  # fmt: skip
    console.print(table)
    if doc.get("llamacpp_note"):
        console.print(f"[dim]{doc['llamacpp_note']}[/dim]")


def fidelity_main(args: argparse.Namespace) -> int:
    from rich.console import Console

    out, err = Console(), Console(stderr=True)
    doc = run_fidelity(args, lambda m: err.print(f"[dim]{m}[/dim]"))
    print_fidelity(out, doc)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, ensure_ascii=False))
    return 0


__all__ = ["agreement", "fidelity_main", "run_fidelity", "text_prompts", "write_float_gguf"]

