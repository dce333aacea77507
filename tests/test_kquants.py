"""GGUF tensors as stored on the block kernel (gguf_linears.py, csrc/kquants.c): Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
Q6_K, and the known-answer check at load (known_answers.py).

- gguf_file.dequantize of every type is bit for bit gguf-py's `gguf.quants.dequantize` of the same bytes.
- Each module's `dequantized()` is bit for bit gguf-py's dequantization (so the kernel runs the file's weights,
  no second rounding), and its outputs are its definition: a float64 reference of the same arithmetic (8-bit
  activation blocks, the file's per-sub-block factors); row-invariant; the same bits in every ISA build.
- The native C step calls the K-quant kinds (decoder.c): its hidden states match the lean forward's.
- The known-answer check passes every real kernel and refuses a deliberately wrong one.
K-quant blocks are random valid bytes (every bit pattern of codes and scales is valid; gguf-py cannot
quantize K-quants), with d / dmin written as fp16 in a weight-like range.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from medusa_chat.errors import DeviceError
from medusa_chat.kernels import block_linears, cbind, known_answers, quantizers
from medusa_chat.kernels.gguf_file import BLOCK, GGUFTensor, dequantize, unpack_k
from medusa_chat.kernels.gguf_linears import (
    K_CLASSES,
    SUPPORTED_TYPES,
    Q4KLinear,
    Q5KLinear,
    Q6KLinear,
    block_linear_from_gguf,
)
from medusa_chat.machine import cpu_flags

pytestmark = pytest.mark.skipif(not cbind.available(), reason=f"qgemm kernel: {cbind.unavailable_reason()}")

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def _gguf_dequantize(raw: np.ndarray, type_name: str, rows: int, cols: int) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    return gguf_dequantize(raw, getattr(GGMLQuantizationType, type_name)).reshape(rows, cols)


def _random_blocks(type_name: str, rows: int, cols: int, seed: int, scale: float = 1e-3) -> np.ndarray:
    """Random valid bytes of `type_name` [rows, bytes per row], fp16 factors of magnitude ~scale."""
    size, per = BLOCK[TYPE_IDS[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    offsets = {"Q4_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[type_name]
    for off in offsets:
        d = rng.standard_normal((rows, cols // per)) * scale
        raw[..., off : off + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, cols // per, 2)
    return raw.reshape(rows, -1)


def _quantized_by_gguf(type_name: str, w: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType, quantize

    return quantize(w, getattr(GGMLQuantizationType, type_name))


@pytest.mark.parametrize("type_name", ["Q4_0", *K_TYPES])
def test_dequantize_is_gguf_pys(type_name: str) -> None:
    raw = _random_blocks(type_name, 9, 512, seed=1)
    t = GGUFTensor("w", (9, 512), TYPE_IDS[type_name], raw.reshape(-1))
    ours, theirs = dequantize(t), _gguf_dequantize(raw, type_name, 9, 512)
    assert ours.dtype == np.float32 and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def _reference(x: torch.Tensor, type_name: str, k: dict, scheme: str = "32") -> torch.Tensor:
    """The K-quant kernel's definition in float64: x as the scheme's 8-bit activations stand for it (per 32, per
    superblock of 256 as llama.cpp's Q8_K, or nested: known_answers.activations_as_the_kernel_rounds_them), the
    weight the fields define exactly ((d * sc) * q - dmin * m, or (d * sc) * (q - 32)), summed in float64."""
    xq = known_answers.activations_as_the_kernel_rounds_them(x, scheme)
    codes = torch.from_numpy(k["codes"].astype(np.float64))
    d = torch.from_numpy(k["d"].astype(np.float64))
    sc = torch.from_numpy(k["sc"].astype(np.float64))
    if type_name == "Q6_K":
        w = (d.repeat_interleave(16, 1) * sc).repeat_interleave(16, 1) * (codes - 32)
    else:
        dmin, m = (torch.from_numpy(k[n].astype(np.float64)) for n in ("dmin", "m"))
        a, b = d.repeat_interleave(8, 1) * sc, dmin.repeat_interleave(8, 1) * m
        w = a.repeat_interleave(32, 1) * codes - b.repeat_interleave(32, 1)
    return xq @ w.t()


SCHEMES = tuple(cbind.KQUANT_SCHEMES)


def _set_scheme(lib: object, scheme: str) -> None:
    lib.mc_set_kq_scheme(cbind.KQUANT_SCHEMES[scheme])  # type: ignore[attr-defined]


@pytest.fixture(params=SCHEMES, ids=[f"act{s}" for s in SCHEMES])
def act_block(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each K-quant activation scheme in turn (csrc/kquants.c: a scale per 32, per superblock of 256, or nested),
    set on the loaded libraries and put back after."""
    libs = [lib for lib in cbind.libraries().values() if lib is not None] or [cbind.load()]
    for lib in libs:
        _set_scheme(lib, request.param)
    yield request.param
    for lib in cbind.libraries().values():
        if lib is not None:
            _set_scheme(lib, cbind.kquant_scheme())


def test_nested_activations_keep_a_small_sub_block_beside_an_outlier() -> None:
    """What the nested scheme is for: a sub-block of small values beside an outlier in the same superblock keeps
    most of its resolution (per 256 rounds it to a few levels), and sub-blocks of like magnitude are stepped
    nearly as finely as per 32; every code stays within +-127 (the rounding of each scheme is what the kernels
    compute: the definition tests above)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 512, generator=g)
    x[:, 7] = 12.0  # an outlier in sub-block 0 of superblock 0 (~4x the others' largest)
    x[:, 32:64] *= 0.1  # a sub-block of small values beside it
    rounded = {s: known_answers.activations_as_the_kernel_rounds_them(x, s) for s in SCHEMES}
    def rms(s: str, cols: slice) -> float:
        return float((rounded[s] - x.double())[:, cols].pow(2).mean().sqrt())

    small, beside, apart = slice(32, 64), slice(64, 256), slice(256, 512)  # superblock 1 has no outlier
    assert rms("nested", small) < rms("256", small) / 6
    assert rms("nested", beside) < 1.25 * rms("32", beside) and rms("256", beside) > 4 * rms("nested", beside)
    assert rms("nested", apart) < 1.1 * rms("32", apart) and rms("256", apart) > 1.2 * rms("32", apart)
    for s in ("256", "nested"):  # codes: the rounded values over their steps, integers within +-127
        xb = x.view(4, 2, 8, 32).abs().amax(-1, keepdim=True)
        dk = (xb.amax(-2, keepdim=True) / 2032).double()
        m = 16 if s == "256" else torch.ceil(16 * xb / xb.amax(-2, keepdim=True)).clamp(1, 16).double()
        codes = rounded[s].view(4, 2, 8, 32) / (dk * m)
        assert float((codes - codes.round()).abs().max()) < 1e-6 and float(codes.abs().max()) <= 127


@pytest.mark.parametrize("type_name", K_TYPES)
@pytest.mark.parametrize(("n", "k"), [(40, 512), (96, 256)])
def test_k_quants_compute_their_definition_and_are_row_invariant(
    type_name: str, n: int, k: int, act_block: str
) -> None:
    raw = _random_blocks(type_name, n, k, seed=n + k)
    lin = block_linear_from_gguf(type_name, raw, n, k)
    assert isinstance(lin, (Q4KLinear, Q5KLinear, Q6KLinear)) and lin.kind == type_name.lower()
    # the weights are the file's: bit for bit gguf-py's dequantization of the same bytes
    assert torch.equal(lin.dequantized(), torch.from_numpy(_gguf_dequantize(raw, type_name, n, k)))
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(n)) * 2
    x[3, :256] = 0  # an all-zero activation superblock
    y = lin(x)
    ref = _reference(x, type_name, unpack_k(type_name, raw, n, k), act_block)
    assert y.shape == (19, n) and torch.allclose(
        y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()
    )
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16):  # tiles of 4 rows and their remainders
        assert torch.equal(lin(x[:rows]), y[:rows]), f"{type_name}: rows 0..{rows} differ"
    idx = torch.tensor([n - 1, 0, 5])  # row selection (the drafter's vocabulary rows) keeps the bits
    assert torch.equal(lin.rows(idx)(x), y[:, idx])


@pytest.mark.parametrize("type_name", K_TYPES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_k_quants_at_their_integer_bounds(
    type_name: str, sign: float, act_block: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every code and scale at its largest magnitude against activations all at +-127: the kernel's 16-bit
    partial sums (AVX2) and 32-bit superblock sums (kq_tile.h's bounds) hold without saturating or wrapping,
    in every instruction set this CPU has (the definition is the float64 reference)."""
    n, k = 24, 512
    raw = _random_blocks(type_name, n, k, seed=3).reshape(n, k // 256, -1)
    if type_name == "Q6_K":  # ql, qh all ones: q = 63; scales -128 (the largest |int8|)
        raw[..., :192] = 0xFF
        raw[..., 192:208] = 0x80
    else:  # scales and minima 63, codes (and Q5_K's 5th bits) all ones: q = 15 / 31
        raw[..., 4:] = 0xFF
    raw = raw.reshape(n, -1)
    x = torch.full((3, k), sign)
    x[1, ::2] = -sign  # alternating signs: the minimum term and the dot partly cancel
    ref = _reference(x, type_name, unpack_k(type_name, raw, n, k), act_block)
    isas = ["avx2"] + (["avx512vnni"] if {"avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags() else [])
    for isa in isas:
        monkeypatch.setenv("MEDUSA_CHAT_QGEMM_ISA", isa)
        lib = cbind.load()
        assert lib is not None, cbind.unavailable_reason()
        _set_scheme(lib, act_block)
        y = block_linear_from_gguf(type_name, raw, n, k)(x).double()
        assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), (isa, (y - ref).abs().max())


def test_k_quant_blocks_round_trip_and_fuse() -> None:
    """The interleaved stream gives the file's fields back exactly; fused projections equal the separate ones
    and keep one copy of the weights."""
    mods = [
        block_linear_from_gguf("Q4_K", _random_blocks("Q4_K", n, 256, seed=n), n, 256) for n in (32, 16, 16)
    ]
    for n, m in zip((32, 16, 16), mods, strict=True):
        raw = _random_blocks("Q4_K", n, 256, seed=n)
        want = unpack_k("Q4_K", raw, n, 256)
        assert all(np.array_equal(m.blocks()[f], want[f]) for f in want)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    separate = [m(x) for m in mods]
    fused = block_linears.fuse(mods)
    assert fused is not None and fused.out_features == 64 and isinstance(fused, Q4KLinear)
    assert torch.equal(fused(x), torch.cat(separate, dim=-1))
    assert all(torch.equal(m(x), s) for m, s in zip(mods, separate, strict=True))
    assert mods[1].qs.data_ptr() == fused.qs[32:].data_ptr()
    q6 = block_linear_from_gguf("Q6_K", _random_blocks("Q6_K", 16, 256, seed=3), 16, 256)
    assert block_linears.fuse([mods[0], q6]) is None  # kinds do not mix


def test_every_instruction_set_gives_the_same_bits(act_block: str, monkeypatch: pytest.MonkeyPatch) -> None:
    flags = cpu_flags()
    isas = ["avx2"] + (["avxvnni"] if "avx_vnni" in flags else [])
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        isas.append("avx512vnni")
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(7)) * 3
    raws = {t: _random_blocks(t, 200, 512, seed=11) for t in K_TYPES}  # 12.5 groups of 16
    outs: dict[str, list[torch.Tensor]] = {}
    for isa in isas:
        monkeypatch.setenv("MEDUSA_CHAT_QGEMM_ISA", isa)
        lib = cbind.load()
        assert lib is not None, cbind.unavailable_reason()
        _set_scheme(lib, act_block)
        mods = [block_linear_from_gguf(t, raws[t], 200, 512) for t in K_TYPES]
        outs[isa] = [m(x) for m in mods] + [m(x[:3]) for m in mods] + [m(x[:1]) for m in mods]
    for isa in isas[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[isa], outs["avx2"], strict=True)), isa


def test_legacy_types_are_the_files_weights() -> None:
    """Q4_0 (as Q4_1 with m = -8 d), Q4_1 and Q8_0 bytes written by gguf-py's own quantizer: the modules'
    weights are gguf-py's dequantization bit for bit; Q4_0 blocks whose -8 d overflows fp16 become Q8_0."""
    w = np.random.default_rng(4).standard_normal((24, 128)).astype(np.float32) * 0.05
    for type_name, cls in (("Q4_0", block_linears.Q41Linear), ("Q4_1", block_linears.Q41Linear), ("Q8_0", block_linears.Q80Linear)):
        raw = _quantized_by_gguf(type_name, w)
        lin = block_linear_from_gguf(type_name, raw, 24, 128)
        assert type(lin) is cls, type_name
        assert torch.equal(lin.dequantized(), torch.from_numpy(_gguf_dequantize(raw, type_name, 24, 128)))
    raw = _random_blocks("Q4_0", 16, 64, seed=5)
    raw[3, 0:2] = np.array([9000.0], np.float16).view(np.uint8)  # 8 d = 72000: not an fp16
    lin = block_linear_from_gguf("Q4_0", raw, 16, 64)
    assert type(lin) is block_linears.Q80Linear
    assert torch.equal(lin.dequantized(), torch.from_numpy(_gguf_dequantize(raw, "Q4_0", 16, 64)))
    assert block_linear_from_gguf("F16", np.zeros((2, 64), np.uint8), 2, 32) is None
    assert SUPPORTED_TYPES == {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}


def test_every_kernel_gives_the_known_answer_and_a_wrong_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    known_answers.reset()
    for cls in (block_linears.Q41Linear, block_linears.Q80Linear, Q4KLinear, Q5KLinear, Q6KLinear):
        assert known_answers.disagreement(cls) == "", cls.kind
        known_answers.check_known_answer(cls)

    # a kernel whose outputs are off by one part in 1000: refused, with one line naming the kind
    def off(self: Q6KLinear, x: torch.Tensor) -> torch.Tensor:
        return block_linears.BlockLinear.forward(self, x) * 1.001

    monkeypatch.setattr(Q6KLinear, "forward", off)
    known_answers.reset()
    reason = known_answers.disagreement(Q6KLinear)
    assert "q6_k" in reason and "\n" not in reason
    with pytest.raises(DeviceError, match="q6_k block kernel disagrees"):
        block_linear_from_gguf("Q6_K", _random_blocks("Q6_K", 16, 256, seed=1), 16, 256)
    assert known_answers.kernels_agree((Q4KLinear, Q6KLinear)).startswith("the q6_k block kernel disagrees")
    monkeypatch.undo()
    known_answers.reset()
    assert known_answers.kernels_agree((Q4KLinear, Q6KLinear)) == ""


def test_the_known_answer_follows_the_activation_scheme(act_block: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each K-quant scheme passes its own known answer and fails the others': the check tells them apart (no
    scheme's kernel is within the tolerance of another scheme's definition)."""
    known_answers.reset()
    assert known_answers.kquant_scheme() == act_block
    for cls in (Q4KLinear, Q5KLinear, Q6KLinear):
        assert known_answers.disagreement(cls) == "", (cls.kind, act_block)
    for other in SCHEMES:
        if other != act_block:
            monkeypatch.setattr(known_answers, "kquant_scheme", lambda other=other: other)  # another's reference
            for cls in (Q4KLinear, Q5KLinear, Q6KLinear):
                assert "disagrees" in known_answers.disagreement(cls), (cls.kind, act_block, other)
    known_answers.reset()


def test_the_activation_scheme_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per 32 unless MEDUSA_CHAT_KQUANT_ACTIVATIONS names another scheme; the library loaded for this CPU
    carries it, and the device name that keys cached timings says which (the default's name unchanged)."""
    monkeypatch.delenv("MEDUSA_CHAT_KQUANT_ACTIVATIONS", raising=False)
    assert cbind.kquant_scheme() == "32"
    lib = cbind.load()
    assert lib is not None and lib.mc_get_kq_scheme() == 32
    from medusa_chat.model.sources.numeric_path import device_name

    default_name = device_name("cpu")
    assert "K-quant" not in default_name
    for name in ("256", "nested"):
        monkeypatch.setenv("MEDUSA_CHAT_KQUANT_ACTIVATIONS", name)
        assert cbind.kquant_scheme() == name
        # timings cached per device (calibrations, tree choices) are kept apart per scheme
        assert device_name("cpu") == default_name[:-1] + f", K-quant activations {name})"
    monkeypatch.setenv("MEDUSA_CHAT_KQUANT_ACTIVATIONS", "64")
    with pytest.raises(ValueError, match="one of 32, 256, nested"):
        cbind.kquant_scheme()


def test_a_block_kernel_missing_its_known_answer_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare_cpu_linears (the int4 / int8 CPU paths) checks the kinds it would use: a wrong Q8_0 kernel makes
    it take torch's weight-only kernels instead, and say why in one line."""
    from torch import nn

    from medusa_chat.kernels.cpu_linears import Int8Linear, check_row_invariant
    from medusa_chat.model.forward.cpu_blocks import prepare_cpu_linears

    def off(self: block_linears.Q80Linear, x: torch.Tensor) -> torch.Tensor:
        return block_linears.BlockLinear.forward(self, x) + 1e-3

    monkeypatch.setattr(block_linears.Q80Linear, "forward", off)
    known_answers.reset()
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Module()])
    model.model.layers[0].proj = nn.Linear(64, 32, bias=False)
    model.lm_head = nn.Linear(64, 48, bias=False)
    model.get_output_embeddings = lambda: model.lm_head
    model.config = type("C", (), {})()
    notes: list[str] = []
    summary = prepare_cpu_linears(model, "int8", progress=notes.append)
    assert (
        summary["refused"].startswith("the q8_0 block kernel disagrees")
        and notes[0].strip() == summary["refused"]
    )
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.model.layers[0].proj, Int8Linear)
    with pytest.raises(DeviceError, match="q8_0"):  # and the row-invariance check refuses such a module too
        check_row_invariant(block_linears.Q80Linear(*quantizers.quantize_q8_0(torch.randn(16, 64))), torch.float32)
    monkeypatch.undo()
    known_answers.reset()


