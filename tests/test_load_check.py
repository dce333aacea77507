"""The load-time check of the CUDA int4 path (kernels/load_check.py, model/forward/cuda_check.py), under Triton's
interpreter on a CPU (on a GPU machine, for real).

The faulty kernels are the real kernel sources with one line changed, as a GPU compiler or a Triton release
could get them wrong: tile 1 reading from the wrong row offset, the high half of K taking the low half's group
scale, the attention's key mask one key too long. Plus a kernel whose configuration follows the row count (as
cuBLAS's algorithm choice does): right values, but a row's bits change with its neighbours. The check must
catch each, and the load must fall back (the other int4 kernel, then 16-bit, then NF4), saying so in a note.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch

from medusa_chat.errors import DeviceError
from medusa_chat.kernels import triton_attention, triton_linears, triton_matmul
from medusa_chat.kernels.int4_quant import pack_int4
from medusa_chat.kernels.load_check import check_attention, check_int4
from medusa_chat.kernels.triton_linears import Int4Linear
from medusa_chat.model.forward import cuda_check, cuda_int4

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
ROWS = 20  # two 16-row tiles: tile 1 holds rows 16..19

pytestmark = pytest.mark.skipif(
    not triton_matmul.available(), reason="needs triton (a GPU or its interpreter)"
)

FAULTS = {
    "tile_offset": (triton_matmul, "x1 = x_off + 16 * stride_xm", "x1 = x_off + 15 * stride_xm"),
    "group_scale": (triton_matmul, "g_hi = (HALF_K + k0) // GROUP", "g_hi = k0 // GROUP"),
    "attention_mask": (
        triton_attention,
        "tl.minimum(lo + CHUNK, start + depth + 1), lo)",
        "tl.minimum(lo + CHUNK, start + depth + 2), lo)",
    ),
}


def faulty(name: str, tmp_path: Path) -> ModuleType:
    """The kernel module with one fault (FAULTS), imported from its own file (Triton reads a kernel's source)."""
    module, right, wrong = FAULTS[name]
    source = inspect.getsource(module)
    assert source.count(right) == 1, name  # the fault is where the test says
    path = tmp_path / f"faulty_{name}.py"
    path.write_text(source.replace(right, wrong))
    spec = importlib.util.spec_from_file_location(f"faulty_{name}", path)
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = copy
    spec.loader.exec_module(copy)
    return copy


def inject(monkeypatch: pytest.MonkeyPatch, name: str, tmp_path: Path) -> None:
    copy = faulty(name, tmp_path)
    if FAULTS[name][0] is triton_matmul:
        monkeypatch.setattr(triton_linears, "int4_matmul", copy.int4_matmul)
    else:
        monkeypatch.setattr(triton_attention, "path_attention", copy.path_attention)


def row_count_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernel with its K split chosen by the row count: each value still right, a row's bits not."""
    real = triton_matmul.int4_matmul

    def by_rows(x: torch.Tensor, w, cfg):  # noqa: ANN001
        return real(x, w, cfg if x.shape[0] == 1 else replace(cfg, split_k=4))

    monkeypatch.setattr(triton_linears, "int4_matmul", by_rows)


def linear(seed: int = 0, n: int = 48, k: int = 256) -> Int4Linear:
    g = torch.Generator().manual_seed(seed)
    m = Int4Linear(pack_int4(torch.randn(n, k, generator=g).to(DEVICE), 32), None, act_dtype=DTYPE)
    m.config = triton_matmul.Config(64, 32, 1, 4, 3)  # one program per call: the interpreter's cost
    return m


def test_the_real_kernels_pass() -> None:
    assert check_int4([linear(0), linear(1, n=40, k=128)], ROWS).ok
    assert check_attention(2, 2, 16, 8, DTYPE, DEVICE, prefix=70).ok


@pytest.mark.parametrize("fault", ["tile_offset", "group_scale"])
def test_a_faulty_int4_kernel_fails_its_check(fault: str, monkeypatch, tmp_path) -> None:
    inject(monkeypatch, fault, tmp_path)
    verdict = check_int4([linear()], ROWS)
    assert not verdict.ok and "wrong values" in verdict.why, verdict.why
    # the tile fault shows only past 16 rows: a check at one row alone would have passed it
    assert ("at 20 rows" in verdict.why) == (fault == "tile_offset")


def test_rows_that_change_with_their_neighbours_fail_the_check(monkeypatch) -> None:
    row_count_config(monkeypatch)
    verdict = check_int4([linear()], ROWS)
    assert not verdict.ok and "differs alone and among 20 rows" in verdict.why, verdict.why


def test_a_faulty_attention_mask_fails_its_check(monkeypatch, tmp_path) -> None:
    inject(monkeypatch, "attention_mask", tmp_path)
    verdict = check_attention(2, 2, 16, 8, DTYPE, DEVICE, prefix=70)
    assert not verdict.ok and "tree attention 2x2x16: wrong values" in verdict.why, verdict.why


def test_a_compile_error_is_a_failed_check_not_a_crash(monkeypatch) -> None:
    def broken(*_args, **_kwargs):
        raise RuntimeError("PTX compilation failed\nmore")

    monkeypatch.setattr(triton_linears, "int4_matmul", broken)
    verdict = check_int4([linear()], ROWS)
    assert not verdict.ok and verdict.why.endswith("RuntimeError: PTX compilation failed")


def test_no_row_invariant_kernel_is_no_kernel(monkeypatch) -> None:
    """The kernel choice no longer settles on Triton when neither kernel keeps a row's bits."""
    row_count_config(monkeypatch)
    m = linear()
    monkeypatch.setattr(cuda_int4, "TREE_ROWS", ROWS)
    record = cuda_int4._measure({"48x256g32": [m]}, (triton_matmul.Config(64, 32, 1, 4, 3),))
    assert record["rows_invariant"]["triton"] is False and record["kernel"] is None


def test_the_fallback_order_after_a_failed_check() -> None:
    gib = 1 << 30
    assert cuda_check.fallback_quant(14 * gib, 80 * gib, True)[0] == "none"
    quant, why = cuda_check.fallback_quant(14 * gib, 10 * gib, True)
    assert quant == "nf4" and "calibrate" in why
    with pytest.raises(DeviceError, match="bitsandbytes"):
        cuda_check.fallback_quant(14 * gib, 10 * gib, False)


@pytest.mark.parametrize("fault", ["group_scale", "attention_mask"])
def test_the_int4_load_falls_back_when_its_check_fails_and_remembers(
    fault: str, tiny_llama_dir, monkeypatch, tmp_path
) -> None:
    """backbones.load_cuda_int4 on a real checkpoint folder with a faulty kernel: no int4 backbone, the load
    goes on with 16-bit weights (this machine's memory holds the tiny model) and one note says why. The verdict
    is cached: the next load does not check again."""
    from medusa_chat.model.sources import backbones

    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cuda_int4, "TREE_ROWS", 8)
    # the interpreter's cost: the kernel choice times one configuration, once per row count
    measure, time_call, tune = cuda_int4._measure, cuda_int4.time_call, cuda_int4.tune
    one = (triton_matmul.Config(64, 32, 1, 4, 3),)
    monkeypatch.setattr(cuda_int4, "_measure", lambda by_shape, _c: measure(by_shape, one))
    monkeypatch.setattr(cuda_int4, "time_call", lambda fn, _reps: time_call(fn, 1))
    monkeypatch.setattr(
        cuda_int4, "tune", lambda m, rows, candidates, reps: tune(m, rows, (1.0, 1.0), candidates, 1)
    )
    inject(monkeypatch, fault, tmp_path)
    said: list[str] = []
    notes: list[str] = []
    backbone, quant = backbones.load_cuda_int4(
        tiny_llama_dir, DEVICE, DTYPE, notes, said.append, False, False
    )
    assert backbone is None and quant == "none"
    assert (
        len(notes) == 1
        and notes[0].startswith("int4 failed its check on this GPU (")
        and "16-bit" in notes[0]
    )
    assert ("tree attention" in notes[0]) == (fault == "attention_mask")
    assert any("Checking the int4 kernels" in s for s in said)

    def no_checking(*_args, **_kwargs):
        raise AssertionError("checked again")

    monkeypatch.setattr(cuda_check, "check_int4", no_checking)
    monkeypatch.setattr(cuda_check, "check_attention", no_checking)
    monkeypatch.setattr(cuda_check, "check_linear", no_checking)
    again: list[str] = []
    assert backbones.load_cuda_int4(tiny_llama_dir, DEVICE, DTYPE, again, print, False, False)[0] is None
    assert [n.split(": 16-bit")[0] for n in again] == [
        n.split(": 16-bit")[0] for n in notes
    ]  # (free memory moves)


def test_tinygemm_ops_have_the_signatures_the_int4_kernel_calls() -> None:
    """int4_quant.tinygemm_operands and Int4Linear call these with uint8 [N, K/2] codes and bf16 [K/g, N, 2]
    scales and zeros (torch >= 2.5; the same schemas in 2.11, the GPU machine's, and 2.13). A torch that changes
    them fails here; on a user's GPU the load check would catch it and fall back."""
    ops = torch.ops.aten
    schemas = {name: [str(s) for s in getattr(ops, name)._schemas.values()]
               for name in ("_convert_weight_to_int4pack", "_weight_int4pack_mm")}  # fmt: skip
    assert schemas == {
        "_convert_weight_to_int4pack": [
            "aten::_convert_weight_to_int4pack(Tensor self, int innerKTiles) -> Tensor"
        ],
        "_weight_int4pack_mm": [
            "aten::_weight_int4pack_mm(Tensor self, Tensor mat2, int qGroupSize, Tensor qScaleAndZeros) -> Tensor"
        ],
    }
