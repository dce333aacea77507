"""An EAGLE-3 draft as the GGUF llama.cpp's `llama-server --spec-type draft-eagle3 -md FILE` loads.

Written to hold what llama.cpp's own converter (`convert_hf_to_gguf.py DRAFT --target-model-dir TARGET`, its
`conversion/llama.py` EAGLE-3 branch, read in the llama-cpp-python 0.3.36 sdist) writes for the same draft:

- arch `eagle3`; `eagle3.target_layers` = the draft config's `eagle_aux_hidden_state_layer_ids`, else
  [2, N // 2, N - 3] of the N-layer target (the same taps this project drafts from); `target_hidden_size`
  (the draft config's, else the target's); `norm_before_residual` and `norm_before_fc` (default false); the
  Llama hyper-parameters of the draft's config; the target's tokenizer (`tokenizer.*`, copied here from the
  target's GGUF: llama.cpp checks that draft and target vocabularies agree).
- tensors: `fc.weight`, `output.weight` (lm_head, over the draft vocabulary), `output_norm.weight`, `blk.0.*`
  with `attn_norm` = input_layernorm (on the embedding), `attn_norm_2` = hidden_norm (on the feature), q/k rows
  permuted from HF's rotary halves to GGML's interleaved pairs, `token_embd.weight` only where the draft carries
  its own embedding, and `d2t` as I64 *absolute* target ids (i + d2t[i]); `t2d` is not written (unused).
- `--outtype f16`: matrices F16, 1-D tensors (norms) F32, as the converter's f16 output; f32: all F32.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from medusa_chat.errors import HeadsError, MedusaChatError
from medusa_chat.export.source import Draft, Target

ARCH = "eagle3"
OUTTYPES = ("f16", "f32")
# source tensor name (after the layer prefix) -> GGUF name, as the converter's tensor map gives them
LAYER_NAMES = {
    "hidden_norm": "attn_norm_2",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.down_proj": "ffn_down",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
}
TOP_NAMES = {
    "fc.weight": "fc.weight",
    "lm_head.weight": "output.weight",
    "norm.weight": "output_norm.weight",
    "embed_tokens.weight": "token_embd.weight",
    "input_norm.weight": "enc.output_norm.weight",
}
LAYER_PREFIXES = ("midlayer.", "layers.0.")  # SafeAILab / SpecForge, and speculators


def gguf_name(name: str) -> str | None:
    """The GGUF tensor name of a draft tensor (None: not written, e.g. t2d)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    for prefix in LAYER_PREFIXES:
        if name.startswith(prefix):
            stem, _, kind = name[len(prefix) :].rpartition(".")
            if stem in LAYER_NAMES:
                return f"blk.0.{LAYER_NAMES[stem]}.{kind}"
    if name in ("d2t", "t2d"):
        return None
    raise HeadsError(f"the EAGLE-3 draft holds {name!r}, which llama.cpp's eagle3 arch has no tensor for")


def permute_rotary(w: torch.Tensor, n_head: int, n_head_kv: int | None = None) -> torch.Tensor:
    """HF's q/k rows (each head's rotary pairs split in two halves) in GGML's order (pairs interleaved): the
    converter's `LlamaModel.permute`."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def target_layers(draft: Draft, target: Target) -> list[int]:
    ids = draft.config.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return [int(i) for i in ids]
    n = target.num_layers
    return [2, n // 2, n - 3]


def llama3_rope_factors(config: dict[str, Any], rope: dict[str, Any]) -> torch.Tensor:
    """Llama-3.1 rope scaling as per-frequency factors (`rope_freqs.weight`), the converter's formula."""
    base = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _rope(writer: Any, config: dict[str, Any]) -> torch.Tensor | None:
    """The rope keys the converter writes for the draft config; returns llama3's factor tensor, if any."""
    import gguf

    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    kind = str(rope.get("rope_type") or rope.get("type") or "default").lower()
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if theta is not None:
        writer.add_rope_freq_base(float(theta))
    factor = rope.get("factor")
    if kind == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(factor))
    elif kind == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(factor))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind == "llama3":
        return llama3_rope_factors(config, rope)
    elif kind != "default":
        raise MedusaChatError(f"the draft's rope scaling {kind!r} has no llama.cpp export here")
    return None


