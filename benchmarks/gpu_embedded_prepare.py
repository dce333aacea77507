#!/usr/bin/env python3
"""The embedded model on a GPU machine: its GGUF (joined from the pieces gpu_stage_gguf.sh made) dequantized by
this app's reader into a checkpoint folder, every weight hash-checked against the CPU's conversion, and the
folder linked where gpu_checks.sh's later stages read it.

    python benchmarks/gpu_embedded_prepare.py GGUF HF_FILES HASHES LINK
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_train_heads import prepare_model, tensor_hashes  # noqa: E402


def main(argv: list[str]) -> int:
    from safetensors.torch import load_file

    gguf, hf_files, hashes, link = argv
    work = Path(link).parent / "embedded-work"
    work.mkdir(parents=True, exist_ok=True)
    folder = prepare_model(gguf, work, hf_files, print)
    want = json.loads(Path(hashes).read_text())
    got = tensor_hashes({k: v for k, v in load_file(str(folder / "model.safetensors")).items() if k in want})
    bad = [k for k in want if got.get(k) != want[k]]
    print("weights vs the CPU conversion:", "identical" if not bad else f"{len(bad)} tensors differ")
    Path(link).unlink(missing_ok=True)
    Path(link).symlink_to(folder.resolve())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
