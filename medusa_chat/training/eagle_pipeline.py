"""An EAGLE draft end to end, as `train-heads --heads-format eagle / eagle3` runs it: train (train_eagle.py),
round to fp16, evaluate on the held-out prompts, and write the Hub layout with its accuracy and fitted tree.

Evaluation (`evaluate_eagle`): the training's unroll on held-out samples gives, for every decoding step's root,
the rank of the true token at each depth with the draft fed its own outputs: per-depth top-1/top-5, conditional
chain accuracy, and the joint rank-tuple table fit_tree grows static trees from.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from medusa_chat.atomic import atomic_write_bytes, atomic_write_json
from medusa_chat.model.forward.eagle import EagleDraft
from medusa_chat.model.forward.native_eagle import EAGLE1_DRAFT_VOCAB
from medusa_chat.training.eagle_data import EagleData
from medusa_chat.training.eagle_model import (
    draft_config,
    draft_logits,
    new_draft,
    unrolled_outputs,
    warm_start_eagle,
)
from medusa_chat.training.evaluate import MAX_RANK, joint_path_probs
from medusa_chat.training.store import Log
from medusa_chat.training.train_eagle import EagleSettings, make_batches, train_eagle

EAGLE_FILE = "model.safetensors"


@torch.no_grad()
def evaluate_eagle(
    draft: EagleDraft,
    lm_weight: torch.Tensor,
    embed_weight: torch.Tensor,
    data: EagleData,
    device: torch.device,
    depth: int = 5,
    max_rank: int = MAX_RANK,
    batch_tokens: int = 1024,  # full-vocabulary logits of a batch: 200 MB at 49k tokens
    joint_top: int = 2048,
) -> dict[str, Any]:
    """Held-out accuracy of the draft fed its own outputs, in fp32 (as it runs on a CPU), per decoding step's
    root: the rank of the true token at depths 1 .. `depth` given the true tokens before it. Returns per-depth
    top1/top5/rank_acc, `chain_top1_conditional` (depth d right given depths < d right) and `joint` (rank-tuple
    prefixes' frequencies: a static tree node's greedy acceptance probability, as evaluate.evaluate_heads)."""
    was = draft.training
    draft.eval().to(device).float()
    lm_w = lm_weight.detach().to(device).float()
    embed = embed_weight.detach().to(device).float()
    vocab = draft.vocab_map()
    rank_rows = []
    for idx in make_batches(data, batch_tokens, 0):
        feats, nxt, tgt, use = data.batch(idx, device)
        outs = unrolled_outputs(draft, feats, F.embedding(nxt, embed), depth)
        b, n = use.shape
        ranks = torch.full((b, n, depth), max_rank, dtype=torch.long, device=device)
        for j, out in enumerate(outs):
            # step j at row s is depth j + 1 of the chain rooted at pair s - j: move it back to row s - j
            top = draft_logits(draft, out, lm_w).topk(max_rank, dim=-1).indices  # [B, L, R]
            if vocab is not None:
                top = vocab[top]  # EAGLE-3: draft indices -> token ids
            hit = top == tgt[..., :1]
            rank = torch.where(hit.any(-1), hit.float().argmax(-1), max_rank)
            rank = torch.where(tgt[..., 0] >= 0, rank, max_rank)  # past the reply's end: nothing to accept
            if j < n:
                ranks[:, : n - j, j] = rank[:, j:]
        rank_rows.append(ranks[use].cpu())
    draft.train(was)
    if not rank_rows:
        raise ValueError("no held-out samples to evaluate")
    steps = torch.cat(rank_rows)
    top1 = [round(float((steps[:, d] == 0).float().mean()), 4) for d in range(depth)]
    top5 = [round(float((steps[:, d] < 5).float().mean()), 4) for d in range(depth)]
    rank_acc = [
        [round(float((steps[:, d] == r).float().mean()), 5) for r in range(max_rank)] for d in range(depth)
    ]
    chain, alive = [], torch.ones(steps.shape[0], dtype=torch.bool)
    for d in range(depth):
        ok = alive & (steps[:, d] == 0)
        chain.append(round(float(ok.sum()) / max(1, int(alive.sum())), 4))
        alive = ok
    return {
        "positions": int(steps.shape[0]),
        "depths": depth,
        "top1": top1,
        "top5": top5,
        "rank_acc": rank_acc,
        "chain_top1_conditional": chain,
        "joint": joint_path_probs(steps, max_rank, joint_top),
    }


def save_draft(draft: EagleDraft, config: dict[str, Any], out_dir: Path) -> None:
    """`config.json` + `model.safetensors` (fp16, the published key names; the embedding is the backbone's and is
    left out, as the loader drops it anyway)."""
    from safetensors.torch import save

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to("cpu", torch.float16 if v.is_floating_point() else v.dtype).contiguous()
        for k, v in draft.state_dict().items()
    }
    # in memory, then the one atomic writer: a readable file (safetensors' save_file would leave it 0600)
    atomic_write_bytes(out_dir / EAGLE_FILE, save(tensors, metadata={"format": "pt"}))
    atomic_write_json(out_dir / "config.json", config)


def train_and_save_eagle(
    backbone: Any,
    data: EagleData,
    settings: EagleSettings,
    out_dir: Path,
    base_model: str,
    device: torch.device,
    holdout: float = 0.03,
    checkpoint: Path | None = None,
    resume: bool = False,
    deadline: float | None = None,
    tree_budget: int = 64,
    eval_depth: int = 5,
    log: Log = print,
    extra_report: dict[str, Any] | None = None,
    stop_after_steps: int | None = None,
    draft_vocab: int | None = None,
    eagle1_draft_vocab: int = EAGLE1_DRAFT_VOCAB,
    init_from: EagleDraft | None = None,
) -> dict[str, Any]:
    """Train an EAGLE-1 draft (with `draft_vocab`: EAGLE-3 over that many of the most frequent reply tokens, on
    `data` cached with EAGLE-3's taps) for `backbone`, round it to fp16, evaluate it on the held-out prompts,
    write the Hub layout + accuracy.json + tree.json (a static tree fitted to the draft's measured chain ranks);
    an EAGLE-1 draft also its `eagle1_draft_vocab` most frequent reply tokens (draft_vocab.safetensors, where the
    vocabulary is larger), which the C drafter guesses among.
    `init_from`: a trained draft of the same kind and shape to continue from (`warm_start_eagle`); an EAGLE-3
    draft keeps its draft vocabulary, `draft_vocab` is then its size."""
    from medusa_chat.training.fit_tree import fit_tree, size_summary
    from medusa_chat.training.pipeline import round_heads_

    settings.check()
    train, held = data.split(holdout)
    lm_weight = backbone.get_output_embeddings().weight.detach()
    embed_weight = backbone.get_input_embeddings().weight.detach()
    ids = None
    if init_from is not None and init_from.version == 3:  # its own vocabulary: its head's rows stay those tokens
        ids = torch.nonzero(init_from.t2d).flatten()
        draft_vocab = len(ids)
    elif draft_vocab:
        from medusa_chat.training.train_heads import draft_vocabulary

        ids = draft_vocabulary(train, draft_vocab, lm_weight.shape[0])  # type: ignore[arg-type]
    config = draft_config(backbone.config, base_model, draft_vocab)
    draft = new_draft(config, settings.seed, lm_weight, ids)
    if init_from is not None:
        warm_start_eagle(draft, init_from)
    kind = f"EAGLE-3 ({draft_vocab}-token draft vocabulary)" if draft_vocab else "EAGLE-1"
    n_params = sum(p.numel() for p in draft.parameters())
    log(
        f"training an {kind} draft ({n_params / 1e6:.2f} M parameters, {2 * n_params / 1e6:.1f} MB fp16) on "
        f"{len(train)} samples ({train.positions} positions), unroll {settings.unroll}, {settings.epochs} epochs"
        + (" from a trained draft" if init_from is not None else "")
    )
    result = train_eagle(
        draft,
        lm_weight,
        embed_weight,
        train,
        settings,
        device,
        checkpoint=checkpoint,
        resume=resume,
        heldout=held if len(held) else None,
        deadline=deadline,
        log=log,
        stop_after_steps=stop_after_steps,
    )
    draft.cpu().float()
    round_heads_(draft)  # evaluate exactly the fp16 weights that are shipped
    save_draft(draft, config, out_dir)
    if not draft_vocab and eagle1_draft_vocab < lm_weight.shape[0]:
        # EAGLE-1 projects with the backbone's whole lm_head; on a CPU the C drafter reads only these rows of it
        # (native_eagle.py), so they are the reply tokens this draft was trained on, most frequent first
        from safetensors.torch import save

        from medusa_chat.model.sources.heads_files import DRAFT_VOCAB_FILE
        from medusa_chat.training.train_heads import draft_vocabulary

        ids = draft_vocabulary(train, eagle1_draft_vocab, lm_weight.shape[0])  # type: ignore[arg-type]
        atomic_write_bytes(out_dir / DRAFT_VOCAB_FILE, save({"draft_vocab": ids.to(torch.int64).contiguous()}))
    report: dict[str, Any] = {
        "heads": {
            "format": draft.format,
            "layers": 1,
            "parameters": n_params,
            "file_mb": round(2 * n_params / 1e6, 3),
        },
        "data": {
            "train_samples": len(train),
            "train_positions": train.positions,
            "heldout_samples": len(held),
            "heldout_positions": held.positions,
        },
        "training": {**asdict(settings), **asdict(result), "seconds": round(result.seconds, 1)},
        **(extra_report or {}),
    }
    if len(held):
        t = time.time()
        ev = evaluate_eagle(draft, lm_weight, embed_weight, held, device, depth=eval_depth)
        report["heldout"] = ev
        tree = fit_tree(report, budget=tree_budget, name=f"{out_dir.name}-fitted")
        atomic_write_json(out_dir / "tree.json", tree)
        report["estimated_tokens_per_step"] = size_summary(tree)
        report["estimated_tokens_per_step_chain"] = round(
            1 + sum(math.prod(ev["chain_top1_conditional"][: i + 1]) for i in range(eval_depth)), 4
        )
        log(
            f"held-out ({ev['positions']} positions, {time.time() - t:.0f}s): top1 {ev['top1']} top5 {ev['top5']} "
            f"chain {ev['chain_top1_conditional']}"
        )
        log(f"estimated tokens/step (greedy, fitted static tree): {report['estimated_tokens_per_step']}")
    atomic_write_json(out_dir / "accuracy.json", report)
    report["config"] = config
    return report
