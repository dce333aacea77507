"""Train the shipped Hydra heads for the embedded model on a CPU, from hidden states already cached.

The run behind `assets/smollm2-135m` (see assets/README.md for the numbers):

    python benchmarks/cpu_train_hydra.py --cache runs/hydra/hidden:0.03 --cache runs/cpu-openers/work/hidden:0.05 \
        --init-from runs/hydra/pilot-heads --out runs/hydra/heads --minutes 60

Each `--cache DIR:FRAC` is a folder of hidden-state shards written by `cache_hidden_states` (train-heads'
`work/hidden`), split by prompt with `FRAC` held out. `--eval-only-cache` adds data that is only evaluated
(e.g. the backbone's replies to benchmark prompts, to diagnose transfer): never trained on, never used to fit
the tree. Everything else is `train_and_save`, the pipeline behind `medusa-chat train-heads`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from medusa_chat.model.sources.embedded import embedded_model_dir
from medusa_chat.model.sources.heads_files import load_heads_file
from medusa_chat.training.distill import make_logger
from medusa_chat.training.evaluate import evaluate_heads
from medusa_chat.training.fit_tree import expected_accept_length
from medusa_chat.training.loop import RunOptions
from medusa_chat.training.pipeline import HeadsKind, SaveOptions, train_and_save
from medusa_chat.training.positions import PositionData, heldout_mask, load_cache
from medusa_chat.training.train_heads import TrainSettings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", action="append", required=True, metavar="DIR:FRAC")
    ap.add_argument(
        "--eval-only-cache", metavar="FILE", default=None, help="a PositionData .pt, evaluated only"
    )
    ap.add_argument("--init-from", default="assets/smollm2-135m")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-heads", type=int, default=5)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--minutes", type=float, default=None, help="training time budget (the schedule shrinks)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument(
        "--keep-draft-vocab",
        action="store_true",
        help="fine-tuning: keep --init-from's draft vocabulary instead of counting one from these caches",
    )
    ap.add_argument("--weight-decay", type=float, default=None)
    ap.add_argument("--warmup-frac", type=float, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = make_logger(file=out / "training_log.txt")
    # the plain fp32 backbone (no CPU kernels swapped in): its lm_head and embeddings are what heads train on
    backbone = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32).eval()
    train_parts, held_parts = [], []
    for spec in args.cache:
        folder, _, frac = spec.rpartition(":")
        data = load_cache(sorted(Path(folder).glob("shard-*.pt")))
        mask = heldout_mask(data.sample, float(frac))
        train_parts.append(data.subset(~mask))
        held_parts.append(data.subset(mask))
        log(f"{folder}: {len(data)} positions, {int(mask.sum())} held out")
    train, held = PositionData.cat(train_parts), PositionData.cat(held_parts)
    init = load_heads_file(Path(args.init_from))[0].float()
    settings = TrainSettings(
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        heads_format="hydra",
        draft_vocab_size=args.draft_vocab,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        bf16=None,
    )
    if args.weight_decay is not None:
        settings.weight_decay = args.weight_decay
    if args.warmup_frac is not None:
        settings.warmup_frac = args.warmup_frac
    embed = backbone.get_input_embeddings().weight.detach()
    t0 = time.time()
    deadline = time.time() + 60 * args.minutes if args.minutes else None
    options = RunOptions(torch.device("cpu"), out / "checkpoint.pt", args.resume, deadline, log)
    vocab = init.draft_vocab.long() if args.keep_draft_vocab else None
    kind = HeadsKind(backbone.get_output_embeddings(), train, held, settings, embed, init, vocab)
    extra = {"init_from": args.init_from, "caches": args.cache}
    report = train_and_save(kind, SaveOptions(out, "HuggingFaceTB/SmolLM2-135M-Instruct", options, extra_report=extra))
    log(f"trained and saved in {time.time() - t0:.0f} s")
    if args.eval_only_cache:
        d = torch.load(args.eval_only_cache, weights_only=True)
        data = PositionData(d["hidden"], d["targets"], d["sample"])
        heads = load_heads_file(out)[0].float()
        ev = evaluate_heads(
            heads, backbone.get_output_embeddings().weight, data, torch.device("cpu"), embed_weight=embed
        )
        tree = json.loads((out / "tree.json").read_text())
        est = {n: round(expected_accept_length(tree["paths"][: n - 1], ev), 3) for n in (8, 16, 32, 64)}
        log(f"eval-only data: top1 {ev['top1']} top5 {ev['top5']}; tokens/step with the fitted tree {est}")
        report["eval_only"] = {
            "file": args.eval_only_cache,
            "top1": ev["top1"],
            "top5": ev["top5"],
            "est": est,
        }
        (out / "eval_only.json").write_text(json.dumps(report["eval_only"], indent=1))
    (out / "checkpoint.pt").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
