"""Two builds of the block kernels side by side in one process: this checkout's library (`cbind.load()`) against
another build of csrc/ (`--old`, e.g. the cached library of an earlier commit), on one thread.

    python benchmarks/lib_ab.py --old ~/.cache/medusa-chat/kernels/qgemm-avx512vnni-<hash>.so --json out.json

Two parts, each checking that both builds give the same bits:
- `products`: single block products with their weights resident in the caches (compute-bound, so what an extra
  row costs in arithmetic): Q4_1 at the embedded model's three shapes (its own blocks), Q4_K and Q6_K on random
  valid blocks, 1-8 rows; the fastest of `--reps` calls per build, calls alternating between the builds.
- `step`: the embedded model's whole C step (decoder_forward, all 30 layers from DRAM, a 256-token prefix in
  the cache) at 1-8 rows, the builds alternating within each round; per row count the median over rounds of
  old / new (> 1: the new build faster) and each build's ratio to its own 1-row step.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def _same_settings(old: Any, new: Any, old_scheme: int | None = None) -> None:
    old.mc_set_threads(1)
    new.mc_set_threads(1)
    # the K-quant activation scheme, the new build's unless --old-scheme (builds before it had only 32 and 256)
    scheme = new.mc_get_kq_scheme() if old_scheme is None else old_scheme
    if hasattr(old, "mc_set_kq_scheme"):
        old.mc_set_kq_scheme(scheme)
    elif scheme in (32, 256):
        old.mc_set_kq_block(scheme)
    else:
        sys.exit(f"--old predates the K-quant activation scheme {scheme}")
    for family in range(3):
        for many in range(2):
            old.mc_set_prefetch(family, many, new.mc_get_prefetch(family, many))


def _time_pair(calls: dict[str, Any], reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            t0 = time.perf_counter()
            fn, args = call
            fn(*args)
            times[name].append(time.perf_counter() - t0)
    return times


def products(old: Any, new: Any, loaded: Any, reps: int, rows: list[int]) -> list[dict[str, Any]]:
    import torch

    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from test_kquants import _random_blocks

    from medusa_chat.kernels.gguf_linears import block_linear_from_gguf

    out = []
    layer = loaded.backbone.model.layers[3]
    q41 = [layer.mlp.gate_proj, layer.mlp.down_proj, layer.self_attn.q_proj]
    kq = [("Q4_K", block_linear_from_gguf("Q4_K", _random_blocks("Q4_K", 1024, 2048, seed=1), 1024, 2048))]
    kq.append(
        ("Q6_K", block_linear_from_gguf("Q6_K", _random_blocks("Q6_K", 1024, 2048, seed=1), 1024, 2048))
    )
    p = ctypes.c_void_p
    for lib in (old, new):
        lib.q4_1_gemm.argtypes = [p, ctypes.c_int, ctypes.c_int, p, p, p, ctypes.c_int, p, p, p, p]
        for fn in ("q4_k_gemm", "q6_k_gemm"):
            getattr(lib, fn).argtypes = [p, ctypes.c_int, ctypes.c_int, p, ctypes.c_int, p, p, p, p]
    cases = [("Q4_1", m) for m in q41] + kq
    for kind, mod in cases:
        n, k = mod.out_features, mod.in_features
        bufs = [getattr(mod, name) for name in mod.buffer_names]
        for m in rows:
            x = torch.randn(m, k)
            qx = torch.empty(4 * m * k + 256, dtype=torch.int8)
            dx, sx = torch.empty(m * k // 16 + 8), torch.empty(m * k // 16 + 8)
            ys = {name: torch.empty(m, n) for name in ("old", "new")}
            scratch = (qx.data_ptr(), dx.data_ptr(), sx.data_ptr())

            ptrs = [b.data_ptr() for b in bufs]
            calls = {}
            for name, lib in (("old", old), ("new", new)):
                y = ys[name].data_ptr()
                if kind == "Q4_1":
                    calls[name] = (lib.q4_1_gemm, (x.data_ptr(), m, k, *ptrs[:3], n, y, *scratch))
                else:
                    fn = getattr(lib, "q4_k_gemm" if kind == "Q4_K" else "q6_k_gemm")
                    calls[name] = (fn, (x.data_ptr(), m, k, ptrs[0], n, y, *scratch))
            t = _time_pair(calls, reps)
            o, w = min(t["old"]), min(t["new"])
            out.append({
                "kind": kind, "N": n, "K": k, "rows": m, "old_us": round(o * 1e6, 2), "new_us": round(w * 1e6, 2),
                "old_over_new": round(o / w, 3), "same_bits": bool(torch.equal(ys["old"], ys["new"])),
            })  # fmt: skip
            print(f"{kind} {n}x{k} rows {m}: old {o * 1e6:.1f} us, new {w * 1e6:.1f} us, old/new {o / w:.3f}")
    return out


def step(old: Any, new: Any, loaded: Any, rounds: int, rows: list[int]) -> dict[str, Any]:
    import torch

    from medusa_chat.engine.engine import MedusaEngine, plain_tree
    from medusa_chat.tuning.measure import timing_prefix

    for fn in ("decoder_forward", "decoder_scratch_bytes"):
        getattr(old, fn).argtypes, getattr(old, fn).restype = (
            getattr(new, fn).argtypes,
            getattr(new, fn).restype,
        )
    engine = MedusaEngine(loaded, plain_tree())
    native = engine.runner.lean
    prefix = timing_prefix(loaded, 256)
    engine.prefill(prefix, 0)
    outs: dict[int, list[torch.Tensor]] = {}
    times: dict[tuple[str, int], list[float]] = {}

    def one(lib: Any, t: int) -> float:
        native.lib = lib
        pos = torch.arange(256, 256 + t)
        t0 = time.perf_counter()
        y = native(prefix[:t], pos, engine.causal_mask(256, t), engine.cache)
        dt = time.perf_counter() - t0
        engine.cache.crop(256)
        outs.setdefault(t, []).append(y.clone())
        return dt

    for r in range(rounds):
        for t in rows:
            order = (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))
            for name, lib in order:
                times.setdefault((name, t), []).append(one(lib, t))
    native.lib = new
    res: dict[str, Any] = {"same_bits": all(torch.equal(v[0], y) for v in outs.values() for y in v)}
    for t in rows:
        ratios = [a / b for a, b in zip(times[("old", t)], times[("new", t)], strict=True)]
        q = statistics.quantiles(ratios)
        res[str(t)] = {
            "old_ms": round(statistics.median(times[("old", t)]) * 1e3, 3),
            "new_ms": round(statistics.median(times[("new", t)]) * 1e3, 3),
            "old_over_new": {"median": round(statistics.median(ratios), 3), "q1": round(q[0], 3), "q3": round(q[2], 3)},
            "old_vs_1_row": round(statistics.median(times[("old", t)]) / statistics.median(times[("old", 1)]), 3),
            "new_vs_1_row": round(statistics.median(times[("new", t)]) / statistics.median(times[("new", 1)]), 3),
        }  # fmt: skip
        print(f"step, {t} rows: {res[str(t)]}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="another build of the kernel library (.so)")
    ap.add_argument("--rows", default="1,2,3,4,8")
    ap.add_argument("--reps", type=int, default=200, help="calls per product and build (the fastest is kept)")
    ap.add_argument("--rounds", type=int, default=31, help="rounds of the whole-step timing")
    ap.add_argument(
        "--old-scheme",
        help="the K-quant activation scheme of --old (32, 256, nested; default: the new build's): with a copy of "
        "this checkout's library as --old, two schemes side by side (their K-quant bits then differ)",
    )
    ap.add_argument("--json", help="result file")
    args = ap.parse_args()
    os.environ.setdefault("MEDUSA_CHAT_AUTO_CALIBRATE", "0")

    import torch

    from medusa_chat.engine import threads
    from medusa_chat.kernels import cbind, isa_choice
    from medusa_chat.machine import cpu_model
    from medusa_chat.model.sources.loading import load_model

    threads.fix(1)
    new = cbind.load()
    old = ctypes.CDLL(str(Path(args.old).expanduser()))
    _same_settings(old, new, None if args.old_scheme is None else cbind.KQUANT_SCHEMES[args.old_scheme])
    rows = [int(r) for r in args.rows.split(",")]
    loaded = load_model(quant="auto", device="cpu")
    with torch.inference_mode():
        doc = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "isa": isa_choice.best_isa(),
            "threads": 1,
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "command": "python benchmarks/lib_ab.py " + " ".join(sys.argv[1:]),
            "old": Path(args.old).name,
            "kquant_schemes": {"old": args.old_scheme or cbind.kquant_scheme(), "new": cbind.kquant_scheme()},
            "new": Path(new._name).name,
            "products": products(old, new, loaded, args.reps, rows),
            "step": step(old, new, loaded, args.rounds, rows),
        }
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
