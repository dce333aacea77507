"""The `--quant` choices and what `auto` picks, in one place: `model/sources/devices.py` decides with `auto_quant_cuda`
and the command line's help is written from the same table (no torch import here: the CLI builds its parser
before any model loads)."""

from __future__ import annotations

QUANTS = ("auto", "none", "int8", "int4", "nf4")

# On CUDA, in order: the first whose condition holds is what `auto` loads.
AUTO_ON_CUDA = (
    ("int4", "where triton is installed (its kernel checked on the GPU at first load; on a failed check the "
             "other int4 kernel, then 16-bit where memory allows, then NF4)"),
    ("nf4", "(bitsandbytes)"),
)  # fmt: skip
AUTO_ON_CPU = "the fastest of none/int8/int4, measured once and cached"
CPU_BLOCKS = "int8/int4 on a CPU: GGUF Q8_0/Q4_1 blocks, the embedded model's own from its file"


def auto_quant_cuda(int4_available: bool) -> str:
    """What `--quant auto` loads on a CUDA GPU (AUTO_ON_CUDA's order)."""
    return AUTO_ON_CUDA[0][0] if int4_available else AUTO_ON_CUDA[1][0]


def quant_help() -> str:
    cuda = ", else ".join(f"{q} {why}" for q, why in AUTO_ON_CUDA)
    return f"weight quantization (auto: on CUDA {cuda}; on a CPU {AUTO_ON_CPU}; {CPU_BLOCKS})"
