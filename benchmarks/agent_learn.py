"""Agentic GRPO in one process: the built-in tiny model learns a multi-turn task from random weights.

    python benchmarks/agent_learn.py --env calc      # the settings of graphs/agent-tools.yaml
    python benchmarks/agent_learn.py --env guess --steps 700 --target 2 --show 100

Exactly the agent node's pieces, without processes: every episode of a step runs concurrently
(``run_episode``) against an :class:`~flowrl.agents.local.EngineGenerator` over a continuous
built-in engine (the episodes' turns share its decode batch, as requests to a rollout replica
do); ``trajectories_to_batch`` lays them out as the agent node emits them; the
``group_advantages`` node's code and the actor's trainer train on that batch; the new weights
are loaded into the engine. One line per step: step, seconds, batch-mean reward, turns and tool
calls per episode, model tokens per episode, finishes. The defaults are the settings found here
(the ones in graphs/agent-tools.yaml): on 2 CPU cores ``--env calc`` reaches a 10-step mean reward
of 0.9 at step ~280 (about 2 minutes) and holds 0.95-0.99 after; ``--env guess --lr 1e-3
--entropy 0.01`` at step ~520 (2.5 minutes). Runs are not bitwise repeatable: the continuous
engine's draws depend on which episodes share an iteration.
"""

from __future__ import annotations

import argparse
import json
import asyncio
import copy
import time
from types import SimpleNamespace

import torch

from flowrl.agents.batch import trajectories_to_batch
from flowrl.agents.chat import chat_format
from flowrl.agents.episode import EpisodeLimits, run_episode
from flowrl.agents.local import EngineGenerator
from flowrl.agents.tools import Tools
from flowrl.engines import build_engine
from flowrl.models import TinyLMSpec, build_model
from flowrl.models.packing import packed_logprobs
from flowrl.rl import ActorConfig, ActorTrainer
from flowrl.agents.envs import resolve_env


async def train(args) -> list[dict]:
    from flowrl.nodes.advantages import GroupAdvantages

    spec = TinyLMSpec(vocab_size=102, d_model=args.d_model, n_layers=args.n_layers, n_heads=4,
                      max_seq_len=args.max_tokens, positions=args.positions,
                      tie_embeddings=args.tie)
    engine = build_engine({"type": "builtin", "continuous": True, "max_num_seqs": args.tasks * args.samples},
                          model=spec, seed=args.seed)
    actor = ActorTrainer(build_model(spec, seed=args.seed),  # the same seed: bitwise the engine's weights
                         ActorConfig(lr=args.lr, mini_batches=args.mini_batches, entropy_coef=args.entropy,
                                     kl_loss_coef=args.kl, kl_loss_kind="k3"),
                         seed=args.seed)
    reference = copy.deepcopy(actor.model).requires_grad_(False).eval() if args.kl else None
    adv_node = GroupAdvantages(GroupAdvantages.Config(), SimpleNamespace(name="advantages"))
    env_cls = resolve_env(args.env)
    fmt = chat_format(spec)
    tools = Tools(env_cls.tools)
    gen = EngineGenerator(engine, temperature=1.0)
    limits = EpisodeLimits(max_turns=args.max_turns, max_tokens=args.max_tokens, deadline_s=60)
    rows, t0 = [], time.perf_counter()
    for step in range(args.steps):
        eps = []
        for i in range(args.tasks):
            index = step * args.tasks + i
            for s in range(args.samples):
                task = {"index": index, "sample": s, "seed": args.seed, "ticket": f"t{step}"}
                eps.append(run_episode(env_cls(**args.env_config), task, gen, fmt, limits=limits, tools=tools,
                                       session=f"t{step}:0:{i * args.samples + s}", min_version=step,
                                       seed=index * 1000 + s, max_new_tokens=args.max_new_tokens))
        trajs = await asyncio.gather(*eps)
        batch = trajectories_to_batch(trajs, args.samples, 1.0, 1.0)
        batch = await adv_node.process(batch, "in")
        t = batch.tensors
        ref = None
        if reference is not None:  # what the reference node adds: the initial policy's log-probs
            ref = packed_logprobs(reference, t["tokens"].to_torch(), temperature=1.0, where="reference")
        metrics = actor.train_step(tokens=t["tokens"].to_torch(), loss_mask=t["loss_mask"].to_torch(),
                                   old_logprobs=t["logprobs"].to_torch(), advantages=t["advantages"].to_torch(),
                                   ref_logprobs=ref, temperature=1.0)
        engine.load_weights(actor.model.state_dict().items(), version=step + 1)
        row = {"step": step + 1, "wall_s": time.perf_counter() - t0, "reward": float(t["scores"].mean()),
               "turns": float(t["turns"].float().mean()), "tool_calls": float(t["tool_calls"].float().mean()),
               "model_tokens": float(t["loss_mask"].values.sum()) / len(trajs),
               "entropy": metrics.get("entropy", float("nan")), "finishes": batch.meta["finishes"],
               "mismatch": metrics.get("mismatch_logprob_abs_mean", float("nan"))}
        rows.append(row)
        row["avg10"] = sum(r["reward"] for r in rows[-10:]) / len(rows[-10:])
        print(f"step {row['step']:4d} {row['wall_s']:7.1f}s reward {row['reward']:.3f} avg10 {row['avg10']:.3f} turns {row['turns']:.2f} "
              f"tools {row['tool_calls']:.2f} model_tok {row['model_tokens']:.1f} "
              f"entropy {row['entropy']:.3f} mismatch {row['mismatch']:.1e} {row['finishes']}", flush=True)
        if args.show and step % args.show == 0:
            for traj in trajs[: 2]:
                print("    ", show(traj), traj.reward, flush=True)
        recent = rows[-args.window:]
        if len(recent) == args.window and sum(r["reward"] for r in recent) / args.window >= args.target:
            break
    engine.close()
    return rows


def show(traj) -> str:
    """The episode as text: the model's turns in brackets, EOS as $."""
    from flowrl.data.tokenizer import CHAR_IDS
    from flowrl.tasks import BOS, EOS

    chars = {i: c for c, i in CHAR_IDS.items()} | {EOS: "$", BOS: "^"}
    out, model = [], False
    for tok, m in zip(traj.tokens, traj.mask):
        if m != model:
            out.append("[" if m else "]")
            model = m
        out.append(chars.get(tok, "?").replace("\n", "|"))
    return "".join(out) + ("]" if model else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="calc")
    p.add_argument("--env-config", type=json.loads, default={}, help='JSON, e.g. {"call_weight": 0.4}')
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--tasks", type=int, default=8, help="tasks per step (the ticket's size)")
    p.add_argument("--samples", type=int, default=8, help="episodes per task (GRPO group)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--mini-batches", type=int, default=4)
    p.add_argument("--entropy", type=float, default=0.03)
    p.add_argument("--kl", type=float, default=0.01, help="k3 KL loss against the initial policy (a reference node)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--tie", action="store_true", help="tie the input and output embeddings (copying is easier)")
    p.add_argument("--positions", default="learned", choices=("learned", "rope"))
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=1, help="per turn: 1 = one character a turn")
    p.add_argument("--target", type=float, default=0.9, help="stop once the mean over --window steps reaches it")
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=0, help="print two episodes every this many steps")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    asyncio.run(train(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
