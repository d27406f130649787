"""A LoRA actor feeding a vLLM rollout that serves its adapters (``lora: serve``), for real (skipped
without vllm or peft): graphs/grpo-vllm.yaml with ``train.lora`` on the actor, every role its own
process; each step's adapter version travels alone (adapter tensors only) and lands in vLLM's LoRA
slot, and the engine samples what the trainer computes (base + adapters) at every version.

    python -m pytest tests/engines/test_grpo_vllm_lora.py      # in the vLLM environment
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")

from flowrl.testing import run_graph  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GRAPH = ROOT / "graphs" / "grpo-vllm.yaml"


@pytest.mark.timeout(480)
def test_a_lora_actor_syncs_adapter_versions_into_a_vllm_engine_that_serves_them(tmp_path, tiny_llama):
    steps = 4
    model = '{type: hf, path: "%s"}' % Path(tiny_llama).as_posix()
    overrides = [f"nodes.{n}.config.model={model}" for n in ("rollout", "reference", "actor")]
    overrides += [
        "nodes.rollout.config.engine={type: vllm, kv_cache_memory_bytes: 67108864, max_model_len: 64, "
        "lora: serve, max_lora_rank: 8}",
        "nodes.actor.config.train.lora={r: 4, alpha: 8, target_modules: [q_proj, k_proj, v_proj, o_proj]}",
        "nodes.actor.config.train.lr=0.05",  # big adapter steps: an adapter not served would show below
        "supervision.deadline_s=30",  # a shared CPU may starve a node's heartbeat for 5 s; hangs are not the point
        "seed=0", f"schedule.steps={steps}", "schedule.batch_size=4", "schedule.checkpoint_every=0",
    ]
    # the vLLM engine's start alone took 60 s to 150 s on the 2-core machine, depending on the day
    result = run_graph(GRAPH, tmp_path / "run", overrides=overrides, timeout_s=450, cwd=ROOT)
    assert result.exit_code == 0, result.stderr[-3000:] + result.log("rollout")[-3000:]
    restarts = [r for r in result.ledger if r["event"] in ("node_down", "reissued", "recovery")]
    assert restarts == [], (restarts[:3], {n: result.log(n)[-1500:] for n in {r.get("node", "").split("/")[0] for r in restarts} if n})  # fault-free
    rows = sorted(result.metrics, key=lambda r: r["step"])
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in rows] == list(range(steps))  # a new adapter version every step
    # vLLM (base + served adapter) vs the trainer (base + peft adapters), float32 both sides
    assert all(r["mismatch_logprob_abs_max"] < 1e-4 for r in rows), [r["mismatch_logprob_abs_max"] for r in rows]
    assert result.audit().exactly_once
