"""Do block-quantized Medusa-1 heads keep the fp32 heads' guesses? Top-1 (and top-1-in-top-3) agreement with the
fp32 heads on real hidden states of the embedded model, for Q8_0 ResBlocks with Q8_0 or Q4_1 own lm_heads, and how
often the fp32 top-1 falls inside a frequent-token draft vocabulary (the embedded Hydra heads' `draft_vocab`).

    python benchmarks/medusa_heads_quant.py [--positions 600] [--heads PATH]

Heads: a Medusa-1 heads folder for the embedded model (--heads), or by default v1 heads built from the embedded
Hydra heads' ResBlocks with the backbone's lm_head (dequantized) as each head's own projection -- the Medusa-1
paper's initialisation, so real heads' projections start from there. Hidden states: the backbone's final hidden
states over the project's fidelity text (medusa_chat/data/fidelity_text.txt), every position.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources

import torch

from medusa_chat.engine.engine import MedusaEngine, plain_tree
from medusa_chat.model.forward.block_heads import block_medusa_heads
from medusa_chat.model.forward.heads import HydraHeads, heads_from_state_dict
from medusa_chat.model.sources.heads_files import load_heads_file
from medusa_chat.model.sources.loading import load_model


def v1_from_hydra(hydra: HydraHeads, lm_weight: torch.Tensor) -> dict[str, torch.Tensor]:
    state = {}
    for k in range(hydra.num_heads):
        for layer in range(hydra.num_layers):
            lin = hydra[k][layer].linear
            state[f"{k}.{layer}.linear.weight"] = lin.weight.detach().float().clone()
            state[f"{k}.{layer}.linear.bias"] = lin.bias.detach().float().clone()
        state[f"{k}.{hydra.num_layers}.weight"] = lm_weight.clone()
    return state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", type=int, default=600)
    ap.add_argument("--heads", help="a Medusa-1 heads folder for the embedded model")
    ap.add_argument("--quant", default="int4")
    args = ap.parse_args()
    loaded = load_model("smollm2-135m", quant=args.quant, device="cpu")
    lm_head = loaded.backbone.get_output_embeddings()
    draft_vocab = loaded.heads.draft_vocab if isinstance(loaded.heads, HydraHeads) else None
    if args.heads:
        from pathlib import Path

        fp32_state = {k: v.float() for k, v in load_heads_file(Path(args.heads))[0].state_dict().items()}
    else:
        fp32_state = v1_from_hydra(loaded.heads, lm_head.dequantized())
    text = resources.files("medusa_chat.data").joinpath("fidelity_text.txt").read_text()
    ids = loaded.tokenizer(text)["input_ids"][: args.positions]
    engine = MedusaEngine(loaded, plain_tree())
    with torch.inference_mode():
        hidden = torch.cat(
            [engine.prefill(torch.tensor(ids[i : i + 256]), i) for i in range(0, len(ids), 256)]
        )
        ref = heads_from_state_dict(fp32_state)
        ref_logits = ref(hidden)  # [K, T, V] fp32 heads
        ref_top = ref_logits.argmax(-1)
        out = {"positions": len(ids), "heads": ref.num_heads, "quant": args.quant}
        for kind in ("q8_0", "q4_1"):
            q = heads_from_state_dict(fp32_state)
            summary = block_medusa_heads(q, loaded.backbone, kind, share=False)
            logits = torch.stack([q[k](hidden) for k in range(q.num_heads)])
            top = logits.argmax(-1)
            top3 = logits.topk(3, -1).indices
            out[kind] = {
                "shared_lm_heads": summary["shared"],
                "top1_agree_per_head": [
                    round(float((top[k] == ref_top[k]).float().mean()), 4) for k in range(q.num_heads)
                ],
                "ref_top1_in_top3_per_head": [
                    round(float((top3[k] == ref_top[k][:, None]).any(-1).float().mean()), 4)
                    for k in range(q.num_heads)
                ],
            }
        if draft_vocab is not None:
            inside = torch.zeros(ref_logits.shape[-1], dtype=torch.bool)
            inside[draft_vocab] = True
            out["draft_vocab"] = {
                "size": int(draft_vocab.numel()),
                "ref_top1_inside_per_head": [
                    round(float(inside[ref_top[k]].float().mean()), 4) for k in range(ref.num_heads)
                ],
            }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
