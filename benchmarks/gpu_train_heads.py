#!/usr/bin/env python3
"""Whole Medusa-head pipeline on one CUDA GPU, on a wall-clock budget: data -> hidden states -> heads -> trees.

    python benchmarks/gpu_train_heads.py MODEL OUT [--minutes 6] [--data-frac 0.55] [--configs 5x2h,5x2,eagle3]

MODEL is a Hugging Face model folder, or a `.gguf` file (dequantized here by the app's own GGUF reader, the same
fp32 weights as the app's conversion; with `--hf-files DIR` the config and tokenizer come from DIR, so neither
transformers' GGUF loader nor the `gguf` package is needed, and `--expect-hashes FILE` checks that the weights
are bit-identical to the ones the heads will be used with). Run from the repository root (or anywhere: the
script puts the repo root on sys.path). No network is needed.

`--configs` also takes `eagle` and `eagle3`: an EAGLE-1 or EAGLE-3 draft (training/train_eagle.py, as
`train-heads --heads-format eagle|eagle3`) from the same data, with its own feature cache; `--eagle-init DIR`
goes on training a trained draft of that format instead of starting from scratch (the shipped one, longer:
`--import-data benchmarks/data/distill_smollm2_h200_2026-12-04.npz --data-frac 0 --configs eagle3 --eagle-init
assets/smollm2-135m-eagle3 --eagle-epochs 16`).

Steps, each stamped with wall-clock time: Magpie prompts + greedy replies in fp32 with TF32 off (so replies
match CPU fp32 greedy decoding) until `data-frac` of the budget is spent; hidden states for every reply
position; then each head configuration in `--configs` trains on a share of the remaining time (bf16 autocast),
is evaluated on held-out prompts, and gets a fitted tree. Everything is written to OUT as it is finished:

    OUT/summary.json         per configuration: accuracies, estimated tokens/step at 8/16/32/64 nodes, timings
    OUT/best/                config.json + medusa_lm_head.safetensors + accuracy.json + tree.json (best config)
    OUT/heads-5x1/ ...       every configuration's folder
    OUT/data.npz             the distilled data (distill.export_npz); `medusa-chat train-heads --import-data`
                             retrains from it anywhere without generating again
    OUT/log.txt              this log

The script stops itself on the budget (it checks before every unit of work and shortens training to fit);
what is done by then is saved. Working files (shards, hidden-state cache) go to --work (default OUT/work);
a rerun with the same --work resumes the data and adds to it.

Heads are independent of each other (separate weights, summed losses), so a 5-head file also holds the best
4-head model: its first four heads. That is why the default configs vary depth (ResBlocks), not head count.
On an H200 (2026-11-29): replies ~12k tokens/s (batch 768, <= 192 new tokens), Magpie ~22k token-slots/s
(batch 1024), hidden states ~70k tokens/s, training 20-24 ms/step (5 heads, batch 2048, bf16). 2026-12-04, the
shipped EAGLE-3 draft: 2.64M reply tokens in 269 s, EAGLE-3 features 66 s, 836 steps of 16,384 pairs in 56 s
(an EAGLE-1 draft's full-vocabulary loss: 0.65 s a step).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from medusa_chat.atomic import atomic_write_json  # noqa: E402
from medusa_chat.training.distill import DistillSettings, distill, load_for_training, make_logger  # noqa: E402
from medusa_chat.training.loop import RunOptions  # noqa: E402
from medusa_chat.training.pipeline import HeadsKind, SaveOptions, train_and_save  # noqa: E402
from medusa_chat.training.positions import cache_hidden_states, heldout_mask, load_cache  # noqa: E402
from medusa_chat.training.store import DistillStore, export_npz  # noqa: E402
from medusa_chat.training.train_heads import TrainSettings, heads_file_bytes  # noqa: E402

HF_SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="HF model folder or .gguf file")
    p.add_argument("out", help="output folder")
    p.add_argument("--minutes", type=float, default=6.0, help="wall-clock budget for the whole run")
    p.add_argument("--data-frac", type=float, default=0.55, help="share of the budget for data generation")
    p.add_argument(
        "--configs",
        default="5x2h,5x2",
        help="heads x ResBlocks to train, each on an equal time share; a trailing h = Hydra heads",
    )
    p.add_argument("--max-mb", type=float, default=9.5, help="skip configs whose fp16 file is larger")
    p.add_argument("--batch-size", type=int, default=768, help="reply generation batch")
    p.add_argument("--magpie-batch", type=int, default=1024, help="Magpie samples per round")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--magpie", type=int, default=1_000_000, help="Magpie prompt target (the budget stops it)")
    p.add_argument(
        "--opener-frac", type=float, default=0.5, help="Magpie rows started from a task opener (0 = plain)"
    )
    p.add_argument("--prompts", help="optional jsonl of extra prompts (never the bench prompts)")
    p.add_argument(
        "--import-data",
        default=None,
        help="start from an export_npz file (e.g. benchmarks/data/distill_smollm2_h200_2026-12-04.npz); with "
        "--data-frac 0 no new data is generated and the whole budget trains",
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="stop data generation at this many reply tokens"
    )
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--train-batch", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--holdout", type=float, default=0.03)
    p.add_argument("--unroll", type=int, default=3, help="EAGLE: training-time test steps")
    p.add_argument("--eagle-epochs", type=float, default=4.0)
    p.add_argument("--eagle-batch", type=int, default=16384, help="EAGLE: pairs per batch, padding included")
    p.add_argument("--eagle-lr", type=float, default=1e-3)
    p.add_argument("--draft-vocab", type=int, default=8192, help="EAGLE-3: draft vocabulary size")
    p.add_argument(
        "--eagle-init",
        default=None,
        help="EAGLE: go on training this trained draft of the same format (e.g. assets/smollm2-135m-eagle3)",
    )
    p.add_argument("--work", default=None, help="working folder (default OUT/work); reruns resume from it")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-files", default=None, help="folder with config/tokenizer files for a .gguf MODEL")
    p.add_argument("--expect-hashes", default=None, help="json {tensor: sha256} the backbone must match")
    p.add_argument(
        "--base-model",
        default="HuggingFaceTB/SmolLM2-135M-Instruct",
        help="base_model_name_or_path written into the heads' config.json",
    )
    return p.parse_args(argv)


def tensor_hashes(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()
        for k, v in sorted(state.items())
    }


def prepare_model(model: str, work: Path, hf_files: str | None, log) -> Path:
    """A plain fp32 HF folder for `model` (a folder is used as is; a GGUF is dequantized once into work/)."""
    path = Path(model)
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise SystemExit(f"{path}: not a model folder or .gguf file")
    out = work / "model"
    if (out / "model.safetensors").is_file():
        return out
    t = time.time()
    if hf_files is None:
        from medusa_chat.model.sources.embedded import (
            _convert,  # converts config, tokenizer and weights from the GGUF
        )

        _convert(path, out)
    else:  # the weights from the GGUF (the app's reader), the rest from the folder: no `gguf` package needed
        from safetensors.torch import save_file
        from transformers import AutoConfig

        from medusa_chat.model.sources.gguf_names import gguf_state_dict

        config = AutoConfig.from_pretrained(hf_files)
        tmp = work / "model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(gguf_state_dict(path, config), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name in HF_SMALL_FILES:
            if (Path(hf_files) / name).is_file():
                shutil.copy(Path(hf_files) / name, tmp / name)
        tmp.rename(out)
    log(f"model: dequantized {path.name} -> {out} in {time.time() - t:.0f}s")
    return out


EAGLE_CONFIGS = ("eagle", "eagle3")


def parse_configs(spec: str) -> list[tuple[int, int, str]]:
    """'5x2h,5x1,eagle3' -> [(5, 2, 'hydra'), (5, 1, 'v2'), (0, 0, 'eagle3')]: heads x ResBlocks, 'h' for Hydra
    heads; `eagle`/`eagle3` for an EAGLE draft."""
    out = []
    for part in spec.split(","):
        if part.strip() in EAGLE_CONFIGS:
            out.append((0, 0, part.strip()))
            continue
        k, _, layers = part.strip().partition("x")
        fmt = "hydra" if layers.endswith("h") else "v2"
        out.append((int(k), int(layers.rstrip("h") or 1), fmt))
    return out


class Run:
    """One run's budget, folders, log and summary.json (written again after every unit of work). A plain class:
    tests load this script without registering it as a module, which dataclasses need."""

    def __init__(
        self, args: argparse.Namespace, out: Path, work: Path, log: Any, t0: float, end: float, summary: dict
    ) -> None:
        self.args, self.out, self.work, self.log = args, out, work, log
        self.t0, self.end = t0, end  # the budget's end keeps a few seconds to write the summary
        self.summary = summary

    @classmethod
    def start(cls, args: argparse.Namespace) -> Run:
        t0 = time.time()
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        work = Path(args.work) if args.work else out / "work"
        work.mkdir(parents=True, exist_ok=True)
        summary = {"args": vars(args), "phases": {}, "configs": {}}
        return cls(args, out, work, make_logger(file=out / "log.txt"), t0, t0 + 60 * args.minutes - 10, summary)

    def save_summary(self) -> None:
        self.summary["elapsed_s"] = round(time.time() - self.t0, 1)
        atomic_write_json(self.out / "summary.json", self.summary)

    def finish(self) -> None:
        self.summary["phases"]["total_s"] = round(time.time() - self.t0, 1)
        self.save_summary()
        self.log(f"done in {time.time() - self.t0:.0f}s; wrote {self.out}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run.start(args)
    device = training_device(args.device, run.log)
    model, tok = load_backbone(run, device)
    store = generate_data(run, model, tok)
    if not store.shards:
        run.log("no data generated: nothing to train")
        return 1
    specs = parse_configs(args.configs)
    eagle_specs = [fmt for _, _, fmt in specs if fmt in EAGLE_CONFIGS]
    configs = head_configs(run, model, [spec for spec in specs if spec[2] not in EAGLE_CONFIGS])
    train_eagle_drafts(run, model, store, eagle_specs, len(configs) + len(eagle_specs), device)
    if not configs:
        run.finish()
        return 0 if run.summary["configs"] else 1
    train, held = cached_positions(run, model, store, device)
    best_name = train_head_configs(run, model, configs, train, held, device)
    run.finish()
    return 0 if best_name else 1


def training_device(name: str, log: Any) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: pass --device cpu for a dry run")
        # fp32 greedy replies must match CPU fp32 decoding: TF32 would flip near-ties.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        log(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    else:
        log(f"device: {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    return device


def load_backbone(run: Run, device: torch.device) -> tuple[Any, Any]:
    """The backbone in fp32 (a GGUF dequantized once), its weights checked against --expect-hashes."""
    args = run.args
    model_dir = prepare_model(args.model, run.work, args.hf_files, run.log)
    model, tok = load_for_training(model_dir, device)
    if args.expect_hashes:
        want = json.loads(Path(args.expect_hashes).read_text())
        got = tensor_hashes({k: v for k, v in model.state_dict().items() if k in want})
        bad = [k for k in want if got.get(k) != want[k]]
        run.summary["backbone_hash_check"] = "ok" if not bad else f"{len(bad)} tensors differ: {bad[:5]}"
        run.log(f"backbone weights vs expected hashes: {run.summary['backbone_hash_check']}")
    run.log(f"model: {model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params)")
    return model, tok


def generate_data(run: Run, model: Any, tok: Any) -> DistillStore:
    """Distilled replies (imported, then generated) for --data-frac of the time left, exported to OUT/data.npz."""
    args, log = run.args, run.log
    t = time.time()
    data_deadline = t + args.data_frac * (run.end - t)  # a share of what is left after loading the model
    store = DistillStore.open(run.work / "distill", model=str(args.model))
    if args.import_data and not store.shards:
        from medusa_chat.training.distill import eos_ids
        from medusa_chat.training.store import import_npz

        import_npz(store, args.import_data, eos=eos_ids(tok, model))
        log(f"imported {args.import_data}: {len(store.shards)} shards, {store.reply_tokens} reply tokens")
    ds = DistillSettings(
        magpie=args.magpie,
        prompt_file=args.prompts,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        magpie_batch=args.magpie_batch,
        shard_size=args.batch_size,
        seed=args.seed,
        max_reply_tokens=args.max_tokens,
        opener_frac=args.opener_frac,
    )
    tokens_before = store.reply_tokens
    distill(model, tok, store, ds, deadline=data_deadline, log=log)
    dt = time.time() - t
    run.summary["data"] = {
        "prompts_answered": store.next_prompt_index(),
        "magpie_prompts": sum(1 for s in store.sources if s == "magpie"),
        "magpie_rounds": store.magpie_rounds,
        "magpie_sampled": store.magpie_sampled,
        "reply_tokens": store.reply_tokens,
        "max_new_tokens": args.max_new_tokens,
        "reply_tokens_per_s_overall": round((store.reply_tokens - tokens_before) / max(dt, 1e-9), 1),
    }
    run.summary["phases"]["data_s"] = round(dt, 1)
    log(f"data: {json.dumps(run.summary['data'])}")
    run.summary["data"].update(export_npz(store, run.out / "data.npz"))
    run.save_summary()
    return store


def head_configs(run: Run, model: Any, specs: list[tuple[int, int, str]]) -> list[TrainSettings]:
    """The head configurations to train, those whose fp16 file exceeds --max-mb left out."""
    args = run.args
    lm_head = model.get_output_embeddings()
    hidden_size, vocab = lm_head.weight.shape[1], lm_head.weight.shape[0]
    configs = []
    for k, layers, fmt in specs:
        ts = TrainSettings(
            num_heads=k,
            num_layers=layers,
            heads_format=fmt,
            epochs=args.epochs,
            batch_size=args.train_batch,
            lr=args.lr,
            seed=args.seed,
        )
        mb = heads_file_bytes(ts, hidden_size, vocab) / 1e6
        if mb > args.max_mb:
            run.log(f"skip {k}x{layers}: {mb:.1f} MB > --max-mb {args.max_mb}")
            continue
        configs.append(ts)
    return configs


def train_eagle_drafts(
    run: Run, model: Any, store: DistillStore, formats: list[str], n_units: int, device: torch.device
) -> None:
    """Each EAGLE draft (with its own feature cache) on an equal share of the time left among `n_units`."""
    for i, fmt in enumerate(formats):
        left = run.end - time.time()
        if left < 30:
            run.log(f"time budget: no time left for {fmt}")
            break
        t = time.time()
        deadline = t + left / (n_units - i) - 8
        report = train_eagle_config(run, model, store, fmt, device, deadline)
        run.summary["configs"][fmt] = {
            **config_summary(report, time.time() - t),
            "train_positions": report["data"]["train_positions"],
        }
        run.save_summary()


def cached_positions(run: Run, model: Any, store: DistillStore, device: torch.device) -> tuple[Any, Any]:
    """The hidden states of every reply position, split into (train, held-out) on the device."""
    t = time.time()
    paths = cache_hidden_states(
        model,
        store,
        run.work / "hidden",
        batch_tokens=131072 if device.type == "cuda" else 4096,
        log=run.log,
        deadline=run.end - 30,
    )
    data = load_cache(paths)
    dt = time.time() - t
    run.summary["phases"]["hidden_s"] = round(dt, 1)
    run.log(f"hidden states: {len(data)} positions in {dt:.0f}s")
    mask = heldout_mask(data.sample, run.args.holdout)
    train, held = data.subset(~mask).to(device), data.subset(mask).to(device)
    del data
    run.summary["data"].update(train_positions=len(train), heldout_positions=len(held))
    run.save_summary()
    return train, held


def train_head_configs(
    run: Run, model: Any, configs: list[TrainSettings], train: Any, held: Any, device: torch.device
) -> str | None:
    """Each head configuration on an equal share of the time left; the best (estimated tokens per step at 64
    nodes, or the whole tree) copied to OUT/best. Returns its name."""
    args, out, log = run.args, run.out, run.log
    lm_head = model.get_output_embeddings()
    best_name, best_score = None, -1.0
    for i, ts in enumerate(configs):
        left = run.end - time.time()
        if left < 20 and i > 0:  # the first configuration always trains (at least a step): save something
            log("time budget: no time left for more head configurations")
            break
        name = f"heads-{ts.num_heads}x{ts.num_layers}" + ("-hydra" if ts.heads_format == "hydra" else "")
        t = time.time()
        share = left / (len(configs) - i)  # the EAGLE drafts (if any) are done
        embed = model.get_input_embeddings().weight.detach()
        options = RunOptions(device, run.work / f"{name}.ckpt", resume=True, deadline=time.time() + share - 8, log=log)
        extra = {"distill": run.summary["data"]}
        report = train_and_save(
            HeadsKind(lm_head, train, held, ts, embed), SaveOptions(out / name, args.base_model, options, extra_report=extra)
        )
        est = report.get("estimated_tokens_per_step", {})
        run.summary["configs"][name] = config_summary(report, time.time() - t)
        score = float(est.get("64", list(est.values())[-1])) if est else 0.0  # 64 nodes, or the whole tree
        if score > best_score:
            best_name, best_score = name, score
            shutil.rmtree(out / "best", ignore_errors=True)
            shutil.copytree(out / name, out / "best")
            run.summary["best"] = {"config": name, "estimated_tokens_per_step_64": score}
        run.save_summary()
    log(f"best: {best_name} ({best_score:.3f} estimated tokens/step at 64 nodes)")
    for name, c in run.summary["configs"].items():
        log(f"  {name}: top1 {c['top1']} est {c['estimated_tokens_per_step']} ({c['seconds']}s)")
    return best_name


def config_summary(report: dict, seconds: float) -> dict:
    """What summary.json keeps of one configuration's training report."""
    ev = report.get("heldout", {})
    return {
        "estimated_tokens_per_step": report.get("estimated_tokens_per_step", {}),
        "estimated_tokens_per_step_chain": report.get("estimated_tokens_per_step_chain"),
        "top1": ev.get("top1"),
        "top5": ev.get("top5"),
        "chain": ev.get("chain_top1_conditional"),
        "train_steps": report["training"]["steps"],
        "total_steps": report["training"]["total_steps"],
        "best_epoch": report["training"]["best_epoch"],
        "seconds": round(seconds, 1),
        "file_mb": report["heads"]["file_mb"],
    }


