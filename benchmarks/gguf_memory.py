"""Resident memory of a GGUF model: load it (`--model PATH.gguf`), decode a reply, and report RSS against the
memory target (<= 1.3 x the file + the KV cache + ~0.5 GB of runtime).

    python benchmarks/gguf_memory.py --model model-Q4_1.gguf [--heads DIR] [--new-tokens 128] [--quant auto]

Without --heads, random v2 heads of the model's hidden size are written to a temp folder (memory does not depend
on what the heads guess). Prints one JSON document: the file size, VmRSS / VmHWM (peak) after the imports, after
loading and after decoding, the KV cache's bytes, and the target. Run it alone on a quiet machine: VmHWM is the
process's peak, taken from /proc/self/status (Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def proc_memory() -> dict[str, int]:
    """VmRSS and VmHWM of this process in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def random_heads(hidden: int, folder: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    state = {}
    for k in range(4):
        state[f"{k}.0.linear.weight"] = (0.01 * torch.randn(hidden, hidden, generator=g)).half()
        state[f"{k}.0.linear.bias"] = torch.zeros(hidden, dtype=torch.float16)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1, "version": "2"}))
    save_file(state, str(folder / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a .gguf file")
    parser.add_argument("--heads", default=None)
    parser.add_argument("--quant", default="auto")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", default="Write a short story about a lighthouse keeper.")
    args = parser.parse_args()

    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.events import GenerationSettings, ReplySummary
    from medusa_chat.model.sources.gguf_folder import read_metadata
    from medusa_chat.model.sources.loading import load_model

    gguf = Path(args.model)
    doc: dict = {"model": str(gguf), "file_bytes": gguf.stat().st_size, "after_imports": proc_memory()}
    heads = args.heads
    if heads is None:
        meta = read_metadata(gguf, ("general.architecture",))
        arch = meta.get("general.architecture", "llama")
        hidden = int(read_metadata(gguf, (f"{arch}.embedding_length",))[f"{arch}.embedding_length"])
        heads = str(random_heads(hidden, Path(tempfile.mkdtemp(prefix="gguf-mem-heads-"))))
    t0 = time.perf_counter()
    loaded = load_model(str(gguf), heads=heads, quant=args.quant, device="cpu", progress=lambda m: print(m, file=sys.stderr))
    doc["load_s"] = round(time.perf_counter() - t0, 2)
    doc["after_load"] = proc_memory()
    engine = MedusaEngine(loaded, loaded.default_tree)
    doc["after_engine"] = proc_memory()  # the native step fuses q/k/v and gate/up here
    prompt = loaded.build_prompt([{"role": "user", "content": args.prompt}])
    summary = None
    for event in engine.generate(prompt, GenerationSettings(max_new_tokens=args.new_tokens, temperature=0)):
        if isinstance(event, ReplySummary):
            summary = event
    doc["after_decode"] = proc_memory()
    cache = engine.cache
    kv = sum(t.numel() * t.element_size() for t in (cache.buffer, cache.rows) if t is not None)
    doc["kv_cache_bytes"] = kv
    doc["tokens"] = len(prompt) + (len(summary.token_ids) if summary else 0)
    doc["quant"] = loaded.quant
    doc["target_bytes"] = int(1.3 * doc["file_bytes"] + kv + 0.5 * 2**30)
    peak = doc["after_decode"]["VmHWM"]
    doc["peak_over_file"] = round(peak / doc["file_bytes"], 3)
    doc["within_target"] = peak <= doc["target_bytes"]
    doc["threads"] = os.environ.get("OMP_NUM_THREADS")
    from medusa_chat.bench.runs import repo_path  # after the measurements: paths relative to the repository

    doc["model"] = repo_path(doc["model"])
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
