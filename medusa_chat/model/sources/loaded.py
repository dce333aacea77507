"""What `load_model` returns: the backbone with its heads and everything the engine and the UIs read of them, and
the startup summary (`info`, `summary_lines`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from medusa_chat.model.forward.heads import MedusaHeads
from medusa_chat.model.sources.chat_template import build_prompt_ids
from medusa_chat.model.sources.lookup_only import heads_info, heads_line
from medusa_chat.model.sources.registry import ModelSpec
from medusa_chat.tree import Tree
from medusa_chat.units import human_bytes, human_count


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
        from medusa_chat.model.forward.cpu_blocks import weight_accounting

        heads = heads_info(self.heads, self.heads_source, self.heads_file, self.spec.backbone or self.model_dir)
        if self.heads is not None:  # block heads: their real footprint (a shared lm_head once) and drafter
            from medusa_chat.model.forward.block_heads import drafter_name, heads_footprint

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
            "dtype": dtype_name(self.dtype),
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


def dtype_name(dtype: torch.dtype) -> str:
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
