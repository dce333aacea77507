"""Load a backbone plus its Medusa heads on the chosen device, whatever format the heads were published in.

Order of work, chosen so that a mistake costs seconds, not a 13 GB download: resolve the name, check the
device/quantization request, fetch the backbone's config.json (size check against the device), fetch and
check the heads (hidden size / vocab against that config), then fetch and load the backbone weights.

Head formats (MEDUSA_FACTS section 3), decided from the tensors, never by trying one and falling back:
- v1: `medusa_lm_head.{safetensors,pt}` with a vocab projection per head (`{h}.{L}.weight`).
- v2: the same file name holding ResBlocks only (config `"version": "2"`); logits via the backbone's lm_head.
- Medusa-2 full model: the backbone checkpoint itself carries `medusa_head.{h}...` keys.

This module imports neither rich nor gradio (see docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from medusa_chat.atomic import read_json
from medusa_chat.errors import DeviceError, HeadsError, MedusaChatError, ModelNotFoundError, TreeError
from medusa_chat.machine import cpu_native_bf16
from medusa_chat.model import hub
from medusa_chat.model.chat_template import TOKENIZER, VICUNA_STOP_STRINGS, VICUNA_V11, build_prompt_ids
from medusa_chat.model.devices import (
    CPU_QUANTS,
    NF4_TREES_NOTE,
    pick_device,
    pick_dtype,
    pick_quant,
    quantization_config,
)
from medusa_chat.model.heads import HydraHeads, MedusaHeads
from medusa_chat.model.heads_files import (
    check_draft_vocab,
    check_heads_fit,
    checkpoint_medusa_keys,
    heads_kind,
    load_checkpoint_heads,
    load_heads_file,
)
from medusa_chat.model.lookup_only import LOOKUP_ONLY, heads_info, heads_line, lookup_only_tree
from medusa_chat.model.registry import MODELS, ModelSpec, heads_location, is_repo_id, resolve
from medusa_chat.tree import Tree
from medusa_chat.units import human_bytes, human_count

Progress = Callable[[str], None]

LARGE_MODEL_PARAMS = 5e9  # "7B and up": unusable on a CPU unless the user insists with --device cpu

# bitsandbytes' CPU int8 path warns on every matmul that fp32 inputs are cast to fp16: known and harmless.
warnings.filterwarnings("ignore", message=r"MatMul8bitLt: inputs will be cast")


@dataclass
class LoadedModel:
    """A backbone with its Medusa heads, ready for the decoding engine (see docs/ARCHITECTURE.md)."""

    spec: ModelSpec
    backbone: Any  # transformers *ForCausalLM
    tokenizer: Any  # PreTrainedTokenizerBase
    heads: MedusaHeads | None  # None: no heads, context lookup drafts alone (lookup_only.py)
    device: torch.device
    dtype: torch.dtype
    quant: str
    default_tree: Tree
    context_limit: int
    eos_token_ids: list[int]
    stop_strings: tuple[str, ...]
    # Extras (not in the contract, for info/UIs): where things came from.
    heads_source: str = ""  # "heads file" | "medusa-2 checkpoint" | lookup_only.LOOKUP_ONLY
    heads_file: str = ""
    heads_asked: str = ""  # --heads as given ("": the model's default, which a calibration may choose)
    model_dir: str = ""
    notes: list[str] = field(default_factory=list)  # decisions a user may want to know (fallbacks, trims)
    # On a GPU: False when this device's calibration timed CUDA-graph steps slower than eager ones (tree_choice)
    graph_step: bool | None = None
    # On a CPU: {calibrated tree size: the size that calibration found best on one thread}, the tree the engine
    # verifies while its thread governor runs the native step on one thread (a busy machine; tree_choice)
    single_thread_trees: dict[int, int] = field(default_factory=dict)
    # this numeric path's teacher-forced agreement with the float model where the `--quant auto` choice measured
    # it (numeric_path.cached_fidelity: top1, mean_kl, p99_kl, tokens); "none" on a float checkpoint is the
    # float model itself
    fidelity: dict[str, Any] | None = None

    def build_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return build_prompt_ids(self.tokenizer, self.spec.chat_template, messages, add_generation_prompt)

    def info(self) -> dict[str, Any]:
        """Startup summary: model, heads, quantization, device, dtype, parameters and memory."""
        from medusa_chat.kernels.cpu_linears import weight_accounting

        heads = heads_info(self.heads, self.heads_source, self.heads_file, self.spec.backbone or self.model_dir)
        if self.heads is not None:  # block heads: their real footprint (a shared lm_head once) and drafter
            from medusa_chat.model.block_heads import drafter_name, heads_footprint

            params, nbytes, dtype = heads_footprint(self.heads, self.backbone)
            drafter = drafter_name(self.heads, self.heads_source)
            heads.update(params=params, bytes=nbytes, dtype=dtype, drafter=drafter)
        swapped_weights, swapped_bytes = weight_accounting(
            self.backbone
        )  # packed / quantized CPU projections
        backbone_bytes = int(self.backbone.get_memory_footprint()) + swapped_bytes
        cuda_bytes = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
        archs = getattr(self.backbone.config, "architectures", None) or [type(self.backbone).__name__]
        return {
            "model": self.spec.name,
            "kind": self.spec.kind,
            "backbone": self.spec.backbone or self.model_dir,
            "model_dir": self.model_dir,
            "architecture": archs[0],
            "heads": heads,
            "quant": self.quant,
            "device": str(self.device),
            "dtype": _dtype_name(self.dtype),
            "params": int(self.backbone.num_parameters()) + swapped_weights,
            "memory": {
                "backbone_bytes": backbone_bytes,
                "heads_bytes": heads["bytes"],
                "total_bytes": backbone_bytes + heads["bytes"],
                "cuda_allocated_bytes": cuda_bytes,
            },
            "context_limit": self.context_limit,
            "chat_template": self.spec.chat_template,
            "default_tree": {
                "name": self.default_tree.name,
                "size": self.default_tree.size,
                "depth": self.default_tree.depth,
            },
            "fidelity": self.fidelity,
            "notes": list(self.notes),
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def summary_lines(info: dict[str, Any]) -> list[str]:
    """`info()` as short plain-text lines (the terminal and web UIs show these at startup)."""
    h, mem = info["heads"], info["memory"]
    lines = [
        f"model      {info['model']} ({info['kind']}, {info['architecture']}) from {info['backbone']}",
        f"heads      {heads_line(h)}",
        f"device     {info['device']}, {info['dtype']}, quantization {info['quant']}",
        f"params     {human_count(info['params'])} backbone + {human_count(h['params'])} heads",
        f"memory     {human_bytes(mem['backbone_bytes'])} backbone + {human_bytes(mem['heads_bytes'])} heads"
        + (
            f" (CUDA allocated {human_bytes(mem['cuda_allocated_bytes'])})"
            if mem["cuda_allocated_bytes"]
            else ""
        ),
        f"context    {info['context_limit']} tokens, template {info['chat_template']}",
        f"tree       {info['default_tree']['name']} ({info['default_tree']['size']} nodes, "
        f"depth {info['default_tree']['depth']})",
    ]
    lines += [f"note       {n}" for n in info.get("notes", [])]
    return lines


# ---- device, dtype, quantization --------------------------------------------------------------------------------


def estimate_params(config: dict[str, Any]) -> int:
    """Backbone parameter count from config.json alone (before any weight is downloaded)."""
    cfg = config.get("text_config") or config
    h = int(cfg.get("hidden_size") or 0)
    layers = int(cfg.get("num_hidden_layers") or 0)
    inter = int(cfg.get("intermediate_size") or 4 * h)
    vocab = int(cfg.get("vocab_size") or 0)
    heads = int(cfg.get("num_attention_heads") or 1)
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (h // heads if heads else 0))
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    per_layer = attn + 3 * h * inter
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return embed + layers * per_layer


# ---- locating files ---------------------------------------------------------------------------------------------
def _local_or_fetch(location: str, want: str, progress: Progress | None) -> Path:
    if is_repo_id(location):
        return hub.fetch(location, want, progress=progress)
    path = Path(location).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(f"folder {location} does not exist")
    if want == "model":
        names = [p.name for p in path.iterdir()]
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json: not a transformers model folder")
        if not hub.weight_files(names):
            raise ModelNotFoundError(
                f"{path} has no model weights (model*.safetensors or pytorch_model*.bin)"
            )
        missing = hub.missing_shards(path)
        if missing:
            raise ModelNotFoundError(f"{path} is incomplete: missing {', '.join(missing[:5])}")
    return path


# ---- reading heads ----------------------------------------------------------------------------------------------


# ---- the backbone -----------------------------------------------------------------------------------------------
def _causal_lm_class(config: Any, ignore_medusa: bool, trust_remote_code: bool) -> Any:
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
    cls = _causal_lm_class(config, ignore_medusa, trust_remote_code)
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


def _context_limit(model: Any, tokenizer: Any) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = int(getattr(cfg, "max_position_embeddings", 0) or 0) or 2048
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < 10_000_000:  # tokenizers without a limit say ~1e30
        limit = min(limit, tok_max)
    return limit


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
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


def _default_tree(spec: ModelSpec, heads_dir: Path | None, num_heads: int | None, notes: list[str]) -> Tree:
    if num_heads is None:  # no heads: a chain for the context lookup's guesses
        return lookup_only_tree()
    tree_file = heads_dir / "tree.json" if heads_dir is not None else None
    if tree_file is not None and tree_file.is_file() and not Path(spec.default_tree).is_file():
        source = str(tree_file)  # a Hub heads repo's own tree, fitted to those heads
    else:
        source = spec.default_tree
    tree = Tree.named(source)
    if Path(source).is_file():
        name = read_json(Path(source)).get("name")
        if isinstance(name, str) and name:
            tree = Tree(tree.paths, name=name)
    if tree.depth > num_heads:
        # Only the default is trimmed to fit; a tree the user names is checked (TreeError) by whoever uses it.
        tree = Tree.from_paths(
            [p for p in tree.paths if len(p) <= num_heads], name=f"{tree.name}[depth<={num_heads}]"
        )
        notes.append(f"default tree trimmed to depth {num_heads} to match {num_heads} heads")
    return tree


def _check_size(spec: ModelSpec, params: float, device_arg: str, dev: torch.device) -> None:
    if device_arg == "auto" and dev.type == "cpu" and params >= LARGE_MODEL_PARAMS:
        raise DeviceError(
            f"{spec.name} has ~{params / 1e9:.0f}B parameters and this machine has no CUDA GPU: on CPU it needs "
            f"~{params * 4 / 1e9:.0f} GB of RAM and answers at well under a token per second. Pass --device cpu "
            "to run it anyway, or use the embedded smollm2-135m"
        )


# ---- the entry point --------------------------------------------------------------------------------------------
def load_model(
    model: str = "smollm2-135m",
    heads: str | None = None,
    quant: str = "auto",
    dtype: str = "auto",
    device: str = "auto",
    progress: Progress | None = None,
    trust_remote_code: bool = False,
    *,
    quantized_cache: bool = True,
) -> LoadedModel:
    """Resolve, download (only what is needed), load and check a backbone and its Medusa heads.

    `quantized_cache`: a checkpoint on a CPU block path (int4/int8) is quantized tensor by tensor into a cached
    GGUF and loaded from it (quantized_cache.py); False: loaded whole in float and quantized in memory."""
    say = progress or (lambda text: None)
    spec = resolve(model, heads)
    dev = pick_device("cpu" if spec.kind == "gguf" and device == "auto" else device)  # GGUF: CPU formats
    q = pick_quant(quant, dev)
    compute_dtype = pick_dtype(dtype, dev)
    notes: list[str] = []
    if dev.type == "cpu":  # the C kernels compile (first start only) while the metadata is read below
        from medusa_chat.kernels import qgemm

        qgemm.prebuild()
    if spec.params_b and not spec.custom:
        _check_size(spec, spec.params_b * 1e9, device, dev)  # known size: refuse before any network access

    # 1. The backbone's config.json (tiny) first: size and head checks happen before any big download.
    spec, backbone_loc, config = _read_config(spec, say, progress)

    if (spec.custom or not spec.params_b) and spec.kind != "gguf":  # a GGUF's size is its file's
        _check_size(spec, estimate_params(config), device, dev)

    # 2. Separate heads: fetch and check them against the config before the backbone weights come.
    spec, heads_mod, heads_dir, heads_path = _separate_heads(spec, config, backbone_loc, progress)

    # 3. The backbone itself.
    model_dir = (
        Path(backbone_loc) if spec.kind == "gguf" else _local_or_fetch(backbone_loc, "model", progress)
    )
    # A Medusa-2 checkpoint used with separately given heads still carries medusa_head.* keys: find them too
    # (from the index / safetensors headers; a lone pickle is only opened when the heads must come from it).
    medusa_keys = checkpoint_medusa_keys(model_dir, open_pickles=heads_mod is None)
    if heads_mod is None and not medusa_keys and spec.kind != "gguf":  # still a chat: lookup drafts alone
        spec = replace(spec, kind="no-heads")
    fidelity, cpu_quant = None, False
    # A GGUF file is built tensor by tensor from the file (gguf_model.py); `auto`: its blocks as stored.
    if spec.kind == "gguf":
        from medusa_chat.model.gguf_model import load_gguf_backbone

        backbone, q = load_gguf_backbone(
            Path(spec.backbone), model_dir, dev, q, compute_dtype, notes, progress
        )
    else:
        if q == "auto":  # a CPU: the fastest exact path on this machine, measured once and cached
            from medusa_chat.kernels.numeric_path import choose_cpu_quant
            from medusa_chat.model.fidelity import fidelity_probe

            # Keyed by the backbone, not the alias: the same weights must get the same numeric path however
            # they are named (a heads repo naming its backbone, or the backbone with --heads).
            probe = fidelity_probe(
                # the float model is in memory for this probe anyway: no cached file for paths it may not keep
                lambda qq: load_model(
                    model,
                    heads,
                    quant=qq,
                    device="cpu",
                    trust_remote_code=trust_remote_code,
                    quantized_cache=False,
                ),
                estimate_params(config),
                say,
            )
            q = choose_cpu_quant(spec.backbone or spec.name, config, progress=progress, fidelity_probe=probe)
        cpu_quant = dev.type == "cpu" and q in CPU_QUANTS
        if cpu_quant:
            from medusa_chat.kernels.numeric_path import cached_fidelity

            fidelity = cached_fidelity(spec.backbone or spec.name, q)
        say(f"Loading {spec.name} on {dev} ({_dtype_name(compute_dtype)}, quantization {q})")
        backbone = None
        if cpu_quant and q != "none" and quantized_cache and spec.kind != "embedded":
            # quantized tensor by tensor into a cached GGUF and loaded from it: no whole float model in memory
            backbone = _load_from_quantized_file(
                model_dir, spec.name, q, compute_dtype, notes, progress, trust_remote_code,
                half_embedding=not isinstance(heads_mod, HydraHeads),
            )
        if backbone is None and dev.type == "cuda" and q == "int4":
            backbone = _load_cuda_int4(
                model_dir, dev, compute_dtype, notes, say, bool(medusa_keys), trust_remote_code
            )
        elif backbone is None:
            backbone = load_backbone(
                model_dir,
                dev,
                compute_dtype,
                "none" if cpu_quant else q,
                ignore_medusa=bool(medusa_keys),
                trust_remote_code=trust_remote_code,
            )
        else:
            cpu_quant = False  # the file's blocks are the projections already
    from medusa_chat.model.runner import BackboneRunner

    problem = BackboneRunner.unsupported(backbone)
    if problem is not None:  # refused here, not at the first reply
        raise MedusaChatError(f"{spec.name}: {problem}")
    if cpu_quant:  # (a GGUF file was built on its blocks already)
        _prepare_cpu_linears(backbone, q, spec, notes, progress)
    heads_source = "heads file" if heads_mod is not None else LOOKUP_ONLY
    if heads_mod is None and medusa_keys:
        heads_mod, heads_path = load_checkpoint_heads(model_dir, medusa_keys, keep_dtype=True)
        heads_source = "medusa-2 checkpoint"
        check_heads_fit(heads_mod, config, str(heads_path), backbone_loc)
    if heads_mod is not None:
        _fit_heads(heads_mod, heads_path, backbone, compute_dtype, dev, q)
    if dev.type == "cuda" and q == "nf4" and heads_mod is not None:
        notes.append(NF4_TREES_NOTE)
    # (only for the float path: with int8/int4 the projections are not fp32 GEMMs, and bf16 would be slower)
    if dev.type == "cpu" and compute_dtype == torch.float32 and q in ("none", "") and cpu_native_bf16():
        notes.append(
            "this CPU computes bf16 natively: --dtype bfloat16 decodes about twice as fast (greedy output then "
            "equals plain decoding only up to bf16 rounding ties; fp32 is bit-exact)"
        )

    # 4. Tokenizer, template, limits.
    spec, tokenizer = _load_tokenizer(spec, model_dir, config, notes, progress, trust_remote_code)

    try:
        tree = _default_tree(spec, heads_dir, heads_mod.num_heads if heads_mod is not None else None, notes)
    except TreeError as err:
        raise TreeError(f"default tree of {spec.name}: {err}") from err

    # The loaded model is hundreds of thousands of long-lived Python objects; the garbage collector would scan
    # them again and again while a reply allocates small objects (~3% of a CPU decoding step). Frozen, they
    # are skipped: they live as long as the process anyway.
    gc.collect()
    gc.freeze()
    return LoadedModel(
        spec=spec,
        backbone=backbone,
        tokenizer=tokenizer,
        heads=heads_mod,
        device=dev,
        dtype=compute_dtype,
        quant=q,
        default_tree=tree,
        context_limit=_context_limit(backbone, tokenizer),
        eos_token_ids=_eos_ids(backbone, tokenizer),
        stop_strings=VICUNA_STOP_STRINGS if spec.chat_template == VICUNA_V11 else (),
        heads_source=heads_source,
        heads_file=str(heads_path or ""),
        heads_asked=heads or "",
        model_dir=str(model_dir),
        notes=notes,
        fidelity=fidelity,
    )


def with_heads(loaded: LoadedModel, heads: str, progress: Progress | None = None) -> LoadedModel:
    """The same backbone (shared, not loaded again) with other heads or an EAGLE draft from `heads` (a shipped
    heads name, a folder or a Hub repo), checked against it as `load_model` checks heads: for drafters side by side (`bench
    --compare-heads`)."""
    heads_dir = _local_or_fetch(heads_location(heads), "heads", progress)
    heads_mod, heads_path, _ = load_heads_file(heads_dir, keep_dtype=True)
    check_heads_fit(heads_mod, loaded.backbone.config.to_dict(), str(heads_path), loaded.spec.name)
    _fit_heads(heads_mod, heads_path, loaded.backbone, loaded.dtype, loaded.device, loaded.quant)
    spec = loaded.spec
    if (heads_dir / "tree.json").is_file():  # the tree fitted to these heads, not the ones loaded before
        spec = replace(spec, default_tree=str(heads_dir / "tree.json"))
    elif Path(spec.default_tree).is_file():  # the loaded heads' own tree: back to the model's named default
        known = MODELS.get(spec.name)
        spec = replace(spec, default_tree=known.default_tree if known else "mc_sim_7b_63")
    tree = _default_tree(spec, heads_dir, heads_mod.num_heads, [])
    return replace(
        loaded, heads=heads_mod, default_tree=tree, heads_source="heads file", heads_file=str(heads_path)
    )


def switch_heads(loaded: LoadedModel, heads: str, progress: Progress | None = None) -> None:
    """`loaded` drafts with `heads` from now on (in place, the backbone kept): the draft a calibration chose among
    the embedded model's shipped ones (tuning/calibrate.py)."""
    other = with_heads(loaded, heads, progress)
    loaded.heads, loaded.default_tree = other.heads, other.default_tree
    loaded.heads_source, loaded.heads_file = other.heads_source, other.heads_file


