"""MedusaHeads: published key names, layout inference, and the heads' math computed by hand."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from medusa_chat.model.forward.heads import MedusaHeads, heads_from_state_dict, infer_layout
from tests.tinymodels import HIDDEN, VOCAB, random_heads_state


def hand_logits(
    state: dict[str, torch.Tensor], hidden: torch.Tensor, lm_head: torch.Tensor | None = None
) -> torch.Tensor:
    """Medusa head math written out: x <- x + SiLU(W x + b) per layer, then the head's (or shared) projection."""
    num_heads = len({k.split(".")[0] for k in state})
    out = []
    for h in range(num_heads):
        x = hidden
        layer = 0
        while f"{h}.{layer}.linear.weight" in state:
            x = x + F.silu(x @ state[f"{h}.{layer}.linear.weight"].T + state[f"{h}.{layer}.linear.bias"])
            layer += 1
        proj = state.get(f"{h}.{layer}.weight", lm_head)
        out.append(x @ proj.T)
    return torch.stack(out)


def test_state_dict_keys_are_the_published_ones() -> None:
    v1 = MedusaHeads(HIDDEN, VOCAB, num_heads=2, num_layers=1, own_lm_head=True)
    assert sorted(v1.state_dict()) == sorted(
        [
            "0.0.linear.weight",
            "0.0.linear.bias",
            "0.1.weight",
            "1.0.linear.weight",
            "1.0.linear.bias",
            "1.1.weight",
        ]
    )
    v2 = MedusaHeads(HIDDEN, VOCAB, num_heads=2, num_layers=2, own_lm_head=False)
    assert sorted(v2.state_dict()) == sorted(
        f"{h}.{layer}.linear.{p}" for h in range(2) for layer in range(2) for p in ("weight", "bias")
    )
    assert v1.format == "v1" and v2.format == "v2"


@pytest.mark.parametrize(("num_heads", "num_layers", "own"), [(5, 1, True), (3, 2, False), (1, 3, True)])
def test_infer_layout_and_roundtrip(num_heads: int, num_layers: int, own: bool) -> None:
    state = random_heads_state(num_heads, num_layers, own_lm_head=own)
    assert infer_layout(state) == (num_heads, num_layers, own, HIDDEN, VOCAB if own else None)
    heads = heads_from_state_dict(state, vocab_size=VOCAB)
    assert heads.num_heads == num_heads and heads.num_layers == num_layers and heads.own_lm_head is own
    for k, v in heads.state_dict().items():
        assert torch.equal(v, state[k])


def test_forward_equals_hand_math_v1_and_v2() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, HIDDEN)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    v1 = random_heads_state(4, 1, own_lm_head=True)
    heads = heads_from_state_dict(v1)
    torch.testing.assert_close(heads(hidden), hand_logits(v1, hidden), rtol=1e-5, atol=1e-5)
    v2 = random_heads_state(3, 2, own_lm_head=False)
    heads = heads_from_state_dict(v2, vocab_size=VOCAB)
    torch.testing.assert_close(
        heads(hidden, lm_head), hand_logits(v2, hidden, lm_head.weight.detach()), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="lm_head"):
        heads(hidden)


def test_fresh_heads_start_as_identity_and_copy_lm_head() -> None:
    """Paper init: W = 0 so a head starts as the identity; v1 projections start as the backbone's lm_head."""
    heads = MedusaHeads(HIDDEN, VOCAB, num_heads=2, own_lm_head=True)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    heads.init_from_lm_head(lm_head)
    hidden = torch.randn(5, HIDDEN)
    expected = lm_head(hidden)
    with torch.no_grad():
        out = heads(hidden)
    for k in range(2):
        torch.testing.assert_close(out[k], expected)


def test_config_dict_marks_v2() -> None:
    v1 = MedusaHeads(HIDDEN, VOCAB, num_heads=3, own_lm_head=True).config_dict("base/model")
    v2 = MedusaHeads(HIDDEN, VOCAB, num_heads=3).config_dict("base/model")
    assert v1["medusa_num_heads"] == 3 and "version" not in v1
    assert v2["version"] == "2" and v2["base_model_name_or_path"] == "base/model"


def test_bad_layouts_are_refused() -> None:
    state = random_heads_state(3, 1)
    with pytest.raises(ValueError, match="not contiguous"):
        infer_layout({k: v for k, v in state.items() if not k.startswith("1.")})
    with pytest.raises(ValueError, match="different tensors"):
        infer_layout({k: v for k, v in state.items() if k != "2.1.weight"})
    with pytest.raises(ValueError, match="unexpected key"):
        infer_layout({**state, "medusa_head.0.0.linear.weight": state["0.0.linear.weight"]})
    with pytest.raises(ValueError, match="no head weights"):
        infer_layout({})
