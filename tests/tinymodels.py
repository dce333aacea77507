"""The test suite's one tiny-model factory: every tiny backbone, tokenizer, set of Medusa heads, heads folder, Hub
cache and LoadedModel a test uses is built here (tests/conftest.py only wraps these builders in fixtures).

All models share one shape (`tiny_config`: Llama or Mistral, hidden 64, 2 layers, vocab 512) and every one is a
real `LoadedModel` (the loader's own dataclass; nothing duck-typed). There are two recipes, because two kinds of
test need heads that are right for different reasons:

* planted (loader, session, UIs, calibration): weights with a planted next-token structure, heads in every
  published file layout, loaded from disk by the real `load_model` (`make_loaded_model`, fixtures below).
* self-distilled (engine): a random backbone and v2 / Hydra heads trained for a few seconds on its own greedy
  output, the way real Medusa-1 heads are made, assembled in memory (`tiny_loaded`).

The planted recipe in detail:

Everything is built once per test session in a temp folder, in well under a second per item.

Backbones (`tiny_llama_dir`, `tiny_mistral_dir`): LlamaForCausalLM / MistralForCausalLM, hidden 64, 2 layers,
vocab 512, saved with a byte-level BPE tokenizer trained here (Llama: ChatML template like SmolLM2, no BOS;
Mistral: Zephyr template, adds `<s>`). Their weights are random with a *planted* structure so that Medusa
heads can be genuinely right: the embeddings are random unit vectors and `lm_head` maps token i to a fixed
random successor `succ[i]`; the transformer layers are random and scaled so that the context still moves the
logits a lot and flips the argmax in a few % of steps (a wrong KV cache or tree mask shows), while top-2 logit
gaps stay well above float noise (measured minimum ~3e-3: no near-ties in greedy-equality tests). Greedy output
never produces a special token (EOS included): replies run to max_new_tokens. `read_successor(model_dir)`
returns `succ`.

Heads written in the exact published layouts (state-dict keys, dtypes, file names, config.json):
- `v1_pt_heads_dir`: `medusa_lm_head.pt` (torch.save of bf16 tensors), 5 heads, config saying 2 heads.
- `v1_safetensors_heads_dir`: `medusa_lm_head.safetensors` (fp16), 4 heads, plus a 12-node `tree.json`.
- `v2_heads_dir`: config `"version": "2"` + ResBlocks only (fp16), 3 heads x 2 layers.
- `medusa2_bin_dir`: Medusa-2 full Llama, 2 `pytorch_model-*.bin` fp16 shards + index, `medusa_head.*` keys.
- `medusa2_safetensors_dir`: Medusa-2 full Mistral, 2 `model-*.safetensors` shards + index.
`heads_state(folder)` returns the tensors a heads folder or Medusa-2 checkpoint holds (float32, published head
keys) for hand-computed checks.

`hub_cache` (function scope): a standard HF cache (`models--org--name/{blobs,snapshots/<rev>,refs/main}`)
under a temp HF_HUB_CACHE with HF_HUB_OFFLINE=1, holding `tiny-org/tiny-llama`, `tiny-org/tiny-llama-medusa`
(v1 heads), `tiny-org/tiny-medusa2` (full Mistral), and `tiny-org/tiny-llama-partial` (weights missing);
`hub_cache.add(repo_id, files)` adds more.

Builders usable from any test: build_tokenizer, build_tiny_backbone, planted_heads_state, random_heads_state,
write_heads, write_medusa2, write_pickled_checkpoint, write_hub_repo, folder_files, heads_state, read_successor.

`make_loaded_model(arch="llama", heads="v1", num_heads=4, num_layers=1, accuracy="planted", quant="none",
dtype="auto", fresh=False) -> LoadedModel` (fixture returning a factory): a real `loading.load_model` result on
CPU. accuracy="planted": v1 heads whose top-1 is right ~80/65/50/45% of the time (decreasing per head, right
token usually in the top few), so tree steps accept several tokens; "random": random non-zero heads (almost
nothing accepted). heads: "v1" | "v2" (v2 heads are always random: a 64-dim ResBlock cannot learn the successor
map) | "medusa2" (full checkpoint, planted heads inside). Results are cached per arguments: treat them as
read-only or pass fresh=True.

The self-distilled recipe in detail: `tiny_loaded(arch="llama", quant="none", heads="v2")` -> LoadedModel with a
random Llama/Mistral backbone (fp32, or NF4 via bitsandbytes on CPU), a word-level tokenizer (token i reads
"wi"), and v2 heads (or, heads="hydra", Hydra heads trained by the real training pipeline) self-distilled on the
backbone's greedy replies to `training_prompts()`, so tree steps really accept several tokens; its EOS id is
outside the vocabulary, so replies run to max_new_tokens. `hf_greedy` is the reference: plain HF greedy decoding
with the top-2 logit gap of every step.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from medusa_chat.model.forward.heads import HydraHeads, MedusaHeads
from medusa_chat.model.sources.loading import LoadedModel
from medusa_chat.model.sources.registry import ModelSpec
from medusa_chat.tree import Tree

HIDDEN = 64
VOCAB = 512
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
N_SPECIAL = len(SPECIALS)
LAYER_SCALE = 11.0  # o_proj/down_proj scale: context flips ~5% of argmaxes (see module docstring)

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + eos_token }}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}{% endfor %}"
)

CORPUS = (
    """\
