"""What `export-draft` reads: the draft named by `--model`/`--heads` (an EAGLE-3 draft folder or Medusa heads) and
the target it was trained on (its config.json, the GGUF llama.cpp serves, its lm_head where heads share it).

Nothing here loads the model: the draft's tensors are read from its files and checked by the project's own
loaders (eagle.load_eagle, heads.heads_from_state_dict), the target is only its config, plus its lm_head for
Medusa heads in the shared-lm_head (v2) layout, read tensor by tensor from its safetensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from medusa_chat.atomic import read_json
from medusa_chat.errors import HeadsError, MedusaChatError, ModelNotFoundError

Progress = Callable[[str], None]


@dataclass
class Target:
    """The model a draft speculates for."""

    name: str  # what a serving engine is told to load: a Hub id, or a path
    folder: Path  # holds its config.json (and its weights, except for a GGUF named by --model)
    config: dict[str, Any]
    gguf: Path | None  # the GGUF llama.cpp serves it from, where known

    @property
    def num_layers(self) -> int:
        return int(self._text()["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self._text()["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self._text()["vocab_size"])

    @property
    def architectures(self) -> list[str]:
        return list(self.config.get("architectures") or ["LlamaForCausalLM"])

    def _text(self) -> dict[str, Any]:
        # multimodal configs keep the language model's sizes under text_config (llama.cpp's converter merges it)
        return {**self.config, **(self.config.get("text_config") or {})}


@dataclass
class Draft:
    """A draft's files as read: `kind` "eagle3" or "medusa"."""

    kind: str
    folder: Path
    config: dict[str, Any]  # its config.json
    state: dict[str, torch.Tensor]  # its tensors, in the file's dtype and under the file's names
    draft_vocab: torch.Tensor | None = None  # Medusa: the token ids the heads draft among (int64), if any
    num_heads: int = (
        0  # Medusa: heads, ResBlocks per head, own projection per head (v1) or the shared one (v2)
    )
    num_layers: int = 0
    own_lm_head: bool = False


def resolve_target(spec: Any, progress: Progress | None = None) -> Target:
    """The target of a registry spec (embedded, a GGUF file, or a transformers folder / Hub repo)."""
    from medusa_chat.model.sources import hub
    from medusa_chat.model.sources.registry import EMBEDDED_HUB_ORIGINAL, is_repo_id

    if spec.kind == "embedded":
        from medusa_chat.model.sources.embedded import embedded_model_dir, gguf_path

        folder = embedded_model_dir(progress=progress)
        return Target(EMBEDDED_HUB_ORIGINAL, folder, read_json(folder / "config.json"), gguf_path())
    if spec.kind == "gguf":
        from medusa_chat.model.sources.gguf_folder import gguf_model_dir

        gguf = Path(spec.backbone)
        folder = gguf_model_dir(gguf, progress=progress)
        return Target(str(gguf), folder, read_json(folder / "config.json"), gguf)
    location = spec.backbone
    folder = hub.fetch(location, "config", progress=progress) if is_repo_id(location) else Path(location)
    config = read_json(folder / "config.json")
    if not config:
        raise ModelNotFoundError(f"{location} has no config.json")
    return Target(location, folder, config, None)


