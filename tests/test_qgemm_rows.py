"""A tree step's rows through the block kernels, and the weight stream's prefetch hint (prefetch.py, qblock.h).

- Row invariance, row by row: every row of a 2-, 4- or 8-row product (a tree step's nodes) is bitwise that row
  computed alone (the plain loop's one-row step), for every kernel (Q4_1, Q8_0 and its fused argmax, Q4_K, Q5_K,
  Q6_K), on one thread (a small product) and in a parallel region (a large one), whatever prefetch hint is in
  force; and the hints give the same bits as each other.
- The hint is chosen by measuring (t0 kept unless another is clearly faster), cached per CPU and library, and
  MEDUSA_CHAT_PREFETCH overrides it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from medusa_chat.kernels import cbind, isa_choice, prefetch
from medusa_chat.kernels.gguf_file import BLOCK
from medusa_chat.kernels.gguf_linears import block_linear_from_gguf

pytestmark = pytest.mark.skipif(not cbind.available(), reason=f"qgemm kernel: {cbind.unavailable_reason()}")

TYPE_IDS = {"Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
FACTORS = {"Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random valid bytes of `type_name` [rows, bytes per row] (Q8_0 codes in -127..127), fp16 factors ~1e-2."""
    size, per = BLOCK[TYPE_IDS[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    if type_name == "Q8_0":
        raw[..., 2:] = np.clip(raw[..., 2:].view(np.int8), -127, 127).view(np.uint8)
    for off in FACTORS[type_name]:
        d = rng.standard_normal((rows, cols // per)) * 1e-2
        raw[..., off : off + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, cols // per, 2)
    return raw.reshape(rows, -1)


@pytest.fixture
def hints_restored():
    before = prefetch.prefetch_choice().get("hints")
    yield
    prefetch.set_prefetch(before or "t0")


# (rows, cols): one thread (N * K below the parallel threshold) and a parallel region with a padded last group
SHAPES = [(40, 512), (536, 1024)]


@pytest.mark.parametrize("type_name", list(TYPE_IDS))
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_a_row_among_others_is_the_row_alone_for_every_hint(type_name: str, n: int, k: int, hints_restored) -> None:
    lin = block_linear_from_gguf(type_name, _random_blocks(type_name, n, k, seed=n), n, k)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(k)) * 2
    x[3, : k // 2] = 0  # zero activation blocks in one row
    reference = None
    for hint in prefetch.PREFETCH_HINTS:
        prefetch.set_prefetch(hint)
        alone = torch.cat([lin(x[r : r + 1]) for r in range(8)])
        for m in (2, 4, 8):
            together = lin(x[:m])
            for r in range(m):
                assert torch.equal(together[r], alone[r]), f"{type_name} {hint}: row {r} of {m} differs alone"
        if reference is None:
            reference = alone
        assert torch.equal(alone, reference), f"{type_name}: hint {hint} changed the outputs"


def test_the_fused_argmax_of_a_row_among_others_is_its_argmax_alone(hints_restored) -> None:
    n, k = 4000, 576  # a vocab projection's shape in small: several groups per thread
    lin = block_linear_from_gguf("Q8_0", _random_blocks("Q8_0", n, k, seed=3), n, k)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(4))
    for hint in prefetch.PREFETCH_HINTS:
        prefetch.set_prefetch(hint)
        alone = torch.cat([lin.argmax(x[r : r + 1]) for r in range(8)])
        assert torch.equal(alone, lin(x).argmax(-1))
        for m in (2, 4, 8):
            assert torch.equal(lin.argmax(x[:m]), alone[:m]), f"{hint}: {m} rows"


def test_the_choice_keeps_t0_unless_another_hint_is_clearly_faster() -> None:
    margin = prefetch.PREFETCH_KEEP_MARGIN
    measured = {
        "q4_1": {"1 t0": 1.0, "1 t1": 1.0 - margin / 2, "2 t0": 1.0, "2 t1": 0.5},
        "q8_0": {"1 t0": 1.0, "1 t1": 1.2, "2 t0": 1.0, "2 t1": 1.0 - 2 * margin},
        "kquant": {"1 t0": 2.0, "1 t1": 1.0},  # a tile class not measured keeps t0
    }
    assert prefetch.choose_prefetch(measured) == {"q4_1": ["t0", "t1"], "q8_0": ["t0", "t1"], "kquant": ["t1", "t0"]}


def test_the_hints_are_measured_once_cached_and_overridden(
    monkeypatch: pytest.MonkeyPatch, tmp_path, hints_restored
) -> None:
    lib = cbind.load()
    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path))
    monkeypatch.delenv("MEDUSA_CHAT_PREFETCH", raising=False)
    calls = []

    def fake_measure(lib_: object) -> dict[str, dict[str, float]]:
        calls.append(1)
        return {f: {"1 t0": 2.0, "1 t1": 1.0, "2 t0": 1.0, "2 t1": 2.0} for f in prefetch.PREFETCH_FAMILIES}

    monkeypatch.setattr(prefetch, "measure_prefetch", fake_measure)
    isa = isa_choice.best_isa()
    prefetch.apply_prefetch(lib, isa, "test-lib")
    assert calls == [1] and prefetch.prefetch_choice()["hints"] == {f: ["t1", "t0"] for f in prefetch.PREFETCH_FAMILIES}
    assert [lib.mc_get_prefetch(f, c) for f in range(3) for c in (0, 1)] == [1, 0] * 3
    (cached,) = (tmp_path / "kernels").glob("prefetch-*-test-lib.json")
    assert json.loads(cached.read_text())["hints"]["kquant"] == ["t1", "t0"]
    prefetch.apply_prefetch(lib, isa, "test-lib")  # the cached choice: not measured again
    assert calls == [1]
    cached.write_text("{not json")  # an unreadable cache is measured again
    prefetch.apply_prefetch(lib, isa, "test-lib")
    assert calls == [1, 1]
    monkeypatch.setenv("MEDUSA_CHAT_PREFETCH", "off")
    prefetch.apply_prefetch(lib, isa, "test-lib")
    assert calls == [1, 1] and prefetch.prefetch_choice()["source"] == "MEDUSA_CHAT_PREFETCH"
    assert [lib.mc_get_prefetch(f, c) for f in range(3) for c in (0, 1)] == [3] * 6
    monkeypatch.setenv("MEDUSA_CHAT_PREFETCH", "t9")
    with pytest.raises(ValueError, match="MEDUSA_CHAT_PREFETCH"):
        prefetch.apply_prefetch(lib, isa, "test-lib")


def test_the_measurement_times_every_family_tile_and_hint() -> None:
    lib = cbind.load()
    before = [lib.mc_get_prefetch(f, c) for f in range(3) for c in (0, 1)]
    measured = prefetch.measure_prefetch(lib, rounds=1, total_bytes=1 << 20)
    assert set(measured) == set(prefetch.PREFETCH_FAMILIES)
    for times in measured.values():
        assert set(times) == {f"{r} {h}" for r in (1, 2) for h in prefetch.PREFETCH_MEASURED}
        assert all(t > 0 for t in times.values())
    assert [lib.mc_get_prefetch(f, c) for f in range(3) for c in (0, 1)] == before  # restored
