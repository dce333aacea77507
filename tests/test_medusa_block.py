"""Medusa-1 / Medusa-2 heads on the CPU block kernel (model/forward/block_heads.py, csrc/medusa.c, drafters.MedusaDrafter):
loaded as Q8_0 blocks without an fp32 copy, the backbone's lm_head shared where a head's equals it, drafted in one
C call that evaluates only the heads the tree reaches, and greedy output still the plain loop's."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from medusa_chat.engine.drafters import MedusaDrafter, confident_paths
from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.kernels import cbind
from medusa_chat.model.forward.block_heads import block_medusa_heads
from medusa_chat.model.forward.heads import heads_from_state_dict
from medusa_chat.model.sources.loading import LoadedModel, load_model
from medusa_chat.tree import Tree
from tests.test_decoding import run
from tests.tinymodels import random_heads_state, write_heads

pytestmark = pytest.mark.skipif(not cbind.available(), reason="the block kernel cannot run here")
TREE = Tree.named("mc_sim_7b_63")


def test_loaded_v1_heads_are_blocks_with_no_float_weights(
    make_loaded_model: Callable[..., LoadedModel],
) -> None:
    loaded = make_loaded_model(heads="v1", quant="int8")
    heads = loaded.heads
    assert heads.block_kind == "q8_0" and heads.shared_lm_heads == []
    assert not any(isinstance(m, nn.Linear) for m in heads.modules())  # the fp32 weights are gone
    assert not list(heads.parameters())
    info = loaded.info()["heads"]
    assert info["dtype"] == "q8_0" and info["drafter"] == "medusa-1"
    # 4 heads x (64 x 64 + 64 bias + 512 x 64 projection)
    assert info["params"] == 4 * (64 * 64 + 64 + 512 * 64)
    engine = MedusaEngine(loaded, TREE.prefix(4))
    assert isinstance(engine.drafter, MedusaDrafter) and engine.drafter.native_draft is not None
    assert engine.draft_shaped and engine.drafter_name == "medusa-1"


def test_medusa2_checkpoint_heads_say_so(make_loaded_model: Callable[..., LoadedModel]) -> None:
    loaded = make_loaded_model(heads="medusa2", quant="int8")
    assert loaded.heads.block_kind == "q8_0"
    assert loaded.info()["heads"]["drafter"] == "medusa-2"
    assert MedusaEngine(loaded, TREE.prefix(3)).drafter_name == "medusa-2"


def test_a_head_whose_lm_head_is_the_backbones_shares_its_module(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Heads 0 and 2 carry the backbone's lm_head (fp16 in the file, as published heads are; equal blocks after
    Q8_0): they use the backbone's module; heads 1 and 3 have their own."""
    from safetensors.torch import load_file

    lm = load_file(str(tiny_llama_dir / "model.safetensors"))["lm_head.weight"].float()
    state = random_heads_state(4, 1, own_lm_head=True, seed=5)
    for k in (0, 2):
        state[f"{k}.1.weight"] = lm.clone()
    folder = write_heads(
        tmp_path / "shared-heads", state, dtype=torch.float32, base_model=str(tiny_llama_dir)
    )
    loaded = load_model(model=str(tiny_llama_dir), heads=str(folder), quant="int8", device="cpu")
    backbone_head = loaded.backbone.get_output_embeddings()
    assert loaded.heads.shared_lm_heads == [0, 2]
    assert loaded.heads[0][1] is backbone_head and loaded.heads[2][1] is backbone_head
    assert loaded.heads[1][1] is not backbone_head
    # the shared projection is not counted twice
    assert loaded.info()["heads"]["params"] == 4 * (64 * 64 + 64) + 2 * 512 * 64


