"""`medusa-chat train-heads` and `medusa-chat fit-tree`: the entry functions (their options: arguments.py).

The main CLI adds the sub-commands with `add_train_args(parser)` / `add_fit_tree_args(parser)` and calls
`train_main(args)` / `fit_tree_main(args)`; both return a process exit code.

train-heads keeps its working files (distilled data, hidden-state cache, checkpoint, log) in `--work`
(default `<out>/work`), which is never part of the published heads; everything there is resumable.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from medusa_chat.errors import ModelNotFoundError, PromptError
from medusa_chat.training.arguments import add_fit_tree_args, add_train_args
from medusa_chat.training.distill import (
    EMBEDDED_ALIASES,
    DistillSettings,
    base_model_name,
    distill,
    eos_ids,
    load_for_training,
    make_logger,
    read_prompt_file,
)
from medusa_chat.training.loop import RunOptions
from medusa_chat.training.pipeline import HeadsKind, SaveOptions, train_and_save
from medusa_chat.training.positions import cache_hidden_states, conversation_starts, heldout_mask, load_cache
from medusa_chat.training.select import SampleRule
from medusa_chat.training.stages import evaluate_main, keep_cached_shards, prompts_main
from medusa_chat.training.store import DistillStore, Log, export_npz, import_npz
from medusa_chat.training.train_heads import TrainSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Hook for medusa_chat.cli (called with the parser of the sub-command being run)."""
    if parser.prog.split()[-1] == "fit-tree":
        add_fit_tree_args(parser)
    else:
        add_train_args(parser)


def _load(model: str, device: torch.device) -> tuple[Any, Any]:
    path = Path(model).expanduser()
    if model.lower() in EMBEDDED_ALIASES or path.exists():
        return load_for_training(model, device)
    if "/" in model and not model.startswith((".", "/", "~")):  # a Hub id: transformers finds it in the cache
        from transformers import AutoTokenizer

        from medusa_chat.model.sources.backbones import load_backbone

        try:
            tok = AutoTokenizer.from_pretrained(model)
        except OSError as err:
            raise ModelNotFoundError(f"cannot load {model!r}: {err}") from err
        return load_backbone(model, device, torch.float32, "none"), tok
    if "/" in model:
        raise ModelNotFoundError(f"model folder {model} does not exist")
    try:  # a registry alias such as "vicuna-7b": let the loader resolve and fetch it
        from medusa_chat.model.sources.loading import load_model
    except ImportError as err:
        raise ModelNotFoundError(
            f"unknown model {model!r}: give a folder, a Hub id, or 'smollm2-135m'"
        ) from err
    lm = load_model(model, quant="none", dtype="float32", device=str(device))
    return lm.backbone.eval().requires_grad_(False), lm.tokenizer


class _Refused(Exception):
    """A run refused before any work: the message is printed and train-heads exits with 2."""


def _import_select(args: argparse.Namespace) -> SampleRule | None:
    if args.import_select is None:
        return None
    if not args.import_data:
        raise _Refused("--import-select selects among --import-data files: give one")
    try:
        return SampleRule.parse(args.import_select)
    except ValueError as err:
        raise _Refused(f"--import-select: {err}") from err


