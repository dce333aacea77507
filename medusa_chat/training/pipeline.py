"""The whole training run after the data, for any draft kind: train the draft, round it to the file's fp16,
save it, evaluate it on held-out data, fit a static tree to what it measured, and write accuracy.json.

The kinds differ in what they build, train, save and measure; `DraftKind` is that difference, and
`train_and_save` the one pipeline around it: `HeadsKind` (Medusa / Hydra heads, here) and `EagleKind`
(EAGLE-1 / EAGLE-3 drafts, eagle_pipeline.py)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from medusa_chat.atomic import atomic_write_bytes, atomic_write_json
from medusa_chat.model.forward.heads import MedusaHeads
from medusa_chat.training.evaluate import evaluate_heads
from medusa_chat.training.loop import RunOptions
from medusa_chat.training.positions import PositionData
from medusa_chat.training.store import Log
from medusa_chat.training.train_heads import (
    TrainSettings,
    draft_vocabulary,
    heads_file_bytes,
    new_heads,
    train_heads,
    warm_start_,
)

HEADS_FILE = "medusa_lm_head.safetensors"


def round_heads_(heads: MedusaHeads, dtype: torch.dtype = torch.float16) -> MedusaHeads:
    """Round the weights to the file dtype in place, so what we evaluate is exactly what we ship."""
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(p.to(dtype).to(p.dtype))
    return heads


def save_heads(
    heads: MedusaHeads, out_dir: Path, base_model: str, dtype: torch.dtype = torch.float16
) -> dict[str, Any]:
    """Write `config.json` + `medusa_lm_head.safetensors` (published keys, fp16) into `out_dir`."""
    from safetensors.torch import save

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to("cpu", dtype if v.is_floating_point() else torch.int32).contiguous()
        for k, v in heads.state_dict().items()
    }
    # Serialised in memory and written by the one atomic writer (a file readable like any other: the folder is
    # meant to be shared, where safetensors' own save_file would leave it 0600).
    atomic_write_bytes(out_dir / HEADS_FILE, save(tensors, metadata={"format": "pt"}))
    cfg = heads.config_dict(base_model)
    atomic_write_json(out_dir / "config.json", cfg)
    return cfg


@dataclass
class SaveOptions:
    """Where the pipeline writes and how it runs: the folder, the base model its config names, the training
    run's options, the node budget of the fitted tree, and sections added to accuracy.json (the data's)."""

    out_dir: Path
    base_model: str
    run: RunOptions
    tree_budget: int = 64
    extra_report: dict[str, Any] | None = None


class DraftKind(Protocol):
    """What one kind of draft does in the pipeline; `model` is the draft once `build` has made it."""

    settings: Any
    model: nn.Module
    depth: int  # the depths its held-out chain accuracy covers
    tree_words: str  # how the log names the fitted tree

    def build(self, base_model: str, log: Log) -> None:
        """Make the draft (warm-started where asked) and say what is trained."""

    def train(self, run: RunOptions) -> Any:
        """Train it in place; the result's fields go to accuracy.json's "training"."""

    def save(self, out_dir: Path, base_model: str) -> dict[str, Any]:
        """Write its published files; returns its config."""

    def report(self) -> dict[str, Any]:
        """accuracy.json's "heads" and "data" sections."""

    def has_heldout(self) -> bool: ...

    def evaluate(self, device: torch.device) -> dict[str, Any]:
        """Held-out accuracies, with `chain_top1_conditional` and the `joint` table fit_tree reads."""

    def heldout_line(self, ev: dict[str, Any], seconds: float) -> str: ...


