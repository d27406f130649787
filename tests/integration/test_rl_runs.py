"""PPO and GRPO for real, end to end, on CPU: the shipped graphs, shortened by overrides.

Each test runs the `flowrl run` command in a child process (`flowrl.testing.run_graph`) — every
role its own process, weights synced over gloo — and then reads what the run left behind:

- the reward rises (PPO, and GRPO on a smaller task and model so that it learns in seconds);
- the staleness bound holds for every consumed batch, read from the ledger (k = 0, 1, 2);
- a run resumed from its checkpoint continues exactly where it stopped: the next ticket indices,
  none repeated, every ticket consumed once over both halves, and the same rewards, step by step,
  as a run that was never interrupted;
- a tiny random Hugging Face causal LM trains in place of the built-in model in every model role.

The learning tests are seeded; their margins were checked over seeds 0-2:

    FLOWRL_RL_TEST_SEEDS=0,1,2 python -m pytest tests/integration/test_rl_runs.py -k learns
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

import pytest

from flowrl.testing import node_checkpoint, run_graph

ROOT = Path(__file__).resolve().parents[2]
PPO = ROOT / "graphs" / "ppo.yaml"
GRPO = ROOT / "graphs" / "grpo.yaml"
SEEDS = [int(s) for s in os.environ.get("FLOWRL_RL_TEST_SEEDS", "0").split(",")]

# GRPO's graph is the e2e benchmark's setting (6 digits, 2 x 128 model: ~200 steps to learn).
# For a test: 4-digit reversal and PPO's 1-layer, 64-wide model, which rise within ~30 steps.
SMALL_MODEL = "{type: tiny, d_model: 64, n_layers: 1, n_heads: 4}"
TASK_4 = "{name: reverse, digits: 4}"
GRPO_SMALL = ([f"nodes.{n}.config.model={SMALL_MODEL}" for n in ("rollout", "reference", "actor")]
              + [f"nodes.{n}.config.task={TASK_4}" for n in ("prompts", "reward")])
NO_CHECKPOINTS = "schedule.checkpoint_every=0"


def run_ok(graph, run_dir: Path, overrides=(), *, extra=(), timeout_s: float = 120.0):
    result = run_graph(graph, run_dir, overrides=list(overrides), extra=list(extra), timeout_s=timeout_s, cwd=ROOT)
    assert result.exit_code == 0, describe_failure(result)
    return result


def describe_failure(result) -> str:
    logs = result.run_dir / "logs"
    tails = []
    if logs.is_dir():
        for path in sorted(logs.iterdir()):
            text = path.read_text(errors="replace")
            if "Traceback" in text or "Error" in text:
                tails.append(f"--- {path.name}\n{text[-1500:]}")
    return f"exit {result.exit_code}\n--- stderr\n{result.stderr[-3000:]}\n" + "\n".join(tails)


def by_step(metrics: list[dict]) -> list[dict]:
    return sorted(metrics, key=lambda r: r["step"])


def ticket_index(ledger: list[dict]) -> dict[str, int]:
    """batch_id -> ticket index, from the `issued` rows (a reissue keeps its index)."""
    index: dict[str, int] = {}
    for r in ledger:
        if r["event"] in ("issued", "reissued") and "index" in r:
            assert index.setdefault(r["batch_id"], r["index"]) == r["index"], r
    return index


def consumed(ledger: list[dict]) -> list[tuple[int, dict]]:
    """(ticket index, consumed row) for every consumption, in ledger order."""
    index = ticket_index(ledger)
    return [(index[r["batch_id"]], r) for r in ledger if r["event"] == "consumed"]


def assert_exactly_once(result, steps: int) -> None:
    audit = result.audit()
    assert audit.exactly_once, f"lost {audit.lost}, duplicated {audit.duplicated}"
    assert len(audit.issued) == steps
    assert sorted(i for i, _ in consumed(result.ledger)) == list(range(steps))


def assert_staleness_bound(result, k: int) -> None:
    """Update n (ticket index n) trains on a batch generated with weights of version >= n - k."""
    pairs = consumed(result.ledger)
    assert pairs
    for i, row in pairs:
        v = row["policy_version"]
        assert 0 <= row["staleness"] <= k, (i, row)
        assert 0 <= i - v <= k, (i, row)
        if k == 0:
            assert v == i, (i, row)
    for m in result.metrics:
        assert m["staleness_max"] <= k, m


def assert_reward_rises(metrics: list[dict], steps: int, margin: float) -> None:
    rewards = [r["reward_mean"] for r in by_step(metrics)]
    assert len(rewards) == steps
    assert all(math.isfinite(x) for x in rewards)
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    curve = " ".join(f"{x:.2f}" for x in rewards)
    assert last >= first + margin, f"mean reward of the first 5 steps {first:.3f}, last 5 {last:.3f}: {curve}"


# 1-2. The reward rises --------------------------------------------------------------------------


@pytest.mark.timeout(150)
@pytest.mark.parametrize("seed", SEEDS)
def test_ppo_learns(tmp_path, seed):
    # Seeds 0-2: the first 5 steps average ~0.06, steps 31-35 ~0.35-0.5 (35 steps: ~20 s).
    steps = 35
    result = run_ok(PPO, tmp_path / "run", [f"seed={seed}", f"schedule.steps={steps}", "schedule.max_staleness=0",
                                            NO_CHECKPOINTS])
    assert_reward_rises(result.metrics, steps, margin=0.15)
    assert_exactly_once(result, steps)
    assert_staleness_bound(result, 0)
    rows = by_step(result.metrics)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in rows] == list(range(steps))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_learns(tmp_path, seed):
    # 4-digit reversal, small model, 8 prompts x 8 samples. Seeds 0-2: the first 5 steps average
    # ~0.06, steps 26-30 ~0.25 (30 steps: ~15 s).
    steps = 30
    result = run_ok(GRPO, tmp_path / "run", [f"seed={seed}", f"schedule.steps={steps}", "schedule.max_staleness=0",
                                             NO_CHECKPOINTS, *GRPO_SMALL])
    assert_reward_rises(result.metrics, steps, margin=0.1)
    assert_exactly_once(result, steps)
    assert_staleness_bound(result, 0)


# 3. The staleness bound, batch by batch ---------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("graph", "k"), [(PPO, 1), (PPO, 2), (GRPO, 1)], ids=["ppo-k1", "ppo-k2", "grpo-k1"])
def test_overlapped_run_never_trains_on_a_batch_staler_than_k(tmp_path, graph, k):
    steps = 12
    overrides = [f"schedule.steps={steps}", f"schedule.max_staleness={k}", NO_CHECKPOINTS]
    if graph == GRPO:
        overrides += GRPO_SMALL
    result = run_ok(graph, tmp_path / "run", overrides)
    assert_exactly_once(result, steps)
    assert_staleness_bound(result, k)
    # The pipeline did overlap: tickets 0..k are issued at once for version 0, and the rollout
    # generates ticket 1 long before batch 0 has gone through reward, reference, critic and actor.
    assert max(row["staleness"] for _, row in consumed(result.ledger)) >= 1
    issued = {r["index"]: r for r in result.ledger if r["event"] == "issued"}
    assert all(issued[i]["min_version"] >= i - k for i in issued)


# 4. Checkpoint and resume ------------------------------------------------------------------------


@pytest.mark.timeout(200)
def test_resume_continues_from_the_checkpoint_with_the_next_tickets_and_the_same_rewards(tmp_path):
    import torch

    first_steps, total = 8, 14
    common = ["schedule.checkpoint_every=5", "schedule.max_staleness=0"]
    run_dir = tmp_path / "run"
    first = run_ok(PPO, run_dir, [*common, f"schedule.steps={first_steps}"])
    ckpts = run_dir / "checkpoints"
    latest = json.loads((ckpts / "latest.json").read_text())
    assert latest["step"] == first_steps  # every 5 steps and at the end
    assert (ckpts / "step00000005" / "commit.json").exists()
    actor_before = node_checkpoint(run_dir, "actor")
    assert actor_before["step"] == first_steps
    issued_before = [r for r in first.ledger if r["event"] == "issued"]

    # The graph argument is required by the CLI; on --resume the run directory's graph.yaml is used.
    resumed = run_ok(PPO, run_dir, extra=["--resume", str(run_dir), "--steps", str(total)])

    # Exactly once over the whole run, both halves.
    ledger = resumed.ledger
    assert_exactly_once(resumed, total)
    assert_staleness_bound(resumed, 0)
    marks = [i for i, r in enumerate(ledger) if r["event"] == "resumed"]
    assert len(marks) == 1 and ledger[marks[0]]["step"] == first_steps
    before, after = ledger[:marks[0]], ledger[marks[0] + 1:]
    assert [r for r in before if r["event"] == "issued"] == issued_before
    # The data cursor was restored: after the checkpoint come the next indices, none repeated.
    issued_after = [r for r in after if r["event"] in ("issued", "reissued")]
    assert [r["index"] for r in issued_after] == list(range(first_steps, total))
    assert all(r["event"] == "issued" and r["attempt"] == 0 for r in issued_after)
    assert not {r["batch_id"] for r in issued_after} & {r["batch_id"] for r in issued_before}
    assert not any(r["event"] == "rolled_back" for r in ledger)  # it stopped on its checkpoint

    # The actor's checkpoint advanced.
    latest = json.loads((ckpts / "latest.json").read_text())
    assert latest["step"] == total
    actor_after = node_checkpoint(run_dir, "actor")
    assert actor_after["step"] == total > actor_before["step"]
    assert actor_after["version"] == total
    assert (ckpts / "step00000010" / "commit.json").exists()  # keep_checkpoints=2: 10 and 14 stay
    assert not (ckpts / "step00000005").exists()
    changed = [k for k, v in actor_after["node"]["model"].items()
               if not torch.equal(v, actor_before["node"]["model"][k])]
    assert changed, "the resumed actor did not train"

    # The metrics continue: one row per step over both halves.
    rows = by_step(resumed.metrics)
    assert [r["step"] for r in rows] == list(range(1, total + 1))

    # And the resumed run is the run that was never interrupted: same prompts (data cursor), same
    # sampling, same model and optimizer state, hence the same reward at every step.
    straight = run_ok(PPO, tmp_path / "straight", [*common, f"schedule.steps={total}"])
    expect = [r["reward_mean"] for r in by_step(straight.metrics)]
    got = [r["reward_mean"] for r in rows]
    assert got == pytest.approx(expect, abs=1e-6)


# 5. A Hugging Face model in every model role -----------------------------------------------------


@pytest.mark.timeout(150)
def test_ppo_runs_with_a_tiny_hugging_face_model_in_every_model_role(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from flowrl.tasks import VOCAB_SIZE

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    assert config.vocab_size >= 18  # the task vocabulary
    torch.manual_seed(0)
    model_dir = tmp_path / "tiny-llama"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)

    steps = 3
    spec = '{type: hf, path: "%s"}' % model_dir.as_posix()
    overrides = [f"nodes.{n}.config.model={spec}" for n in ("rollout", "reference", "critic", "actor")]
    overrides += [f"schedule.steps={steps}", "schedule.batch_size=8", "schedule.max_staleness=0"]
    result = run_ok(PPO, tmp_path / "run", overrides, timeout_s=140)

    assert_exactly_once(result, steps)
    assert_staleness_bound(result, 0)  # weights went actor -> rollout at every version
    rows = by_step(result.metrics)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(math.isfinite(r["reward_mean"]) and r["samples"] == 8 * 4 for r in rows)
    import yaml

    resolved = yaml.safe_load((result.run_dir / "graph.yaml").read_text())
    for n in ("rollout", "reference", "critic", "actor"):
        assert resolved["nodes"][n]["config"]["model"]["type"] == "hf", n
    # The trained checkpoint is the Hugging Face model's (its parameter names), and it trained.
    actor = node_checkpoint(result.run_dir, "actor")
    names = list(actor["node"]["model"])
    assert any("self_attn" in k for k in names), names[:5]
    fresh = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    moved = [k for k, v in actor["node"]["model"].items()
             if k.split(".", 1)[-1] in fresh and not torch.equal(v.cpu(), fresh[k.split(".", 1)[-1]])]
    assert moved, "the actor's Hugging Face weights did not change"
