"""Compile the CUDA kernels (kernels/triton_matmul.py, triton_attention.py) for Hopper (sm_90) without a GPU:
Triton's own compiler and ptxas, as they would run on an H100/H200 at first use. The interpreter that runs the
kernels' tests on a CPU accepts programs the compiler refuses; this catches those before a GPU machine runs them.

Run in a process without TRITON_INTERPRET (tests/test_cuda_int4.py does): `python tests/cuda_compile.py`.
Prints one line per kernel variant with its registers and spill stack; exits 1 on the first failure.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from medusa_chat.kernels import triton_attention as ta  # noqa: E402
from medusa_chat.kernels import triton_matmul as tm  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def usage(cubin: bytes) -> str:
    """`REG:n STACK:n` of a cubin (cuobjdump -res-usage), or '' where the tool is absent."""
    if not CUOBJDUMP.is_file():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True, text=True).stdout
    line = next((ln for ln in out.splitlines() if "REG:" in ln), "")
    return " ".join(w for w in line.split() if w.startswith(("REG:", "STACK:")))


def build(fn, signature: dict[str, str], constexprs: dict[str, object], name: str, **options: int) -> None:  # noqa: ANN001
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    kernel = triton.compile(source, target=TARGET, options=options or None)
    print(f"ok {name}: {usage(kernel.asm['cubin'])}", flush=True)


def main() -> int:
    int4 = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*fp16", "zeros_ptr": "*fp16", "out_ptr": "*bf16",
            "M": "i32", "N": "i32", "HALF_K": "i32", "stride_xm": "i32", "stride_om": "i32", "stride_os": "i32",
            "GROUP": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "SPLIT_K": "constexpr",
            "TILES": "constexpr", "PARTIAL": "constexpr", "DOT_PRECISION": "constexpr"}  # fmt: skip
    for act in ("bf16",):  # (fp16 compiles to the same program with other types)
        for cfg in tm.CANDIDATES:
            for tiles in (1, 4):
                partial = cfg.split_k > 1
                sig = {**int4, "x_ptr": f"*{act}", "out_ptr": "*fp32" if partial else f"*{act}"}
                consts = {"GROUP": 64, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "SPLIT_K": cfg.split_k,
                          "TILES": tiles, "PARTIAL": partial, "DOT_PRECISION": "tf32"}  # fmt: skip
                build(tm._int4_kernel, sig, consts, f"int4 {act} {cfg.name()} tiles={tiles}",
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
    dense = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
             "stride_wn": "i32", "stride_xm": "i32", "stride_om": "i32", "stride_os": "i32", "BLOCK_N": "constexpr",
             "BLOCK_K": "constexpr", "SPLIT_K": "constexpr", "TILES": "constexpr", "PARTIAL": "constexpr",
             "DOT_PRECISION": "constexpr"}  # fmt: skip
    for tiles in (1, 4):
        build(tm._dense_kernel, dense, {"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1, "TILES": tiles,
                                        "PARTIAL": False, "DOT_PRECISION": "tf32"}, f"dense tiles={tiles}")  # fmt: skip
    build(tm._sum_splits, {"ws_ptr": "*fp32", "out_ptr": "*bf16", "count": "i32", "SPLIT_K": "constexpr",
                           "BLOCK": "constexpr"}, {"SPLIT_K": 4, "BLOCK": 1024}, "sum_splits")  # fmt: skip
    attention = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "start_ptr": "*i64", "path_ptr": "*i64",
                 "depth_ptr": "*i64", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "n_nodes": "i32", "stride_qn": "i32",
                 "stride_qh": "i32", "stride_kh": "i32", "stride_ks": "i32", "stride_pn": "i32", "stride_an": "i32",
                 "stride_ah": "i32", "stride_ac": "i32", "scale": "fp32", "GROUPS": "constexpr",
                 "GROUPS_PAD": "constexpr", "NODES": "constexpr", "HEAD_DIM": "constexpr", "BLOCK": "constexpr",
                 "CHUNK": "constexpr", "DOT_PRECISION": "constexpr"}  # fmt: skip
    for groups, head_dim in ((1, 128), (4, 128), (3, 64), (8, 128)):
        consts = {"GROUPS": groups, "GROUPS_PAD": triton.next_power_of_2(groups), "HEAD_DIM": head_dim,
                  "NODES": ta.nodes_per_program(groups), "BLOCK": ta.BLOCK, "CHUNK": ta.CHUNK,
                  "DOT_PRECISION": "tf32"}  # fmt: skip
        build(ta._path_attention_chunks, attention, consts, f"path attention groups={groups} head_dim={head_dim}")
    build(ta._merge_chunks, {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*bf16", "chunks": "i32",
                             "stride_on": "i32", "stride_oh": "i32", "HEADS": "constexpr", "HEAD_DIM": "constexpr"},
          {"HEADS": 32, "HEAD_DIM": 128}, "merge chunks")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
