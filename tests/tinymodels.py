"""Tiny real models for fast engine tests: random Llama/Mistral backbones (fp32 or NF4 via bitsandbytes on
CPU) and GPT-2 / GPT-NeoX ones (run by the transformers forward), a real word-level tokenizer, and v2 Medusa
heads self-distilled for a few seconds on the backbone's own greedy output (so tree steps really accept
several tokens)."""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    AutoModelForCausalLM,
    BitsAndBytesConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from medusa_chat.heads import HydraHeads, MedusaHeads
from medusa_chat.tree import Tree

VOCAB = 512
HIDDEN = 64
_DIR = Path(tempfile.mkdtemp(prefix="medusa-tiny-"))


@dataclass
class TinyLoaded:
    """The LoadedModel fields the engine reads (see docs/CONTRACTS.md)."""

    backbone: PreTrainedModel
    heads: MedusaHeads
    tokenizer: PreTrainedTokenizerFast
    device: torch.device = torch.device("cpu")
    context_limit: int = 512
    eos_token_ids: list[int] = field(
        default_factory=lambda: [VOCAB + 1]
    )  # never produced: replies run to max
    stop_strings: tuple[str, ...] = ()
    default_tree: Tree = field(default_factory=lambda: Tree.named("mc_sim_7b_63"))
    vocab_size: int = VOCAB


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")


@functools.cache
def _backbone_dir(arch: str) -> Path:
    torch.manual_seed({"llama": 0, "mistral": 1, "gpt2": 2, "gpt_neox": 3}[arch])
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "mistral":
        config = MistralConfig(sliding_window=None, **common)
    elif arch == "gpt2":  # learned absolute positions, fused qkv, `transformer` as the decoder
        config = GPT2Config(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=2,
            n_head=4,
            n_positions=1024,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
    else:  # gpt_neox: parallel attention + MLP, partial rotary, `gpt_neox` as the decoder
        common.pop("num_key_value_heads")
        config = GPTNeoXConfig(**common)
    model = AutoModelForCausalLM.from_config(config)
    # Larger weights than the default init make the random model's greedy output less repetitive.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    path = _DIR / arch
    model.save_pretrained(path)
    return path


def _load_backbone(arch: str, quant: str) -> PreTrainedModel:
    kw: dict = {"attn_implementation": "sdpa", "dtype": torch.float32}
    if quant == "nf4":
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        )
        kw["device_map"] = "cpu"
    model = AutoModelForCausalLM.from_pretrained(_backbone_dir(arch), **kw).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@functools.cache
def _distilled_heads(arch: str, num_heads: int = 4) -> MedusaHeads:
    """Train v2 heads on the fp32 backbone's own greedy continuations (Medusa-1 self-distillation, tiny)."""
    model = _load_backbone(arch, "none")
    # The GPT-2 / GPT-NeoX tests only need steps that accept some tokens: a smaller, quicker distillation.
    small = arch in ("gpt2", "gpt_neox")
    prompts = torch.tensor(training_prompts()[: 12 if small else None])
    with torch.no_grad():
        seqs = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=50 if small else 90,
            do_sample=False,
        )
        hidden = model.base_model(seqs).last_hidden_state
    heads = MedusaHeads(HIDDEN, VOCAB, num_heads, 1, own_lm_head=False)
    lm_head = model.get_output_embeddings()
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    start = prompts.shape[1] - 1
    torch.manual_seed(0)
    for _ in range(80 if small else 150):
        logits = heads(hidden[:, start : -num_heads - 1], lm_head)  # [K, B, T, V]
        loss = sum(
            (0.8**k)
            * torch.nn.functional.cross_entropy(
                logits[k].reshape(-1, VOCAB),
                seqs[:, start + 2 + k : seqs.shape[1] - num_heads + 1 + k].reshape(-1),
            )
            for k in range(num_heads)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval().requires_grad_(False)


@functools.cache
def _distilled_hydra_heads(arch: str, num_heads: int = 4, draft_vocab: int = 384) -> HydraHeads:
    """Hydra heads trained by the real pipeline (train_heads, teacher forcing) on the same distilled data,
    warm-started from the Medusa heads; a draft vocabulary smaller than the vocabulary, so tokens outside it
    occur."""
    from medusa_chat.training.train_heads import (
        PositionData,
        TrainSettings,
        draft_vocabulary,
        hidden_states_for,
        new_heads,
        train_heads,
        warm_start_,
    )

    model = _load_backbone(arch, "none")
    prompts = torch.tensor(training_prompts())
    with torch.no_grad():
        seqs = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=90, do_sample=False
        )
    samples = [(i, row.tolist(), prompts.shape[1]) for i, row in enumerate(seqs)]
    data: PositionData = hidden_states_for(model, samples, store_dtype=torch.float32)
    s = TrainSettings(
        num_heads=num_heads,
        heads_format="hydra",
        draft_vocab_size=draft_vocab,
        epochs=15,
        batch_size=256,
        lr=1e-2,
        bf16=False,
    )
    lm_head = model.get_output_embeddings()
    heads = new_heads(s, lm_head, HIDDEN, VOCAB, draft_vocabulary(data, draft_vocab, VOCAB))
    warm_start_(heads, _distilled_heads(arch, num_heads))
    torch.manual_seed(0)
    embed = model.get_input_embeddings().weight.detach()
    train_heads(heads, lm_head.weight, data, s, torch.device("cpu"), log=lambda m: None, embed_weight=embed)
    return heads.eval().requires_grad_(False)


def training_prompts() -> list[list[int]]:
    """The prompts the tiny heads were distilled on: replies to them accept several tokens per step."""
    g = torch.Generator().manual_seed(42)
    return torch.randint(3, VOCAB, (48, 6), generator=g).tolist()


@functools.cache
def tiny_loaded(arch: str = "llama", quant: str = "none", heads: str = "v2") -> TinyLoaded:
    trained = _distilled_hydra_heads(arch) if heads == "hydra" else _distilled_heads(arch)
    return TinyLoaded(_load_backbone(arch, quant), trained, word_tokenizer())


def hf_greedy(loaded: TinyLoaded, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Plain greedy decoding with HF generate, plus the top-2 logit gap at each generated position."""
    return _hf_greedy(loaded.backbone, tuple(prompt), n)


@functools.lru_cache(maxsize=256)
def _hf_greedy(model: PreTrainedModel, prompt: tuple[int, ...], n: int) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    gaps = [float(torch.topk(step[0].float(), 2).values.diff().abs()) for step in out.logits]
    return tokens, gaps
