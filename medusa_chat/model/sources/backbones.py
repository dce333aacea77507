"""The backbone's weight readers: a checkpoint folder through transformers (16-bit, bitsandbytes, or int4
quantized onto a CUDA GPU one weight at a time), the cached quantized GGUF of a checkpoint for the CPU block path,
the CPU's row-invariant projections, and the heads fitted to the backbone's device and vocabulary. `load_model`
(loading.py) decides which applies; these do the reading."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from medusa_chat.errors import HeadsError, MedusaChatError, ModelNotFoundError
from medusa_chat.model.forward.heads import MedusaHeads
from medusa_chat.model.sources.devices import quantization_config
from medusa_chat.model.sources.heads_files import check_draft_vocab
from medusa_chat.model.sources.registry import ModelSpec
from medusa_chat.units import human_bytes

if TYPE_CHECKING:
    from medusa_chat.model.sources.gguf_model import WeightsOptions

Progress = Callable[[str], None]


def causal_lm_class(config: Any, ignore_medusa: bool, trust_remote_code: bool) -> Any:
    """The *ForCausalLM class; with `ignore_medusa` a subclass that skips the checkpoint's medusa_head.* keys
    quietly (they are read separately), instead of a LOAD REPORT warning about unexpected keys."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(config, "auto_map", None) and trust_remote_code:
        return AutoModelForCausalLM
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError as err:
        raise ModelNotFoundError(
            f"model type {getattr(config, 'model_type', '?')!r} is not a causal language model transformers knows"
            + ("" if trust_remote_code else " (if it needs its own code, pass --trust-remote-code)")
        ) from err
    if not ignore_medusa:
        return cls
    patterns = [*(cls._keys_to_ignore_on_load_unexpected or []), r"^medusa_head\."]
    return type(
        cls.__name__, (cls,), {"_keys_to_ignore_on_load_unexpected": patterns, "__module__": cls.__module__}
    )


def load_backbone(
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
    quant: str,
    *,
    ignore_medusa: bool = False,
    trust_remote_code: bool = False,
) -> Any:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise ModelNotFoundError(
            f"cannot read the model config in {folder}: {str(err).splitlines()[0]}"
        ) from err
    cls = causal_lm_class(config, ignore_medusa, trust_remote_code)
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        # Tree verification passes a 4D additive mask: sdpa and eager take it, flash-attention cannot.
        "attn_implementation": "sdpa",
        "device_map": {"": str(device)},
        "trust_remote_code": trust_remote_code,
    }
    qc = quantization_config(quant, dtype)
    if qc is not None:
        kwargs["quantization_config"] = qc
    try:
        model = cls.from_pretrained(folder, config=config, **kwargs)
    except (OSError, ValueError, RuntimeError, EOFError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise MedusaChatError(f"cannot load the model in {folder}: {first[:300]}") from err
    model.eval()
    model.requires_grad_(False)
    return model


def context_limit(model: Any, tokenizer: Any) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = int(getattr(cfg, "max_position_embeddings", 0) or 0) or 2048
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < 10_000_000:  # tokenizers without a limit say ~1e30
        limit = min(limit, tok_max)
    return limit


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    # ChatML models end a turn with <|im_end|>, which is not always their configured EOS.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if im_end is not None and im_end not in ids:
        ids.append(int(im_end))
    return ids


def load_cuda_int4(
    model_dir: Path,
    dev: torch.device,
    dtype: torch.dtype,
    notes: list[str],
    say: Progress,
    ignore_medusa: bool,
    trust_remote_code: bool,
) -> tuple[Any | None, str]:
    """The checkpoint read in 16 bits on the CPU, its projections quantized to int4 on the GPU one at a time, the
    int4 kernel chosen by measuring (model/forward/cuda_int4.py) and checked on this GPU (model/forward/cuda_check.py):
    (backbone, "int4"), or (None, the quantization to load instead) where no int4 kernel passed."""
    from medusa_chat.model.forward import cuda_check
    from medusa_chat.model.forward.cuda_int4 import TREE_ROWS, choose_kernel, quantize_backbone

    backbone = load_backbone(
        model_dir, torch.device("cpu"), dtype, "none", ignore_medusa=ignore_medusa, trust_remote_code=trust_remote_code
    )
    done = quantize_backbone(backbone, dev, dtype, progress=say)
    choice = choose_kernel(backbone, dev, progress=say)
    checked = cuda_check.verify_int4_load(backbone, dev, choice, TREE_ROWS, progress=say)
    if checked.kernel is None:
        need = cuda_check.sixteen_bit_bytes(backbone)
        del backbone
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        quant, instead = cuda_check.fallback_quant(need, cuda_check.free_bytes(dev), cuda_check.nf4_available())
        line = f"{checked.line}: {instead}"
        say(line)
        notes.append(line)
        return None, quant
    notes.append(
        f"{checked.line}; {done['int4']} projections, {human_bytes(done['bytes'])}"
        + (f"; {len(done['kept_16bit'])} projections kept 16-bit" if done["kept_16bit"] else "")
    )
    return backbone, "int4"


def load_from_quantized_file(folder: Path, name: str, options: WeightsOptions, trust_remote_code: bool) -> Any | None:
    """The backbone from the checkpoint's cached quantized GGUF (model/sources/quantized_cache.py), or None where
    that path does not apply (then the checkpoint loads whole and is quantized in memory, as before)."""
    from transformers import AutoConfig

    from medusa_chat.model.sources.quantized_cache import load_quantized_backbone, unsuitable

    q, notes, progress = options.quant, options.notes, options.progress
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):
        return None  # load_backbone says what is wrong
    why = unsuitable(folder, config, q, trust_remote_code)
    if why:  # said at startup (`info`, the UIs' notes): which path loaded this checkpoint, and why
        notes.append(f"quantized in memory after a whole float load: {why}")
        return None
    try:
        return load_quantized_backbone(folder, name, config, options)
    except OSError as err:  # no room (or no write access) for the file: quantized in memory instead
        why = err.strerror or str(err)
        notes.append(f"the quantized file could not be written ({why}): quantized in memory after a float load")
        if progress:
            progress(f"  the quantized file could not be written ({why}); loading the float model instead")
        return None


