"""The CUDA 4-bit path (kernels/int4_quant.py, triton_matmul.py, triton_attention.py, model/forward/cuda_int4.py),
checked where it can be without a GPU: Triton's interpreter runs the very kernels on this CPU.

What is pinned: the quantizer (never worse than round-to-nearest, codes and layout round-trip), the kernels
against a float reference, every row's bits independent of how many rows share the call (the property that
makes a tree step give the plain step's bits), the path attention bitwise equal to the plain step's attention
for every node, and end to end: a tiny Llama quantized by `quantize_backbone` decodes Medusa replies equal to
its own plain loop token for token, eager and through the graph step's static body. Speed is the GPU's
(benchmarks/gpu_4bit.py); `benchmarks/gpu_checks.sh` runs the CUDA-only parts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from medusa_chat.kernels import triton_matmul
from medusa_chat.kernels.int4_quant import (
    dequantize,
    group_for,
    pack_codes,
    pack_int4,
    quantize_int4,
    unpack_codes,
)
from medusa_chat.kernels.triton_linears import Int4Linear

# On a GPU machine the kernels run for real, in 16 bits; elsewhere under Triton's interpreter in fp32.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
TOL = {"rtol": 2e-2, "atol": 2e-2} if DTYPE == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-4}

pytestmark = pytest.mark.skipif(
    not triton_matmul.available(), reason="needs triton (a GPU or its interpreter)"
)


def test_group_sizes_keep_a_group_inside_one_half_of_k() -> None:
    assert group_for(4096) == 64 and group_for(11008) == 64  # Llama-2-7B's projections
    assert group_for(576) == 32  # SmolLM2-135M: K/2 = 288, not a multiple of 64
    assert group_for(4096, preferred=128) == 128 and group_for(11008, preferred=128) == 128
    assert group_for(100) is None and group_for(7) is None


def test_the_refit_is_never_worse_than_round_to_nearest_per_group() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g) * torch.rand(48, 1, generator=g)  # rows of different ranges
    w[3, 17] = 9.0  # an outlier in one group
    errors = {}
    for refine in (0, 2):
        codes, scales, zeros = quantize_int4(w, 64, refine=refine, storage=torch.float32)
        assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
        per_group = (dequantize(codes, scales, zeros, 64) - w).pow(2).reshape(48, 4, 64).sum(-1)
        errors[refine] = per_group
    assert bool((errors[2] <= errors[0] * (1 + 1e-6)).all())
    assert float(errors[2].sum()) < 0.97 * float(errors[0].sum())  # and it does help overall


def test_packing_round_trips_and_dequantizes_as_the_formula_says() -> None:
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (24, 128), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(codes)), codes)
    w = torch.randn(24, 128, generator=g)
    packed = pack_int4(w, 32)
    c, s, z = quantize_int4(w, 32)
    want = ((c.float() - 8).reshape(24, 4, 32) * s.float()[..., None] + z.float()[..., None]).reshape(24, 128)
    assert torch.equal(packed.dequantize(), want)
    assert (packed.dequantize() - w).abs().max() < 0.5  # 4 bits of a unit normal


CONFIGS = [
    triton_matmul.Config(32, 32, 1, 4, 3),
    triton_matmul.Config(64, 32, 2, 4, 3),
    triton_matmul.Config(16, 32, 3, 4, 3),  # a split that does not divide the steps evenly
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name())
def test_int4_rows_are_the_same_bits_at_every_row_count(cfg: triton_matmul.Config) -> None:
    g = torch.Generator().manual_seed(2)
    n, k = 80, 192  # N not a multiple of the column block; 3 groups of 32 per half of K
    packed = pack_int4(torch.randn(n, k, generator=g).to(DEVICE), 32)
    x = torch.randn(70, k, generator=g).to(DEVICE, DTYPE)  # 70 rows: two row programs (64 + 6)
    full = triton_matmul.int4_matmul(x, packed, cfg)
    torch.testing.assert_close(full.float(), x.float() @ packed.dequantize().T, **TOL)
    for m in (1, 2, 7, 16, 17, 40, 64):
        assert torch.equal(triton_matmul.int4_matmul(x[:m], packed, cfg), full[:m]), m
        assert torch.equal(triton_matmul.int4_matmul(x[m - 1 : m], packed, cfg)[0], full[m - 1]), m


def test_the_dense_kernel_is_row_invariant_too() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(100, 72, generator=g).to(DEVICE, DTYPE)  # K not a multiple of BLOCK_K
    x = torch.randn(33, 72, generator=g).to(DEVICE, DTYPE)
    cfg = triton_matmul.Config(32, 32, 2, 4, 3)
    full = triton_matmul.dense_matmul(x, w, cfg)
    torch.testing.assert_close(full.float(), x.float() @ w.float().T, **TOL)
    for m in (1, 5, 16, 32):
        assert torch.equal(triton_matmul.dense_matmul(x[m - 1 : m], w, cfg)[0], full[m - 1])


# (KV heads, query heads per KV head, tree): GQA with 4 nodes per program (3 programs, the last with one node);
# MHA with 16 nodes per program (2 programs)
PATH_CASES = [
    (2, 3, [-1, 0, 0, 1, 1, 2, 3, 6, 7]),
    (3, 1, [-1, 0, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]),
]


@pytest.mark.parametrize("kvh,groups,parents", PATH_CASES, ids=["gqa", "mha"])
def test_path_attention_gives_each_node_the_plain_steps_bits(kvh: int, groups: int, parents: list[int]) -> None:
    from medusa_chat.kernels.triton_attention import CHUNK, path_attention, tree_paths

    g = torch.Generator().manual_seed(4)
    hd, start = 16, CHUNK + 37  # the prefix spans two key chunks; blocks of the prefix and of the tree both
    n = len(parents)
    path, depth = tree_paths(parents)
    path, depth = path.to(DEVICE), depth.to(DEVICE)
    keys = torch.randn(kvh, 2048, hd, generator=g).to(DEVICE, DTYPE)
    values = torch.randn(kvh, 2048, hd, generator=g).to(DEVICE, DTYPE)
    q = torch.randn(n, kvh * groups, hd, generator=g).to(DEVICE, DTYPE)
    scale = hd**-0.5
    at = lambda v: torch.tensor(v, device=DEVICE)  # noqa: E731
    out = path_attention(q, keys, values, at(start), path, depth, 1024, scale)
    for node in range(n):
        chain = path[node, : int(depth[node]) + 1].tolist()
        slots = list(range(start)) + [start + a for a in chain]
        k = keys[:, slots].repeat_interleave(groups, 0).float()
        v = values[:, slots].repeat_interleave(groups, 0).float()
        ref = F.scaled_dot_product_attention(q[node][:, None].float(), k, v, scale=scale)[:, 0]
        torch.testing.assert_close(out[node].float(), ref, **TOL)
        # the plain loop: the path committed in order, this token alone at start + depth, another width
        k2, v2 = keys.clone(), values.clone()
        for t, a in enumerate(chain):
            k2[:, start + t], v2[:, start + t] = keys[:, start + a], values[:, start + a]
        zero = torch.zeros(1, dtype=torch.long, device=DEVICE)
        one = path_attention(
            q[node : node + 1], k2, v2, at(start + len(chain) - 1), zero[None], zero, 2048, scale
        )
        assert torch.equal(one[0], out[node]), node


@pytest.fixture(scope="module")
def int4_loaded():
    from medusa_chat.kernels.triton_linears import Int4Linear, RowInvariantLinear
    from medusa_chat.model.forward.cuda_int4 import quantize_backbone
    from tests.tinymodels import moved, tiny_loaded

    loaded = moved(tiny_loaded("llama"), DEVICE, DTYPE)
    loaded.dtype = DTYPE
    done = quantize_backbone(loaded.backbone, DEVICE, DTYPE)
    assert done["int4"] == 14 and not done["kept_16bit"]  # 2 layers x 7 projections
    if DEVICE.type == "cpu":  # one program per column block: the interpreter's cost is per program
        for m in loaded.backbone.modules():
            if isinstance(m, Int4Linear):
                m.config = triton_matmul.Config(64, 32, 1, 4, 3)
    assert isinstance(loaded.backbone.get_output_embeddings(), RowInvariantLinear)
    assert isinstance(loaded.backbone.model.layers[0].mlp.down_proj, Int4Linear)
    loaded.quant = "int4"
    return loaded


def _reply(engine, prompt: list[int], n: int):
    from medusa_chat.events import GenerationSettings, ReplySummary

    *_, summary = engine.generate(prompt, GenerationSettings(max_new_tokens=n))
    assert isinstance(summary, ReplySummary)
    return summary


def test_int4_medusa_replies_equal_its_plain_loop_eager_and_as_graph_bodies(int4_loaded) -> None:
    from medusa_chat.engine.engine import MedusaEngine, plain_tree
    from medusa_chat.tree import Tree

    tree = Tree.named("mc_sim_7b_63").prefix(12)
    plain = MedusaEngine(int4_loaded, plain_tree())
    eager = MedusaEngine(int4_loaded, tree)
    graph = MedusaEngine(int4_loaded, tree)
    graph.use_graphs(capture=DEVICE.type == "cuda")  # on a CPU the CUDA graph's static body, run eagerly
    assert plain.runner.lean.path_attention  # the exact attention is what runs
    prompt = torch.randint(3, 60, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    want = _reply(plain, prompt, 16).token_ids
    engines = [eager, graph]
    if DEVICE.type == "cuda":  # the plain loop recorded as graphs too: the pair a user's session compares
        plain_graph = MedusaEngine(int4_loaded, plain_tree())
        plain_graph.use_graphs(capture=True)
        engines.append(plain_graph)
    for engine in engines:
        summary = _reply(engine, prompt, 16)
        assert summary.token_ids == want
        if engine is not engines[-1] or DEVICE.type != "cuda":  # (a plain loop accepts nothing)
            assert (
                max(summary.accepted_lengths) >= 1
            )  # the tree did accept guesses: the equality is not trivial


def test_the_kernel_choice_is_measured_once_then_read_back(monkeypatch, tmp_path) -> None:
    from medusa_chat.kernels.triton_matmul import Config
    from medusa_chat.model.forward import cuda_int4

    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path))

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(6)
            self.a = Int4Linear(
                pack_int4(torch.randn(48, 64, generator=g).to(DEVICE), 32), None, act_dtype=DTYPE
            )
            self.b = Int4Linear(
                pack_int4(torch.randn(48, 64, generator=g).to(DEVICE), 32), None, act_dtype=DTYPE
            )

    candidates = (Config(16, 32, 1, 4, 3), Config(32, 32, 2, 4, 3))
    model = Tiny()
    record = cuda_int4.choose_kernel(model, DEVICE, candidates=candidates)
    assert record["measured"]["48x64g32"]["triton"]["rows_invariant"] is True
    if DEVICE.type == "cpu":  # tinygemm has no CPU packing: measured as unavailable, the Triton kernel chosen
        assert record["kernel"] == "triton" and "error" in record["measured"]["48x64g32"]["tinygemm"]
    assert model.a.config.name() == model.b.config.name() == record["configs"]["48x64g32"]
    assert model.a.kernel == model.b.kernel == record["kernel"]

    def no_measuring(*_args, **_kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(cuda_int4, "_measure", no_measuring)
    again = Tiny()
    assert cuda_int4.choose_kernel(again, DEVICE, candidates=candidates)["kernel"] == record["kernel"]
    assert again.a.config.name() == record["configs"]["48x64g32"]


def test_medusa_1_heads_project_in_int4_and_still_draft_what_their_weights_say() -> None:
    from medusa_chat.model.forward.cuda_int4 import quantize_head_projections
    from medusa_chat.model.forward.heads import MedusaHeads

    torch.manual_seed(7)
    heads = MedusaHeads(64, 512, 3, own_lm_head=True).to(DEVICE, DTYPE)
    hidden = torch.randn(2, 64, device=DEVICE, dtype=DTYPE)
    before = heads(hidden)
    reference = [head[1].weight.detach().clone() for head in heads]
    assert quantize_head_projections(heads, DEVICE, DTYPE) == 3
    assert all(isinstance(head[1], Int4Linear) for head in heads)
    after = heads(hidden)
    assert after.shape == before.shape == (3, 2, 512)
    for k, head in enumerate(heads):  # the int4 values the kernel holds, applied exactly
        feats = heads.features(hidden)[k].float()
        torch.testing.assert_close(after[k].float(), feats @ head[1].packed.dequantize().T, **TOL)
        assert (head[1].packed.dequantize() - reference[k].float()).abs().max() < 0.1
    v2 = MedusaHeads(64, 512, 2, own_lm_head=False)
    assert quantize_head_projections(v2, DEVICE, DTYPE) == 0  # v2 heads share the backbone's lm_head


def test_the_int4_load_reads_a_checkpoint_folder_and_stays_close_to_it(
    tiny_llama_dir, monkeypatch, tmp_path
) -> None:
    """The CUDA branch of load_model (backbones.load_cuda_int4) on a real safetensors folder: 16 bits read on the
    CPU, each projection quantized onto the device, the kernel chosen; the logits stay near the float model's."""
    from medusa_chat.model.forward import cuda_int4
    from medusa_chat.model.forward.runner import BackboneRunner
    from medusa_chat.model.sources import backbones

    monkeypatch.setenv("MEDUSA_CHAT_CACHE", str(tmp_path))
    if DEVICE.type == "cpu":  # the interpreter's cost: the kernel choice and the load check at 16 tree rows
        monkeypatch.setattr(cuda_int4, "TREE_ROWS", 16)
    notes: list[str] = []
    backbone, quant = backbones.load_cuda_int4(tiny_llama_dir, DEVICE, DTYPE, notes, lambda _m: None, False, False)
    assert quant == "int4" and any("int4" in n and "projections" in n and "checked on this GPU" in n for n in notes)
    layers = backbone.config.num_hidden_layers
    assert sum(isinstance(m, Int4Linear) for m in backbone.modules()) == 7 * layers
    reference = backbones.load_backbone(tiny_llama_dir, DEVICE, DTYPE, "none")
    ids = torch.arange(3, 19, device=DEVICE)[None]
    with torch.inference_mode():
        want = reference(ids).logits.float()
        got = backbone(ids).logits.float()  # the transformers forward over the int4 modules
        runner = BackboneRunner(backbone)
        assert runner.lean is not None and runner.lean.path_attention
    assert torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0) > 0.95