Medusa adds a few small heads to a language model so that it can guess several tokens at once.
The backbone checks every guess in one pass and keeps the longest prefix it agrees with.
Give me three tips for staying healthy: drink water, exercise every day, and sleep well.
Eat more vegetables and fruit, walk outside, and keep a regular sleep schedule.
A chat between a curious user and an artificial intelligence assistant.
The assistant gives helpful, detailed, and polite answers to the user's questions.
USER: What is the capital of France? ASSISTANT: The capital of France is Paris.
Hello world! How are you today? I am fine, thank you. What are you doing this weekend?
The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.
Python is a programming language that lets you work quickly and integrate systems effectively.
Numbers like 1, 2, 3, 42 and 2024 appear in text, as do symbols such as #, $, % and &.
Large language models read all their weights for every token, so decoding is memory bound.
"""
    * 3
)


def tiny_config(arch: str, **overrides: Any) -> Any:
    """The one tiny shape: a LlamaConfig or MistralConfig (no sliding window) of hidden 64, 2 layers, 4 query
    and 2 KV heads, vocab 512; `overrides` set the rest (positions, special ids, tying)."""
    from transformers import LlamaConfig, MistralConfig

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    common.update(overrides)
    return LlamaConfig(**common) if arch == "llama" else MistralConfig(sliding_window=None, **common)


# ---- the planted recipe: builders (plain functions: any test module may call them) -------------------------------
def build_tokenizer(flavor: str) -> Any:
    """A byte-level BPE tokenizer with exactly VOCAB tokens; "chatml" (Llama fixture) or "zephyr" (Mistral)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    if flavor == "zephyr":
        # Llama/Mistral tokenizers put <s> in front of every encoded text.
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", SPECIALS.index("<s>"))]
        )
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
        )
        fast.chat_template = ZEPHYR_TEMPLATE
    else:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
            unk_token="<unk>",
            pad_token="<|im_end|>",
        )
        fast.chat_template = CHATML_TEMPLATE
    fast.model_max_length = 512
    return fast


