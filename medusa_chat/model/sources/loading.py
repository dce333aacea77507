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
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from medusa_chat.atomic import read_json
from medusa_chat.errors import HeadsError, MedusaChatError, ModelNotFoundError, TreeError
from medusa_chat.machine import cpu_native_bf16
from medusa_chat.model.forward.heads import HydraHeads, MedusaHeads
from medusa_chat.model.sources import hub
from medusa_chat.model.sources.backbones import (
    context_limit,
    eos_ids,
    fit_heads,
    load_backbone,
    load_cuda_int4,
    load_from_quantized_file,
    prepare_cpu_blocks,
)
from medusa_chat.model.sources.chat_template import TOKENIZER, VICUNA_STOP_STRINGS, VICUNA_V11
from medusa_chat.model.sources.devices import (
    CPU_QUANTS,
    NF4_TREES_NOTE,
    pick_device,
    pick_dtype,
    pick_quant,
)
from medusa_chat.model.sources.heads_files import (
    check_heads_fit,
    checkpoint_medusa_keys,
    heads_kind,
    load_checkpoint_heads,
    load_heads_file,
)
from medusa_chat.model.sources.loaded import LoadedModel, dtype_name
from medusa_chat.model.sources.lookup_only import LOOKUP_ONLY, lookup_only_tree
from medusa_chat.model.sources.registry import MODELS, ModelSpec, heads_location, is_repo_id, resolve
from medusa_chat.tree import Tree

Progress = Callable[[str], None]

LARGE_MODEL_PARAMS = 5e9  # "7B and up": on a CPU with --device auto, 4-bit (int4) by default (_cpu_fit)

# bitsandbytes' CPU int8 path warns on every matmul that fp32 inputs are cast to fp16: known and harmless.
warnings.filterwarnings("ignore", message=r"MatMul8bitLt: inputs will be cast")








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


def _cpu_fit(
    spec: ModelSpec, config: dict[str, Any], backbone_loc: str, device_arg: str, dev: torch.device, q: str,
    say: Progress,
) -> str:
    """A big model on a CPU (cpu_plan.py): with `--device auto` a 7B-class checkpoint takes the int4 block path
    (`--quant auto` would first load it whole in float to measure the numeric paths), a GGUF file its blocks as
    stored; either way one line of the memory and speed to expect first, and a refusal (cpu_plan.WontFit) only
    where this machine cannot hold it. Returns the quantization to load with."""
    from medusa_chat.model.sources import cpu_plan

    if dev.type != "cpu":
        return q
    if spec.kind == "gguf":
        need = cpu_plan.gguf_need(spec.name, Path(spec.backbone), config, cpu_plan.free_ram())
        cpu_plan.check(need, spec.name, "its blocks as stored" if q == "auto" else q, say)
        return q
    params = spec.params_b * 1e9 if spec.params_b and not spec.custom else estimate_params(config)
    if device_arg != "auto" or params < LARGE_MODEL_PARAMS or q not in ("auto", "int4"):
        return q
    need = cpu_plan.checkpoint_need(spec.name, backbone_loc, config, int(params), cpu_plan.free_ram())
    cpu_plan.check(need, spec.name, "int4", say)
    return "int4"


@dataclass
class _Load:
    """One load_model call's request and what it has decided so far, handed from step to step."""

    model: str
    heads: str | None
    trust_remote_code: bool
    quantized_cache: bool
    spec: ModelSpec
    dev: torch.device
    q: str
    dtype: torch.dtype
    notes: list[str]
    say: Progress
    progress: Progress | None


def _cpu_auto_quant(job: _Load, config: dict[str, Any]) -> str:
    """`--quant auto` on a CPU: the fastest exact path on this machine, measured once and cached."""
    from medusa_chat.model.sources.fidelity import fidelity_probe
    from medusa_chat.model.sources.numeric_path import choose_cpu_quant

    # Keyed by the backbone, not the alias: the same weights must get the same numeric path however they are
    # named (a heads repo naming its backbone, or the backbone with --heads).
    probe = fidelity_probe(
        # the float model is in memory for this probe anyway: no cached file for paths it may not keep
        lambda qq: load_model(
            job.model,
            job.heads,
            quant=qq,
            device="cpu",
            trust_remote_code=job.trust_remote_code,
            quantized_cache=False,
        ),
        estimate_params(config),
        job.say,
    )
    return choose_cpu_quant(job.spec.backbone or job.spec.name, config, progress=job.progress, fidelity_probe=probe)


