"""The agent node: a ticket's episodes, the batch layout GRPO and the actor take, metrics, replay."""

from __future__ import annotations

import anyio
import pytest
import torch

import flowrl
from flowrl.agents.base import Trajectory
from flowrl.agents.batch import trajectories_to_batch
from flowrl.graph.kinds import resolve_kind
from flowrl.node import Ticket
from flowrl.nodes.agent import Agent
from tests.agents.fakes import ScriptedGen
from tests.node_harness import call, make_node, metrics_row

MODEL = {"type": "tiny", "vocab_size": 102, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}


def agent(config: dict, gen, **kw):
    node = make_node(Agent, {"model": MODEL, **config}, name="agent", **kw)
    node.ctx.services = {"rollout": gen}
    return node


def engine_gen():
    from flowrl.agents.local import EngineGenerator
    from flowrl.engines import build_engine

    engine = build_engine({"type": "builtin", "continuous": True, "max_num_seqs": 32}, model=MODEL, seed=0)
    return EngineGenerator(engine), engine


def test_the_agent_kind_is_built_in():
    assert resolve_kind("agent") is Agent


def test_the_config_takes_an_env_or_agent_code_not_both():
    with pytest.raises(ValueError, match="exactly one of `env`"):
        Agent.Config.model_validate({"model": MODEL})
    with pytest.raises(ValueError, match="exactly one of `env`"):
        Agent.Config.model_validate({"model": MODEL, "env": "calc", "agent": "m:f"})
    with pytest.raises(ValueError):
        Agent.Config.model_validate({"model": MODEL, "env": "calc", "max_turn": 3})  # a typo is refused


@pytest.mark.timeout(60)
def test_a_ticket_runs_size_tasks_times_n_episodes_into_a_grpo_batch(tmp_path):
    gen, engine = engine_gen()
    node = agent({"env": "calc", "samples_per_prompt": 3, "max_turns": 3, "max_tokens": 64, "max_new_tokens": 8},
                 gen, run_dir=tmp_path)
    ticket = Ticket(batch_id="b5", index=5, attempt=0, min_policy_version=0, size=2)
    batch = call(node.generate, ticket)
    t = batch.tensors
    assert t["tokens"].num_samples == 6 and t["scores"].shape == (6,) and batch.meta["samples_per_prompt"] == 3
    assert t["loss_mask"].aligned(t["tokens"]) and t["logprobs"].aligned(t["tokens"])
    assert t["versions"].aligned(t["tokens"])
    assert t["tokens"].values.dtype == torch.int64 and t["loss_mask"].values.dtype == torch.bool
    assert t["logprobs"].values.dtype == torch.float32 and t["versions"].values.dtype == torch.int64
    assert batch.meta["temperature"] == 1.0 and sum(batch.meta["finishes"].values()) == 6
    assert batch.meta["tokenizer"] == {"type": "char"}
    assert (t["versions"].values[~t["loss_mask"].values] == -1).all()
    assert int(t["tokens"].lengths.max()) <= 64
    # a group shares its task: the same first prompt for the 3 samples of each task, another task after
    prompts = [t["tokens"][i][: int(t["prompt_lens"][i])].tolist() for i in range(6)]
    assert prompts[0] == prompts[1] == prompts[2] and prompts[3] == prompts[5] and prompts[0] != prompts[3]
    from flowrl.agents.envs import CalcEnv

    assert prompts[0][1:-1] == flowrl.data.tokenizer.CharTokenizer().encode(
        CalcEnv().reset({"index": 10, "seed": 0}))[1:]  # task index = ticket.index * size + i
    row = metrics_row(node, tmp_path)
    assert row["episodes"] == 6 and sum(v for k, v in row.items() if k.startswith("episodes_")) == 6
    engine.close()