def planted_successor(seed: int) -> torch.Tensor:
    """One long random cycle over the ordinary tokens; special tokens lead into it (never out of it)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(VOCAB - N_SPECIAL, generator=g) + N_SPECIAL
    succ = torch.empty(VOCAB, dtype=torch.long)
    succ[perm] = torch.roll(perm, -1)
    succ[:N_SPECIAL] = perm[:N_SPECIAL]
    return succ


def build_tiny_backbone(arch: str, seed: int) -> tuple[Any, torch.Tensor]:
    """A tiny random model with the planted successor structure (see the module docstring)."""
    from transformers import LlamaForCausalLM, MistralForCausalLM

    if arch == "llama":
        ids = {"bos_token_id": SPECIALS.index("<|im_start|>"), "eos_token_id": SPECIALS.index("<|im_end|>")}
    else:
        ids = {"bos_token_id": SPECIALS.index("<s>"), "eos_token_id": SPECIALS.index("</s>")}
    config = tiny_config(arch, max_position_embeddings=512, tie_word_embeddings=False, **ids)
    torch.manual_seed(seed)
    model = (LlamaForCausalLM if arch == "llama" else MistralForCausalLM)(config).eval()
    g = torch.Generator().manual_seed(seed + 100)
    emb = torch.randn(VOCAB, HIDDEN, generator=g)
    emb /= emb.norm(dim=1, keepdim=True)
    succ = planted_successor(seed)
    out = torch.empty(VOCAB, HIDDEN)
    out[succ[N_SPECIAL:]] = emb[N_SPECIAL:]  # row succ[i] = emb[i]: h ~ emb[i] scores succ[i] highest
    out[:N_SPECIAL] = -emb[:N_SPECIAL]  # special tokens are never the argmax
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(emb)
        model.get_output_embeddings().weight.copy_(out)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(LAYER_SCALE)
            layer.mlp.down_proj.weight.mul_(LAYER_SCALE)
    return model, succ


def save_backbone(model: Any, tokenizer: Any, path: Path, succ: torch.Tensor | None = None) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if succ is not None:
        (path / "planted_successor.json").write_text(json.dumps(succ.tolist()))
    return path


def read_successor(path: Path) -> torch.Tensor:
    return torch.tensor(json.loads((Path(path) / "planted_successor.json").read_text()))


def planted_heads_state(
    model: Any,
    succ: torch.Tensor,
    num_heads: int,
    num_layers: int = 1,
    noise: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9),
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """v1 heads (published keys) whose head k scores succ^(k+2)(token) highest, blurred by noise[k].

    ResBlocks are small random matrices (non-zero), so the head input is ~ the final hidden state.
    """
    g = torch.Generator().manual_seed(seed)
    emb = model.get_input_embeddings().weight.detach().float()
    state: dict[str, torch.Tensor] = {}
    target = succ.clone()  # succ^(k+2): token at t+2+k
    for k in range(num_heads):
        target = succ[target]
        proj = torch.zeros(VOCAB, HIDDEN)
        # row target[i] = emb[i] for ordinary i (target is a bijection on ordinary tokens)
        proj[target[N_SPECIAL:]] = emb[N_SPECIAL:]
        proj[:N_SPECIAL] = -emb[:N_SPECIAL]
        sigma = noise[min(k, len(noise) - 1)]
        proj += sigma * torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5 * 2
        for layer in range(num_layers):
            state[f"{k}.{layer}.linear.weight"] = 0.02 * torch.randn(HIDDEN, HIDDEN, generator=g)
            state[f"{k}.{layer}.linear.bias"] = 0.01 * torch.randn(HIDDEN, generator=g)
        state[f"{k}.{num_layers}.weight"] = proj
    return state


def random_heads_state(
    num_heads: int,
    num_layers: int = 1,
    own_lm_head: bool = True,
    hidden: int = HIDDEN,
    vocab: int = VOCAB,
    seed: int = 1,
) -> dict[str, torch.Tensor]:
    """Random, non-zero heads in the published key layout (v1 with projections, v2 without)."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for k in range(num_heads):
        for layer in range(num_layers):
            state[f"{k}.{layer}.linear.weight"] = 0.05 * torch.randn(hidden, hidden, generator=g)
            state[f"{k}.{layer}.linear.bias"] = 0.05 * torch.randn(hidden, generator=g)
        if own_lm_head:
            state[f"{k}.{num_layers}.weight"] = 0.05 * torch.randn(vocab, hidden, generator=g)
    return state