def train_main(args: argparse.Namespace) -> int:
    device = _training_device(args)
    out = Path(args.out).expanduser()
    work = Path(args.work).expanduser() if args.work else out / "work"
    eagle = args.heads_format in ("eagle", "eagle3")
    if args.stage == "prompts":
        return prompts_main(args, work, make_logger())
    try:
        if (work / "distill" / "manifest.json").exists() and not args.resume and args.stage != "evaluate":
            raise _Refused(f"{work} already holds a run: add --resume to continue it, or choose another --out/--work")
        if not 0.0 <= args.teacher_weight <= 1.0 or args.teacher_top < 1:
            raise _Refused("--teacher-weight is a share from 0 to 1, --teacher-top at least 1")
        if args.heads_format == "eagle" and args.teacher_weight:
            raise _Refused("--teacher-weight trains Medusa or Hydra heads or an EAGLE-3 draft, not an EAGLE-1 draft")
        eagle_settings = _eagle_settings(args) if eagle else None
        select = _import_select(args)
        init_from = _init_from(args, eagle)
    except _Refused as err:
        print(err)
        return 2
    if args.prompts:
        try:
            read_prompt_file(args.prompts)  # fail now, not after loading the model
        except (OSError, ValueError) as err:
            raise PromptError(f"--prompts: {err}") from err
    work.mkdir(parents=True, exist_ok=True)
    log = make_logger(file=work / "train.log")
    model, tok = _load(args.model, device)
    store = DistillStore.open(work / "distill", model=str(args.model))
    if args.import_data and not store.shards:
        import_npz(store, args.import_data, eos=eos_ids(tok, model), select=select)
        log(f"imported {args.import_data}: {len(store.shards)} shards, {store.reply_tokens} reply tokens")
    if args.stage == "evaluate":
        return evaluate_main(args, model, store, work, log)
    t_data = time.time()
    if args.stage in ("all", "data"):
        _distill_data(args, model, tok, store, device, log)
        if args.export_data:
            info = export_npz(store, args.export_data)
            log(f"exported {info['samples']} replies ({info['tokens']} tokens) to {args.export_data}")
        if args.stage == "data":
            return 0
    if args.cached_only and not eagle:
        keep_cached_shards(store, work / "hidden", log)
    if not store.shards:
        log("no distilled data: run without --stage train first")
        return 2
    distill_report = _distill_report(args, store, time.time() - t_data)
    deadline = time.time() + 60 * args.train_minutes if args.train_minutes else None
    stage = _TrainStage(args, model, store, out, work, RunOptions(device, deadline=deadline, log=log))
    extra = {"distill": distill_report}
    if eagle_settings is not None:
        return _train_eagle(stage, eagle_settings, extra, init_from)
    return _train_heads(stage, extra, init_from)


def _training_device(args: argparse.Namespace) -> torch.device:
    """The device (`--device`), with `--threads` and, on CUDA, no TF32 (the fp32 replies and hidden states must
    match what the backbone computes at decode time)."""
    from medusa_chat.model.sources.devices import pick_device

    device = pick_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def _eagle_settings(args: argparse.Namespace) -> Any:
    """An EAGLE run's settings from the flags, checked now (not after the data)."""
    from medusa_chat.training.train_eagle import EagleSettings

    settings = EagleSettings(
        unroll=args.unroll,
        epochs=args.epochs or 4.0,
        batch_tokens=args.train_batch_size or 4096,
        lr=args.lr,
        seed=args.seed,
        bf16={"auto": None, "on": True, "off": False}[args.bf16],
        teacher_weight=args.teacher_weight,
    )
    try:
        settings.check()
    except ValueError as err:
        raise _Refused(f"train-heads: {err}") from None
    return settings


def _init_from(args: argparse.Namespace, eagle: bool) -> Any:
    """The heads or draft `--init-from` starts from (None without it), read now: bad folders say why, and a
    format that cannot start this run is refused."""
    if not args.init_from:
        return None
    from medusa_chat.model.sources.heads_files import load_heads_file

    init_from = load_heads_file(Path(args.init_from).expanduser())[0]
    given = getattr(init_from, "format", "heads")
    if eagle != (given in ("eagle", "eagle3")) or (eagle and given != args.heads_format):
        what = "an EAGLE draft" if given in ("eagle", "eagle3") else "heads"
        raise _Refused(f"--init-from {args.init_from} holds {what} of format {given}: it cannot start a "
                       f"--heads-format {args.heads_format} run")  # fmt: skip
    return init_from