def test_the_batch_trains_through_group_advantages_and_the_actor():
    from flowrl.rl import ActorConfig, ActorTrainer
    from flowrl.models import build_model
    from flowrl.nodes.advantages import GroupAdvantages

    def traj(tokens, mask, reward):  # multi-turn: holes in the loss mask
        return Trajectory(tokens=tokens, mask=mask, logprobs=[-1.0 if m else 0.0 for m in mask],
                          versions=[4 if m else -1 for m in mask], prompt_len=2, reward=reward, turns=2)

    m = [False, False, True, True, False, False, True, True]
    trajs = [traj([12, 1, 2, 13, 3, 4, 5, 13], m, 1.0), traj([12, 1, 7, 13, 3, 4, 9, 9], m, 0.0),
             traj([12, 2, 5, 13, 3], m[:5], 0.5), traj([12, 2, 5, 13, 3, 1, 1], m[:7], 0.5)]
    batch = trajectories_to_batch(trajs, 2, 1.0, 1.0)
    assert batch.policy_version == 4
    node = GroupAdvantages(GroupAdvantages.Config(), type("Ctx", (), {"name": "advantages"})())
    out = anyio.run(node.process, batch, "in")
    adv = out.tensors["advantages"]
    assert adv.aligned(batch.tensors["tokens"])
    a0 = adv[0].tolist()
    assert a0[0] == 0 and a0[4] == 0 and a0[2] > 0 and a0[6] > 0  # only the model's tokens carry advantage
    assert adv[2].abs().sum() == 0  # a group whose samples scored alike learns nothing
    spec = {**MODEL, "vocab_size": 18}
    trainer = ActorTrainer(build_model(spec, seed=0), ActorConfig(lr=1e-3), seed=0)
    t = out.tensors
    metrics = trainer.train_step(tokens=t["tokens"].to_torch(), loss_mask=t["loss_mask"].to_torch(),
                                 old_logprobs=t["logprobs"].to_torch(), advantages=t["advantages"].to_torch(),
                                 temperature=1.0)
    assert torch.isfinite(torch.tensor(metrics["policy_loss"]))


def test_the_actor_node_trains_on_an_agent_batch(tmp_path):
    from flowrl.nodes.actor import Actor
    from flowrl.nodes.advantages import GroupAdvantages

    gen = ScriptedGen([[5, 6], [7]], stop=13)
    node = agent({"env": "guess", "samples_per_prompt": 2, "max_turns": 3, "max_tokens": 40, "max_new_tokens": 3},
                 gen)
    batch = call(node.generate, Ticket(batch_id="b0", index=0, attempt=0, min_policy_version=0, size=2))
    assert batch.policy_version == 3 and (batch.tensors["turns"] >= 1).all()
    adv = make_node(GroupAdvantages, {}, name="advantages")
    batch = call(adv.process, batch, "in")
    actor = make_node(Actor, {"model": MODEL, "train": {"lr": 1e-3}}, name="actor")
    call(actor.process, batch, "in")
    row = metrics_row(actor, tmp_path)
    assert any("policy_loss" in k for k in row)


def test_a_replayed_ticket_plays_the_same_episodes_and_sessions_name_the_attempt():
    seen = []

    class Recording(ScriptedGen):
        async def complete(self, prompt, *, session, seed=0, **kw):
            seen.append((session, seed, tuple(prompt)))
            return await super().complete(prompt, session=session, seed=seed, **kw)

    node = agent({"env": "guess", "samples_per_prompt": 2, "max_turns": 2}, Recording([[1]], stop=13))
    ticket = Ticket(batch_id="b3", index=3, attempt=0, min_policy_version=0, size=2)
    first = call(node.generate, ticket)
    n = len(seen)
    again = call(node.generate, Ticket(batch_id="b3", index=3, attempt=1, min_policy_version=0, size=2))
    assert torch.equal(first.tensors["tokens"].values, again.tensors["tokens"].values)
    assert [s[1:] for s in seen[:n]] == [s[1:] for s in seen[n:]]  # same seeds, same prompts
    assert {s[0] for s in seen[:n]} == {f"b3:0:{e}" for e in range(4)}
    assert {s[0] for s in seen[n:]} == {f"b3:1:{e}" for e in range(4)}