def write_heads(
    folder: Path,
    state: dict[str, torch.Tensor],
    *,
    fmt: str = "safetensors",
    dtype: torch.dtype = torch.float16,
    base_model: str = "",
    config_num_heads: int | None = None,
    version2: bool = False,
    tree: list[list[int]] | None = None,
) -> Path:
    """A heads folder as published: config.json + medusa_lm_head.{pt,safetensors} (+ optional tree.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    num_heads = len({k.split(".")[0] for k in state})
    num_layers = len({k.split(".")[1] for k in state if k.startswith("0.") and k.endswith("linear.weight")})
    config: dict[str, Any] = {
        "base_model_name_or_path": base_model,
        "medusa_num_heads": num_heads if config_num_heads is None else config_num_heads,
        "medusa_num_layers": num_layers,
        "transformers_version": "4.34.0",
    }
    if version2:
        config["version"] = "2"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    cast = {k: v.to(dtype).contiguous() for k, v in state.items()}
    if fmt == "pt":
        torch.save(cast, folder / "medusa_lm_head.pt")
    else:
        from safetensors.torch import save_file

        save_file(cast, str(folder / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
    if tree is not None:
        (folder / "tree.json").write_text(json.dumps({"name": f"{folder.name}-tree", "paths": tree}))
    return folder


def heads_state(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors a heads folder (or a Medusa-2 checkpoint) holds, as float32, with published head keys."""
    from medusa_chat.model.sources.heads_files import checkpoint_medusa_keys, find_heads_file, read_state_file

    folder = Path(folder)
    if any((folder / f).is_file() for f in ("medusa_lm_head.pt", "medusa_lm_head.safetensors")):
        return {k: v.float() for k, v in read_state_file(find_heads_file(folder)).items()}
    out = {}
    for fname, keys in checkpoint_medusa_keys(folder).items():
        for k, v in read_state_file(folder / fname, keys).items():
            out[k.removeprefix("medusa_head.")] = v.float()
    return out


def write_medusa2(
    folder: Path,
    model: Any,
    tokenizer: Any,
    heads: dict[str, torch.Tensor],
    *,
    fmt: str = "bin",
    dtype: torch.dtype = torch.float16,
) -> Path:
    """A Medusa-2 full checkpoint: 2 shards + index, backbone keys plus `medusa_head.{h}...` (in the last shard)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    num_layers = len({k.split(".")[1] for k in heads if k.startswith("0.") and k.endswith("linear.weight")})
    config.update(
        architectures=["MedusaModelLlama" if config["model_type"] == "llama" else "MedusaModelMistral"],
        medusa_num_heads=len({k.split(".")[0] for k in heads}),
        medusa_num_layers=num_layers,
        dtype="float16",
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    backbone = {k: v.detach().to(dtype).contiguous().clone() for k, v in model.state_dict().items()}
    keys = sorted(backbone)
    half = len(keys) // 2
    shards = [{k: backbone[k] for k in keys[:half]}, {k: backbone[k] for k in keys[half:]}]
    shards[1].update({f"medusa_head.{k}": v.to(dtype).contiguous() for k, v in heads.items()})
    if fmt == "bin":
        names = [f"pytorch_model-0000{i + 1}-of-00002.bin" for i in range(2)]
        index_name = "pytorch_model.bin.index.json"
    else:
        names = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
        index_name = "model.safetensors.index.json"
    weight_map: dict[str, str] = {}
    total = 0
    for name, shard in zip(names, shards, strict=True):
        if fmt == "bin":
            torch.save(shard, folder / name)
        else:
            from safetensors.torch import save_file

            save_file(shard, str(folder / name), metadata={"format": "pt"})
        for k, v in shard.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    (folder / index_name).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return folder


def write_pickled_checkpoint(source: Path, out: Path, shards: int = 1, legacy: bool = False) -> Path:
    """The safetensors model folder `source` again as a pickled checkpoint, as transformers 4 saved one with
    safe_serialization=False: `pytorch_model.bin`, or `pytorch_model-0000i-of-0000n.bin` shards +
    `pytorch_model.bin.index.json`; the same tensors bit for bit; the other files copied. `legacy`: the pre-zip
    torch.save format (torch < 1.6), which cannot be memory-mapped."""
    import shutil

    from safetensors.torch import load_file

    out.mkdir(parents=True, exist_ok=True)
    for f in Path(source).iterdir():
        if f.is_file() and not f.name.startswith("model") and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    state = {}
    for f in sorted(Path(source).glob("model*.safetensors")):
        state.update(load_file(str(f)))
    keys = sorted(state)
    size = -(-len(keys) // shards)
    parts = [keys[i : i + size] for i in range(0, len(keys), size)]
    names = (
        ["pytorch_model.bin"]
        if len(parts) == 1
        else [f"pytorch_model-{i + 1:05d}-of-{len(parts):05d}.bin" for i in range(len(parts))]
    )
    weight_map: dict[str, str] = {}
    for name, part in zip(names, parts, strict=True):
        torch.save({k: state[k] for k in part}, out / name, _use_new_zipfile_serialization=not legacy)
        weight_map.update({k: name for k in part})
    if len(parts) > 1:
        total = sum(v.numel() * v.element_size() for v in state.values())
        (out / "pytorch_model.bin.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
        )
    return out


def write_hub_repo(
    cache: Path, repo_id: str, files: dict[str, Path | bytes], commit: str | None = None
) -> Path:
    """Put files into a standard huggingface_hub cache layout; returns the snapshot folder."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    blobs = storage / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        data = src if isinstance(src, bytes) else Path(src).read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return snapshot


