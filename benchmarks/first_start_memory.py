"""Resident memory per phase of a model's first start on a CPU: load, one short reply, the first-start calibration
(what `medusa-chat ask` runs after its first reply), with the bytes the engines' KV caches hold at each progress
line. Finds what a first start holds beyond what a later one needs.

    MEDUSA_CHAT_CACHE=$(mktemp -d) PYTHONPATH=. python benchmarks/first_start_memory.py --model F.gguf

Each line: seconds since start, RSS now, the highest RSS sampled so far (every 50 ms), the KV caches' bytes, and the
loader's or calibration's own progress line. Needs psutil.
"""

from __future__ import annotations

import argparse
import gc
import resource
import threading
import time

import psutil


def kv_bytes() -> int:
    """Bytes held by every live TreeKVCache (its buffer and its per-node key rows)."""
    from medusa_chat.model.forward.kv_cache import TreeKVCache

    total = 0
    for obj in gc.get_objects():
        if isinstance(obj, TreeKVCache):
            total += sum(t.nbytes for t in (obj.buffer, obj.rows) if t is not None)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    args = ap.parse_args()

    from medusa_chat.engine.engine import MedusaEngine
    from medusa_chat.events import GenerationSettings
    from medusa_chat.model.sources.loading import load_model
    from medusa_chat.tuning.first_start import calibrate_first_start, resolve_tree
    from medusa_chat.tuning.tree_choice import choose_tree

    proc, peak, t0 = psutil.Process(), [0], time.time()

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()

    def say(text: str) -> None:
        rss = proc.memory_info().rss
        print(f"{time.time() - t0:7.1f} s  RSS {rss / 2**30:5.2f} GiB  peak {max(peak[0], rss) / 2**30:5.2f} GiB  "
              f"KV {kv_bytes() / 2**20:6.0f} MiB | {text}", flush=True)  # fmt: skip

    loaded = load_model(args.model, progress=say)
    say("loaded")
    tree, _ = resolve_tree(loaded, None, None, say, defer=True)
    engine = MedusaEngine(loaded, tree)
    ids = loaded.build_prompt([{"role": "user", "content": "Hi"}])
    for _ in engine.generate(ids, GenerationSettings(max_new_tokens=args.max_new_tokens)):
        pass
    say("replied")
    engine.fresh_cache()  # as ask does before it calibrates
    base, _ = choose_tree(loaded, None, None)
    calibrate_first_start(loaded, base, say)
    say(f"calibrated; peak RSS (getrusage) {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
