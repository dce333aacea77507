"""Where and how a model runs: the device, the compute dtype and the quantization the options ask for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from medusa_chat.errors import DeviceError
from medusa_chat.quant_choice import QUANTS, auto_quant_cuda

Progress = Callable[[str], None]




CPU_QUANTS = ("none", "int8", "int4")  # torch kernels, row-invariant (cpu_linears.py)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


DEVICES = ("auto", "cpu", "cuda")


def pick_device(device: str) -> torch.device:
    if device not in DEVICES and not device.startswith("cuda:"):
        raise DeviceError(f"unknown device {device!r} (use auto, cpu or cuda)")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(
            f"--device {device} was asked for but no CUDA GPU is usable here (torch {torch.__version__}"
            f"{', a CPU-only build' if torch.version.cuda is None else ''}); use --device cpu (--quant nf4 "
            "also works on CPU, slowly) or install a CUDA build of torch"
        )
    dev = torch.device(device)
    return (
        torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev
    )


def pick_quant(quant: str, device: torch.device) -> str:
    """auto: on CUDA the int4 path (model/forward/cuda_int4.py: Triton or tinygemm kernels, row-invariant, chosen by
    measuring) where Triton is installed, else bitsandbytes NF4; on a CPU "auto" stays until the session measures
    the paths (numeric_path.py). On a CPU int8 and int4 are the block kernels; nf4 is bitsandbytes (slow there)."""
    if quant not in QUANTS:
        raise DeviceError(f"unknown quantization {quant!r} (use {', '.join(QUANTS[:-1])} or {QUANTS[-1]})")
    if quant == "auto":
        if device.type != "cuda":
            return "auto"
        return auto_quant_cuda(cuda_int4_available())
    if device.type == "cpu" and quant in CPU_QUANTS:
        return quant
    if quant == "int4":
        if not cuda_int4_available():
            raise DeviceError("--quant int4 on a GPU needs triton (pip install triton), or use --quant nf4")
        return quant
    if quant != "none":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as err:
            raise DeviceError(
                f"--quant {quant} needs bitsandbytes: `pip install bitsandbytes`, or use --quant none"
            ) from err
    return quant


def cuda_int4_available() -> bool:
    from medusa_chat.kernels import triton_matmul

    return triton_matmul.triton is not None


# Told to a user who asked for bitsandbytes NF4 on a GPU with Medusa heads. Measured on an H200
# (benchmarks/RESULTS.md, "GPU"): bitsandbytes runs more than two rows by dequantizing every weight, so an NF4 tree
# step of 64 nodes costs 2.5x a plain step and the calibration keeps (nearly) plain decoding.
NF4_TREES_NOTE = (
    "bitsandbytes NF4 tree steps cost 2-2.5x a plain step (it dequantizes each weight for more than one row): "
    "--quant int4 (the default on CUDA where triton is installed) keeps tree steps on its 4-bit kernel"
)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        # fp32 on a CPU: greedy Medusa output is then bit-identical to plain greedy decoding. bf16 is ~2x
        # faster on CPUs with native bf16 but only identical up to bf16 rounding ties; it is one flag away
        # (--dtype bfloat16) and load_model says so in its notes.
        return torch.float32
    if dtype not in DTYPES:
        raise DeviceError(f"unknown dtype {dtype!r} (use auto, float32, bfloat16 or float16)")
    return DTYPES[dtype]


def quantization_config(quant: str, dtype: torch.dtype) -> Any:
    if quant == "none":
        return None
    from transformers import BitsAndBytesConfig

    if quant == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True,  # ~0.4 bit/param saved, no measurable quality cost
        )
    return BitsAndBytesConfig(load_in_8bit=True)
