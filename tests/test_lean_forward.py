"""The lean Llama-family forward (medusa_chat/model/forward/lean_forward.py) is bitwise the transformers forward.

Compared the way the engine calls them: a prefill with the causal mask, then one-token steps; hidden states and
the KV cache must be equal bit for bit, in fp32, NF4 (bitsandbytes on CPU) and bf16. (Tree steps are not
compared with the transformers forward: the lean forward attends per node exactly as the plain loop would,
which a masked tree forward does not; tests/test_exact_paths.py pins that.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, GPT2Config, LlamaConfig, MistralConfig

from medusa_chat.engine.engine import MedusaEngine
from medusa_chat.model.forward.lean_forward import LeanForward, lean_forward_for
from medusa_chat.model.forward.runner import BackboneRunner
from medusa_chat.tree import Tree
from tests.tinymodels import VOCAB, moved, tiny_loaded


def _three_calls(engine: MedusaEngine, runner: BackboneRunner, prompt_len: int = 40) -> list[torch.Tensor]:
    """Prefill, one tree step, commit 3 nodes, one single-token step: outputs and the cache's contents."""
    g = torch.Generator().manual_seed(7)
    vocab = engine.backbone.config.vocab_size
    engine.fresh_cache(capacity=64)
    dev = engine.device
    prompt = torch.randint(3, vocab, (prompt_len,), generator=g).to(dev)
    tokens = torch.randint(3, vocab, (2,), generator=g).to(dev)
    out = []
    with torch.inference_mode():
        out.append(
            runner.forward(
                prompt, torch.arange(prompt_len, device=dev), engine.causal_mask(0, prompt_len), engine.cache
            )
        )
        for token in tokens:
            n = engine.cache.length
            one = torch.zeros((1, 1, 1, n + 1), dtype=engine.dtype, device=dev)
            out.append(runner.forward(token[None], torch.tensor([n], device=dev), one, engine.cache))
        out.append(engine.cache.buffer[..., : engine.cache.length, :].clone())
    return out


def _assert_bitwise(model_loaded, tree: Tree) -> None:
    engine = MedusaEngine(model_loaded, tree)
    assert engine.runner.lean is not None, "expected the lean forward for a Llama-family model"
    hf = BackboneRunner(model_loaded.backbone)
    hf.lean = None  # the transformers forward, same cache and masks
    lean_out = _three_calls(engine, engine.runner)
    hf_out = _three_calls(engine, hf)
    for name, a, b in zip(("prefill", "one token", "next token", "kv cache"), lean_out, hf_out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_lean_forward_is_bitwise_transformers_fp32(arch: str) -> None:
    _assert_bitwise(tiny_loaded(arch), Tree.named("mc_sim_7b_63"))


def test_lean_forward_is_bitwise_transformers_nf4() -> None:
    pytest.importorskip("bitsandbytes")
    loaded = tiny_loaded("llama", "nf4")
    _assert_bitwise(loaded, Tree.named("mc_sim_7b_63").prefix(16))


def _bf16_copy(loaded):
    twin = copy.copy(loaded)
    twin.backbone = copy.deepcopy(loaded.backbone).to(torch.bfloat16)
    twin.backbone.__dict__.pop("_medusa_lean_forward", None)
    return twin


def test_lean_forward_bf16_is_bitwise_transformers() -> None:
    loaded = _bf16_copy(tiny_loaded("llama"))
    assert lean_forward_for(loaded.backbone) is not None
    _assert_bitwise(loaded, Tree.named("mc_sim_7b_63").prefix(16))


def test_lean_forward_is_shared_and_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_loaded("llama").backbone
    first = lean_forward_for(model)
    assert isinstance(first, LeanForward) and lean_forward_for(model) is first  # built once per model
    monkeypatch.setenv("MEDUSA_CHAT_LEAN", "0")
    assert lean_forward_for(model) is None
    assert BackboneRunner(model).path == "transformers"


def _tiny(config) -> torch.nn.Module:
    return AutoModelForCausalLM.from_config(config).eval()


def test_unsupported_models_use_the_transformers_forward() -> None:
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    gpt2 = _tiny(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4))
    windowed = _tiny(MistralConfig(sliding_window=16, **common))
    gelu = _tiny(LlamaConfig(hidden_act="gelu", **common))
    for model in (gpt2, windowed, gelu):
        assert lean_forward_for(model) is None
        assert BackboneRunner(model).path == "transformers"
        assert BackboneRunner.unsupported(model) is None  # the transformers forward verifies trees there


