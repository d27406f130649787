"""Advantages, losses and KL estimators against plain reference loops and hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.rl import (
    aggregate, broadcast_to_tokens, gae, group_advantages, kl_estimate, masked_mean, masked_var,
    masked_whiten, ppo_advantages, ppo_policy_loss, token_rewards, value_loss,
)
from tests.rl import reference as ref

MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
X = [[0.5, -1.0, 2.0, 9.0], [1.5, 0.25, -7.0, 3.0], [-0.5, 0.75, 1.0, -2.0]]


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_masked_mean_and_var_ignore_padding():
    assert float(masked_mean(t(X), t(MASK))) == pytest.approx(ref.masked_mean(X, MASK))
    assert float(masked_var(t(X), t(MASK).bool())) == pytest.approx(ref.masked_var(X, MASK))
    assert float(masked_mean(t(X), torch.zeros(3, 4))) == 0.0  # nothing valid: 0, not NaN


def test_masked_whiten_gives_zero_mean_unit_variance_and_zero_padding():
    w = masked_whiten(t(X), t(MASK))
    assert float(masked_mean(w, t(MASK))) == pytest.approx(0.0, abs=1e-6)
    assert float(masked_var(w, t(MASK))) == pytest.approx(1.0, abs=1e-4)
    assert float(w[0, 3]) == 0.0 and float(w[1, 2]) == 0.0
    kept = masked_whiten(t(X), t(MASK), shift_mean=False)
    assert float(masked_mean(kept, t(MASK))) == pytest.approx(ref.masked_mean(X, MASK), abs=1e-5)


def test_gae_on_hand_worked_numbers():
    rewards, values, mask = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv[0].tolist() == pytest.approx([0.5, 0.4, 0.3])
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert adv[0].tolist() == pytest.approx([0.11425, 0.165, 0.3])


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0), (1.0, 0.5)])
def test_gae_matches_the_reference_loop_with_padding(gamma, lam):
    rewards = [[0.1, -0.2, 0.3, 0.0], [0.0, 1.0, 0.0, 0.0], [0.2, 0.0, -0.1, 0.7]]
    adv, ret = gae(t(rewards), t(X), t(MASK), gamma=gamma, lam=lam)
    want_adv, want_ret = ref.gae(rewards, X, MASK, gamma, lam)
    assert adv.tolist() == [pytest.approx(r, abs=1e-5) for r in want_adv]
    assert ret.tolist() == [pytest.approx(r, abs=1e-5) for r in want_ret]


def test_gae_treats_a_hole_in_the_mask_as_not_part_of_the_episode():
    mask = [[1, 0, 1, 1]]
    rewards, values = [[0.0, 5.0, 0.0, 1.0]], [[0.2, 9.0, 0.4, 0.6]]
    adv, _ = gae(t(rewards), t(values), t(mask), gamma=0.9, lam=0.8)
    want, _ = ref.gae(rewards, values, mask, 0.9, 0.8)
    assert adv.tolist() == [pytest.approx(r, abs=1e-6) for r in want]


def test_token_rewards_put_the_score_on_the_last_token_and_the_kl_penalty_everywhere():
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    kl = t([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8], [1.0, 1.0, 1.0, 1.0]])
    r = token_rewards(t([1.0, 0.5, 0.9]), mask, kl=kl, kl_coef=0.1)
    assert r[0].tolist() == pytest.approx([-0.01, -0.02, 1.0 - 0.03, 0.0])
    assert r[1].tolist() == pytest.approx([0.5 - 0.05, 0.0, 0.0, 0.0])
    assert r[2].tolist() == [0.0, 0.0, 0.0, 0.0]  # an empty row gets nothing, not its score


def test_group_advantages_match_the_reference_loop():
    scores = [0.2, 0.4, 0.9, 0.1, 1.0, 1.0, 0.0, 0.5]
    got = group_advantages(t(scores), group_size=4)
    assert got.tolist() == pytest.approx(ref.group_advantages(scores, 4), abs=1e-5)
    centred = group_advantages(t(scores), group_size=4, normalize_std=False)
    assert centred.tolist() == pytest.approx(ref.group_advantages(scores, 4, normalize_std=False), abs=1e-6)


def test_a_group_that_scored_all_the_same_gets_zero_advantage():
    assert group_advantages(t([0.7, 0.7, 0.7, 0.1, 0.3, 0.2]), group_size=3)[:3].tolist() == [0.0, 0.0, 0.0]


def test_group_advantages_reject_a_batch_that_does_not_split_into_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), group_size=4)


def test_ppo_policy_loss_matches_the_reference_loop():
    lp = [[-1.0, -0.5, -2.0, -0.1], [-0.3, -1.7, -0.2, -0.9], [-2.5, -0.05, -1.2, -0.6]]
    old = [[-1.1, -0.9, -1.5, -0.1], [-0.3, -1.0, -0.8, -0.4], [-2.0, -0.5, -1.2, -1.6]]
    adv = [[1.0, -0.5, 2.0, 0.3], [-1.0, 0.7, -0.2, 1.0], [0.5, 1.5, -2.0, -0.4]]
    loss, stats = ppo_policy_loss(t(lp), t(old), t(adv), t(MASK), clip_low=0.2, clip_high=0.28)
    per_token, clipped = [], []
    for i in range(3):
        for j in range(4):
            if MASK[i][j]:
                v, c = ref.ppo_token_loss(lp[i][j], old[i][j], adv[i][j], 0.2, 0.28)
                per_token.append(v)
                clipped.append(c)
    assert float(loss) == pytest.approx(sum(per_token) / len(per_token), abs=1e-6)
    assert float(stats["clipfrac"]) == pytest.approx(sum(clipped) / len(clipped))
    assert float(stats["approx_kl"]) > 0


def test_ppo_policy_loss_gradient_is_the_policy_gradient_when_nothing_is_clipped():
    lp = t([[-1.0, -2.0]]).requires_grad_()
    adv = t([[0.5, -1.5]])
    loss, stats = ppo_policy_loss(lp, lp.detach(), adv, t([[1, 1]]))
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-0.25, 0.75])  # -A / n_tokens
    assert float(stats["clipfrac"]) == 0.0 and float(stats["ratio_mean"]) == pytest.approx(1.0)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    lp, old, adv = t([[0.0]]), t([[-3.0]]), t([[-1.0]])  # ratio e^3 ~ 20 on a bad token
    plain, _ = ppo_policy_loss(lp, old, adv, t([[1]]))
    dual, _ = ppo_policy_loss(lp, old, adv, t([[1]]), dual_clip=3.0)
    assert float(plain) == pytest.approx(math.exp(3.0)) and float(dual) == pytest.approx(3.0)


def test_loss_aggregation_modes():
    loss, mask = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]), t([[1, 1, 1], [1, 0, 0]])
    assert float(aggregate(loss, mask, "token_mean")) == pytest.approx(10 / 4)
    assert float(aggregate(loss, mask, "seq_mean_token_mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(loss, mask, "seq_mean_token_sum")) == pytest.approx((6 + 4) / 2)
    with pytest.raises(ValueError, match="token_mean"):
        aggregate(loss, mask, "mean")  # type: ignore[arg-type]


def test_value_loss_takes_the_larger_of_clipped_and_unclipped_errors():
    values, old, ret = t([[1.0, 0.0, 0.5]]), t([[0.5, 0.2, 0.5]]), t([[2.0, 0.0, 0.0]])
    mask = t([[1, 1, 1]])
    loss, clipfrac = value_loss(values, old, ret, mask, clip_range=0.2)
    # token 0: v=1 -> (1-2)^2=1, clipped v=0.7 -> 1.69; token 1: 0 vs clipped 0.0 -> 0.0; token 2: 0.25 vs 0.25
    assert float(loss) == pytest.approx(0.5 * (1.69 + 0.0 + 0.25) / 3)
    assert float(clipfrac) == pytest.approx(1 / 3)
    plain, _ = value_loss(values, old, ret, mask, clip_range=None)
    assert float(plain) == pytest.approx(0.5 * (1.0 + 0.0 + 0.25) / 3)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_match_their_formulas(kind):
    lp, rp = [[-1.0, -0.2, -3.0]], [[-1.5, -0.2, -0.5]]
    got = kl_estimate(t(lp), t(rp), kind)
    assert got[0].tolist() == pytest.approx([ref.kl(a, b, kind) for a, b in zip(lp[0], rp[0])], abs=1e-6)


def test_k1_and_k3_estimate_the_true_kl_on_samples_of_the_policy():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=gen), 0)
    q = torch.softmax(torch.randn(6, generator=gen), 0)
    true_kl = float((p * (p / q).log()).sum())
    x = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    for kind in ("k1", "k3"):
        est = float(kl_estimate(p.log()[x], q.log()[x], kind).mean())
        assert est == pytest.approx(true_kl, rel=0.05)
    assert float(kl_estimate(p.log()[x], q.log()[x], "k3").min()) >= 0.0


def test_ppo_advantages_are_whitened_and_returns_are_not():
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = ppo_advantages(t([1.0, 0.0]), t([[0.2, 0.3, 0.4], [0.5, 0.1, 0.0]]), mask, gamma=1.0, lam=1.0)
    assert float(masked_mean(adv, mask)) == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_broadcast_puts_a_sequence_value_on_each_valid_token():
    assert broadcast_to_tokens(t([2.0, -1.0]), t([[1, 1, 0], [1, 0, 0]])).tolist() == [[2, 2, 0], [-1, 0, 0]]
