"""Data-parallel trainer cases, run by each rank (``python -m tests.rl.dp_cases OUT``) and by the test.

Every rank gets the env a node rank gets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), joins a gloo
group, runs each case on its shard of the same batches and saves what the test compares to a
1-rank trainer run on the whole batches: ``OUT/rank{r}.pt`` (plain tensors and floats).

Then, after one more data-parallel step, rank 0 publishes the full state through a
``WeightPublisher`` fed by ``FullState`` (rank 1 drains) to a subscriber at rank 1 of weight-sync
epoch 1 (the test); rank 0 first saves the unsharded state to ``OUT/expected.pt`` and prints the
store address (its only stdout line).
"""

from __future__ import annotations

import copy
import os
import sys
from datetime import timedelta

import torch

from flowrl.models import TinyLMSpec, build_model
from flowrl.rl import ActorConfig, ActorTrainer, CriticConfig, CriticTrainer
from flowrl.tasks import build_task
from flowrl.transport.ragged import Ragged
from tests.rl.batches import PackedTinyLM, random_batch, sample_rect

SPEC = TinyLMSpec(d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
RSPEC = TinyLMSpec(d_model=32, n_layers=2, n_heads=2, max_seq_len=24)  # ragged cases: up to 21 tokens
TASK = build_task({"name": "reverse", "digits": 3})
P = TASK.prompt_len
B = 16
STEPS = 3

# name -> (trainer kind, config, rows of rank 0 (rank 1 gets the rest), data: rect | ragged | ragged_kernel)
# rect: the legacy call on rollouts of the reverse task. ragged: long-tailed random sequences, packed into
# micro-batches of a small token budget, so the ranks hold different token counts and micro-batch counts (the
# one with fewer runs dummy passes); ragged_kernel: the same on a model with its own forward_packed (registered
# with FSDP as a forward method), plain TinyLM otherwise (padded micro-batches).
CASES = {
    "actor_token_mean": ("actor", ActorConfig(lr=3e-3, epochs=2, mini_batches=4, kl_loss_coef=0.1, entropy_coef=0.01),
                         8, "rect"),
    "actor_seq_mean_uneven": ("actor", ActorConfig(lr=3e-3, mini_batches=8, loss_agg="seq_mean_token_mean",
                                                   max_grad_norm=0.05), 13, "rect"),
    "actor_empty_shard": ("actor", ActorConfig(lr=3e-3, mini_batches=2), 16, "rect"),
    "critic_token_mean": ("critic", CriticConfig(lr=3e-3, epochs=2, mini_batches=2, clip_range_value=0.2), 6, "rect"),
    "ragged_actor_token_mean": ("actor", ActorConfig(lr=3e-3, epochs=2, mini_batches=2, kl_loss_coef=0.1,
                                                     entropy_coef=0.01, max_tokens_per_microbatch=24),
                                5, "ragged_kernel"),
    "ragged_actor_seq_mean_is": ("actor", ActorConfig(lr=3e-3, mini_batches=2, loss_agg="seq_mean_token_mean",
                                                      rollout_is="truncate", rollout_is_cap=1.05,
                                                      max_tokens_per_microbatch=30), 11, "ragged"),
    "ragged_actor_sum_norm_empty": ("actor", ActorConfig(lr=3e-3, mini_batches=3, loss_agg="seq_mean_token_sum_norm",
                                                         loss_agg_norm_len=16, max_tokens_per_microbatch=24),
                                    16, "ragged_kernel"),
    "ragged_critic": ("critic", CriticConfig(lr=3e-3, epochs=2, mini_batches=2, clip_range_value=0.2,
                                             max_tokens_per_microbatch=24), 7, "ragged_kernel"),
}


def batches(form: str = "rect") -> list[dict]:
    """The same STEPS batches of B rows on every rank and in the test."""
    out = []
    for s in range(STEPS):
        if form != "rect":
            out.append(random_batch(build_model(RSPEC, seed=0), B, seed=s, response=(1, 16), holes=True))
            continue
        prompts, _ = TASK.prompts(s, 0, B)
        gen = sample_rect(build_model(SPEC, seed=0), prompts, max_new_tokens=TASK.max_new_tokens, seed=s)
        g = torch.Generator().manual_seed(100 + s)
        mask = gen.response_mask
        out.append({"tokens": gen.tokens, "response_mask": mask, "old_logprobs": gen.logprobs,
                    "advantages": torch.randn(B, generator=g),
                    "ref_logprobs": gen.logprobs + 0.1 * torch.randn(mask.shape, generator=g),
                    "returns": torch.rand(mask.shape, generator=g) * mask})
    return out


def trainer(kind: str, config, form: str = "rect", seed_model: int = 0, seed: int = 7):
    spec = SPEC if form == "rect" else RSPEC
    build = (lambda **kw: PackedTinyLM(spec, **kw)) if form == "ragged_kernel" else \
        (lambda **kw: build_model(spec, **kw))
    if kind == "actor":
        return ActorTrainer(build(seed=seed_model), config, seed=seed)
    return CriticTrainer(build(value_head=True, seed=seed_model), config, seed=seed)


def step(t, batch: dict) -> dict[str, float]:
    if isinstance(batch["tokens"], Ragged):
        if isinstance(t, ActorTrainer):
            return t.train_step(tokens=batch["tokens"], loss_mask=batch["loss_mask"],
                                old_logprobs=batch["old_logprobs"], advantages=batch["advantages"],
                                ref_logprobs=batch["ref_logprobs"])
        return t.train_step(tokens=batch["tokens"], loss_mask=batch["loss_mask"], returns=batch["returns"],
                            old_values=t.values(batch["tokens"]))
    if isinstance(t, ActorTrainer):
        return t.train_step(tokens=batch["tokens"], prompt_len=P, response_mask=batch["response_mask"],
                            old_logprobs=batch["old_logprobs"], advantages=batch["advantages"],
                            ref_logprobs=batch["ref_logprobs"])
    old = t.values(batch["tokens"], P)
    return t.train_step(tokens=batch["tokens"], prompt_len=P, response_mask=batch["response_mask"],
                        returns=batch["returns"], old_values=old)


def shard(batch: dict, rank: int, rows0: int) -> dict:
    """Rank 0 holds rows [0, rows0), rank 1 the rest: the batch is their concatenation in rank order."""
    sl = slice(0, rows0) if rank == 0 else slice(rows0, B)
    return {k: v.select(sl) if isinstance(v, Ragged) else v[sl] for k, v in batch.items()}


def main(out_dir: str) -> None:
    import torch.distributed as dist

    from flowrl.rl.parallel import full_state_items

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    data, out = {form: batches(form) for form in ("rect", "ragged")}, {}
    for name, (kind, config, rows0, form) in CASES.items():
        t = trainer(kind, config, form, seed_model=rank, seed=7 + 10 * rank)  # rank 0's weights and seed must win
        dummies = []
        real_dummy = t._dummy_pass
        t._dummy_pass = lambda: (dummies.append(1), real_dummy())  # count the passes a rank pads with
        metrics = [step(t, shard(b, rank, rows0)) for b in data["rect" if form == "rect" else "ragged"]]
        out[name] = {"params": {k: v.clone() for k, v in full_state_items(t.model)}, "metrics": metrics,
                     "dummy_passes": len(dummies)}

    # GAE advantages whitened over every rank's tokens
    from flowrl.rl import ppo_advantages
    from flowrl.rl.parallel import DataParallel

    sh = shard(data["rect"][0], rank, 5)
    adv, _ = ppo_advantages(sh["advantages"], sh["returns"], sh["response_mask"], all_sum=DataParallel().all_sum)
    out["whitened"] = adv
    from flowrl.rl import ppo_advantages_ragged

    sh = shard(data["ragged"][0], rank, 5)
    adv, _ = ppo_advantages_ragged(sh["scores"], sh["returns"], sh["loss_mask"], all_sum=DataParallel().all_sum)
    out["whitened_ragged"] = adv.values

    # full_state_items of a freshly sharded model is the unsharded model's state, bitwise
    plain = build_model(SPEC, seed=0)
    before = copy.deepcopy(plain.state_dict())
    sharded = ActorTrainer(plain, ActorConfig(), seed=0)
    out["fresh"] = {"expected": before, "items": [(k, v.clone()) for k, v in full_state_items(sharded.model)]}

    # checkpoint: save each rank's state after 2 steps, load into a new trainer, the 3rd step is bitwise equal
    for kind, config, rows0, form, name in [(*CASES["critic_token_mean"], "critic"),
                                            (*CASES["actor_token_mean"], "actor"),
                                            (*CASES["ragged_actor_token_mean"], "ragged_actor")]:
        a = trainer(kind, config, form)
        batches_ = data["rect" if form == "rect" else "ragged"]
        for b in batches_[:2]:
            step(a, shard(b, rank, rows0))
        path = os.path.join(out_dir, f"ckpt-{name}-{rank}.pt")
        torch.save(a.state_dict(), path)
        restored = trainer(kind, config, form, seed_model=5)
        restored.load_state_dict(torch.load(path, weights_only=True))
        ma, mb = step(a, shard(batches_[2], rank, rows0)), step(restored, shard(batches_[2], rank, rows0))
        same = all(torch.equal(x, y) for (_, x), (_, y) in zip(full_state_items(a.model),
                                                                 full_state_items(restored.model)))
        out[f"resume_{name}"] = {"bitwise": same, "metrics_equal": ma == mb, "steps": restored.steps}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    publish(out_dir, rank)
    dist.destroy_process_group()


def publish(out_dir: str, rank: int) -> None:
    import json

    import torch.distributed as dist

    from flowrl.rl.parallel import full_state_items
    from flowrl.rl.publish import FullState
    from flowrl.weights import WeightPublisher

    kind, config, rows0, _ = CASES["actor_token_mean"]
    t = trainer(kind, config)
    step(t, shard(batches()[0], rank, rows0))
    expected = {k: v.clone() for k, v in full_state_items(t.model)}
    view = FullState(t.model, serving_dtype="bfloat16")
    if rank == 0:
        torch.save({k: v.bfloat16() for k, v in expected.items()}, os.path.join(out_dir, "expected.pt"))
        pub = WeightPublisher(lambda: view, bucket_bytes=16 << 10, serving_dtype="bfloat16",
                              secret=os.environ["FLOWRL_TEST_SECRET"])
        pub.snapshot(1)
        try:  # out of order: refused before any collective, so the ranks stay in step
            view[view.gather_order[1]]
            refused = ""
        except RuntimeError as e:
            refused = str(e)
        print(json.dumps({"addr": pub.store_addr, "gathers": len(view.gather_order), "refused": refused}), flush=True)
        pub.serve(1, 2, timeout_s=30, ready_timeout_s=60)
        pub.close()
    else:
        view.drain()
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