# ---- load_model's steps ---------------------------------------------------------------------------------------
def _read_config(
    spec: ModelSpec, say: Progress, progress: Progress | None
) -> tuple[ModelSpec, str, dict[str, Any]]:
    """The backbone's location and config.json; a `--model` that names a heads repo leads to its base model."""
    if spec.kind == "embedded":
        from medusa_chat.model.embedded import embedded_model_dir

        backbone_loc = str(embedded_model_dir(progress=progress))
    elif spec.kind == "gguf":  # the file's config and tokenizer, read once into a weightless folder
        from medusa_chat.model.gguf_model import gguf_model_dir

        backbone_loc = str(gguf_model_dir(Path(spec.backbone), progress=progress))
    else:
        backbone_loc = spec.backbone
    cfg_dir = _local_or_fetch(backbone_loc, "config", progress)
    config = read_json(cfg_dir / "config.json")
    if not config:
        raise ModelNotFoundError(f"{backbone_loc} has no config.json")

    if spec.custom and spec.heads is None and "model_type" not in config:
        # `--model` named a heads repo/folder (config has base_model_name_or_path): load its base model.
        base = config.get("base_model_name_or_path")
        if not base:
            raise ModelNotFoundError(
                f"{backbone_loc} is neither a transformers model nor a Medusa heads repo"
            )
        say(f"{spec.name} holds Medusa heads for {base}; loading that backbone")
        spec = replace(spec, backbone=str(base), heads=backbone_loc, kind="v1-heads")
        backbone_loc = spec.backbone
        cfg_dir = _local_or_fetch(backbone_loc, "config", progress)
        config = read_json(cfg_dir / "config.json")
    return spec, backbone_loc, config