def _read_backbone(
    job: _Load, config: dict[str, Any], model_dir: Path, heads_mod: MedusaHeads | None, medusa_keys: bool
) -> tuple[Any, bool, dict[str, Any] | None]:
    """(backbone, whether its projections still need the CPU's row-invariant blocks, the numeric path's measured
    fidelity): a GGUF file tensor by tensor (gguf_model.py; `auto`: its blocks as stored), else the checkpoint by
    the path the device and quantization call for. Sets job.q to the quantization actually used."""
    spec, dev, dtype, notes = job.spec, job.dev, job.dtype, job.notes
    if spec.kind == "gguf":
        from medusa_chat.model.sources.gguf_model import WeightsOptions, load_gguf_backbone

        options = WeightsOptions(job.q, dtype, notes, job.progress)
        backbone, job.q = load_gguf_backbone(Path(spec.backbone), model_dir, dev, options)
        return backbone, False, None
    if job.q == "auto":  # a CPU (on CUDA `auto` was decided by pick_quant)
        job.q = _cpu_auto_quant(job, config)
    q = job.q
    cpu_quant = dev.type == "cpu" and q in CPU_QUANTS
    fidelity = None
    if cpu_quant:
        from medusa_chat.model.sources.numeric_path import cached_fidelity

        fidelity = cached_fidelity(spec.backbone or spec.name, q)
    job.say(f"Loading {spec.name} on {dev} ({dtype_name(dtype)}, quantization {q})")
    if cpu_quant and q != "none" and job.quantized_cache and spec.kind != "embedded":
        # quantized tensor by tensor into a cached GGUF and loaded from it: no whole float model in memory
        from medusa_chat.model.sources.gguf_model import WeightsOptions

        # a 16-bit token embedding stays 16-bit, but for Hydra heads, whose C drafter reads an fp32 table
        options = WeightsOptions(q, dtype, notes, job.progress, half_embedding=not isinstance(heads_mod, HydraHeads))
        backbone = load_from_quantized_file(model_dir, spec.name, options, job.trust_remote_code)
        if backbone is not None:
            return backbone, False, fidelity  # the file's blocks are the projections already
    if dev.type == "cuda" and q == "int4":
        backbone, job.q = load_cuda_int4(model_dir, dev, dtype, notes, job.say, medusa_keys, job.trust_remote_code)
        if backbone is not None:
            return backbone, False, None
        q = job.q  # the int4 kernels failed their check on this GPU: 16-bit or NF4 (the note says why)
    backbone = load_backbone(
        model_dir,
        dev,
        dtype,
        "none" if cpu_quant else q,
        ignore_medusa=medusa_keys,
        trust_remote_code=job.trust_remote_code,
    )
    return backbone, cpu_quant, fidelity


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
        from medusa_chat.kernels import cbind

        cbind.prebuild()

    # 1. The backbone's config.json (tiny) first: size and head checks happen before any big download.
    spec, backbone_loc, config = _read_config(spec, say, progress)
    q = _cpu_fit(spec, config, backbone_loc, device, dev, q, say)

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
    job = _Load(model, heads, trust_remote_code, quantized_cache, spec, dev, q, compute_dtype, notes, say, progress)
    backbone, cpu_quant, fidelity = _read_backbone(job, config, model_dir, heads_mod, bool(medusa_keys))
    q = job.q
    from medusa_chat.model.forward.runner import BackboneRunner

    problem = BackboneRunner.unsupported(backbone)
    if problem is not None:  # refused here, not at the first reply
        raise MedusaChatError(f"{spec.name}: {problem}")
    if cpu_quant:  # (a GGUF file was built on its blocks already)
        prepare_cpu_blocks(backbone, q, spec, notes, progress)
    heads_source = "heads file" if heads_mod is not None else LOOKUP_ONLY
    if heads_mod is None and medusa_keys:
        heads_mod, heads_path = load_checkpoint_heads(model_dir, medusa_keys, keep_dtype=True)
        heads_source = "medusa-2 checkpoint"
        check_heads_fit(heads_mod, config, str(heads_path), backbone_loc)
    if heads_mod is not None:
        fit_heads(heads_mod, heads_path, backbone, compute_dtype, dev, q)
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
        context_limit=context_limit(backbone, tokenizer),
        eos_token_ids=eos_ids(backbone, tokenizer),
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
    fit_heads(heads_mod, heads_path, loaded.backbone, loaded.dtype, loaded.device, loaded.quant)
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
    the embedded model's shipped ones (tuning/first_start.py)."""
    other = with_heads(loaded, heads, progress)
    loaded.heads, loaded.default_tree = other.heads, other.default_tree
    loaded.heads_source, loaded.heads_file = other.heads_source, other.heads_file


# ---- load_model's steps ---------------------------------------------------------------------------------------
def _read_config(
    spec: ModelSpec, say: Progress, progress: Progress | None
) -> tuple[ModelSpec, str, dict[str, Any]]:
    """The backbone's location and config.json; a `--model` that names a heads repo leads to its base model."""
    if spec.kind == "embedded":
        from medusa_chat.model.sources.embedded import embedded_model_dir

        backbone_loc = str(embedded_model_dir(progress=progress))
    elif spec.kind == "gguf":  # the file's config and tokenizer, read once into a weightless folder
        from medusa_chat.model.sources.gguf_folder import gguf_model_dir

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
        heads_mod, heads_path, _ = load_heads_file(heads_dir, keep_dtype=True)  # (fit_heads casts them)
        check_heads_fit(heads_mod, config, str(heads_path), backbone_loc)
        if spec.kind in ("v1-heads", "v2-heads", "eagle"):
            spec = replace(spec, kind=heads_kind(heads_mod))
    return spec, heads_mod, heads_dir, heads_path










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
