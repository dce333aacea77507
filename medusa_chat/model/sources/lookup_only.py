"""A model without Medusa heads: context lookup (engine/lookup.py) is its only drafter.

Such a model is still a chat. Each step verifies the root plus as many tokens as the lookup guessed from the
conversation (prompt lookup decoding: names, code, lists, quoted text), on a chain; without a guess the step is
a plain one-token step. Verification is unchanged, so greedy output is the plain loop's token for token and
exact sampling keeps the model's distribution. What the UIs and `info` say about it, and the tree it gets, are
decided here (loading.py only marks the model as head-less).
"""

from __future__ import annotations

import shlex
from typing import Any

from medusa_chat.tree import Tree
from medusa_chat.units import human_count

# LoadedModel.heads_source of a model without heads
LOOKUP_ONLY = "none (context lookup only)"

# The default tree without heads: a chain of 3 lookup guesses. Root + 3 guesses are 4 rows, one tile of the
# CPU block kernel (lookup.LOOKUP_RUN says why 3); a step verifies only the guesses the lookup has, so a longer
# chain costs nothing where the lookup guesses less. The CPU calibration picks among its prefixes.
LOOKUP_CHAIN = 3


def lookup_only_tree() -> Tree:
    """The default tree of a model without heads (a chain the context lookup fills)."""
    return Tree.chain(LOOKUP_CHAIN)


def train_heads_command(model: str) -> str:
    """The command that trains heads for `model` (the `--model` argument as the loader resolved it)."""
    return f"medusa-chat train-heads --model {shlex.quote(model)}"


def lookup_only_line(model: str) -> str:
    """What `info`, the REPL banner and the web model panel say about a model without heads."""
    return (
        f"no Medusa heads: context lookup only (train heads with `{train_heads_command(model)}`, "
        "then pass --heads medusa-heads)"
    )


def heads_info(heads: Any, source: str, file: str, model: str) -> dict[str, Any]:
    """LoadedModel.info()'s "heads" entry: count, layers, format, source, file, dtype, params, bytes; for a
    model without heads the same keys (count 0) plus `note`, the line the UIs show."""
    if heads is None:
        return {
            "count": 0,
            "layers": 0,
            "format": "none",
            "source": source or LOOKUP_ONLY,
            "file": "",
            "dtype": None,
            "params": 0,
            "bytes": 0,
            "note": lookup_only_line(model),
            "drafter": "lookup",
        }
    params = list(heads.parameters())
    return {
        "count": heads.num_heads,
        "layers": heads.num_layers,
        "format": heads.format,  # "v1" own projections | "v2" shared lm_head | "hydra"
        "source": source,
        "file": file,
        "dtype": str(params[0].dtype).removeprefix("torch.") if params else None,  # block heads: buffers
        "params": sum(p.numel() for p in params),
        "bytes": sum(p.numel() * p.element_size() for p in params),
        "draft_vocab": _draft_vocab_size(heads),
    }


def _draft_vocab_size(heads: Any) -> int | None:
    """How many tokens the heads draft among: Hydra's buffer or a Medusa heads folder's draft_vocab file."""
    ids = getattr(heads, "draft_vocab_ids", None)
    if ids is None and "draft_vocab" in dict(heads.named_buffers()):
        ids = heads.draft_vocab
    return None if ids is None else int(ids.numel())


def heads_line(h: dict[str, Any]) -> str:
    """summary_lines' heads line (after the "heads      " label)."""
    if not h["count"]:
        return str(h.get("note") or LOOKUP_ONLY)
    eagle = {"eagle": "EAGLE-1/2 draft", "eagle3": "EAGLE-3 draft"}.get(h["format"])  # model/forward/eagle.py
    what = f"{eagle}, {h['layers']} decoder layer(s)" if eagle else f"{h['count']} Medusa heads x {h['layers']} layer(s)"
    return (
        f"{what}, format {h['format']} "
        f"({h['source']}), {human_count(h['params'])} params, {h['dtype']}, drafter {h.get('drafter', '?')}"
        + (f", draft vocabulary {h['draft_vocab']}" if h.get("draft_vocab") else "")
    )