@dataclass
class HeadsKind:
    """Medusa (v1 / v2) or Hydra heads over cached hidden states. Hydra heads need `embed_weight` (the
    backbone's input embeddings); `init_from` warm-starts from trained heads of the same shape (Medusa v2 heads
    into Hydra: the ResBlocks are copied, the token cell starts at zero, so training starts from exactly the
    Medusa heads' accuracy). `draft_vocab` keeps a given draft vocabulary (e.g. the warm start's, counted on more
    data than a fine-tuning set): Hydra heads guess among it instead of one counted from `train`; Medusa heads
    train against the whole lm_head and it is written beside them (draft_vocab.safetensors: the rows the CPU
    drafter reads)."""

    lm_head: nn.Module
    train_data: PositionData
    heldout: PositionData
    settings: TrainSettings
    embed_weight: torch.Tensor | None = None
    init_from: MedusaHeads | None = None
    draft_vocab: torch.Tensor | None = None
    tree_words = "tree"

    @property
    def depth(self) -> int:
        return self.settings.num_heads

    def build(self, base_model: str, log: Log) -> None:
        del base_model  # (save_heads writes it into the config)
        settings, train = self.settings, self.train_data
        self.weight = self.lm_head.weight.detach()
        vocab, hidden = self.weight.shape
        draft_vocab = self.draft_vocab
        if settings.heads_format != "hydra":
            draft_vocab = None
        elif draft_vocab is None:
            draft_vocab = draft_vocabulary(train, settings.draft_vocab_size, vocab)
        elif len(draft_vocab) != settings.draft_vocab_size:
            raise ValueError(
                f"draft vocabulary of {len(draft_vocab)} tokens, settings say {settings.draft_vocab_size}"
            )
        self.model = new_heads(settings, self.lm_head, hidden, vocab, draft_vocab)
        if self.init_from is not None:
            warm_start_(self.model, self.init_from)
        self.size_mb = heads_file_bytes(settings, hidden, vocab) / 1e6
        log(
            f"training {settings.num_heads} heads x {settings.num_layers} layer(s), {settings.heads_format} "
            f"({self.size_mb:.2f} MB fp16) on {len(train)} positions, {settings.epochs} epochs, batch "
            f"{settings.batch_size}"
        )

    def train(self, run: RunOptions) -> Any:
        held = self.heldout if len(self.heldout) else None
        return train_heads(self.model, self.weight, self.train_data, self.settings, run, held, self.embed_weight)

    def save(self, out_dir: Path, base_model: str) -> dict[str, Any]:
        config = save_heads(self.model, out_dir, base_model)
        if self.settings.heads_format != "hydra" and self.draft_vocab is not None:
            from medusa_chat.model.sources.heads_files import DRAFT_VOCAB_FILE, write_draft_vocab

            write_draft_vocab(out_dir / DRAFT_VOCAB_FILE, self.draft_vocab)
        return config

    def report(self) -> dict[str, Any]:
        s = self.settings
        return {
            "heads": {
                "format": s.heads_format,
                "num_heads": s.num_heads,
                "num_layers": s.num_layers,
                "file_mb": round(self.size_mb, 3),
            },
            "data": {"train_positions": len(self.train_data), "heldout_positions": len(self.heldout)},
        }

    def has_heldout(self) -> bool:
        return bool(len(self.heldout))

    def evaluate(self, device: torch.device) -> dict[str, Any]:
        ev = evaluate_heads(self.model.to(device), self.weight, self.heldout, device, embed_weight=self.embed_weight)
        self.model.cpu()
        return ev

    def heldout_line(self, ev: dict[str, Any], seconds: float) -> str:
        return (
            f"held-out ({len(self.heldout)} positions, {seconds:.0f}s): top1 {ev['top1']} top5 {ev['top5']} "
            f"chain {ev['chain_top1_conditional']} backbone agreement {ev['backbone_agreement']}"
        )


def train_and_save(kind: DraftKind, options: SaveOptions) -> dict[str, Any]:
    """Train one draft and write its published folder + accuracy.json + tree.json (a static tree fitted to the
    held-out accuracies, where there are held-out data). Returns the report with the config added."""
    from medusa_chat.training.fit_tree import fit_tree, size_summary

    run, out_dir = options.run, options.out_dir
    kind.build(options.base_model, run.log)
    result = kind.train(run)
    kind.model.cpu().float()
    round_heads_(kind.model)  # evaluate exactly the fp16 weights that are shipped
    config = kind.save(out_dir, options.base_model)
    report: dict[str, Any] = {
        **kind.report(),
        "training": {**asdict(kind.settings), **asdict(result), "seconds": round(result.seconds, 1)},
        **(options.extra_report or {}),
    }
    if kind.has_heldout():
        t = time.time()
        ev = kind.evaluate(run.device)
        report["heldout"] = ev
        tree = fit_tree(report, budget=options.tree_budget, name=f"{out_dir.name}-fitted")
        atomic_write_json(out_dir / "tree.json", tree)
        report["estimated_tokens_per_step"] = size_summary(tree)
        report["estimated_tokens_per_step_chain"] = round(
            1 + sum(math.prod(ev["chain_top1_conditional"][: i + 1]) for i in range(kind.depth)), 4
        )
        run.log(kind.heldout_line(ev, time.time() - t))
        run.log(f"estimated tokens/step (greedy, fitted {kind.tree_words}): {report['estimated_tokens_per_step']}")
    atomic_write_json(out_dir / "accuracy.json", report)
    report["config"] = config
    return report
