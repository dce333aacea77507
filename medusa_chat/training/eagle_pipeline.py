"""An EAGLE draft as one kind of the training pipeline (pipeline.train_and_save), as `train-heads --heads-format
eagle / eagle3` runs it: train (train_eagle.py), round to fp16, evaluate on the held-out prompts, and write the
Hub layout with its accuracy and fitted tree.

Evaluation (`evaluate_eagle`): the training's unroll on held-out samples gives, for every decoding step's root,
the rank of the true token at each depth with the draft fed its own outputs: per-depth top-1/top-5, conditional
chain accuracy, and the joint rank-tuple table fit_tree grows static trees from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
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
from medusa_chat.training.evaluate import JOINT_TOP, MAX_RANK, joint_path_probs
from medusa_chat.training.loop import RunOptions
from medusa_chat.training.positions import PositionData
from medusa_chat.training.store import Log
from medusa_chat.training.teacher import eagle_teacher
from medusa_chat.training.train_eagle import EagleSettings, make_batches, train_eagle
from medusa_chat.training.train_heads import draft_vocabulary

EAGLE_FILE = "model.safetensors"
EVAL_BATCH_TOKENS = 1024  # full-vocabulary logits of an evaluation batch: 200 MB at 49k tokens


@torch.no_grad()
def evaluate_eagle(
    draft: EagleDraft,
    lm_weight: torch.Tensor,
    embed_weight: torch.Tensor,
    data: EagleData,
    device: torch.device,
    depth: int = 5,
) -> dict[str, Any]:
    """Held-out accuracy of the draft fed its own outputs, in fp32 (as it runs on a CPU), per decoding step's
    root: the rank of the true token at depths 1 .. `depth` given the true tokens before it. Returns per-depth
    top1/top5/rank_acc, `chain_top1_conditional` (depth d right given depths < d right) and `joint` (rank-tuple
    prefixes' frequencies: a static tree node's greedy acceptance probability, as evaluate.evaluate_heads)."""
    max_rank, batch_tokens = MAX_RANK, EVAL_BATCH_TOKENS
    was = draft.training
    draft.eval().to(device).float()
    lm_w = lm_weight.detach().to(device).float()
    embed = embed_weight.detach().to(device).float()
    vocab = draft.vocab_map()
    rank_rows = []
    for idx in make_batches(data, batch_tokens, 0):
        feats, nxt, tgt, use = data.batch(idx, device)[:4]
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
        "joint": joint_path_probs(steps, max_rank, JOINT_TOP),
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


@dataclass
class EagleKind:
    """An EAGLE-1 draft for `backbone` (with `draft_vocab`: EAGLE-3 over that many of the most frequent reply
    tokens, on `data` cached with EAGLE-3's taps), trained on all but `holdout` of the prompts and evaluated to
    `eval_depth` on those. An EAGLE-1 draft also writes its `eagle1_draft_vocab` most frequent reply tokens
    (draft_vocab.safetensors, where the vocabulary is larger), which the C drafter guesses among.
    `init_from`: a trained draft of the same kind and shape to continue from (`warm_start_eagle`); an EAGLE-3
    draft keeps its draft vocabulary, `draft_vocab` is then its size. `teacher_hidden`: the hidden-state cache of
    the same samples, from which an EAGLE-3 draft with `settings.teacher_weight` learns the backbone's
    distribution (its `teacher_top` likeliest tokens; teacher.eagle_teacher)."""

    backbone: Any
    data: EagleData
    settings: EagleSettings
    holdout: float = 0.03
    eval_depth: int = 5
    draft_vocab: int | None = None
    eagle1_draft_vocab: int = EAGLE1_DRAFT_VOCAB
    init_from: EagleDraft | None = None
    teacher_hidden: PositionData | None = None
    teacher_top: int = 8
    tree_words = "static tree"

    @property
    def depth(self) -> int:
        return self.eval_depth

    def build(self, base_model: str, log: Log) -> None:
        settings, init_from = self.settings, self.init_from
        settings.check()
        # a sample with no trained pair (a later turn whose context was too long got an empty reply) teaches nothing
        splits = self.data.split(self.holdout)
        self.train_data, self.held = train, _ = tuple(d.select(d.lengths > d.first_pair) for d in splits)
        self.lm_weight = self.backbone.get_output_embeddings().weight.detach()
        self.embed_weight = self.backbone.get_input_embeddings().weight.detach()
        ids = None
        if init_from is not None and init_from.version == 3:  # its own vocabulary: its head's rows stay those
            ids = torch.nonzero(init_from.t2d).flatten()
            self.draft_vocab = len(ids)
        elif self.draft_vocab:
            ids = draft_vocabulary(train, self.draft_vocab, self.lm_weight.shape[0])  # type: ignore[arg-type]
        self.config = draft_config(self.backbone.config, base_model, self.draft_vocab)
        self.model = new_draft(self.config, settings.seed, self.lm_weight, ids)
        if init_from is not None:
            warm_start_eagle(self.model, init_from)
        if settings.teacher_weight > 0:
            self.train_data = self._taught(train, log)
        what = f"EAGLE-3 ({self.draft_vocab}-token draft vocabulary)" if self.draft_vocab else "EAGLE-1"
        self.n_params = sum(p.numel() for p in self.model.parameters())
        log(
            f"training an {what} draft ({self.n_params / 1e6:.2f} M parameters, {2 * self.n_params / 1e6:.1f} MB "
            f"fp16) on {len(train)} samples ({train.positions} positions), unroll {settings.unroll}, "
            f"{settings.epochs} epochs" + (" from a trained draft" if init_from is not None else "")
        )

    def _taught(self, train: EagleData, log: Log) -> EagleData:
        """The training rows with the backbone's distribution over the draft vocabulary (fp32: the ties decide)."""
        vocab = self.model.vocab_map()
        if vocab is None or self.teacher_hidden is None:
            raise ValueError("a teacher trains an EAGLE-3 draft, from the hidden-state cache of its samples")
        t0 = time.time()
        projection = self.lm_weight[vocab.to(self.lm_weight.device)].float()
        teacher, has = eagle_teacher(train, self.teacher_hidden, projection, self.teacher_top)
        log(
            f"teacher: the backbone's top {self.teacher_top} at {int(has.sum())} of {train.positions} trained "
            f"positions ({time.time() - t0:.0f}s)"
        )
        return train.with_teacher(teacher)

    def train(self, run: RunOptions) -> Any:
        held = self.held if len(self.held) else None
        return train_eagle(self.model, self.lm_weight, self.embed_weight, self.train_data, self.settings, run, held)

    def save(self, out_dir: Path, base_model: str) -> dict[str, Any]:
        del base_model  # (in the config since `build`)
        save_draft(self.model, self.config, out_dir)
        if not self.draft_vocab and self.eagle1_draft_vocab < self.lm_weight.shape[0]:
            # EAGLE-1 projects with the backbone's whole lm_head; on a CPU the C drafter reads only these rows of
            # it (native_eagle.py), so they are the reply tokens this draft was trained on, most frequent first
            from medusa_chat.model.sources.heads_files import DRAFT_VOCAB_FILE, write_draft_vocab

            vocab = self.lm_weight.shape[0]
            ids = draft_vocabulary(self.train_data, self.eagle1_draft_vocab, vocab)  # type: ignore[arg-type]
            write_draft_vocab(out_dir / DRAFT_VOCAB_FILE, ids)
        return self.config

    def report(self) -> dict[str, Any]:
        train, held = self.train_data, self.held
        return {
            "heads": {
                "format": self.model.format,
                "layers": 1,
                "parameters": self.n_params,
                "file_mb": round(2 * self.n_params / 1e6, 3),
            },
            "data": {
                "train_samples": len(train),
                "train_positions": train.positions,
                "heldout_samples": len(held),
                "heldout_positions": held.positions,
            },
        }

    def has_heldout(self) -> bool:
        return bool(len(self.held))

    def evaluate(self, device: torch.device) -> dict[str, Any]:
        return evaluate_eagle(self.model, self.lm_weight, self.embed_weight, self.held, device, self.eval_depth)

    def heldout_line(self, ev: dict[str, Any], seconds: float) -> str:
        return (
            f"held-out ({ev['positions']} positions, {seconds:.0f}s): top1 {ev['top1']} top5 {ev['top5']} "
            f"chain {ev['chain_top1_conditional']}"
        )
