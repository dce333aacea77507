"""`medusa-chat export-draft`: write a draft (`--model`/`--heads` as the other commands take them) for a serving
engine, and print the one line that serves with it.

    medusa-chat export-draft --heads eagle3 --format llama.cpp --out d.gguf
    medusa-chat export-draft --heads eagle3 --format vllm --out draft-vllm/
    medusa-chat export-draft --heads medusa-1 --format vllm --out heads-vllm/
    medusa-chat export-draft --heads eagle3 --format sglang --out draft-sglang/
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from medusa_chat.errors import MedusaChatError

if TYPE_CHECKING:
    from medusa_chat.export.source import Target

FORMATS = ("llama.cpp", "vllm", "sglang")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """cli.py hook: the options of `medusa-chat export-draft` (on top of --model/--heads)."""
    parser.add_argument("--format", choices=FORMATS, required=True, help="the engine to write the draft for")
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="PATH",
        help="the GGUF file (llama.cpp) or folder (vllm, sglang)",
    )
    parser.add_argument(
        "--outtype",
        choices=("f16", "f32"),
        default="f16",
        help="llama.cpp: tensor type of the matrices (f16)",
    )
    parser.add_argument(
        "--target-gguf",
        type=Path,
        default=None,
        metavar="FILE",
        help="llama.cpp: the target's GGUF, whose tokenizer the draft carries (default: the model's own GGUF)",
    )


def export_main(args: argparse.Namespace) -> int:
    from medusa_chat.export.source import load_source

    fmt = args.format
    out: Path = args.out
    if fmt == "llama.cpp" and out.is_dir():
        raise MedusaChatError(
            f"{out} is a folder: llama.cpp's draft is one GGUF file (e.g. --out draft.gguf)"
        )
    if fmt != "llama.cpp" and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MedusaChatError(
            f"{out} exists and is not an empty folder: the {fmt} export writes a new folder"
        )
    if args.target_gguf is not None and not args.target_gguf.is_file():
        raise MedusaChatError(f"--target-gguf {args.target_gguf} does not exist")
    draft, target = load_source(args.model, args.heads, progress=lambda m: print(m, file=sys.stderr))
    if fmt == "llama.cpp":
        from medusa_chat.export.llamacpp import recipe, write_gguf

        write_gguf(draft, target, out, args.outtype, args.target_gguf)
        line = recipe(out, target if args.target_gguf is None else _with_gguf(target, args.target_gguf))
    else:
        from medusa_chat.export.folders import recipe, write_folder

        write_folder(fmt, draft, target, out)
        line = recipe(fmt, draft, target, out)
    print(f"wrote {out} ({draft.kind} draft for {target.name}, {fmt} layout)", file=sys.stderr)
    print(line)
    return 0


def _with_gguf(target: Target, gguf: Path) -> Target:
    """The target with the GGUF the user named (the one the recipe serves)."""
    return dataclasses.replace(target, gguf=gguf)