def prepare_cpu_blocks(
    backbone: Any, q: str, spec: ModelSpec, notes: list[str], progress: Progress | None
) -> None:
    """Row-invariant projections (exact tree decoding) on a CPU; the embedded model's blocks as stored."""
    # Row-invariant projections (exact tree decoding) and, for int4/int8, torch's weight-only kernels.
    # The embedded model's int4 weights are its GGUF's own Q4_1 blocks.
    from medusa_chat.model.forward.cpu_blocks import prepare_cpu_linears
    from medusa_chat.model.sources.gguf_names import gguf_blocks

    prebuilt = None
    if q != "none" and spec.kind == "embedded":
        from medusa_chat.model.sources.embedded import gguf_path

        gguf = gguf_path()
        if gguf is not None:
            prebuilt = gguf_blocks(gguf, backbone.config)
            if q == "int8":  # 8-bit projections are quantized here; the Q8_0 lm_head is the file's
                prebuilt = {k: v for k, v in prebuilt.items() if v[0] == "q8_0"}
            notes.append(f"{len(prebuilt)} quantized tensors of {gguf.name} used as stored")
    summary = prepare_cpu_linears(backbone, q, prebuilt, progress=progress)
    if summary["kept_float"]:
        notes.append(f"kept in float (no row-invariant kernel): {', '.join(summary['kept_float'][:4])}")
    if summary["refused"]:
        notes.append(summary["refused"])


def fit_heads(
    heads_mod: MedusaHeads,
    heads_path: Path | None,
    backbone: Any,
    compute_dtype: torch.dtype,
    dev: torch.device,
    quant: str = "none",
) -> None:
    """Check the heads' vocabulary against the backbone's lm_head, then move them to the device and dtype (on
    CUDA int4, Medusa-1 heads' vocab projections in int4 too)."""
    lm_head = backbone.get_output_embeddings()
    vocab = int(lm_head.out_features)
    if heads_mod.own_lm_head and heads_mod.vocab_size != vocab:
        raise HeadsError(
            f"Medusa heads in {heads_path} project to {heads_mod.vocab_size} tokens but the backbone's lm_head "
            f"has {vocab}"
        )
    heads_mod.vocab_size = vocab
    check_draft_vocab(heads_mod, vocab, str(heads_path))
    from medusa_chat.model.forward.block_heads import block_medusa_heads, can_block

    heads_mod.eval().requires_grad_(False)
    if dev.type == "cpu" and can_block(heads_mod, backbone):
        # The CPU block path (block_heads.py): each linear quantized from the file's dtype and its float weight
        # dropped, one after another, so the heads never exist in fp32 all at once (Vicuna-7B's five 32000-row
        # projections would be 2.6 GB).
        # (no cast after: the blocks keep their fp16 scales, which the kernel's bound pointers read; the biases
        # are fp32 already)
        block_medusa_heads(heads_mod, backbone, "q8_0")
        return
    # 16-bit on GPU like the backbone's compute; fp32 on CPU, where 16-bit matmuls are slow and inexact. An EAGLE
    # draft on a CPU keeps its file's precision here: the C drafter quantizes from it, and the PyTorch drafter
    # widens it to fp32 only where it runs (engine/eagle_drafter.py).
    if dev.type == "cpu" and getattr(heads_mod, "format", "") in ("eagle", "eagle3"):
        heads_mod.to(device=dev)
        return
    heads_dtype = compute_dtype if dev.type == "cuda" else torch.float32
    heads_mod.to(device=dev, dtype=heads_dtype)
    if dev.type == "cuda" and quant == "int4" and isinstance(heads_mod, MedusaHeads):
        from medusa_chat.model.forward.cuda_int4 import quantize_head_projections

        quantize_head_projections(heads_mod, dev, compute_dtype)
