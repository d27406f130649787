"""Train/rollout mismatch: the metric, truncated (TIS) and masked importance sampling in the PPO /
GRPO loss, against the plain loops of tests/rl/reference.py, and in the actor trainer."""

from __future__ import annotations

import pytest
import torch

from flowrl.models import build_model
from flowrl.rl import ActorConfig, ActorTrainer, ppo_policy_loss
from flowrl.rl.losses import logprob_mismatch, rollout_importance_weights
from flowrl.tasks import build_task
from tests.rl import reference as ref
from tests.rl.batches import sample_rect

MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
LP = [[-1.0, -0.5, -2.0, -9.0], [-0.2, -1.5, -3.0, -0.1], [-0.7, -0.3, -1.1, -2.5]]
OLD = [[-1.1, -0.4, -2.2, -1.0], [-0.3, -1.0, -2.0, -0.5], [-0.6, -0.3, -1.0, -2.0]]
ROLLOUT = [[-1.0, -1.4, -2.1, -4.0], [-1.6, -1.0, -2.5, -0.5], [-0.6, -0.2, -2.0, -0.1]]  # some far off
ADV = [[1.0, 1.0, 1.0, 1.0], [-0.5, -0.5, -0.5, -0.5], [2.0, -1.0, 0.5, 0.3]]


def t(x):
    return torch.tensor(x, dtype=torch.float32)


@pytest.mark.parametrize("mode,cap,floor", [("truncate", 2.0, None), ("truncate", 1.2, None),
                                            ("mask", 2.0, None), ("mask", 3.0, 0.5), ("off", 2.0, None)])
def test_importance_weighted_ppo_loss_matches_the_reference_loop(mode, cap, floor):
    w, keep, _ = rollout_importance_weights(t(OLD), t(ROLLOUT), t(MASK), mode=mode, cap=cap, floor=floor)
    loss, _ = ppo_policy_loss(t(LP), t(OLD), t(ADV), keep, clip_low=0.2, clip_high=0.28, is_weights=w)
    want = ref.ppo_is_loss(LP, OLD, ROLLOUT, ADV, MASK, 0.2, 0.28, mode, cap, floor)
    assert float(loss) == pytest.approx(want, rel=1e-5)


def test_tis_truncates_large_ratios_and_keeps_every_token():
    w, keep, stats = rollout_importance_weights(t(OLD), t(ROLLOUT), t(MASK), mode="truncate", cap=2.0)
    assert torch.equal(keep, t(MASK).bool())
    assert float(w.max()) == 2.0  # exp(-0.3 + 1.6) = 3.67 capped
    assert float(stats["rollout_is_truncated_frac"]) == pytest.approx(3 / 9)  # 3.67 and twice exp(1.0) = 2.72


def test_masked_is_drops_tokens_outside_the_band_from_the_mean():
    w, keep, stats = rollout_importance_weights(t(OLD), t(ROLLOUT), t(MASK), mode="mask", cap=2.0)
    assert torch.equal(w, torch.ones_like(w))
    dropped = t(MASK).bool() & ~keep
    assert dropped.sum() == 4  # ratios 3.67, 2.72, 2.72 (> 2) and exp(-1.9) = 0.15 (< 1/2)
    assert float(stats["rollout_is_masked_frac"]) == pytest.approx(4 / 9)


def test_is_weights_do_not_carry_gradient_and_scale_the_policy_gradient():
    lp = t(LP).requires_grad_()
    w, keep, _ = rollout_importance_weights(t(OLD), t(ROLLOUT), t(MASK), mode="truncate", cap=2.0)
    loss, _ = ppo_policy_loss(lp, t(OLD), t(ADV), keep, is_weights=w)
    loss.backward()
    plain = t(LP).requires_grad_()
    ppo_policy_loss(plain, t(OLD), t(ADV), keep)[0].backward()
    # token (1, 0): ratio exp(0.1) inside the clip band, weight 2 (capped): twice the plain gradient
    assert float(lp.grad[1, 0]) == pytest.approx(2.0 * float(plain.grad[1, 0]))


def test_mismatch_metric_is_mean_and_max_absolute_logprob_difference():
    got = logprob_mismatch(t(OLD), t(ROLLOUT), t(MASK))
    mean, hi, kl = ref.mismatch(OLD, ROLLOUT, MASK)
    assert float(got["mismatch_logprob_abs_mean"]) == pytest.approx(mean)
    assert float(got["mismatch_logprob_abs_max"]) == pytest.approx(hi)
    assert float(got["mismatch_kl"]) == pytest.approx(kl, rel=1e-5)
    zero = logprob_mismatch(t(OLD), t(OLD), t(MASK))
    assert all(float(v) == 0.0 for v in zero.values())


def test_is_options_need_recomputed_old_logprobs_and_say_so():
    with pytest.raises(ValueError, match="old_logprobs: recompute"):
        ActorConfig(rollout_is="truncate", old_logprobs="rollout")
    assert ActorConfig(rollout_is="mask").recompute_old_logprobs
    assert not ActorConfig().recompute_old_logprobs


def _batch(seed=0):
    policy = build_model({"type": "tiny", "d_model": 32, "n_layers": 1, "n_heads": 2}, seed=seed)
    prompts = build_task({"name": "reverse", "digits": 3}).prompts(0, 0, 8)[0]
    gen = sample_rect(policy, prompts, max_new_tokens=4, temperature=0.7, seed=0)
    return policy, gen, prompts.shape[1]


def test_actor_reports_zero_mismatch_for_its_own_samples_and_the_true_gap_for_a_perturbed_rollout():
    policy, gen, p = _batch()
    adv = torch.randn(gen.tokens.shape[0])
    same = ActorTrainer(policy, ActorConfig(lr=1e-12, mini_batches=2, old_logprobs="recompute"))
    m = same.train_step(tokens=gen.tokens, prompt_len=p, response_mask=gen.response_mask,
                        old_logprobs=gen.logprobs, advantages=adv, temperature=0.7)
    assert m["mismatch_logprob_abs_max"] < 1e-5 and m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    shifted = gen.logprobs - 0.3 * gen.response_mask  # an engine that thinks every token 26% less likely
    tis = ActorTrainer(policy, ActorConfig(lr=1e-12, mini_batches=2, rollout_is="truncate", rollout_is_cap=1.2))
    m = tis.train_step(tokens=gen.tokens, prompt_len=p, response_mask=gen.response_mask,
                       old_logprobs=shifted, advantages=adv, temperature=0.7)
    assert m["mismatch_logprob_abs_mean"] == pytest.approx(0.3, abs=1e-5)
    assert m["rollout_is_ratio_mean"] == pytest.approx(1.3499, rel=1e-3)  # exp(0.3) on every token
    assert m["rollout_is_truncated_frac"] == pytest.approx(1.0)


def test_a_temperature_that_disagrees_with_the_batch_is_an_error():
    policy, gen, p = _batch()
    trainer = ActorTrainer(policy, ActorConfig(temperature=1.0))
    with pytest.raises(ValueError, match="sampled at temperature=0.7"):
        trainer.train_step(tokens=gen.tokens, prompt_len=p, response_mask=gen.response_mask,
                           old_logprobs=gen.logprobs, advantages=torch.zeros(8), temperature=0.7)