def _distill_data(
    args: argparse.Namespace, model: Any, tok: Any, store: DistillStore, device: torch.device, log: Log
) -> None:
    """The data stage: self-distilled replies added to `store` (within `--minutes`)."""
    cuda = device.type == "cuda"
    ds = DistillSettings(
        magpie=args.magpie,
        prompt_file=args.prompts,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size or (512 if cuda else 64),
        magpie_batch=args.batch_size or (512 if cuda else 64),
        shard_size=args.shard_size or (1024 if cuda else 256),
        seed=args.seed,
        max_reply_tokens=args.max_tokens,
        opener_frac=args.opener_frac,
    )
    if args.minutes is not None and args.minutes <= 0:
        log(f"data: {len(store.shards)} shards, {store.reply_tokens} reply tokens; --minutes 0: none added")
        return
    deadline = time.time() + 60 * args.minutes if args.minutes else None
    log(f"data: {len(store.prompts)} prompts, {store.reply_tokens} reply tokens so far; generating on {device}")
    replies = None
    if args.generator == "engine":
        from medusa_chat.training.engine_replies import EngineReplies

        replies = EngineReplies.load(args.model, args.max_new_tokens)
        log(replies.describe())
    distill(model, tok, store, ds, deadline=deadline, log=log, replies=replies)
    log(f"data: {len(store.shards)} shards, {store.reply_tokens} reply tokens")


def _distill_report(args: argparse.Namespace, store: DistillStore, data_seconds: float) -> dict[str, Any]:
    """What the report says of the distilled data."""
    return {
        "model": str(args.model),
        "prompts": store.next_prompt_index(),
        "magpie_prompts": sum(1 for s in store.sources if s == "magpie"),
        "magpie_rounds": store.magpie_rounds,
        "reply_tokens": store.reply_tokens,
        "max_new_tokens": args.max_new_tokens,
        "data_seconds_this_run": round(data_seconds, 1),
    }


@dataclass
class _TrainStage:
    """What the train stage works with once the data are there: the parsed flags, the backbone, the distilled
    data, the output and work folders, and the run's device, deadline and log."""

    args: argparse.Namespace
    model: Any
    store: DistillStore
    out: Path
    work: Path
    run: RunOptions

    def finish(self, kind: Any, checkpoint: str, extra: dict[str, Any]) -> int:
        """The pipeline with `kind`, its checkpoint in the work folder; what it wrote is logged."""
        run = replace(self.run, checkpoint=self.work / checkpoint, resume=self.args.resume)
        options = SaveOptions(self.out, base_model_name(self.args.model), run, self.args.tree_budget, extra)
        report = train_and_save(kind, options)
        log = self.run.log
        log(f"wrote {self.out}: {', '.join(sorted(p.name for p in self.out.iterdir() if p.is_file()))}")
        if "estimated_tokens_per_step" in report:
            log(f"estimated tokens/step: {json.dumps(report['estimated_tokens_per_step'])}")
        return 0


def _train_heads(stage: _TrainStage, extra: dict[str, Any], init_from: Any) -> int:
    """Medusa or Hydra heads: the hidden states cached, the heads trained, evaluated and saved to `out`."""
    args, model, device, log = stage.args, stage.model, stage.run.device, stage.run.log
    cuda = device.type == "cuda"
    paths = cache_hidden_states(model, stage.store, stage.work / "hidden", batch_tokens=65536 if cuda else 4096, log=log)
    data = load_cache(paths)
    mask = heldout_mask(conversation_starts(stage.store.prompts)[data.sample.long()], args.holdout)
    train, held = data.subset(~mask), data.subset(mask)
    if cuda:
        train, held = train.to(device), held.to(device)
    ts = TrainSettings(
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        heads_format=args.heads_format,
        draft_vocab_size=args.draft_vocab,
        epochs=args.epochs or 2.0,
        batch_size=args.train_batch_size or (4096 if cuda else 256),
        lr=args.lr,
        seed=args.seed,
        bf16={"auto": None, "on": True, "off": False}[args.bf16],
        teacher_weight=args.teacher_weight,
        teacher_top=args.teacher_top,
    )
    embed = model.get_input_embeddings().weight.detach()
    # the warm start's draft vocabulary: Hydra heads hold it in the heads file, Medusa heads in a file beside them
    held_in = "draft_vocab" if args.heads_format == "hydra" else "draft_vocab_ids"
    draft_vocab = getattr(init_from, held_in, None) if args.keep_draft_vocab else None
    kind = HeadsKind(model.get_output_embeddings(), train, held, ts, embed, init_from, draft_vocab)
    return stage.finish(kind, "checkpoint.pt", extra)


