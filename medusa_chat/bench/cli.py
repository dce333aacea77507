"""`medusa-chat bench`: its options and entry point."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from medusa_chat.bench.harness import BenchConfig, run_bench
from medusa_chat.bench.report import print_summary
from medusa_chat.bench.runs import BASELINES, DEFAULT_BASELINES, read_prompts
from medusa_chat.cliargs import add_generation_args, int_list, settings_from_args

if TYPE_CHECKING:
    from rich.console import Console

    from medusa_chat.model.sources.loading import LoadedModel


def _baselines(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in BASELINES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown baseline(s) {bad}: choose from {','.join(BASELINES)}")
    return names


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Options of `medusa-chat bench`."""
    parser.add_argument(
        "--prompts",
        type=Path,
        default=None,
        metavar="FILE.jsonl",
        help="one JSON object a line with `turns` (first turn used) or `prompt`",
    )
    parser.add_argument("--limit", type=int, default=None, metavar="K", help="first K prompts only")
    # --temperature, --max-new-tokens (128 here), --top-p, --seed (0 here), --accept, --no-context-lookup; at
    # temperature 0 every method's reply is compared token by token with the reference, above it speed only
    add_generation_args(parser, "bench")
    parser.add_argument(
        "--json", type=Path, default=None, metavar="OUT", help="write the results as JSON to OUT"
    )
    parser.add_argument(
        "--baselines",
        type=_baselines,
        default=None,
        metavar="hf,plain,lookup,llamacpp,heads,llamacpp-spec",
        help="baselines to run beside Medusa (default: hf,plain,lookup,llamacpp; with --background-load: "
        "plain,llamacpp; llamacpp is skipped with a note without llama-bench or llama-cpp-python; heads = the "
        "same tree without context lookup; llamacpp-spec = llama-server plain, ngram-mod and EAGLE-3 beside "
        "`medusa-chat serve`, all through the OpenAI API)",
    )
    parser.add_argument(
        "--background-load",
        type=int,
        default=0,
        metavar="N",
        help="run the bench quiet, then again with N busy processes (one core each), and show each method's "
        "speed side by side (bench/load.py)",
    )
    parser.add_argument(
        "--llamacpp-bench",
        default=None,
        metavar="PATH",
        help="llama.cpp's llama-bench binary for the llamacpp baseline (default: $MEDUSA_CHAT_LLAMA_BENCH or "
        "PATH; without one, an installed llama-cpp-python decodes the same prompts)",
    )
    parser.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="llama.cpp's llama-server binary for the llamacpp-spec baseline (default: $MEDUSA_CHAT_LLAMA_SERVER, "
        "the llama-server beside llama-bench, or PATH)",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed warm-up runs of every method (default: 1)"
    )
    parser.add_argument(
        "--tree-sizes",
        type=int_list,
        default=None,
        metavar="8,16,32,64",
        help="also run Medusa with the first N nodes of the tree for each N",
    )
    parser.add_argument(
        "--compare-heads",
        type=lambda text: [x for x in text.split(",") if x],
        default=None,
        metavar="PATH[,PATH]",
        help="also run other heads or EAGLE drafts (folders or Hub repos) on the same backbone, each with its own "
        "tree cut to the run's node budget: tokens/step, acceptance by depth and speed side by side",
    )
    parser.add_argument("--quiet", action="store_true", help="no per-prompt tables, only the summary")
    parser.add_argument(
        "--fidelity",
        action="store_true",
        help="instead of speed: each numeric path's agreement with the float model (teacher-forced top-1 and KL on a "
        "fixed text, greedy replies' agreement), beside llama.cpp's on the same text where it is built",
    )
    parser.add_argument(
        "--fidelity-paths",
        default=None,
        metavar="int4,int8",
        help="with --fidelity: the numeric paths to score (default: the one --quant picks)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """cli.py hook: the options of `medusa-chat bench`."""
    add_bench_args(parser)


def load_from_args(args: argparse.Namespace, console: Console | None = None) -> LoadedModel:
    from medusa_chat.model.sources.loading import load_from_args as _load

    return _load(args, progress=(lambda m: console.print(f"[dim]{m}[/dim]")) if console is not None else None)


def progress_printer(console: Console, quiet: bool) -> Callable[[str], None] | None:
    return None if quiet else (lambda m: console.print(f"[dim]{m}[/dim]"))


def serve_args(args: argparse.Namespace) -> list[str]:
    """The model options this bench was given, for the `medusa-chat serve` it starts beside llama-server."""
    out: list[str] = []
    for flag in ("model", "heads", "quant", "dtype", "device", "tree", "tree_size"):
        value = getattr(args, flag, None)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out


def bench_main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from medusa_chat.tuning.first_start import resolve_tree

    if getattr(args, "fidelity", False):
        from medusa_chat.bench.fidelity import fidelity_main

        return fidelity_main(args)
    out = Console()
    err = Console(stderr=True)
    if args.prompts is None:
        from medusa_chat.errors import MedusaChatError

        raise MedusaChatError("bench needs --prompts FILE.jsonl (e.g. benchmarks/data/vicuna_bench_question.jsonl)")
    background = getattr(args, "background_load", 0) or 0
    if background < 0:
        from medusa_chat.errors import MedusaChatError

        raise MedusaChatError(f"--background-load must be >= 0 (got {background})")
    prompts = read_prompts(args.prompts, args.limit)
    settings = settings_from_args(args)  # validated before the (slow) load
    for heads in getattr(args, "compare_heads", None) or []:
        from medusa_chat.model.sources.registry import heads_location

        heads_location(heads)  # an unknown name or a missing folder: said before the load
    loaded = load_from_args(args, err)
    tree, source = resolve_tree(
        loaded, getattr(args, "tree", None), getattr(args, "tree_size", None), progress_printer(err, False)
    )
    config = BenchConfig(
        settings=settings,
        baselines=args.baselines
        if args.baselines is not None
        else (["plain", "llamacpp"] if background else list(DEFAULT_BASELINES)),
        warmup=args.warmup,
        tree_sizes=args.tree_sizes,
        compare_heads=getattr(args, "compare_heads", None),
        llamacpp_bench=args.llamacpp_bench,
        llama_server=getattr(args, "llama_server", None),
        serve_args=serve_args(args),
    )
    if background:
        from medusa_chat.bench.load import print_load_summary, run_with_background_load

        console = None if args.quiet else out
        doc = run_with_background_load(
            lambda: run_bench(loaded, tree, prompts, config, console, tree_source=source), background, err
        )
        print_load_summary(out, doc)
    else:
        doc = run_bench(loaded, tree, prompts, config, None if args.quiet else out, tree_source=source)
        print_summary(out, doc)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, ensure_ascii=False))
        err.print(f"[dim]results written to {args.json}[/dim]")
    return 0
