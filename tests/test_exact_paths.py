"""Tree decoding is bitwise the engine's own plain loop in every CPU numeric path (fp32, bf16, int8, int4).

Two levels: (1) one verification step gives every tree node exactly the hidden state the plain loop computes
for that token after that node's path (the property everything rests on: per-node attention rows,
row-invariant projections); (2) greedy replies with several trees equal the plain loop's token for token.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from medusa_chat.engine.engine import MedusaEngine, TreeKVCache, plain_tree
from medusa_chat.events import GenerationSettings, ReplySummary
from medusa_chat.kernels import block_linears, cbind, quantizers
from medusa_chat.kernels.cpu_linears import Int4Linear, Int8Linear, PackedLinear
from medusa_chat.machine import cpu_flags
from medusa_chat.model.forward.cpu_blocks import prepare_cpu_linears
from medusa_chat.model.forward.tree_plan import TreePlan
from medusa_chat.tree import Tree
from tests.tinymodels import tiny_loaded, training_prompts

PATHS = ["fp32", "bf16", "int8", "int4"]


@functools.cache
def _path_model(arch: str, path: str):
    base = tiny_loaded(arch)
    twin = copy.copy(base)
    backbone = copy.deepcopy(base.backbone)
    if path == "bf16":
        backbone = backbone.to(torch.bfloat16)
    backbone.__dict__.pop("_medusa_lean_forward", None)
    prepare_cpu_linears(backbone, {"fp32": "none", "bf16": "none"}.get(path, path))
    twin.backbone = backbone
    return twin


def _kinds(model) -> set[str]:
    kinds = (PackedLinear, Int8Linear, Int4Linear, block_linears.Q41Linear, block_linears.Q80Linear)
    return {type(m).__name__ for m in model.backbone.modules() if isinstance(m, kinds)}


@pytest.mark.parametrize("path", PATHS)
def test_paths_use_their_kernels(path: str) -> None:
    kinds = _kinds(_path_model("llama", path))
    if cbind.available():  # the block kernels: GGUF Q4_1 projections, Q8_0 lm_head
        expected = {"fp32": {"PackedLinear"}, "int8": {"Q80Linear"}, "int4": {"Q41Linear", "Q80Linear"}}
    else:  # torch's weight-only kernels
        expected = {"fp32": {"PackedLinear"}, "int8": {"Int8Linear"}, "int4": {"Int4Linear", "Int8Linear"}}
    if path in expected:
        assert kinds == expected[path]  # int4: the lm_head keeps 8 bits


def _plain_hidden(engine: MedusaEngine, cache: TreeKVCache, tokens: list[int], start: int) -> torch.Tensor:
    root_only = TreePlan.build([-1], [0], engine.device)
    hidden = None
    for i, t in enumerate(tokens):
        ids = torch.tensor([t])
        hidden = engine.runner.forward(ids, torch.tensor([start + i]), root_only, cache)
    return hidden[0]


@pytest.mark.parametrize(("arch", "path"), [("llama", p) for p in PATHS] + [("mistral", "int4")])
def test_every_tree_node_gets_the_plain_steps_bits(arch: str, path: str) -> None:
    model = _path_model(arch, path)
    tree = Tree.named("mc_sim_7b_63").prefix(24)
    engine = MedusaEngine(model, tree)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 500, (37,), generator=g)
    tokens = torch.randint(3, 500, (tree.size,), generator=g)
    with torch.inference_mode():
        prefill_cache = TreeKVCache(model.backbone.config.num_hidden_layers, capacity=128)
        engine.runner.forward(prompt, torch.arange(37), engine.causal_mask(0, 37), prefill_cache)
        cache = copy.deepcopy(prefill_cache)
        hidden = engine.runner.forward(tokens, 37 + engine.buffers.depth, engine.plan, cache)
        for node in range(tree.size):
            path_tokens = [int(tokens[n]) for n in tree.path_nodes(node)]
            plain = _plain_hidden(engine, copy.deepcopy(prefill_cache), path_tokens, 37)
            assert torch.equal(hidden[node], plain), f"node {node} (depth {tree.depths[node]}) differs"


def _reply(engine: MedusaEngine, prompt: list[int], n: int = 32) -> list[int]:
    for event in engine.generate(prompt, GenerationSettings(max_new_tokens=n, temperature=0)):
        if isinstance(event, ReplySummary):
            return event.token_ids
    raise AssertionError("no summary")


TREES = [Tree.chain(3), Tree.named("mc_sim_7b_63").prefix(6), Tree.named("mc_sim_7b_63")]


@pytest.mark.parametrize("path", PATHS)
def test_greedy_medusa_equals_the_plain_loop(path: str) -> None:
    model = _path_model("llama", path)
    plain = MedusaEngine(model, plain_tree())
    prompts = training_prompts()[:2] + [[5, 9, 17, 33, 65, 129, 257, 7, 11]]
    refs = [_reply(plain, p) for p in prompts]
    for tree in TREES:
        engine = MedusaEngine(model, tree)
        for prompt, ref in zip(prompts, refs, strict=True):
            assert _reply(engine, prompt) == ref, f"{path}, {tree.name}, prompt {prompt[:3]}"
    # the heads really propose: with the 64-node tree, steps accept several tokens
    engine = MedusaEngine(model, TREES[-1])
    steps = [
        e
        for e in engine.generate(prompts[0], GenerationSettings(max_new_tokens=40))
        if isinstance(e, ReplySummary)
    ]
    assert steps[0].tokens_per_step > 1.2


def test_second_turn_reuses_the_cache_and_stays_exact() -> None:
    """The per-node key rows sync only what was committed since the last step; a new prompt that shares a
    prefix crops the cache: the rows must follow (no stale prefix entries)."""
    model = _path_model("llama", "int8")
    plain, tree = MedusaEngine(model, plain_tree()), MedusaEngine(model, Tree.named("mc_sim_7b_63").prefix(8))
    first = training_prompts()[0]
    a_plain, a_tree = _reply(plain, first), _reply(tree, first)
    assert a_plain == a_tree
    second = first + a_plain[:20] + [42, 43]
    assert _reply(plain, second) == _reply(tree, second)
    assert _reply(plain, [7, 8, 9]) == _reply(tree, [7, 8, 9])  # unrelated prompt: cache cropped to 0


@pytest.mark.skipif(not cbind.available(), reason="block kernel not available here")
def test_a_tied_q8_0_table_is_looked_up_in_the_lm_head_blocks() -> None:
    """The embedded GGUF has one Q8_0 token_embd for the embedding and the lm_head: the float table is then
    exactly the lm_head's blocks dequantized, and the embedding is looked up in those blocks instead of being
    kept a second time in fp32, with the same bits (the same replies, the same hidden states)."""
    from torch import nn

    from medusa_chat.model.forward.cpu_blocks import share_tied_embedding

    base = tiny_loaded("llama")
    backbone = copy.deepcopy(base.backbone)
    backbone.__dict__.pop("_medusa_lean_forward", None)
    head = backbone.get_output_embeddings()
    v, h = head.weight.shape
    codes, d = quantizers.quantize_q8_0(head.weight)
    table = (d[..., None] * codes.float().view(v, h // 32, 32)).view(v, h)  # what a Q8_0 file stores
    with torch.no_grad():
        backbone.get_input_embeddings().weight.copy_(table)
        head.weight = backbone.get_input_embeddings().weight  # tied, as SmolLM2 is
    backbone.config.tie_word_embeddings = True
    float_twin = copy.deepcopy(backbone)
    prepare_cpu_linears(backbone, "int8")
    embed = backbone.get_input_embeddings()
    assert isinstance(embed, block_linears.BlockEmbedding) and embed.table is backbone.get_output_embeddings()
    assert not any(p.shape == (v, h) for p in backbone.parameters())  # no fp32 table left
    ids = torch.arange(v)
    assert torch.equal(embed(ids), table) and embed(ids.view(2, -1)).shape == (2, v // 2, h)
    with pytest.raises(IndexError):
        embed(torch.tensor([v]))
    # the same model with the float table kept: the same replies, token for token
    prepare_cpu_linears(float_twin, "int8")
    float_twin.set_input_embeddings(nn.Embedding.from_pretrained(table.clone()))
    models = []
    for bb in (backbone, float_twin):
        twin = copy.copy(base)
        twin.backbone = bb
        models.append(twin)
    prompts = training_prompts()[:2]
    for tree in (plain_tree(), Tree.named("mc_sim_7b_63").prefix(6)):
        replies = [[_reply(MedusaEngine(m, tree), p) for p in prompts] for m in models]
        assert replies[0] == replies[1], tree.name
    # a table that is not exactly the blocks (an fp32 model quantized here) keeps its float embedding
    other = copy.deepcopy(base.backbone)
    other.config.tie_word_embeddings = True
    prepare_cpu_linears(other, "int8")
    assert type(other.get_input_embeddings()) is nn.Embedding
    assert not share_tied_embedding(other)


def test_the_native_step_gives_the_same_bits_on_every_instruction_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The native int4 step (block GEMMs and attention: decoder.c) computes the same per-lane arithmetic in the
    AVX2 build and the 512-bit AVX-512 build (two keys a register for scores, 16 dims a register for the values):
    a prefill block and a tree step give the same hidden states, bit for bit, whichever build runs them."""
    if not cbind.available():
        pytest.skip(f"no block kernel here: {cbind.unavailable_reason()}")
    flags = cpu_flags()
    isas = ["avx2"] + (["avx512vnni"] if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags else [])
    if len(isas) < 2:
        pytest.skip("this CPU runs only the AVX2 build")
    tree = Tree.named("mc_sim_7b_63").prefix(8)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 500, (45,), generator=g)  # 5 full 8-key chunks and a tail
    tokens = torch.randint(3, 500, (tree.size,), generator=g)
    outs = {}
    for isa in isas:
        monkeypatch.setenv("MEDUSA_CHAT_QGEMM_ISA", isa)
        model = copy.copy(tiny_loaded("llama"))
        model.backbone = copy.deepcopy(model.backbone)
        model.backbone.__dict__.pop("_medusa_lean_forward", None)
        prepare_cpu_linears(model.backbone, "int4")
        engine = MedusaEngine(model, tree)
        assert "native" in engine.runner.path
        with torch.inference_mode():
            cache = TreeKVCache(model.backbone.config.num_hidden_layers, capacity=128)
            pre = engine.runner.forward(prompt, torch.arange(45), engine.causal_mask(0, 45), cache)
            step = engine.runner.forward(tokens, 45 + engine.buffers.depth, engine.plan, cache)
        outs[isa] = (pre, step)
    assert all(torch.equal(a, b) for a, b in zip(outs["avx2"], outs[isas[1]], strict=True))


