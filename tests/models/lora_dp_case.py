"""LoRA data-parallel case, run by each rank (``python -m tests.models.lora_dp_case BASE OUT``) and by the test.

Every rank joins a gloo group with the env a node rank gets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
trains a LoRA actor on its shard of the same batches (no reference log-probs in them: the actor takes
them from its base, ``reference_from_base``), and saves to ``OUT/rank{r}.pt``: the unsharded adapters
after each step, the metrics, what ``FullState(model, state=adapter_weights)`` publishes (rank 0
gathers, rank 1 drains), and whether a resume from its own checkpoint makes the next step bitwise.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch

from flowrl.models import build_model
from flowrl.rl import ActorConfig, ActorTrainer, LoraConfig
from flowrl.transport.ragged import Ragged
from tests.rl.batches import random_batch

B, ROWS0, STEPS = 12, 5, 3
CONFIG = ActorConfig(lr=1e-2, epochs=2, mini_batches=2, kl_loss_coef=0.1, entropy_coef=0.01,
                     max_tokens_per_microbatch=24,
                     lora=LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj", "up_proj"),
                                     reference_from_base=True))


def batches(base: str) -> list[dict]:
    model = build_model({"type": "hf", "path": base})
    return [random_batch(model, B, seed=s, response=(1, 14), holes=True) for s in range(STEPS + 1)]


def trainer(base: str, seed: int = 0) -> ActorTrainer:
    return ActorTrainer(build_model({"type": "hf", "path": base}), CONFIG, seed=seed)


def step(t: ActorTrainer, b: dict) -> dict[str, float]:
    return t.train_step(tokens=b["tokens"], loss_mask=b["loss_mask"], old_logprobs=b["old_logprobs"],
                        advantages=b["advantages"])  # no ref_logprobs: the base gives them


def shard(b: dict, rank: int) -> dict:
    sl = slice(0, ROWS0) if rank == 0 else slice(ROWS0, B)
    return {k: v.select(sl) if isinstance(v, Ragged) else v[sl] for k, v in b.items()}


def adapters(t: ActorTrainer) -> dict[str, torch.Tensor]:
    """The unsharded adapter parameters (a collective: every rank calls it)."""
    from flowrl.rl.parallel import full_state_items

    return {k: v.clone() for k, v in full_state_items(t.model) if ".lora_" in k}


def main(base: str, out_dir: str) -> None:
    import torch.distributed as dist

    from flowrl.models.lora import adapter_weights
    from flowrl.rl.publish import FullState

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    data = batches(base)
    t = trainer(base, seed=7 + 10 * rank)  # rank 0's adapter init and shuffling seed must win
    out: dict = {"params": [], "metrics": []}
    for b in data[:STEPS]:
        out["metrics"].append(step(t, shard(b, rank)))
        out["params"].append(adapters(t))

    view = FullState(t.model, state=adapter_weights)
    if rank == 0:
        out["published"] = {name: view[name].clone() for name in view.gather_order}
        out["gathers"] = len(view.gather_order)
    else:
        view.drain()

    path = os.path.join(out_dir, f"ckpt-{rank}.pt")
    torch.save(t.state_dict(), path)
    restored = trainer(base, seed=3)
    restored.load_state_dict(torch.load(path, weights_only=True))
    ma, mb = step(t, shard(data[STEPS], rank)), step(restored, shard(data[STEPS], rank))
    a, b = adapters(t), adapters(restored)
    out["resume"] = {"bitwise": all(torch.equal(a[k], b[k]) for k in a), "metrics_equal": ma == mb,
                     "saved_keys": sorted(torch.load(path, weights_only=True)["model"])}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