def _separate_heads(
    spec: ModelSpec, config: dict[str, Any], backbone_loc: str, progress: Progress | None
) -> tuple[ModelSpec, MedusaHeads | None, Path | None, Path | None]:
    """Heads given apart from the backbone (a heads repo or folder), fetched and checked against the config."""
    heads_mod: MedusaHeads | None = None
    heads_dir: Path | None = None
    heads_path: Path | None = None
    if spec.heads is not None:
        if spec.kind == "embedded" and not spec.custom and not Path(spec.heads).is_dir():
            raise HeadsError(
                f"no Medusa heads for {spec.name} yet: {spec.heads} does not exist (it should hold config.json, "
                "medusa_lm_head.safetensors and tree.json); train them with `medusa-chat train-heads` or pass "
                "--heads ORG/NAME|PATH"
            )
        heads_dir = _local_or_fetch(spec.heads, "heads", progress)
        heads_mod, heads_path, _ = load_heads_file(heads_dir, keep_dtype=True)  # (_fit_heads casts them)
        check_heads_fit(heads_mod, config, str(heads_path), backbone_loc)
        if spec.kind in ("v1-heads", "v2-heads", "eagle"):
            spec = replace(spec, kind=heads_kind(heads_mod))
    return spec, heads_mod, heads_dir, heads_path


