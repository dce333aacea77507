"""Medusa heads from files: a heads folder's safetensors, or the medusa_head.* tensors inside a backbone checkpoint;
and the check that heads fit their backbone."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from medusa_chat.atomic import atomic_write_bytes, read_json
from medusa_chat.errors import HeadsError, MedusaChatError
from medusa_chat.model.forward.heads import HydraHeads, MedusaHeads, heads_from_state_dict
from medusa_chat.model.mapped_weights import load_pickle
from medusa_chat.model.sources import hub
from medusa_chat.model.sources.registry import HEADS_FILES

Progress = Callable[[str], None]


MEDUSA_PREFIX = "medusa_head."
# Beside a heads file in its published layout: the token ids the heads draft among (FR-Spec style), int32 under
# the key `draft_vocab`, most frequent first. A separate file, so that the heads file stays loadable by
# FasterDecoding's code, vLLM and TGI.
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def find_heads_file(folder: Path) -> Path:
    for name in HEADS_FILES:
        if (folder / name).is_file():
            return folder / name
    raise HeadsError(f"no Medusa heads in {folder}: expected {' or '.join(HEADS_FILES)}")


def read_state_file(path: Path, keys: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors from a .safetensors or pickled .pt/.bin file; pickles are read with weights_only=True.

    Both are memory-mapped (a legacy non-zip pickle excepted): a tensor's bytes are read when it is first used,
    and mapped_weights.release gives its pages back once converted (block_heads.block_medusa_heads), so a heads
    file is never resident whole next to its quantized copy.
    `keys`: only these.
    Any unreadable file becomes a one-line HeadsError naming it.
    """
    from safetensors import SafetensorError, safe_open

    if path.suffix != ".safetensors":
        obj, _ = load_pickle(path, HeadsError)
    else:
        try:
            out: dict[str, torch.Tensor] = {}
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys() if keys is None else keys:
                    out[key] = f.get_tensor(key)
            return out
        except (SafetensorError, RuntimeError, EOFError, OSError, ValueError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise HeadsError(f"cannot read {path}: the file is truncated or corrupt ({first[:200]})") from err
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise HeadsError(f"{path} does not hold a state dict of tensors")
    if keys is not None:
        obj = {k: obj[k] for k in keys}
    return obj


def _build_heads(state: dict[str, torch.Tensor], where: str, keep_dtype: bool = False) -> MedusaHeads:
    try:
        return heads_from_state_dict(state, keep_dtype=keep_dtype)
    except (ValueError, KeyError, RuntimeError) as err:
        raise HeadsError(f"{where} does not hold Medusa heads in a known layout: {err}") from err


def load_heads_file(folder: Path, keep_dtype: bool = False) -> tuple[MedusaHeads, Path, dict[str, Any]]:
    """v1 or v2 heads from a heads folder/snapshot. The head count comes from the tensors (the v1 configs on
    the Hub give a wrong `medusa_num_heads`)."""
    from medusa_chat.model.forward.eagle import eagle_file, load_eagle

    eagle = eagle_file(folder)
    if eagle is not None and not any((folder / f).is_file() for f in HEADS_FILES):
        # an EAGLE-1/2/3 draft in its Hub layout (model/forward/eagle.py; its errors name EAGLE)
        draft = load_eagle(folder, eagle, read_state_file(eagle))
        if draft.version != 3:  # (EAGLE-3 drafts carry their own vocabulary maps)
            draft.draft_vocab_ids = read_draft_vocab(folder / DRAFT_VOCAB_FILE)
        return draft, eagle, read_json(folder / "config.json")  # type: ignore[return-value]
    path = find_heads_file(folder)
    config = read_json(folder / "config.json")
    heads = _build_heads(read_state_file(path), str(path), keep_dtype)
    if str(config.get("version")) == "2" and heads.own_lm_head:
        raise HeadsError(
            f"{path}: config.json says version 2 (shared lm_head) but the file has a projection per head"
        )
    if not isinstance(heads, HydraHeads):  # (Hydra heads carry their draft vocabulary in the heads file)
        heads.draft_vocab_ids = read_draft_vocab(folder / DRAFT_VOCAB_FILE)
    return heads, path, config


def write_draft_vocab(path: Path, ids: torch.Tensor) -> None:
    """The draft vocabulary file `read_draft_vocab` reads: `draft_vocab`, int64 token ids."""
    from safetensors.torch import save

    atomic_write_bytes(path, save({"draft_vocab": ids.to("cpu", torch.int64).contiguous()}))


def read_draft_vocab(path: Path) -> torch.Tensor | None:
    """The draft vocabulary beside a heads file (int64 token ids), None when the folder has none. Only its form
    is checked here; check_draft_vocab checks it against the backbone's vocabulary once that is known."""
    if not path.is_file():
        return None
    ids = read_state_file(path).get("draft_vocab")
    if ids is None or ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.is_complex():
        raise HeadsError(f"{path} must hold `draft_vocab`: a non-empty 1-D tensor of integer token ids")
    ids = ids.to(torch.int64)
    if int(ids.unique().numel()) != int(ids.numel()):
        raise HeadsError(f"{path}: the draft vocabulary lists a token id more than once")
    return ids


def check_draft_vocab(heads: MedusaHeads, vocab_size: int, where: str) -> None:
    """A draft vocabulary must name tokens of the backbone's vocabulary (a mismatch is a heads file meant for
    another tokenizer); one as large as the vocabulary saves nothing and is dropped."""
    ids = getattr(heads, "draft_vocab_ids", None)  # (an EAGLE draft has none: its own vocabulary maps)
    if ids is None:
        return
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise HeadsError(
            f"the draft vocabulary beside {where} names token ids up to {int(ids.max())}, but the backbone's "
            f"vocabulary has {vocab_size} tokens: it belongs to another tokenizer"
        )
    if ids.numel() >= vocab_size:
        heads.draft_vocab_ids = None


def checkpoint_medusa_keys(folder: Path, open_pickles: bool = True) -> dict[str, list[str]]:
    """{checkpoint file: [medusa_head.* keys in it]} for a model folder; {} when it has none.

    Sharded checkpoints answer from their index; single files from the safetensors header, or by loading the
    pickle (memory-mapped, weights_only) when `open_pickles`.
    """
    from safetensors import SafetensorError, safe_open

    for index in (hub.SAFETENSORS_INDEX, hub.BIN_INDEX):
        if (folder / index).is_file():
            weight_map = read_json(folder / index).get("weight_map", {})
            out: dict[str, list[str]] = {}
            for key, fname in weight_map.items():
                if key.startswith(MEDUSA_PREFIX):
                    out.setdefault(fname, []).append(key)
            return out
    files = hub.weight_files(p.name for p in folder.iterdir())
    out = {}
    for fname in files:
        path = folder / fname
        if path.suffix == ".safetensors":
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    keys = [k for k in f.keys() if k.startswith(MEDUSA_PREFIX)]
            except (SafetensorError, OSError) as err:
                raise MedusaChatError(
                    f"cannot read {path}: the file is truncated or corrupt ({err})"
                ) from err
        elif open_pickles:
            keys = [k for k in read_state_file(path) if k.startswith(MEDUSA_PREFIX)]
        else:
            keys = []
        if keys:
            out[fname] = keys
    return out


def load_checkpoint_heads(
    folder: Path, keys_by_file: dict[str, list[str]], keep_dtype: bool = False
) -> tuple[MedusaHeads, Path]:
    state: dict[str, torch.Tensor] = {}
    for fname, keys in keys_by_file.items():
        for key, tensor in read_state_file(folder / fname, keys).items():
            state[key[len(MEDUSA_PREFIX) :]] = tensor
    first = folder / sorted(keys_by_file)[0]
    return _build_heads(state, f"the medusa_head.* weights of {folder}", keep_dtype), first


def heads_kind(heads: Any) -> str:
    """The spec kind loaded heads make: "eagle" for an EAGLE draft, else v1 (own projections) / v2 heads."""
    from medusa_chat.model.forward.eagle import EagleDraft

    return "eagle" if isinstance(heads, EagleDraft) else "v1-heads" if heads.own_lm_head else "v2-heads"


def check_heads_fit(heads: MedusaHeads, config: dict[str, Any], where: str, backbone: str) -> None:
    from medusa_chat.model.forward.eagle import EagleDraft, check_eagle_fits

    if isinstance(heads, EagleDraft):
        check_eagle_fits(heads, config, where, backbone)
        return
    cfg = config.get("text_config") or config
    hidden, vocab = cfg.get("hidden_size"), cfg.get("vocab_size")
    if hidden is not None and heads.hidden_size != int(hidden):
        raise HeadsError(
            f"Medusa heads in {where} have hidden size {heads.hidden_size} but the backbone {backbone} has "
            f"{hidden}: they were trained for another model"
        )
    if heads.own_lm_head and vocab is not None and heads.vocab_size != int(vocab):
        raise HeadsError(
            f"Medusa heads in {where} project to a vocabulary of {heads.vocab_size} but the backbone {backbone} "
            f"has {vocab}: they were trained for another model"
        )
    if isinstance(heads, HydraHeads) and vocab is not None and int(heads.draft_vocab.max()) >= int(vocab):
        raise HeadsError(
            f"Hydra heads in {where} draft token ids up to {int(heads.draft_vocab.max())} but the backbone "
            f"{backbone} has a vocabulary of {vocab}: they were trained for another model"
        )