def read_draft(location: str, progress: Progress | None = None) -> Draft:
    """The draft in `location` (a folder or a Hub repo): an EAGLE-3 draft or Medusa heads, checked by the loaders
    the chat itself uses, so what is exported is what the chat would run."""
    from medusa_chat.model.forward.eagle import eagle_file, is_eagle_folder, load_eagle
    from medusa_chat.model.sources import hub
    from medusa_chat.model.sources.heads_files import (
        DRAFT_VOCAB_FILE,
        find_heads_file,
        read_draft_vocab,
        read_state_file,
    )
    from medusa_chat.model.sources.registry import is_repo_id

    folder = hub.fetch(location, "heads", progress=progress) if is_repo_id(location) else Path(location)
    config = read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    if is_eagle_folder(folder):
        path = eagle_file(folder)
        assert path is not None  # is_eagle_folder saw it
        state = read_state_file(path)
        draft = load_eagle(folder, path, state)  # shapes checked against the config
        if draft.version != 3:
            raise HeadsError(
                f"{folder} holds an EAGLE-1/2 draft: the engines' EAGLE-3 layouts cannot carry it (export an "
                "EAGLE-3 draft, e.g. `--heads eagle3`)"
            )
        return Draft("eagle3", folder, config, state)
    from medusa_chat.model.forward.heads import HydraHeads, heads_from_state_dict, infer_layout

    state = read_state_file(find_heads_file(folder))
    heads = heads_from_state_dict(state, keep_dtype=True)
    if isinstance(heads, HydraHeads):
        raise HeadsError(
            f"{folder} holds Hydra heads (each head reads the previous head's token): no serving engine loads "
            "them; export the Medusa-1 heads (`--heads medusa-1`) or the EAGLE-3 draft (`--heads eagle3`)"
        )
    num_heads, num_layers, own, _, _ = infer_layout(state)
    vocab = read_draft_vocab(folder / DRAFT_VOCAB_FILE)
    return Draft("medusa", folder, config, state, vocab, num_heads, num_layers, own)


def load_source(
    model: str | None, heads: str | None, progress: Progress | None = None
) -> tuple[Draft, Target]:
    """`--model`/`--heads` as the other commands take them: the draft and its target."""
    from medusa_chat.model.sources.registry import resolve

    spec = resolve(model, heads)
    if not spec.heads:
        raise MedusaChatError(
            f"{spec.name} names no draft: give --heads (a draft folder, a Hub repo, or for the embedded model "
            "`eagle3` / `medusa-1`)"
        )
    draft = read_draft(spec.heads, progress)
    target = resolve_target(spec, progress)
    check_fits(draft, target)
    return draft, target


def check_fits(draft: Draft, target: Target) -> None:
    """The draft's sizes against the target's: a draft for another model is refused before anything is written."""
    if draft.kind == "eagle3":
        h = int(draft.state["fc.weight"].shape[1]) // 3
        vocab = int(draft.state["t2d"].shape[0])
    else:
        h = int(draft.state["0.0.linear.weight"].shape[1])
        vocab = (
            int(draft.state[f"0.{draft.num_layers}.weight"].shape[0])
            if draft.own_lm_head
            else target.vocab_size
        )
    if (h, vocab) != (target.hidden_size, target.vocab_size):
        raise HeadsError(
            f"the draft in {draft.folder} reads hidden size {h} over a {vocab}-token vocabulary; {target.name} has "
            f"{target.hidden_size} and {target.vocab_size}: it is another model's draft"
        )
    if draft.draft_vocab is not None and int(draft.draft_vocab.max()) >= target.vocab_size:
        raise HeadsError(
            f"the draft vocabulary in {draft.folder} names tokens outside {target.name}'s vocabulary"
        )


def target_lm_head(target: Target) -> torch.Tensor:
    """The target's output projection [vocab, hidden] in its file's dtype (its token embedding when tied), read
    from its safetensors without loading the rest."""
    from safetensors import safe_open

    from medusa_chat.model.sources import hub
    from medusa_chat.model.sources.registry import is_repo_id

    folder = target.folder
    if target.gguf is not None and target.gguf.suffix == ".gguf" and not list(folder.glob("*.safetensors")):
        raise MedusaChatError(
            "heads that share the target's lm_head need its weights in safetensors: give --model the transformers "
            "folder or Hub repo the GGUF was made from"
        )
    if is_repo_id(target.name) and not list(folder.glob("*.safetensors")):
        folder = hub.fetch(target.name, "model")
    names = ["lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight"]
    if not target.config.get("tie_word_embeddings", False):
        names = names[:1]
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = set(f.keys())
            for name in names:
                if name in keys:
                    return f.get_tensor(name)
    raise MedusaChatError(
        f"no {' or '.join(names)} in {folder}'s safetensors: cannot write the shared lm_head"
    )