@pytest.mark.parametrize("in_f, out_f", [(1536, 576), (576, 1536), (576, 576)])
def test_packed_fp32_rows_are_invariant_at_the_embedded_models_shapes(in_f: int, out_f: int) -> None:
    """oneDNN takes another kernel for a lone row at some shapes on some CPUs (an AMX Xeon: the 1536-wide down
    projection, whose fp32 path was then refused): the check pads such calls to the multi-row kernel, and a row
    then gets the same bits alone as among 16 or 64 rows."""
    from medusa_chat.kernels.cpu_linears import check_row_invariant

    gen = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(in_f, out_f, bias=False)
    lin.weight.data = torch.randn(out_f, in_f, generator=gen) * 0.02
    packed = PackedLinear(lin)
    check_row_invariant(packed, torch.float32)
    x = torch.randn(64, in_f, generator=gen)
    with torch.inference_mode():
        full = packed(x)
        for n in (1, 2, 3, 4, 7, 16, 33):
            assert torch.equal(packed(x[:n]), full[:n]), n
        assert torch.equal(packed(x[:1].view(1, 1, in_f)), full[:1].view(1, 1, out_f))
        assert torch.equal(packed.rows(torch.arange(5))(x[:1]), full[:1, :5])


def test_packed_padding_keeps_rows_and_shapes() -> None:
    """min_rows pads short calls with zero rows: each row's result is its result in a min_rows-row call."""
    gen = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(64, 48)
    packed = PackedLinear(lin)
    packed.min_rows = 4
    x = torch.randn(4, 64, generator=gen)
    with torch.inference_mode():
        full = packed(x)
        for n in (1, 2, 3):
            out = packed(x[:n].view(1, n, 64))
            assert out.shape == (1, n, 48)
            assert torch.equal(out[0], full[:n])
        torch.testing.assert_close(full, lin(x))