def folder_files(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, Path | bytes]:
    return {p.name: p for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name not in skip}


# ---- the planted recipe: what the fixtures build -------------------------------------------------------------
PlantedModels = dict[
    str, tuple[Any, torch.Tensor, Any, Path]
]  # arch -> (model, successor map, tokenizer, folder)


def build_planted_models(root: Path) -> PlantedModels:
    """The planted Llama (ChatML tokenizer) and Mistral (Zephyr tokenizer), each saved in a folder under root."""
    out = {}
    for arch, seed, flavor in (("llama", 0, "chatml"), ("mistral", 1, "zephyr")):
        model, succ = build_tiny_backbone(arch, seed)
        tok = build_tokenizer(flavor)
        out[arch] = (model, succ, tok, save_backbone(model, tok, root / f"tiny-{arch}", succ))
    return out


_LOADED: dict[tuple, LoadedModel] = {}


def load_planted(
    models: PlantedModels,
    root: Path,
    arch: str = "llama",
    heads: str = "v1",
    num_heads: int = 4,
    num_layers: int = 1,
    accuracy: str = "planted",
    quant: str = "none",
    dtype: str = "auto",
    fresh: bool = False,
) -> LoadedModel:
    """A real `loading.load_model` result on CPU for a planted backbone (see the module docstring for the
    arguments); cached per arguments unless `fresh`."""
    from medusa_chat.model.sources.loading import load_model

    key = (arch, heads, num_heads, num_layers, accuracy, quant, dtype)
    if key in _LOADED and not fresh:
        return _LOADED[key]
    model, succ, tok, path = models[arch]
    name = "-".join(str(k) for k in key[:5])
    if heads == "v2" or accuracy == "random":
        state = random_heads_state(num_heads, num_layers, own_lm_head=heads != "v2")
    else:
        state = planted_heads_state(model, succ, num_heads, num_layers)
    if heads == "medusa2":
        folder = root / f"loaded-{name}"
        if not folder.exists():
            write_medusa2(folder, model, tok, state, fmt="safetensors", dtype=torch.float32)
        loaded = load_model(model=str(folder), quant=quant, dtype=dtype, device="cpu")
    else:
        folder = root / f"loaded-heads-{name}"
        if not folder.exists():
            write_heads(folder, state, dtype=torch.float32, base_model=str(path), version2=heads == "v2")
        loaded = load_model(model=str(path), heads=str(folder), quant=quant, dtype=dtype, device="cpu")
    _LOADED[key] = loaded
    return loaded


# ---- the self-distilled recipe (engine tests) ------------------------------------------------------------------
@functools.cache
def _engine_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="medusa-tiny-"))