def _load_cuda_int4(
    model_dir: Path,
    dev: torch.device,
    dtype: torch.dtype,
    notes: list[str],
    say: Progress,
    ignore_medusa: bool,
    trust_remote_code: bool,
) -> Any:
    """The checkpoint read in 16 bits on the CPU, its projections quantized to int4 on the GPU one at a time and
    the int4 kernel chosen by measuring (model/cuda_int4.py)."""
    from medusa_chat.model.cuda_int4 import choose_kernel, quantize_backbone

    backbone = load_backbone(
        model_dir, torch.device("cpu"), dtype, "none", ignore_medusa=ignore_medusa, trust_remote_code=trust_remote_code
    )
    done = quantize_backbone(backbone, dev, dtype, progress=say)
    choice = choose_kernel(backbone, dev, progress=say)
    notes.append(
        f"int4 (group-wise, {done['int4']} projections, {human_bytes(done['bytes'])}) on the {choice['kernel']} kernel"
        + (f"; {len(done['kept_16bit'])} projections kept 16-bit" if done["kept_16bit"] else "")
    )
    return backbone


def _load_from_quantized_file(
    folder: Path,
    name: str,
    q: str,
    dtype: torch.dtype,
    notes: list[str],
    progress: Progress | None,
    trust_remote_code: bool,
    *,
    half_embedding: bool = True,
) -> Any | None:
    """The backbone from the checkpoint's cached quantized GGUF (model/quantized_cache.py), or None where that path
    does not apply (then the checkpoint loads whole and is quantized in memory, as before)."""
    from transformers import AutoConfig

    from medusa_chat.model.quantized_cache import load_quantized_backbone, unsuitable

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):
        return None  # load_backbone says what is wrong
    why = unsuitable(folder, config, q, trust_remote_code)
    if why:  # said at startup (`info`, the UIs' notes): which path loaded this checkpoint, and why
        notes.append(f"quantized in memory after a whole float load: {why}")
        return None
    try:
        return load_quantized_backbone(
            folder, name, config, q, dtype, notes, progress, half_embedding=half_embedding
        )
    except OSError as err:  # no room (or no write access) for the file: quantized in memory instead
        why = err.strerror or str(err)
        notes.append(f"the quantized file could not be written ({why}): quantized in memory after a float load")
        if progress:
            progress(f"  the quantized file could not be written ({why}); loading the float model instead")
        return None


