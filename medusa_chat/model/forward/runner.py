"""The backbone call: the lean forward where supported (lean_forward.py, or the native C step), else the
transformers forward; and the vocab projection."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

from medusa_chat.model.forward.lean_forward import lean_forward_for
from medusa_chat.model.forward.tree_plan import TreePlan

if TYPE_CHECKING:
    from medusa_chat.model.forward.kv_cache import TreeKVCache


class BackboneRunner:
    """`forward(ids [T], positions [T], attend, cache) -> last hidden states [T, H]` and the vocab projection
    `lm_head(rows)`, as the engine and the calibration that times it both run them.

    `attend` is an additive mask [1, 1, T, L], or for a verification step `tree_attend(tree buffers, start)`:
    the lean forward's exact per-node attention (TreePlan), the transformers forward's ancestor mask.
    """

    def __init__(self, causal_lm: torch.nn.Module) -> None:
        self.model = causal_lm
        # The decoder stack without the lm_head, whatever the architecture calls it (`model` for Llama,
        # `transformer` for GPT-2, `gpt_neox` for GPT-NeoX): the engine needs its hidden states, not logits.
        self.body = causal_lm.base_model
        self.cache_arg = _cache_arg(self.body)
        self.lean = lean_forward_for(causal_lm)
        self.lm_head = causal_lm.get_output_embeddings()
        self.path = (
            "transformers" if self.lean is None else getattr(self.lean, "path", "lean, exact tree attention")
        )

    @property
    def native(self) -> bool:
        """Does the backbone run the native C step (block_forward.NativeForward: the block kernel's library)?"""
        return getattr(self.lean, "lib", None) is not None

    @staticmethod
    def unsupported(causal_lm: torch.nn.Module) -> str | None:
        """Why the transformers forward cannot verify trees on this backbone, or None.

        A tree step gives each node its own position (`position_ids`) and its ancestors only (a 4D mask), and
        writes into the engine's cache (`cache`). A decoder whose forward takes no position ids (e.g. BLOOM,
        whose ALiBi biases come from a 2D mask) would place the tree's tokens in a row: wrong output.
        """
        body = getattr(causal_lm, "base_model", None)
        params = inspect.signature(body.forward).parameters if body is not None else {}
        missing = [name for name in ("position_ids", "attention_mask") if name not in params]
        if body is not None and _cache_arg(body) is None:
            missing.append("cache")
        if body is None or missing:
            kind = getattr(getattr(causal_lm, "config", None), "model_type", type(causal_lm).__name__)
            return (
                f"{kind} models cannot be tree-decoded: their forward takes no {', '.join(missing) or 'decoder'}"
                " (tree verification gives every node its own position and ancestor mask); supported are "
                "decoders like Llama, Mistral, Qwen2, Gemma, GPT-2 and GPT-NeoX"
            )
        return None

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor | TreePlan, cache: TreeKVCache
    ) -> torch.Tensor:
        if self.lean is not None:
            return self.lean(ids, positions, attend, cache)
        out = self.body(
            input_ids=ids[None],
            position_ids=positions[None],
            attention_mask=attend,
            use_cache=True,
            **{self.cache_arg or "cache": cache},
        )
        return out.last_hidden_state[0]


def _cache_arg(body: torch.nn.Module) -> str | None:
    """The name the decoder's forward takes its KV cache by: `cache` in recent transformers 5 releases,
    `past_key_values` in earlier ones (5.17, which GPU images still ship); None when it takes neither."""
    params = inspect.signature(body.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)
