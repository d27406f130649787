"""The trainers on sequences of their own length: packed micro-batches make the update of one sequence at a
time, whatever the token budget, for every loss aggregation; the legacy rectangular call is the ragged one."""

from __future__ import annotations

import copy

import pytest
import torch

from flowrl.models import TinyLMSpec, build_model
from flowrl.rl import ActorConfig, ActorTrainer, CriticConfig, CriticTrainer, aggregate, kl_estimate
from flowrl.rl.losses import ppo_token_loss, value_token_loss
from flowrl.rl.tokens import to_rect
from flowrl.tasks import build_task
from flowrl.transport.ragged import Ragged
from tests.rl.batches import PackedTinyLM, assert_same_params, random_batch, relative_error, sample

SPEC = TinyLMSpec(d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


def _actor_args(b: dict, per_sequence: bool = False) -> dict:
    return {"tokens": b["tokens"], "loss_mask": b["loss_mask"], "old_logprobs": b["old_logprobs"],
            "advantages": b["seq_advantages"] if per_sequence else b["advantages"], "ref_logprobs": b["ref_logprobs"]}


def _capture_grads(trainer) -> list[dict[str, torch.Tensor]]:
    """The gradient of each optimizer step, as the trainer applies it (before clipping)."""
    grads, real = [], trainer._optimizer_step

    def step():
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return real()

    trainer._optimizer_step = step
    return grads


def _one_at_a_time_loss(model, b: dict, cfg: ActorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The actor's loss on the whole batch, each sequence run alone through the model, aggregated on the
    rectangular grid by ``aggregate`` (independent of the packed path and of its loss weights); and its policy
    gradient part."""
    lps, ents = [], []
    for seq in b["tokens"]:
        logp = torch.log_softmax(model(seq[None])[0].float(), dim=-1)
        lps.append(torch.cat([torch.zeros(1), logp[:-1].gather(-1, seq[1:, None]).squeeze(-1)]))
        ents.append(torch.cat([torch.zeros(1), -(logp.exp() * logp).sum(-1)[:-1]]))
    width = int(b["tokens"].lengths.max())
    grid = lambda r: r.to_padded(0.0, width)  # noqa: E731
    lp = torch.nn.utils.rnn.pad_sequence(lps, batch_first=True)
    ent = torch.nn.utils.rnn.pad_sequence(ents, batch_first=True)
    mask = b["loss_mask"].to_padded(False, width)
    pg, *_ = ppo_token_loss(lp, grid(b["old_logprobs"]), grid(b["advantages"]), clip_low=cfg.clip_low,
                            clip_high=cfg.clip_high)
    agg = lambda x: aggregate(x, mask, cfg.loss_agg, norm_len=cfg.loss_agg_norm_len)  # noqa: E731
    kl = kl_estimate(lp, grid(b["ref_logprobs"]), cfg.kl_loss_kind)
    return agg(pg) - cfg.entropy_coef * agg(ent) + cfg.kl_loss_coef * agg(kl), agg(pg)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", [None, 24, 14])  # one micro-batch; several; about one sequence each
def test_packed_micro_batches_give_the_loss_and_gradient_of_one_sequence_at_a_time(mode, budget):
    b = random_batch(build_model(SPEC, seed=0), 10, seed=1, response=(1, 10), holes=True)
    b["loss_mask"].values[: int(b["tokens"].offsets[1])] = False  # a sequence with nothing in the loss
    cfg = ActorConfig(lr=1e-3, loss_agg=mode, loss_agg_norm_len=16, kl_loss_coef=0.1, entropy_coef=0.01,
                      max_tokens_per_microbatch=budget)
    model = build_model(SPEC, seed=0)
    want_loss, want_pg = _one_at_a_time_loss(copy.deepcopy(model), b, cfg)
    ref = copy.deepcopy(model)
    _one_at_a_time_loss(ref, b, cfg)[0].backward()
    actor = ActorTrainer(model, cfg, seed=0)
    grads = _capture_grads(actor)
    metrics = actor.train_step(**_actor_args(b))
    assert metrics["policy_loss"] == pytest.approx(float(want_pg.detach()), rel=1e-5, abs=1e-7)
    for name, p in ref.named_parameters():
        if name.endswith("attn.qkv.bias"):  # its key third's exact gradient is 0: compare the rest
            q, _, v = p.grad.chunk(3)
            gq, _, gv = grads[0][name].chunk(3)
            assert relative_error(torch.cat([gq, gv]), torch.cat([q, v])) <= 1e-5
            continue
        assert relative_error(grads[0][name], p.grad) <= 1e-5, name


@pytest.mark.parametrize("cfg", [
    dict(epochs=2, mini_batches=3, kl_loss_coef=0.1, entropy_coef=0.01),
    dict(mini_batches=2, loss_agg="seq_mean_token_mean", rollout_is="truncate", rollout_is_cap=1.05),
    dict(mini_batches=2, loss_agg="seq_mean_token_sum_norm", loss_agg_norm_len=12, old_logprobs="recompute",
         rollout_is="mask", rollout_is_cap=1.05),
])
@pytest.mark.parametrize("model_kind", ["tiny", "kernel"])
def test_a_small_token_budget_makes_the_update_of_one_micro_batch(cfg, model_kind):
    build = (lambda: PackedTinyLM(SPEC, seed=0)) if model_kind == "kernel" else (lambda: build_model(SPEC, seed=0))
    batches = [random_batch(build_model(SPEC, seed=0), 12, seed=s, response=(1, 20), holes=True) for s in range(2)]
    runs = {}
    for budget in (None, 26):
        actor = ActorTrainer(build(), ActorConfig(lr=3e-3, max_tokens_per_microbatch=budget, **cfg), seed=3)
        metrics = [actor.train_step(**_actor_args(b, per_sequence=True)) for b in batches]
        runs[budget] = (actor.model.state_dict(), metrics)
    assert_same_params(runs[26][0], runs[None][0])
    for got, want in zip(runs[26][1], runs[None][1]):
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    start = build().state_dict()
    assert max(relative_error(runs[None][0][k], start[k]) for k in start) > 1e-3  # it trained


def test_the_legacy_rectangular_call_is_the_ragged_call():
    task = build_task({"name": "reverse", "digits": 3})
    p = task.prompt_len
    policy = build_model(SPEC, seed=0)
    gen = sample(policy, task.prompts(0, 0, 12)[0], max_new_tokens=task.max_new_tokens, seed=0)
    t = int(gen.response_lens.max())
    rect_tokens = torch.cat([gen.tokens.to_padded(0)[:, :p], gen.responses(pad=0)], dim=1)
    mask = torch.arange(t)[None] < gen.response_lens[:, None]
    ref = gen.logprobs.map(lambda v: v + 0.05 * gen.loss_mask.values)
    adv = torch.randn(12, generator=torch.Generator().manual_seed(0))
    cfg = ActorConfig(lr=3e-3, mini_batches=3, epochs=2, kl_loss_coef=0.1, max_tokens_per_microbatch=30)
    a, b = ActorTrainer(copy.deepcopy(policy), cfg, seed=1), ActorTrainer(copy.deepcopy(policy), cfg, seed=1)
    ma = a.train_step(tokens=rect_tokens, prompt_len=p, response_mask=mask, old_logprobs=to_rect(gen.logprobs, p, t),
                      advantages=adv, ref_logprobs=to_rect(ref, p, t))
    mb = b.train_step(tokens=gen.tokens, loss_mask=gen.loss_mask, old_logprobs=gen.logprobs, advantages=adv,
                      ref_logprobs=ref)
    assert ma == mb
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    for key in ("policy_loss", "entropy", "kl", "clipfrac", "approx_kl", "ratio_mean", "grad_norm", "lr",
                "response_len", "advantage_mean", "mismatch_logprob_abs_mean", "mismatch_logprob_abs_max"):
        assert key in ma


def test_the_critic_on_ragged_sequences_matches_its_legacy_form_and_any_budget():
    task = build_task({"name": "reverse", "digits": 3})
    p = task.prompt_len
    prompts = task.prompts(0, 0, 8)[0]
    gen = sample(build_model(SPEC, seed=0), prompts, max_new_tokens=task.max_new_tokens, seed=0)
    critic = CriticTrainer(build_model(SPEC, value_head=True, seed=0), CriticConfig(lr=3e-3), seed=0)
    torch.nn.init.normal_(critic.model.value_head.weight, std=0.5)
    v = critic.values(gen.tokens)
    assert isinstance(v, Ragged) and v.aligned(gen.tokens)
    rect = torch.cat([prompts, gen.responses(pad=0)], dim=1)
    legacy = critic.values(rect, p)
    t = rect.shape[1] - p
    assert torch.allclose(legacy * (torch.arange(t)[None] < gen.response_lens[:, None]), to_rect(v, p, t), atol=1e-6)

    returns = gen.loss_mask.like(torch.rand(gen.tokens.total, generator=torch.Generator().manual_seed(0))
                                 * gen.loss_mask.values)
    runs = {}
    for budget in (None, 20):
        cfg = CriticConfig(lr=3e-3, mini_batches=2, epochs=2, clip_range_value=0.2, max_tokens_per_microbatch=budget,
                           loss_agg="seq_mean_token_mean")
        c = CriticTrainer(build_model(SPEC, value_head=True, seed=0), cfg, seed=0)
        metrics = [c.train_step(tokens=gen.tokens, loss_mask=gen.loss_mask, returns=returns,
                                old_values=c.values(gen.tokens)) for _ in range(3)]
        runs[budget] = (c.model.state_dict(), metrics)
    assert_same_params(runs[20][0], runs[None][0])
    assert runs[20][1][-1]["value_loss"] == pytest.approx(runs[None][1][-1]["value_loss"], rel=1e-4)


def test_critic_value_loss_matches_the_grid_loss_per_mode():
    b = random_batch(build_model(SPEC, seed=0), 8, seed=2, holes=True)
    for mode in MODES:
        critic = CriticTrainer(build_model(SPEC, value_head=True, seed=0),
                               CriticConfig(loss_agg=mode, loss_agg_norm_len=10, clip_range_value=0.1,
                                            max_tokens_per_microbatch=16), seed=0)
        torch.nn.init.normal_(critic.model.value_head.weight, std=0.5)
        old = critic.values(b["tokens"]).map(lambda v: v + 0.2)
        with torch.no_grad():
            now = critic.values(b["tokens"])
        width = int(b["tokens"].lengths.max())
        per_token, _ = value_token_loss(now.to_padded(0.0, width), old.to_padded(0.0, width),
                                        b["returns"].to_padded(0.0, width), clip_range=0.1)
        want = aggregate(per_token, b["loss_mask"].to_padded(False, width), mode, norm_len=10)
        got = critic.train_step(tokens=b["tokens"], loss_mask=b["loss_mask"], returns=b["returns"], old_values=old)
        assert got["value_loss"] == pytest.approx(float(want), rel=1e-5), mode


def test_a_sequence_longer_than_the_budget_is_named_with_the_fix():
    b = random_batch(build_model(SPEC, seed=0), 6, seed=0, response=(1, 20))
    longest = int(b["tokens"].lengths.max())
    which = int(b["tokens"].lengths.argmax())
    actor = ActorTrainer(build_model(SPEC, seed=0), ActorConfig(max_tokens_per_microbatch=longest - 1))
    with pytest.raises(ValueError, match=rf"actor: sequence {which} of the batch has {longest} tokens, more than "
                                         rf"max_tokens_per_microbatch={longest - 1}; raise max_tokens_per_microbatch "
                                         rf"to at least {longest}"):
        actor.train_step(**_actor_args(b))
    critic = CriticTrainer(build_model(SPEC, value_head=True, seed=0), CriticConfig(max_tokens_per_microbatch=4))
    with pytest.raises(ValueError, match="critic: sequence"):
        critic.values(b["tokens"])


def test_misaligned_or_missing_per_token_inputs_are_named():
    b = random_batch(build_model(SPEC, seed=0), 4, seed=0)
    actor = ActorTrainer(build_model(SPEC, seed=0), ActorConfig())
    short = Ragged.from_sequences([v[:-1] for v in b["old_logprobs"]], dtype="float32")
    with pytest.raises(ValueError, match="old_logprobs is not aligned with tokens"):
        actor.train_step(**{**_actor_args(b), "old_logprobs": short})
    with pytest.raises(TypeError, match="need a loss_mask"):
        actor.train_step(**{**_actor_args(b), "loss_mask": None})
    with pytest.raises(TypeError, match="needs prompt_len and response_mask"):
        actor.train_step(tokens=torch.zeros(2, 5, dtype=torch.long), old_logprobs=torch.zeros(2, 3),
                         advantages=torch.zeros(2))


def test_sum_norm_needs_its_constant():
    with pytest.raises(ValueError, match="set loss_agg_norm_len"):
        ActorConfig(loss_agg="seq_mean_token_sum_norm")
    assert CriticConfig(loss_agg="seq_mean_token_sum_norm", loss_agg_norm_len=512).loss_agg_norm_len == 512