def _train_eagle(stage: _TrainStage, settings: Any, extra: dict[str, Any], init_from: Any = None) -> int:
    """The EAGLE draft after the data: every position's feature cached in `work`/eagle-features (EAGLE-3's three
    taps: eagle3-features), training with its checkpoint in `work`/eagle-checkpoint.pt (eagle3-checkpoint.pt),
    then the Hub layout, accuracy.json and tree.json in `out`."""
    from medusa_chat.model.forward.eagle import eagle_taps
    from medusa_chat.training.eagle_data import eagle_features
    from medusa_chat.training.eagle_pipeline import EagleKind

    args, model, log = stage.args, stage.model, stage.run.log
    name, taps, draft_vocab = args.heads_format, None, None
    if name == "eagle3":
        n_layers = int(getattr(model.config, "num_hidden_layers", 0))
        taps = eagle_taps(n_layers)
        if not 0 < taps[0] < taps[1] < taps[2] < n_layers:
            log(
                f"EAGLE-3 reads the backbone's layers 2, N/2 and N-3: this one has {n_layers} (at least 7 needed)"
            )
            return 2
        draft_vocab = min(args.draft_vocab, int(model.config.vocab_size))
    if init_from is not None:  # (before the feature cache: a draft for another model fails now)
        from medusa_chat.errors import HeadsError
        from medusa_chat.model.forward.eagle import check_eagle_fits

        try:
            check_eagle_fits(init_from, model.config.to_dict(), args.init_from, str(args.model))
        except HeadsError as err:
            log(f"--init-from: {err}")
            return 2

    features = stage.work / f"{name}-features"
    data = eagle_features(model, stage.store, features, stage.run.device, log=log, deadline=stage.run.deadline, taps=taps)
    teacher_hidden = None
    if settings.teacher_weight > 0:  # the final hidden state of the same samples: the teacher's distribution
        batch_tokens = 65536 if stage.run.device.type == "cuda" else 4096
        teacher_hidden = load_cache(cache_hidden_states(model, stage.store, stage.work / "hidden", batch_tokens, log=log))
    kind = EagleKind(model, data, settings, args.holdout, draft_vocab=draft_vocab, init_from=init_from,
                     teacher_hidden=teacher_hidden, teacher_top=args.teacher_top)  # fmt: skip
    return stage.finish(kind, f"{name}-checkpoint.pt", extra)


def fit_tree_main(args: argparse.Namespace) -> int:
    from medusa_chat.training.fit_tree import fit_tree_for_heads, size_summary

    if not args.heads:
        print("fit-tree: --heads DIR is required (a folder written by train-heads, with accuracy.json)")
        return 2
    try:
        tree = fit_tree_for_heads(args.heads, budget=args.budget, prefer_joint=not args.independent)
    except (FileNotFoundError, ValueError) as err:
        print(f"fit-tree: {err}")
        return 2
    print(
        f"wrote {Path(args.heads) / 'tree.json'}: {len(tree['paths']) + 1} nodes "
        f"(gains from {tree['gains_from']} accuracies)"
    )
    for size, value in size_summary(tree).items():
        print(f"  {size:>8} nodes: {value:.3f} expected tokens per step")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry for `python -m medusa_chat.training.cli train-heads|fit-tree ...`."""
    parser = argparse.ArgumentParser(prog="medusa_chat.training.cli")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_train_args(sub.add_parser("train-heads"))
    add_fit_tree_args(sub.add_parser("fit-tree"))
    args = parser.parse_args(argv)
    return train_main(args) if args.cmd == "train-heads" else fit_tree_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