@pytest.mark.parametrize("mixed", [False, True])
def test_the_native_step_runs_k_quant_projections(mixed: bool, act_block: str) -> None:
    """decoder.c calls the K-quant kinds (BLin.kind 2-4): a Llama whose projections are Q4_K / Q5_K / Q6_K
    blocks gives, through the native C step, the hidden states of the transformers forward over the same
    modules (up to the native step's fp16 KV cache), and a token decoded alone gets the bits it gets in a
    prefill block. `mixed`: v and up of another type than q/k and gate (as a Q4_K_M file's Q6_K attn_v): they
    run apart (DLayer v / up) and their outputs are interleaved as the fused ones would be."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from medusa_chat.engine.engine import TreeKVCache
    from medusa_chat.model.forward.block_forward import native_forward_for

    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    lm = LlamaForCausalLM(cfg).eval()
    kinds = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q4_K", "o_proj": "Q6_K"}
    kinds |= {"gate_proj": "Q5_K", "up_proj": "Q5_K", "down_proj": "Q6_K"}
    if mixed:
        kinds |= {"v_proj": "Q6_K", "up_proj": "Q4_K"}
    for i, layer in enumerate(lm.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, type_name in kinds.items():
                if hasattr(parent, name):
                    old = getattr(parent, name)
                    n, k = old.out_features, old.in_features
                    scale = 2e-5 if type_name == "Q6_K" else 1e-4
                    raw = _random_blocks(type_name, n, k, seed=i * 10 + len(name), scale=scale)
                    setattr(parent, name, block_linear_from_gguf(type_name, raw, n, k))
    native = native_forward_for(lm)
    assert native is not None
    assert all((layer.v.kind >= 0) == mixed and (layer.up.kind >= 0) == mixed for layer in native.model.layers[:2])
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = lm.model(ids[None]).last_hidden_state[0]
        cache = TreeKVCache(cfg.num_hidden_layers, capacity=64)
        block = native(ids, torch.arange(12), torch.zeros(1), cache).clone()
        cache2 = TreeKVCache(cfg.num_hidden_layers, capacity=64)
        native(ids[:11], torch.arange(11), torch.zeros(1), cache2)
        alone = native(ids[11:], torch.arange(11, 12), torch.zeros(1), cache2).clone()
    if act_block == "32":
        assert torch.allclose(block, ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
    else:
        # The paths differ only by the native step's fp16 KV cache: its rounding flips some 8-bit activation
        # codes downstream, and this random-weight model amplifies that to ~3% with the superblock schemes' codes (an
        # embedding perturbed by 5e-4 moves the transformers forward's own output as much); a wrong kernel or
        # scratch layout is off by tens of percent.
        assert float((block - ref).norm() / ref.norm()) < 0.05
    assert torch.equal(alone[0], block[11])


@pytest.mark.parametrize("type_name", K_TYPES)
def test_the_c_repack_is_the_numpy_one(type_name: str) -> None:
    """kquants.c kq_repack (the load path) writes exactly interleave_k's bytes, padding rows included."""
    raw = _random_blocks(type_name, 37, 768, seed=8)
    fast = K_CLASSES[type_name](37, 768, raw=raw)
    slow = K_CLASSES[type_name](37, 768, raw=raw, numpy_repack=True)
    assert torch.equal(fast.qs, slow.qs) and fast.qs.shape[0] % fast.group == 0


@pytest.mark.parametrize("type_name", K_TYPES)
def test_a_k_quant_embedding_looks_up_the_files_rows(type_name: str) -> None:
    """embedding_from_gguf: rows dequantized in C (kq_rows) are bit for bit gguf-py's rows of the same bytes."""
    from medusa_chat.kernels.gguf_linears import KQuantEmbedding, embedding_from_gguf

    raw = _random_blocks(type_name, 50, 512, seed=9)
    emb = embedding_from_gguf(type_name, raw, 50, 512)
    assert isinstance(emb, KQuantEmbedding)
    ids = torch.tensor([[0, 49, 17], [17, 16, 15]])
    want = torch.from_numpy(_gguf_dequantize(raw, type_name, 50, 512))[ids]
    assert torch.equal(emb(ids), want)
    with pytest.raises(IndexError):
        emb(torch.tensor([50]))
    assert embedding_from_gguf("Q8_0", raw, 50, 512) is None