def train_eagle_config(run: Run, model: Any, store: DistillStore, fmt: str, device: torch.device, deadline: float) -> dict:
    """An EAGLE-1 (`eagle`) or EAGLE-3 (`eagle3`) draft from the distilled data, as `train-heads --heads-format`
    does: the features cached in work/<fmt>-features, training to `deadline`, the Hub layout written to
    OUT/<fmt>."""
    from medusa_chat.model.forward.eagle import eagle_taps
    from medusa_chat.training.eagle_data import eagle_features
    from medusa_chat.training.eagle_pipeline import EagleKind
    from medusa_chat.training.train_eagle import EagleSettings

    args, work, log = run.args, run.work, run.log

    taps, draft_vocab = None, None
    if fmt == "eagle3":
        taps = eagle_taps(int(model.config.num_hidden_layers))
        draft_vocab = min(args.draft_vocab, int(model.config.vocab_size))
    init = None
    if args.eagle_init:
        from medusa_chat.model.sources.heads_files import load_heads_file

        init = load_heads_file(Path(args.eagle_init))[0]
        if getattr(init, "format", None) != fmt:
            raise SystemExit(f"--eagle-init {args.eagle_init} is not an {fmt} draft")
    t = time.time()
    features = eagle_features(model, store, work / f"{fmt}-features", device, log=log, deadline=deadline, taps=taps)
    log(f"{fmt}: features of {features.positions} positions in {time.time() - t:.0f}s")
    settings = EagleSettings(
        unroll=args.unroll,
        epochs=args.eagle_epochs,
        batch_tokens=args.eagle_batch,
        lr=args.eagle_lr,
        seed=args.seed,
    )
    kind = EagleKind(model, features, settings, args.holdout, draft_vocab=draft_vocab, init_from=init)
    options = RunOptions(device, work / f"{fmt}-checkpoint.pt", resume=True, deadline=deadline, log=log)
    extra = {"distill": run.summary["data"]}
    return train_and_save(kind, SaveOptions(run.out / fmt, args.base_model, options, extra_report=extra))


if __name__ == "__main__":
    raise SystemExit(main())
