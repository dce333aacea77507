#!/usr/bin/env python3
"""`medusa-chat export-draft --format llama.cpp` against llama.cpp's own converter, tensor by tensor and key by key.

    python benchmarks/export_vs_converter.py --llama-cpp PATH/TO/llama.cpp [--heads eagle3] [--json out.json]

PATH/TO/llama.cpp is a llama.cpp source tree (e.g. `vendor/llama.cpp` of the llama-cpp-python 0.3.36 sdist). Its
`convert_hf_to_gguf.py` runs with its own `gguf-py` on the draft folder and the target's transformers folder
(`--target-model-dir`, `--outtype f16`); it imports `sentencepiece` (PyPI) even for BPE vocabularies. Then both
files are read with the `gguf` package and compared: every converter tensor must be in the export with the
same name, type, shape and bytes; metadata keys are listed where they differ (the `general.*` naming the
converter derives from folder names, and tokenizer keys the export copies whole from the target's GGUF, may).
Exit status 0 when all tensors are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.getcwd())


def compare(ours: Path, theirs: Path) -> dict:
    import gguf
    import numpy as np

    a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    fa = {k: f for k, f in a.fields.items() if not k.startswith("GGUF.")}
    fb = {k: f for k, f in b.fields.items() if not k.startswith("GGUF.")}
    differ = [k for k in sorted(set(fa) & set(fb)) if fa[k].types != fb[k].types or fa[k].contents() != fb[k].contents()]
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    unequal = [
        n
        for n, t in tb.items()
        if n not in ta
        or ta[n].tensor_type != t.tensor_type
        or list(ta[n].shape) != list(t.shape)
        or not np.array_equal(np.asarray(ta[n].data), np.asarray(t.data))
    ]
    return {
        "tensors": len(tb),
        "tensors_unequal": unequal,
        "tensors_only_in_export": sorted(set(ta) - set(tb)),
        "keys_only_in_export": sorted(set(fa) - set(fb)),
        "keys_only_in_converter": sorted(set(fb) - set(fa)),
        "keys_with_other_values": differ,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp source tree (holds convert_hf_to_gguf.py)")
    p.add_argument("--model", default=None)
    p.add_argument("--heads", default="eagle3")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    from medusa_chat.export.llamacpp import write_gguf
    from medusa_chat.export.source import load_source

    draft, target = load_source(args.model, args.heads)
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = Path(tmp) / "export.gguf", Path(tmp) / "converter.gguf"
        write_gguf(draft, target, ours)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(args.llama_cpp / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(draft.folder),
               "--target-model-dir", str(target.folder), "--outtype", "f16", "--outfile", str(theirs)]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return 2
        result = {"draft": draft.folder.name, "target": target.name, **compare(ours, theirs)}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if not result["tensors_unequal"] and not result["tensors_only_in_export"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
