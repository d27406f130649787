"""Actor and critic trainers: they move the model the right way, report metrics, and resume exactly."""

from __future__ import annotations

import copy

import pytest
import torch

from flowrl.models import TinyLMSpec, build_model
from flowrl.models.packing import packed_logprobs
from flowrl.rl import ActorConfig, ActorTrainer, CriticConfig, CriticTrainer
from flowrl.rl.tokens import rect_to_ragged, to_rect
from flowrl.tasks import build_task
from tests.rl.batches import sample_rect

SPEC = TinyLMSpec(d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
TASK = build_task({"name": "reverse", "digits": 3})
P = TASK.prompt_len


def _batch(model, n=16, seed=0):
    prompts, _ = TASK.prompts(seed, 0, n)
    return sample_rect(model, prompts, max_new_tokens=TASK.max_new_tokens, seed=seed)


def _actor_step(actor, gen, adv, **extra):
    return actor.train_step(tokens=gen.tokens, prompt_len=P, response_mask=gen.response_mask,
                            old_logprobs=gen.logprobs, advantages=adv, **extra)


def test_a_positive_advantage_makes_its_tokens_more_likely():
    policy = build_model(SPEC, seed=0)
    gen = _batch(policy)
    adv = torch.where(torch.arange(16) < 8, 1.0, -1.0)  # [B]: broadcast over each row's tokens
    actor = ActorTrainer(policy, ActorConfig(lr=1e-2), seed=0)
    metrics = _actor_step(actor, gen, adv)
    mask = gen.response_mask
    tokens, _, _ = rect_to_ragged(gen.tokens, P, mask)
    after = to_rect(packed_logprobs(policy, tokens), P, mask.shape[1])
    delta = ((after - gen.logprobs) * mask).sum(dim=1)
    assert float(delta[:8].min()) > 0 and float(delta[8:].max()) < 0
    for key in ("policy_loss", "entropy", "clipfrac", "approx_kl", "grad_norm", "lr", "response_len"):
        assert key in metrics
    assert metrics["clipfrac"] == 0.0  # first mini-batch of the first epoch: ratio is exactly 1


def test_kl_loss_needs_reference_logprobs_and_reports_kl():
    policy = build_model(SPEC, seed=0)
    gen = _batch(policy)
    actor = ActorTrainer(policy, ActorConfig(kl_loss_coef=0.1), seed=0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        _actor_step(actor, gen, torch.ones(16))
    metrics = _actor_step(actor, gen, torch.ones(16), ref_logprobs=gen.logprobs)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy was the reference before this step


def test_epochs_and_mini_batches_take_that_many_optimizer_steps():
    actor = ActorTrainer(build_model(SPEC, seed=0), ActorConfig(epochs=2, mini_batches=4), seed=0)
    metrics = _actor_step(actor, _batch(actor.model), torch.randn(16))
    assert actor.steps == 8 and actor.updates == 1
    assert metrics["clipfrac"] >= 0.0
    with pytest.raises(ValueError, match="mini_batches=4 exceeds the batch of 2"):
        actor.train_step(tokens=torch.zeros(2, P + 3, dtype=torch.long), prompt_len=P,
                         response_mask=torch.ones(2, 3, dtype=torch.bool), old_logprobs=torch.zeros(2, 3),
                         advantages=torch.zeros(2))


def test_warmup_ramps_the_learning_rate():
    actor = ActorTrainer(build_model(SPEC, seed=0), ActorConfig(lr=1e-3, warmup_steps=4), seed=0)
    lrs = [_actor_step(actor, _batch(actor.model), torch.randn(16))["lr"] for _ in range(5)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_an_actor_restored_from_its_state_dict_makes_the_same_next_update():
    cfg = ActorConfig(epochs=2, mini_batches=4)
    a = ActorTrainer(build_model(SPEC, seed=0), cfg, seed=7)
    batches = [_batch(a.model, seed=s) for s in range(3)]
    advs = [torch.randn(16, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    for gen, adv in zip(batches[:2], advs[:2]):
        _actor_step(a, gen, adv)
    b = ActorTrainer(build_model(SPEC, seed=99), cfg, seed=0)
    b.load_state_dict(a.state_dict())
    ma, mb = _actor_step(a, batches[2], advs[2]), _actor_step(b, batches[2], advs[2])
    assert ma == mb and b.updates == 3
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))


def test_the_critic_learns_returns_and_resumes_exactly():
    critic = CriticTrainer(build_model(SPEC, value_head=True, seed=0), CriticConfig(lr=3e-3, mini_batches=2), seed=0)
    gen = _batch(build_model(SPEC, seed=0))
    mask = gen.response_mask
    returns = torch.where(torch.arange(16)[:, None] % 2 == 0, 1.0, 0.0).expand_as(mask) * mask
    first = None
    for i in range(30):
        old = critic.values(gen.tokens, P)
        metrics = critic.train_step(tokens=gen.tokens, prompt_len=P, response_mask=mask, returns=returns,
                                    old_values=old)
        first = first if first is not None else metrics["value_loss"]
        if i == 19:
            saved = copy.deepcopy(critic.state_dict())  # a checkpoint is a snapshot
    assert metrics["value_loss"] < 0.5 * first
    for key in ("value_loss", "value_clipfrac", "grad_norm", "explained_variance", "values_mean", "returns_mean"):
        assert key in metrics
    again = CriticTrainer(build_model(SPEC, value_head=True, seed=1), CriticConfig(lr=3e-3, mini_batches=2), seed=0)
    again.load_state_dict(saved)
    for _ in range(10):
        old = again.values(gen.tokens, P)
        again.train_step(tokens=gen.tokens, prompt_len=P, response_mask=mask, returns=returns, old_values=old)
    assert all(torch.equal(x, y) for x, y in zip(critic.model.state_dict().values(), again.model.state_dict().values()))


def test_linear_decay_falls_from_the_end_of_the_warmup_to_zero():
    actor = ActorTrainer(build_model(SPEC, seed=0), ActorConfig(lr=1e-3, warmup_steps=2, lr_decay_steps=6), seed=0)
    lrs = [_actor_step(actor, _batch(actor.model), torch.randn(16))["lr"] for _ in range(8)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0, 0.0])


def test_linear_decay_is_the_schedule_trl_uses_by_default():
    """TRL's GRPOTrainer takes Hugging Face's `linear` scheduler over max_steps (no warm-up by default)."""
    transformers = pytest.importorskip("transformers")
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1e-3)
    sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=5)
    expected = []
    for _ in range(6):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    actor = ActorTrainer(build_model(SPEC, seed=0), ActorConfig(lr=1e-3, lr_decay_steps=5), seed=0)
    lrs = [_actor_step(actor, _batch(actor.model), torch.randn(16))["lr"] for _ in range(6)]
    assert lrs == pytest.approx(expected)


def test_lr_decay_must_end_after_the_warmup():
    with pytest.raises(ValueError, match="lr_decay_steps=4 must exceed warmup_steps=4"):
        ActorConfig(warmup_steps=4, lr_decay_steps=4)