def _prepare_cpu_linears(
    backbone: Any, q: str, spec: ModelSpec, notes: list[str], progress: Progress | None
) -> None:
    """Row-invariant projections (exact tree decoding) on a CPU; the embedded model's blocks as stored."""
    # Row-invariant projections (exact tree decoding) and, for int4/int8, torch's weight-only kernels.
    # The embedded model's int4 weights are its GGUF's own Q4_1 blocks.
    from medusa_chat.kernels.cpu_linears import gguf_blocks, prepare_cpu_linears

    prebuilt = None
    if q != "none" and spec.kind == "embedded":
        from medusa_chat.model.embedded import gguf_path

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


def _fit_heads(
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
    from medusa_chat.model.block_heads import block_medusa_heads, can_block

    heads_mod.eval().requires_grad_(False)
    if dev.type == "cpu" and can_block(heads_mod, backbone):
        # The CPU block path (block_heads.py): each linear quantized from the file's dtype and its float weight
        # dropped, one after another, so the heads never exist in fp32 all at once (Vicuna-7B's five 32000-row
        # projections would be 2.6 GB).
        # (no cast after: the blocks keep their fp16 scales, which the kernel's bound pointers read; the biases
        # are fp32 already)
        block_medusa_heads(heads_mod, backbone, os.environ.get("MEDUSA_CHAT_MEDUSA_LM_HEAD", "q8_0"))
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
        from medusa_chat.model.cuda_int4 import quantize_head_projections

        quantize_head_projections(heads_mod, dev, compute_dtype)


def _load_tokenizer(
    spec: ModelSpec,
    model_dir: Path,
    config: dict[str, Any],
    notes: list[str],
    progress: Progress | None,
    trust_remote_code: bool,
) -> tuple[ModelSpec, Any]:
    """The tokenizer (the base model's where the checkpoint has none) and the chat template it implies."""
    from transformers import AutoTokenizer

    tok_dir = model_dir
    base = config.get("base_model_name_or_path")
    if (
        not hub.select_files([p.name for p in model_dir.iterdir()], "tokenizer")
        and isinstance(base, str)
        and base
    ):
        # Some fine-tuned checkpoints (Medusa-2 ones among them) leave the tokenizer to their base model.
        tok_dir = _local_or_fetch(base, "tokenizer", progress)
        notes.append(f"tokenizer taken from the base model {base}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise ModelNotFoundError(
            f"cannot load the tokenizer in {tok_dir}: {str(err).splitlines()[0]}"
        ) from err
    if spec.chat_template == TOKENIZER and not getattr(tokenizer, "chat_template", None):
        spec = replace(spec, chat_template=VICUNA_V11)
        notes.append("the tokenizer has no chat template: using Vicuna v1.1")
    return spec, tokenizer


# ---- helpers for the command line and the UIs --------------------------------------------------------------------
def load_from_args(args: Any, progress: Progress | None = None) -> LoadedModel:
    """load_model() from the common CLI options (see cli.add_model_options)."""
    return load_model(
        model=args.model,
        heads=args.heads,
        quant=args.quant,
        dtype=args.dtype,
        device=args.device,
        progress=progress,
        trust_remote_code=args.trust_remote_code,
    )
