"""AMX tiles against the AVX512-VNNI tiles for the Q4_1 / Q8_0 block products: bitwise the same outputs (and the
same fused argmax), and the time of each product per row count. Needs a CPU with AMX (amx_tile, amx_int8) and the
AMX kernel, which is not part of the app (measured and not kept: benchmarks/RESULTS.md); to re-measure:

    git apply benchmarks/amx_tiles.patch && python benchmarks/amx_rows.py && git apply -R benchmarks/amx_tiles.patch
"""

from __future__ import annotations

import os
import time

import torch

from medusa_chat.kernels import qgemm
from medusa_chat.kernels.cpu_linears import quantize_q4_1

SHAPES = ((1536, 576), (576, 1536), (49152, 576))
ROWS = (1, 2, 3, 4, 8, 15, 16, 17, 33, 64)
TIMED = (1, 2, 3, 4, 8, 16, 64)


def main() -> None:
    if "amx" not in qgemm.ISA_FLAGS:
        raise SystemExit("no AMX kernel in this tree: git apply benchmarks/amx_tiles.patch first")
    res: dict[tuple, dict[str, object]] = {}
    for isa in ("avx512vnni", "amx"):
        os.environ["MEDUSA_CHAT_QGEMM_ISA"] = isa
        for n, k in SHAPES:
            g = torch.Generator().manual_seed(n)
            w = torch.randn(n, k, generator=g) * 0.05
            x = torch.randn(70, k, generator=g)
            q4, q8 = qgemm.Q41Linear(*quantize_q4_1(w)), qgemm.Q80Linear(*qgemm.quantize_q8_0(w))
            for name, lin in (("q4_1", q4), ("q8_0", q8)):
                for m in ROWS:
                    cell = res.setdefault((name, n, k, m), {})
                    cell[isa] = lin(x[:m])
                    if m in TIMED:
                        reps = 20 if n > 10000 else 200
                        for _ in range(3):
                            lin(x[:m])
                        t = time.perf_counter()
                        for _ in range(reps):
                            lin(x[:m])
                        cell[isa + "_us"] = (time.perf_counter() - t) / reps * 1e6
            for m in (1, 3, 8, 16, 64):
                res.setdefault(("argmax", n, k, m), {})[isa] = q8.argmax(x[:m])
    differ = [key for key, v in res.items() if not torch.equal(v["amx"], v["avx512vnni"])]
    print("outputs that differ between the builds:", differ or "none")
    for key, v in res.items():
        if "amx_us" in v:
            ratio = v["amx_us"] / v["avx512vnni_us"]
            print(f"{key}: VNNI {v['avx512vnni_us']:.0f} us, AMX {v['amx_us']:.0f} us ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