def _metadata(writer: Any, draft: Draft, target: Target, outtype: str, params: int) -> None:
    import gguf

    cfg = {**draft.config, **(draft.config.get("transformer_layer_config") or {})}
    # by name: the gguf package on PyPI (0.19) predates these keys, llama.cpp reads them as written here
    writer.add_array(f"{ARCH}.target_layers", target_layers(draft, target))
    writer.add_uint32(
        f"{ARCH}.target_hidden_size", int(draft.config.get("target_hidden_size") or target.hidden_size)
    )
    writer.add_bool(f"{ARCH}.norm_before_residual", bool(draft.config.get("norm_before_residual", False)))
    writer.add_bool(f"{ARCH}.norm_before_fc", bool(draft.config.get("norm_before_fc", False)))
    writer.add_type("model")
    writer.add_name(f"{Path(target.name).name} EAGLE-3 draft")
    writer.add_size_label(gguf.size_label(params, 0, 0, 0))
    writer.add_block_count(1)
    if cfg.get("max_position_embeddings") is not None:
        writer.add_context_length(int(cfg["max_position_embeddings"]))
    writer.add_embedding_length(int(cfg["hidden_size"]))
    writer.add_feed_forward_length(int(cfg["intermediate_size"]))
    writer.add_head_count(int(cfg["num_attention_heads"]))
    writer.add_head_count_kv(int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    head_dim = cfg.get("head_dim")
    if head_dim is not None:
        writer.add_key_length(int(head_dim))
        writer.add_value_length(int(head_dim))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if outtype == "f16" else gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(int(cfg["vocab_size"]))
    writer.add_rope_dimension_count(
        int(head_dim or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    )
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def copy_tokenizer(writer: Any, target_gguf: Path) -> None:
    """The target's `tokenizer.*` keys, value for value (llama.cpp refuses a draft whose vocabulary differs)."""
    import gguf

    reader = gguf.GGUFReader(str(target_gguf))
    found = False
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or not field.types:
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
        found = True
    if not found:
        raise MedusaChatError(f"{target_gguf} carries no tokenizer: llama.cpp needs one in the draft too")


def gguf_tensors(draft: Draft, outtype: str) -> list[tuple[str, np.ndarray, Any]]:
    """(GGUF name, array, raw dtype or None) for every tensor, in the converter's order: the draft file's sorted
    names, `rope_freqs` after them, `d2t` last."""
    import gguf

    cfg = {**draft.config, **(draft.config.get("transformer_layer_config") or {})}
    n_head = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    out: list[tuple[str, np.ndarray, Any]] = []
    for name in sorted(draft.state):
        target = gguf_name(name)
        if target is None:
            continue
        t = draft.state[name].detach().to(torch.float32)
        if ".attn_q." in target:
            t = permute_rotary(t, n_head, n_head)
        elif ".attn_k." in target:
            t = permute_rotary(t, n_head, n_kv)
        dtype = np.float16 if outtype == "f16" and t.dim() > 1 else np.float32
        out.append((target, t.numpy().astype(dtype), None))
    d2t = draft.state["d2t"].to(torch.int64).reshape(-1)
    absolute = (d2t + torch.arange(d2t.numel())).numpy()
    out.append(("d2t", absolute, gguf.GGMLQuantizationType.I64))
    return out


def check_vocab_maps(draft: Draft, vocab_size: int) -> None:
    """d2t must name distinct target tokens, and t2d mark exactly those (the converter checks the first part)."""
    d2t = draft.state["d2t"].to(torch.int64).reshape(-1)
    ids = d2t + torch.arange(d2t.numel())
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise HeadsError(f"d2t names token ids outside the target's {vocab_size}-token vocabulary")
    if int(ids.unique().numel()) != int(ids.numel()):
        raise HeadsError("d2t names a target token twice")
    t2d = draft.state.get("t2d")
    if t2d is not None:
        marked = torch.nonzero(t2d.reshape(-1).bool()).reshape(-1)
        if not torch.equal(marked, ids.sort().values):
            raise HeadsError("t2d does not mark exactly the target tokens d2t names")


def write_gguf(
    draft: Draft, target: Target, out: Path, outtype: str = "f16", target_gguf: Path | None = None
) -> Path:
    """Write `draft` (an EAGLE-3 draft) as llama.cpp's eagle3 GGUF at `out`."""
    import gguf

    if draft.kind != "eagle3":
        raise MedusaChatError(
            "llama.cpp loads EAGLE-3 drafts only (`--spec-type draft-eagle3`): use --heads eagle3"
        )
    if outtype not in OUTTYPES:
        raise MedusaChatError(f"--outtype must be one of {', '.join(OUTTYPES)}")
    source = target_gguf or target.gguf
    if source is None:
        raise MedusaChatError(
            "llama.cpp needs the target's tokenizer inside the draft: give --target-gguf FILE (the GGUF you "
            "serve the model from)"
        )
    check_vocab_maps(draft, target.vocab_size)
    tensors = gguf_tensors(draft, outtype)
    rope_config = {**draft.config, **(draft.config.get("transformer_layer_config") or {})}
    params = sum(int(a.size) for name, a, _ in tensors if name != "d2t")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    try:
        _metadata(writer, draft, target, outtype, params)
        factors = _rope(writer, rope_config)
        copy_tokenizer(writer, source)
        if factors is not None:
            tensors.insert(len(tensors) - 1, ("rope_freqs.weight", factors.numpy(), None))
        for name, array, raw in tensors:
            writer.add_tensor(name, array, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    tmp.replace(out)
    return out


def recipe(out: Path, target: Target) -> str:
    model = target.gguf or "TARGET.gguf"
    return f"llama-server -m {model} -md {out} --spec-type draft-eagle3"
