"""The options of `medusa-chat train-heads` and `medusa-chat fit-tree` (training/cli.py runs them)."""

from __future__ import annotations

import argparse
from typing import Any

from medusa_chat.training.stages import add_stage_args


class _Adder:
    """Adds options to a group unless the parser already has them: medusa_chat.cli gives every model command
    --model/--device/--heads itself, with compatible meanings."""

    def __init__(self, parser: argparse.ArgumentParser, title: str) -> None:
        self.parser, self.group = parser, parser.add_argument_group(title)

    def add_argument(self, *names: str, **kw: Any) -> None:
        if not any(n in self.parser._option_string_actions for n in names):
            self.group.add_argument(*names, **kw)


def add_train_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = _Adder(parser, "data (self-distillation)")
    g.add_argument(
        "--model", default="smollm2-135m", help="model folder, Hub id, or 'smollm2-135m' (embedded)"
    )
    g.add_argument("--prompts", metavar="FILE", help="jsonl of prompts ('prompt' or 'turns'[0] per line)")
    g.add_argument(
        "--magpie",
        type=int,
        default=2000,
        metavar="N",
        help="self-generated (Magpie-style) prompts to collect (default 2000; 0 = none)",
    )
    g.add_argument(
        "--opener-frac",
        type=float,
        default=0.5,
        metavar="F",
        help="share of Magpie user turns started from a task opener ('Write a', 'Explain', ...) for more "
        "varied requests (default 0.5; 0 = plain Magpie)",
    )
    g.add_argument("--max-new-tokens", type=int, default=160, help="reply length limit (default 160)")
    g.add_argument(
        "--generator",
        choices=["hf", "engine"],
        default="hf",
        help="who answers: hf = batched transformers generate on the float model (default); engine = the app's "
        "own engine with no flags, one reply at a time (its default numeric path: the tokens the heads meet "
        "at run time; faster per CPU-second on a small CPU)",
    )
    g.add_argument("--batch-size", type=int, default=None, help="generation batch (default 64 CPU, 512 CUDA)")
    g.add_argument(
        "--max-tokens", type=int, default=None, help="stop generating data at this many reply tokens"
    )
    g.add_argument(
        "--shard-size",
        type=int,
        default=None,
        metavar="N",
        help="prompts per data shard, the unit of resumption (default 256 CPU, 1024 CUDA; a conversation's "
        "turns always share a shard)",
    )
    g.add_argument("--minutes", type=float, default=None, help="time budget for data generation (resumable; 0: none, e.g. to --export-data a store)")
    g.add_argument(
        "--import-data",
        metavar="NPZ[:N][,NPZ[:N]...]",
        default=None,
        help="start from distilled data exported by other runs (--export-data, benchmarks/gpu_train_heads.py): "
        "several files in a row, each whole or its first N samples (e.g. ShareGPT replies beside Magpie ones)",
    )
    g.add_argument(
        "--import-select",
        metavar="RULE",
        default=None,
        help="keep only the imported prompts that meet every condition of RULE: first-turns, max-chars=N, "
        "no-code (e.g. 'first-turns,max-chars=400,no-code': short single questions)",
    )
    g.add_argument(
        "--export-data",
        metavar="NPZ",
        default=None,
        help="after the data stage, write the store's replies to one compressed file for --import-data",
    )
    g = _Adder(parser, "heads training")
    g.add_argument(
        "--heads-format",
        choices=["v1", "v2", "hydra", "eagle", "eagle3"],
        default="v2",
        help="v2: shared lm_head, small files (default); v1: a vocab projection per head; hydra: v2 heads "
        "that also see the draft tokens before their target (this project's format, more tokens per step); "
        "eagle: an EAGLE-1 draft (one decoder layer over the backbone's features, SafeAILab's Hub layout); "
        "eagle3: an EAGLE-3 draft (three layers' features, its own head over --draft-vocab tokens)",
    )
    g.add_argument(
        "--unroll",
        type=int,
        default=3,
        metavar="N",
        help="eagle: training-time test steps, the draft fed its own outputs (default 3; 1 = teacher forcing)",
    )
    g.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        metavar="N",
        help="hydra, eagle3: guess among the N most frequent reply tokens (default 8192)",
    )
    g.add_argument(
        "--init-from",
        metavar="DIR",
        default=None,
        help="warm-start from trained heads of the same shape (e.g. v2 heads -> hydra; an EAGLE draft of the "
        "same format: the shipped one, trained further)",
    )
    g.add_argument(
        "--teacher-weight",
        type=float,
        default=0.0,
        metavar="A",
        help="Medusa/Hydra heads and EAGLE-3 drafts: train share A of the loss against the backbone's own "
        "distribution of each token instead of the stored token (Hydra++'s teacher loss; EAGLE-3's reference "
        "trains on that distribution alone; an EAGLE-3 run caches the hidden states for it too; 1: the teacher "
        "only; default 0)",
    )
    g.add_argument(
        "--teacher-top",
        type=int,
        default=8,
        metavar="N",
        help="the teacher's N likeliest tokens kept per position, renormalised (default 8)",
    )
    g.add_argument("--num-heads", type=int, default=4)
    g.add_argument("--num-layers", type=int, default=1, help="ResBlocks per head")
    g.add_argument("--epochs", type=float, default=None, help="passes over the data (default 2; eagle: 4)")
    g.add_argument(
        "--train-batch-size",
        type=int,
        default=None,
        help="positions per step (256 CPU, 4096 CUDA; eagle: pairs per batch, padding included, 4096)",
    )
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument(
        "--train-minutes",
        type=float,
        default=None,
        help="time budget of the train stage from its start, the hidden-state or feature caching included "
        "(resumable with --resume)",
    )
    g.add_argument("--holdout", type=float, default=0.03, help="fraction of prompts held out for accuracy")
    g.add_argument("--bf16", choices=["auto", "on", "off"], default="auto", help="bf16 autocast for training")
    g.add_argument("--tree-budget", type=int, default=64, help="nodes of the fitted tree (root included)")
    g = _Adder(parser, "run")
    g.add_argument("--out", default="medusa-heads", help="output folder (published Hub layout)")
    g.add_argument("--work", default=None, help="working folder (default <out>/work)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    g.add_argument(
        "--resume", action="store_true", help="continue an interrupted run in the same --out/--work"
    )
    g.add_argument(
        "--stage",
        choices=["all", "prompts", "data", "train", "evaluate"],
        default="all",
        help="prompts: real prompt files from ShareGPT (--sharegpt); data: only generate data; train: only "
        "train on the data already there; evaluate: score --heads on the replies in --work",
    )
    g.add_argument("--seed", type=int, default=0)
    add_stage_args(parser, _Adder)
    return parser


def add_fit_tree_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = _Adder(parser, "fit-tree")
    g.add_argument("--heads", help="heads folder with accuracy.json (from train-heads)")
    g.add_argument("--budget", type=int, default=64, help="tree nodes, root included (default 64)")
    g.add_argument(
        "--independent",
        action="store_true",
        help="multiply per-head accuracies instead of using the measured joint hits",
    )
    return parser
