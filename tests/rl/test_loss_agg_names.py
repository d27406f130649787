"""TRL's loss_type names as loss_agg aliases: each one aggregates exactly as TRL's GRPOTrainer does.

The references are TRL 1.16's formulas (``GRPOTrainer._compute_loss``), written out plainly for one
micro-batch ``[B, T]`` with a completion mask, no gradient accumulation.
"""

from __future__ import annotations

import pytest
import torch

from flowrl.rl.config import LOSS_AGG_ALIASES, ActorConfig
from flowrl.rl.losses import aggregate, loss_weights

MAX_COMPLETION = 9


def _trl(loss_type: str, per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.float()
    if loss_type == "grpo":
        return ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):  # dapo: the generation batch's tokens; one step per batch = these
        return (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * m).sum() / (per_token_loss.size(0) * MAX_COMPLETION)
    raise AssertionError(loss_type)


@pytest.mark.parametrize("name", sorted(LOSS_AGG_ALIASES))
def test_each_trl_loss_type_name_aggregates_as_trl_does(name):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, MAX_COMPLETION, generator=gen)
    lengths = torch.tensor([1, 3, 9, 5, 2, 7])
    mask = torch.arange(MAX_COMPLETION)[None] < lengths[:, None]
    cfg = ActorConfig(loss_agg=name, loss_agg_norm_len=MAX_COMPLETION if name == "dr_grpo" else None)
    assert cfg.loss_agg == LOSS_AGG_ALIASES[name]
    expected = _trl(name, loss, mask)
    assert aggregate(loss, mask, cfg.loss_agg, norm_len=cfg.loss_agg_norm_len) == pytest.approx(float(expected))
    # the trainers' per-token weights (any micro-batch split) add up to the same number
    seq_tokens = mask.sum(1, keepdim=True).expand_as(mask)
    w = loss_weights(mask.flatten(), seq_tokens.flatten(), cfg.loss_agg, tokens=float(mask.sum()), sequences=6.0,
                     norm_len=cfg.loss_agg_norm_len)
    assert float((w * loss.flatten()).sum()) == pytest.approx(float(expected), rel=1e-5, abs=1e-7)


def test_dr_grpo_by_its_trl_name_still_needs_the_constant():
    with pytest.raises(ValueError, match="set loss_agg_norm_len"):
        ActorConfig(loss_agg="dr_grpo")


def test_an_unknown_aggregation_name_is_rejected():
    with pytest.raises(ValueError, match="loss_agg"):
        ActorConfig(loss_agg="cispo")