def test_an_episode_budget_beyond_the_context_is_refused_at_setup():
    with pytest.raises(ValueError, match="max_tokens=100 is more than the model's context of 64"):
        make_node(Agent, {"model": MODEL, "env": "calc", "max_tokens": 100}, name="agent")


def test_a_node_without_the_service_says_how_to_declare_it():
    node = make_node(Agent, {"model": MODEL, "env": "calc"}, name="agent")
    with pytest.raises(ValueError, match=r"services: \[agent -> rollout\]"):
        call(node.generate, Ticket(batch_id="b0", index=0, attempt=0, min_policy_version=0, size=1))


def test_metrics_count_episodes_by_finish_and_spans_are_recorded(tmp_path):
    node = agent({"env": "guess", "samples_per_prompt": 2, "max_turns": 2}, ScriptedGen([[1]], stop=13))
    call(node.generate, Ticket(batch_id="b0", index=0, attempt=0, min_policy_version=0, size=2))
    drained = node.ctx.recorder.drain()
    text = repr(drained)
    for name in ("episodes", "episode_turns", "episode_tool_calls", "env_step_s", "episode_reward", "'episode'",
                 "'turn'"):
        assert name in text, name
    assert "episodes_done" in text or "episodes_max_turns" in text


@pytest.mark.timeout(60)
def test_the_learning_benchmark_runs_a_step_of_each_task(capsys):
    from benchmarks.agent_learn import main

    for env in ("calc", "guess"):
        assert main(["--env", env, "--steps", "2", "--tasks", "2", "--samples", "2", "--d-model", "32",
                     "--n-layers", "1", "--kl", "0.01", "--positions", "rope", "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("step    2") == 2 and "reward" in out


def test_the_reference_node_takes_an_agent_batch_and_the_sampling_temperature_travels_with_it():
    from flowrl.nodes.reference import Reference

    gen = ScriptedGen([[5, 6], [7]], stop=13)
    node = agent({"env": "guess", "samples_per_prompt": 2, "max_turns": 3, "max_tokens": 40}, gen)
    batch = call(node.generate, Ticket(batch_id="b0", index=0, attempt=0, min_policy_version=0, size=1))
    assert batch.meta["temperature"] == 1.0 and batch.meta["top_p"] == 1.0  # what ScriptedGen's completions say
    ref = make_node(Reference, {"model": MODEL}, name="reference")
    out = call(ref.process, batch, "in")
    assert out.tensors["ref_logprobs"].aligned(batch.tensors["tokens"])


def test_a_batch_takes_the_temperature_its_episodes_were_sampled_at():
    t = Trajectory(tokens=[12, 1], mask=[False, True], logprobs=[0.0, -1.0], versions=[-1, 0], prompt_len=1)
    hot = Trajectory(**{**t.__dict__, "info": {"temperature": 0.7, "top_p": 0.9}})
    batch = trajectories_to_batch([hot, hot], 2, extra_meta={"x": 1})
    assert (batch.meta["temperature"], batch.meta["top_p"], batch.meta["x"]) == (0.7, 0.9, 1)
    assert trajectories_to_batch([t, t], 2, 0.5, 1.0).meta["temperature"] == 0.5
    cold = Trajectory(**{**t.__dict__, "info": {"temperature": 0.1}})
    with pytest.raises(ValueError, match="different temperature"):
        trajectories_to_batch([hot, cold], 2)
    with pytest.raises(ValueError, match="groups of samples_per_prompt=2"):
        trajectories_to_batch([t, t, t], 2)


def test_an_agent_temperature_other_than_the_rollouts_is_an_error():
    node = agent({"env": "guess", "samples_per_prompt": 2, "max_turns": 2, "temperature": 0.5}, ScriptedGen([[1]], stop=13))
    with pytest.raises(ValueError, match="the rollout sampled at temperature=1.0"):
        call(node.generate, Ticket(batch_id="b0", index=0, attempt=0, min_policy_version=0, size=1))
