"""The whole training run after the data: train the heads, evaluate them on held-out positions, save them
with their config and accuracy files."""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from medusa_chat.atomic import atomic_write_bytes, atomic_write_json
from medusa_chat.model.forward.heads import MedusaHeads
from medusa_chat.training.evaluate import evaluate_heads
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


def train_and_save(
    lm_head: nn.Module,
    train: PositionData,
    heldout: PositionData,
    settings: TrainSettings,
    out_dir: Path,
    base_model: str,
    device: torch.device,
    checkpoint: Path | None = None,
    resume: bool = False,
    deadline: float | None = None,
    tree_budget: int = 64,
    log: Log = print,
    extra_report: dict[str, Any] | None = None,
    embed_weight: torch.Tensor | None = None,
    init_from: MedusaHeads | None = None,
    draft_vocab: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Train one head configuration and write the published folder + accuracy.json + tree.json.

    Hydra heads need `embed_weight` (the backbone's input embeddings); `init_from` warm-starts from trained
    heads of the same shape (Medusa v2 heads into Hydra: the ResBlocks are copied, the token cell starts at
    zero, so training starts from exactly the Medusa heads' accuracy). `draft_vocab` keeps a given draft
    vocabulary (e.g. the warm start's, counted on more data than a fine-tuning set) instead of counting one
    from `train`."""
    from medusa_chat.training.fit_tree import fit_tree, size_summary

    weight = lm_head.weight.detach()
    vocab, hidden = weight.shape
    if settings.heads_format != "hydra":
        draft_vocab = None
    elif draft_vocab is None:
        draft_vocab = draft_vocabulary(train, settings.draft_vocab_size, vocab)
    elif len(draft_vocab) != settings.draft_vocab_size:
        raise ValueError(
            f"draft vocabulary of {len(draft_vocab)} tokens, settings say {settings.draft_vocab_size}"
        )
    heads = new_heads(settings, lm_head, hidden, vocab, draft_vocab)
    if init_from is not None:
        warm_start_(heads, init_from)
    size_mb = heads_file_bytes(settings, hidden, vocab) / 1e6
    log(
        f"training {settings.num_heads} heads x {settings.num_layers} layer(s), {settings.heads_format} "
        f"({size_mb:.2f} MB fp16) on {len(train)} positions, {settings.epochs} epochs, batch {settings.batch_size}"
    )
    result = train_heads(
        heads,
        weight,
        train,
        settings,
        device,
        checkpoint=checkpoint,
        resume=resume,
        heldout=heldout if len(heldout) else None,
        deadline=deadline,
        log=log,
        embed_weight=embed_weight,
    )
    heads.cpu().float()
    round_heads_(heads)  # evaluate exactly the fp16 weights that are shipped
    cfg = save_heads(heads, out_dir, base_model)
    report: dict[str, Any] = {
        "heads": {
            "format": settings.heads_format,
            "num_heads": settings.num_heads,
            "num_layers": settings.num_layers,
            "file_mb": round(size_mb, 3),
        },
        "data": {"train_positions": len(train), "heldout_positions": len(heldout)},
        "training": {**asdict(settings), **asdict(result), "seconds": round(result.seconds, 1)},
        **(extra_report or {}),
    }
    if len(heldout):
        t = time.time()
        ev = evaluate_heads(heads.to(device), weight, heldout, device, embed_weight=embed_weight)
        heads.cpu()
        report["heldout"] = ev
        tree = fit_tree(report, budget=tree_budget, name=f"{out_dir.name}-fitted")
        atomic_write_json(out_dir / "tree.json", tree)
        report["estimated_tokens_per_step"] = size_summary(tree)
        report["estimated_tokens_per_step_chain"] = round(
            1 + sum(math.prod(ev["chain_top1_conditional"][: i + 1]) for i in range(settings.num_heads)), 4
        )
        log(
            f"held-out ({len(heldout)} positions, {time.time() - t:.0f}s): top1 {ev['top1']} top5 {ev['top5']} "
            f"chain {ev['chain_top1_conditional']} backbone agreement {ev['backbone_agreement']}"
        )
        log(f"estimated tokens/step (greedy, fitted tree): {report['estimated_tokens_per_step']}")
    atomic_write_json(out_dir / "accuracy.json", report)
    report["config"] = cfg
    return report