def test_packing_in_row_chunks_is_the_same_as_in_one_piece(monkeypatch) -> None:
    from medusa_chat.kernels import int4_quant

    w = torch.randn(100, 128, generator=torch.Generator().manual_seed(8))
    whole = pack_int4(w, 64)
    monkeypatch.setattr(int4_quant, "ROWS_PER_CHUNK", 24)  # 100 rows: 4 chunks of 24 and one of 4
    chunked = int4_quant.pack_int4(w, 64)
    for a, b in ((whole.codes, chunked.codes), (whole.scales, chunked.scales), (whole.zeros, chunked.zeros)):
        assert torch.equal(a, b)


@pytest.mark.skipif(triton_matmul.triton is None, reason="needs triton")
def test_the_cuda_kernels_compile_for_hopper_without_a_gpu() -> None:
    """Triton's compiler and ptxas on every kernel variant the app launches (tests/cuda_compile.py): what the
    interpreter above accepts but a GPU's compiler would refuse fails here, before a GPU machine runs it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, str(root / "tests" / "cuda_compile.py")], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    launched = 2 * len(triton_matmul.CANDIDATES) + 2 + 1 + 4 + 1  # int4 x tiles, dense, sum, attention, merge
    assert done.stdout.count("ok ") == launched, done.stdout


def test_the_interpreters_dot_gives_a_row_the_same_bits_wherever_it_sits_in_the_tile() -> None:
    """The interpreter's dot is the host BLAS unless replaced (kernels/triton_interpreter.py); some BLAS builds
    (OpenBLAS with OPENBLAS_CORETYPE=Haswell) round a row differently by its place in the tile. The replacement
    must be row-invariant by construction and still a matmul."""
    import numpy as np

    from medusa_chat.kernels.triton_interpreter import _row_invariant_dot

    rng = np.random.default_rng(7)
    a = rng.standard_normal((16, 64), dtype=np.float32)
    b = rng.standard_normal((64, 48), dtype=np.float32)
    full = _row_invariant_dot(a, b, np.dtype(np.float32))
    np.testing.assert_allclose(full, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-4, atol=1e-4)
    for row in (0, 5, 15):
        alone = np.zeros_like(a)
        alone[15 - row] = a[row]  # the same row at another place, zeros around it (a masked tile)
        assert np.array_equal(_row_invariant_dot(alone, b, np.dtype(np.float32))[15 - row], full[row])