@pytest.mark.parametrize("lm_head_kind", ["q8_0", "q4_1"])
def test_native_draft_equals_the_module_reference_of_the_same_blocks(
    lm_head_kind: str, make_loaded_model: Callable[..., LoadedModel]
) -> None:
    """medusa_draft's top-k tokens are the block modules' own (ResBlocks, projection, top-k in torch), and its
    shaped tree is confident_paths over the softmax of those logits."""
    loaded = make_loaded_model(heads="v1", quant="int8")
    heads = heads_from_state_dict(random_heads_state(4, 1, own_lm_head=True, seed=7))
    block_medusa_heads(heads, loaded.backbone, lm_head_kind)
    drafter = MedusaDrafter(heads, loaded.backbone, "medusa-1")
    native = drafter.native
    assert native is not None
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        hidden = torch.randn(1, 64, generator=g)
        for depth, k in ((1, 1), (2, 3), (4, 10)):
            tokens, probs = native.top(hidden, depth, k, probs=True)
            assert torch.equal(tokens, drafter.top(hidden, depth, k)), (depth, k)
            rows = []
            for d in range(depth):
                x = hidden
                for block in heads[d][:1]:
                    x = block(x)
                p = torch.softmax(drafter.projections[d](x)[0], -1)
                rows.append(p[tokens[d * k : (d + 1) * k]].tolist())
            assert probs is not None
            assert torch.allclose(probs, torch.tensor(rows).flatten(), rtol=1e-4, atol=1e-6)
        root = torch.tensor([9])
        for depth, k, size in ((2, 2, 3), (3, 3, 5), (4, 4, 8)):
            codes, tokens = native.draft_shaped(root, hidden, depth, k, size)
            top, probs = native.top(hidden, depth, k, probs=True)
            rows = [probs[d * k : (d + 1) * k].tolist() for d in range(depth)]
            paths = [(0,) * (c // k) + (c % k,) for c in codes]
            assert tuple(paths) == confident_paths(rows, size)
            assert tokens.tolist() == [9] + [int(top[c]) for c in codes]


class _Counting:
    """The kernel library, passing every call through and recording medusa_draft's head counts."""

    def __init__(self, lib: Any) -> None:
        self.lib, self.depths = lib, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lib, name)

    @property
    def medusa_draft(self) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.depths.append(args[2])
            return self.lib.medusa_draft(*args)

        return call

    @property
    def medusa_draft_shaped(self) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.depths.append(args[2])
            return self.lib.medusa_draft_shaped(*args)

        return call


@pytest.mark.parametrize(("size", "depth"), [(2, 1), (3, 2), (64, 4)])
def test_a_step_evaluates_only_the_heads_its_tree_reaches(
    size: int, depth: int, make_loaded_model: Callable[..., LoadedModel]
) -> None:
    loaded = make_loaded_model(heads="v1", quant="int8", num_heads=5, accuracy="random")
    tree = TREE.prefix(size)
    assert tree.depth == depth
    # native: one C call per step, for `depth` heads
    engine = MedusaEngine(loaded, tree, shaped=False)
    counting = _Counting(engine.drafter.native.lib)
    engine.drafter.native.lib = counting
    run(engine, [5, 6, 7], max_new_tokens=8)
    assert counting.depths and set(counting.depths) == {depth}
    # without the C drafter: the projections of the unreached heads are never called
    engine = MedusaEngine(loaded, tree, shaped=False)
    engine.drafter.native_draft = None
    calls = [0] * 5
    hooks = [
        p.register_forward_hook(lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
        for k, p in enumerate(engine.drafter.projections)
    ]
    try:
        _, summary = run(engine, [5, 6, 7], max_new_tokens=8)
    finally:
        for h in hooks:
            h.remove()
    # (a step whose tree is a run of context-lookup guesses drafts nothing)
    assert 0 < calls[0] <= summary.steps and calls[:depth] == [calls[0]] * depth and not any(calls[depth:])


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_greedy_with_native_medusa1_heads_is_the_plain_loop(
    quant: str, make_loaded_model: Callable[..., LoadedModel]
) -> None:
    """Planted v1 heads (they really accept): static, draft-shaped and full trees give the plain loop's tokens."""
    loaded = make_loaded_model(heads="v1", quant=quant)
    prompt = loaded.build_prompt([{"role": "user", "content": "hello there"}])
    _, plain = run(MedusaEngine(loaded, plain_tree()), prompt, max_new_tokens=32)
    for tree, shaped in (
        (TREE.prefix(2), True),
        (TREE.prefix(4), True),
        (TREE.prefix(4), False),
        (TREE, True),
    ):
        engine = MedusaEngine(loaded, tree, shaped=shaped)
        assert engine.drafter.native_draft is not None
        _, out = run(engine, prompt, max_new_tokens=32)
        assert out.token_ids == plain.token_ids, (tree.size, shaped)
        assert out.tokens_per_step > 1.2, (tree.size, shaped)


def test_calibration_times_the_drafting_step(make_loaded_model: Callable[..., LoadedModel]) -> None:
    """The latency the calibration measures runs the drafter (a step of the shaped tree drafts in C)."""
    from medusa_chat.tuning.measure import measure_step_latency

    loaded = make_loaded_model(heads="v1", quant="int8")
    counting = None
    original = MedusaDrafter.__init__

    def init(self: MedusaDrafter, *args: Any, **kwargs: Any) -> None:
        nonlocal counting
        original(self, *args, **kwargs)
        counting = self.native.lib = _Counting(self.native.lib)

    MedusaDrafter.__init__ = init  # type: ignore[method-assign]
    try:
        lat = measure_step_latency(loaded, [4], tree=TREE, prefix_tokens=16, reps=2, warmup=1)
    finally:
        MedusaDrafter.__init__ = original  # type: ignore[method-assign]
    assert lat[4]["median_s"] > 0 and counting is not None and len(counting.depths) >= 3


def _with_draft_vocab(loaded: LoadedModel, tmp_path: Path, ids: list[int]) -> LoadedModel:
    """The same heads folder with a draft vocabulary file beside the heads file, loaded afresh."""
    import shutil

    from safetensors.torch import save_file

    from medusa_chat.model.sources.heads_files import DRAFT_VOCAB_FILE

    folder = tmp_path / "heads"
    shutil.copytree(Path(loaded.heads_file).parent, folder)
    save_file({"draft_vocab": torch.tensor(ids, dtype=torch.int32)}, str(folder / DRAFT_VOCAB_FILE))
    return load_model(model=loaded.spec.backbone, heads=str(folder), quant="int8", device="cpu")


def test_a_draft_vocabulary_beside_the_heads_limits_their_guesses_and_keeps_the_output(
    make_loaded_model: Callable[..., LoadedModel], tmp_path: Path
) -> None:
    """The heads project onto the draft vocabulary's rows only: one holding the reply's tokens keeps the planted
    heads' acceptance, one without them leaves nothing to accept; the output is the plain loop's either way."""
    loaded = make_loaded_model(heads="v1", quant="int8")
    vocab = loaded.heads.vocab_size
    prompt = loaded.build_prompt([{"role": "user", "content": "hello there"}])
    _, plain = run(MedusaEngine(loaded, plain_tree()), prompt, max_new_tokens=32)
    reply = sorted(set(plain.token_ids))
    others = [t for t in torch.randperm(vocab, generator=torch.Generator().manual_seed(0)).tolist() if t not in reply]
    for ids, accepts in ((reply + others[: vocab // 4], True), (others[: vocab // 2], False)):
        with_vocab = _with_draft_vocab(loaded, tmp_path / str(accepts), ids)
        assert with_vocab.info()["heads"]["draft_vocab"] == len(ids)
        engine = MedusaEngine(with_vocab, TREE.prefix(4))
        assert engine.drafter.draft_vocab is not None and engine.drafter.native_draft is not None
        _, out = run(engine, prompt, max_new_tokens=32, context_lookup=False)
        assert out.token_ids == plain.token_ids
        assert (out.tokens_per_step > 1.5) == accepts, out.tokens_per_step


@pytest.mark.parametrize(
    ("ids", "message"),
    [([0, 1, 1], "more than once"), ([0, 1, 10**6], "another tokenizer"), ([], "non-empty 1-D")],
)
def test_a_bad_draft_vocabulary_is_a_clear_error(
    ids: list[int], message: str, make_loaded_model: Callable[..., LoadedModel], tmp_path: Path
) -> None:
    from medusa_chat.errors import HeadsError

    loaded = make_loaded_model(heads="v1", quant="int8")
    with pytest.raises(HeadsError, match=message):
        _with_draft_vocab(loaded, tmp_path, ids)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_heads_become_the_blocks_of_their_exact_float_values(
    dtype: torch.dtype, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Heads stored in 16 bits (as published) are quantized from the file's tensors one by one, never cast to fp32
    all at once: the blocks equal Q8_0 of the fp32 values, and the biases are fp32."""
    from medusa_chat.kernels.block_linears import Q80Linear
    from medusa_chat.kernels.quantizers import quantize_q8_0

    state = random_heads_state(3, 1, own_lm_head=True, seed=11)
    folder = write_heads(tmp_path / "heads16", state, dtype=dtype, base_model=str(tiny_llama_dir))
    loaded = load_model(model=str(tiny_llama_dir), heads=str(folder), quant="int8", device="cpu")
    for k in range(3):
        for name, module in (("0.linear", loaded.heads[k][0].linear.block), ("1", loaded.heads[k][1])):
            ref = Q80Linear(*quantize_q8_0(state[f"{k}.{name}.weight"].to(dtype).float()))
            assert all(torch.equal(getattr(module, b), getattr(ref, b)) for b in ref.buffer_names), (k, name)
        bias = loaded.heads[k][0].linear.bias
        assert bias.dtype == torch.float32 and torch.equal(bias, state[f"{k}.0.linear.bias"].to(dtype).float())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_pt_heads_file_is_read_through_its_map_into_the_safetensors_files_blocks(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pickled heads file (bf16, as published) is memory-mapped: its tensors are views of the file, not copies,
    each one's pages are given back as it becomes blocks, and the blocks are the safetensors file's."""
    from medusa_chat.model import mapped_weights
    from medusa_chat.model.forward import block_heads
    from medusa_chat.model.sources.heads_files import read_state_file

    state = random_heads_state(3, 1, own_lm_head=True, seed=13)
    folders = {
        fmt: write_heads(tmp_path / fmt, state, fmt=fmt, dtype=torch.bfloat16, base_model=str(tiny_llama_dir))
        for fmt in ("pt", "safetensors")
    }
    for fmt, folder in folders.items():
        for t in read_state_file(folder / f"medusa_lm_head.{fmt}").values():
            assert mapped_weights._file_mapping(t.data_ptr(), t.data_ptr() + t.nbytes), (fmt, t.shape)
    given_back: list[int] = []

    def release(t: torch.Tensor) -> int:  # the real one, its answers kept
        given_back.append(mapped_weights.release(t))
        return given_back[-1]

    monkeypatch.setattr(block_heads, "release", release)
    loaded = {
        fmt: load_model(model=str(tiny_llama_dir), heads=str(folder), quant="int8", device="cpu")
        for fmt, folder in folders.items()
    }
    # per file, each of the 6 weights as quantize_q8_0 reads it (one chunk at this size), and each of the 3 vocab
    # projections once more when it is blocks (a Q4_1 head reads it again)
    assert len(given_back) == 2 * (6 + 3) and sum(given_back) >= 2 * 3 * (512 * 64 * 2 - 8192)
    pt, st = loaded["pt"].heads, loaded["safetensors"].heads
    for k in range(3):
        for a, b in ((pt[k][0].linear.block, st[k][0].linear.block), (pt[k][1], st[k][1])):
            assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in b.buffer_names), k
        assert torch.equal(pt[k][0].linear.bias, st[k][0].linear.bias)
    (steps_pt, pt_reply), (steps_st, st_reply) = (
        run(MedusaEngine(loaded[fmt], TREE.prefix(12)), [5, 6, 7, 300], 16) for fmt in ("pt", "safetensors")
    )
    assert pt_reply.token_ids == st_reply.token_ids and len(steps_pt) == len(steps_st)  # the same drafts