def test_backbones_that_cannot_verify_trees_are_named() -> None:
    """BLOOM's forward takes no position ids (ALiBi from a 2D mask): a tree would be read as a row of tokens.
    The loader refuses such a backbone with this message instead of failing or answering wrongly later."""
    bloom = _tiny(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4))
    why = BackboneRunner.unsupported(bloom)
    assert why is not None and "bloom" in why and "position_ids" in why and "GPT-2" in why
    assert BackboneRunner.unsupported(tiny_loaded("llama").backbone) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lean_forward_is_bitwise_transformers_on_cuda_fp16() -> None:
    _assert_bitwise(moved(tiny_loaded("llama"), "cuda", torch.float16), Tree.named("mc_sim_7b_63"))


def test_models_with_accelerate_hooks_use_the_transformers_forward() -> None:
    """Offloaded or multi-device models move tensors in accelerate hooks that run in nn.Module.__call__; the
    lean forward calls `.forward` directly, so such models keep the transformers forward."""
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    model = _tiny(LlamaConfig(**common))
    assert lean_forward_for(model) is not None
    model.model.layers[0].mlp.up_proj._hf_hook = object()  # what accelerate's add_hook_to_module sets
    model.__dict__.pop("_medusa_lean_forward", None)
    assert lean_forward_for(model) is None


class _Body(torch.nn.Module):
    """A decoder body that records what its forward was given and returns the ids as hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.got: dict = {}

    def _record(self, **kwargs: object) -> object:
        self.got.update(kwargs)
        return type("Out", (), {"last_hidden_state": kwargs["input_ids"].float()})()


class _CacheBody(_Body):  # transformers 5.25's name
    def forward(self, input_ids=None, position_ids=None, attention_mask=None, cache=None, use_cache=None):
        return self._record(input_ids=input_ids, cache=cache)


class _PastKeyValuesBody(_Body):  # 5.17's (GPU images ship it)
    def forward(
        self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None, use_cache=None
    ):
        return self._record(input_ids=input_ids, past_key_values=past_key_values)


class _NoCacheBody(_Body):
    def forward(self, input_ids=None, position_ids=None, attention_mask=None):
        return self._record(input_ids=input_ids)


class _LM(torch.nn.Module):
    def __init__(self, body: _Body) -> None:
        super().__init__()
        self.body = body
        self.head = torch.nn.Linear(2, 2)

    @property
    def base_model(self) -> _Body:
        return self.body

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.head


@pytest.mark.parametrize(("body", "name"), [(_CacheBody, "cache"), (_PastKeyValuesBody, "past_key_values")])
def test_transformers_forward_gets_the_cache_by_either_name(body: type, name: str) -> None:
    lm = _LM(body())
    assert BackboneRunner.unsupported(lm) is None
    runner = BackboneRunner(lm)
    assert runner.lean is None  # not a Llama: the transformers forward is what runs
    sentinel = object()
    runner.forward(torch.tensor([5, 6]), torch.tensor([0, 1]), torch.zeros(1, 1, 2, 2), sentinel)
    assert lm.body.got[name] is sentinel


def test_a_forward_without_a_cache_is_refused_by_name() -> None:
    problem = BackboneRunner.unsupported(_LM(_NoCacheBody()))
    assert problem is not None and "takes no cache" in problem