def word_tokenizer() -> Any:
    """Token i reads "wi": one word per token, so texts and ids map one to one."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")


@functools.cache
def _backbone_dir(arch: str) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed({"llama": 0, "mistral": 1, "gpt2": 2, "gpt_neox": 3}[arch])
    ids = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if (
        arch == "gpt2"
    ):  # learned absolute positions, fused qkv, `transformer` as the decoder (transformers forward)
        from transformers import GPT2Config

        config = GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=1024, **ids)
    elif arch == "gpt_neox":  # parallel attention + MLP, partial rotary, `gpt_neox` as the decoder
        from transformers import GPTNeoXConfig

        config = GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=1024, **ids,
        )  # fmt: skip
    else:
        config = tiny_config(arch, max_position_embeddings=1024, **ids)
    model = AutoModelForCausalLM.from_config(config)
    # Larger weights than the default init make the random model's greedy output less repetitive.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    path = _engine_dir() / arch
    model.save_pretrained(path)
    return path


def _load_backbone(arch: str, quant: str) -> Any:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

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


def _distilled_heads(arch: str, num_heads: int = 4) -> MedusaHeads:
    """Train v2 heads on the fp32 backbone's own greedy continuations (Medusa-1 self-distillation, tiny); once per
    (arch, num_heads) however it is called (functools.cache keys `f(a)` and `f(a, 4)` apart)."""
    return _distilled_heads_once(arch, num_heads)


@functools.cache
def _distilled_heads_once(arch: str, num_heads: int) -> MedusaHeads:
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
    from medusa_chat.training.loop import RunOptions
    from medusa_chat.training.positions import PositionData, hidden_states_for
    from medusa_chat.training.train_heads import (
        TrainSettings,
        draft_vocabulary,
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
    quiet = RunOptions(torch.device("cpu"), log=lambda m: None)
    train_heads(heads, lm_head.weight, data, s, quiet, embed_weight=embed)
    return heads.eval().requires_grad_(False)


def training_prompts() -> list[list[int]]:
    """The prompts the tiny heads were distilled on: replies to them accept several tokens per step."""
    g = torch.Generator().manual_seed(42)
    return torch.randint(3, VOCAB, (48, 6), generator=g).tolist()


@dataclass
class TinyLoaded(LoadedModel):
    """The real LoadedModel, plus the vocabulary size the engine tests draw random prompts from."""

    vocab_size: int = VOCAB


@functools.cache
def tiny_loaded(arch: str = "llama", quant: str = "none", heads: str = "v2") -> TinyLoaded:
    """The engine tests' model (see the module docstring); one shared object per arguments: treat it as
    read-only (dataclasses.replace makes a variant)."""
    trained = _distilled_hydra_heads(arch) if heads == "hydra" else _distilled_heads(arch)
    spec = ModelSpec(
        name=f"tiny-{arch}-{heads}",
        backbone=str(_backbone_dir(arch)),
        heads=None,
        kind="v2-heads",
        chat_template="tokenizer",
        default_tree="mc_sim_7b_63",
        description="self-distilled tiny test model",
        custom=True,
    )
    return TinyLoaded(
        spec=spec,
        backbone=_load_backbone(arch, quant),
        tokenizer=word_tokenizer(),
        heads=trained,
        device=torch.device("cpu"),
        dtype=torch.float32,
        quant=quant,
        default_tree=Tree.named("mc_sim_7b_63"),
        context_limit=512,
        eos_token_ids=[VOCAB + 1],  # never produced: replies run to max_new_tokens
        stop_strings=(),
        model_dir=str(_backbone_dir(arch)),
    )


def block_loaded(quant: str, arch: str = "llama", heads: str = "hydra") -> Any:
    """A copy of tiny_loaded(arch, heads=heads) whose backbone projections are on the block kernel (`quant`: int8
    or int4; the lm_head Q8_0), as the embedded model runs on a CPU; the test is skipped where the kernel cannot
    run. The shared tiny model is untouched."""
    import pytest

    from medusa_chat.kernels import cbind
    from medusa_chat.model.forward.cpu_blocks import prepare_cpu_linears

    if not cbind.available():
        pytest.skip(f"block kernel: {cbind.unavailable_reason()}")
    base = tiny_loaded(arch, heads=heads)
    loaded = copy.copy(base)
    lean = base.backbone.__dict__.pop("_medusa_lean_forward", None)  # a native step's C structs do not copy
    try:
        loaded.backbone = copy.deepcopy(base.backbone)
    finally:
        if lean is not None:
            base.backbone._medusa_lean_forward = lean
    prepare_cpu_linears(loaded.backbone, quant)
    return loaded


def moved(loaded: Any, device: str | torch.device, dtype: torch.dtype) -> Any:
    """A copy of a tiny LoadedModel whose backbone and heads are on `device` in `dtype` (the shared original is
    left alone; the copy gets its own lean forward)."""
    twin = copy.copy(loaded)
    twin.backbone = copy.deepcopy(loaded.backbone).to(device, dtype)
    twin.backbone.__dict__.pop("_medusa_lean_forward", None)
    twin.heads = copy.deepcopy(loaded.heads).to(device, dtype)
    twin.device = torch.device(device)
    return twin


def hf_greedy(loaded: LoadedModel, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Plain greedy decoding with HF generate, plus the top-2 logit gap at each generated position."""
    return _hf_greedy(loaded.backbone, tuple(prompt), n)


@functools.lru_cache(maxsize=256)
def _hf_greedy(model: Any, prompt: tuple[int, ...], n: int) -> tuple[list[int], list[float]]:
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
