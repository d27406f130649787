"""LoRA across data parallel: 2 real ranks (gloo, FSDP2) make the adapter updates 1 rank makes on the whole batch.

The ranks run ``tests/models/lora_dp_case.py``; the test runs the same LoRA actor here, on one rank,
on the concatenated batches, and compares the adapters after every step, the metrics, what the
sharded actor publishes (adapters only, gathered) and a resume from each rank's own checkpoint.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models import lora_dp_case as case

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(hf_model_dir, tmp_path_factory) -> list[dict]:
    out, port = tmp_path_factory.mktemp("lora-dp"), _free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.models.lora_dp_case", hf_model_dir, str(out)],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        logs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, logs):
        assert p.returncode == 0, err[-3000:]
    results = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for r, result in enumerate(results):
        result["checkpoint"] = out / f"ckpt-{r}.pt"  # this rank's trainer state after STEPS steps
    return results


@pytest.fixture(scope="module")
def one_rank(hf_model_dir) -> dict:
    from flowrl.models.lora import adapter_weights

    torch.set_num_threads(1)
    t = case.trainer(hf_model_dir, seed=7)  # rank 0's seed (lora_dp_case.main)
    params, metrics = [], []
    for b in case.batches(hf_model_dir)[:case.STEPS]:
        metrics.append(case.step(t, b))
        params.append({k: v.clone() for k, v in t.model.state_dict().items() if ".lora_" in k})
    return {"params": params, "metrics": metrics, "published": adapter_weights(t.model), "model": t.model.eval()}


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.timeout(300)
def test_two_ranks_make_the_one_rank_adapter_updates_step_by_step(ranks, one_rank):
    for r in ranks:
        for s, (got, want) in enumerate(zip(r["params"], one_rank["params"])):
            assert got.keys() == want.keys() and len(want) == 2 * 4 * 2  # A, B x 4 targets x 2 layers
            for k in want:
                err = _relative_error(got[k], want[k])
                assert err < 1e-5, f"{k} differs by {err:.2e} relative after step {s + 1}"
    moved = [k for k in one_rank["params"][-1] if ".lora_B." in k]
    assert all(float(one_rank["params"][-1][k].abs().max()) > 1e-3 for k in moved)  # B left zero: they trained


@pytest.mark.timeout(300)
def test_metrics_with_the_reference_from_the_base_are_reduced_over_all_ranks(ranks, one_rank):
    for r in ranks:
        for got, want in zip(r["metrics"], one_rank["metrics"]):
            assert got.keys() == want.keys() and "kl" in want
            for k in want:
                assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-5), k
    assert one_rank["metrics"][-1]["kl"] > 0


@pytest.mark.timeout(300)
def test_the_sharded_actor_publishes_only_the_gathered_adapters(ranks, one_rank):
    got, want = ranks[0]["published"], one_rank["published"]
    assert ranks[0]["gathers"] == len(want) and got.keys() == want.keys()  # every tensor was sharded, then gathered
    assert all(k.endswith((".lora_A", ".lora_B")) for k in got)
    for k in want:
        assert _relative_error(got[k], want[k]) < 1e-5, k


@pytest.mark.timeout(300)
def test_each_rank_resumes_bitwise_from_its_own_adapter_checkpoint(ranks):
    for r in ranks:
        assert r["resume"]["bitwise"] and r["resume"]["metrics_equal"]
        assert r["resume"]["saved_keys"] and all(".lora_" in k for k in r["resume"]["saved_keys"])


@pytest.mark.timeout(300)
def test_export_joins_the_ranks_adapter_shards(ranks, one_rank, hf_model_dir, tmp_path):
    """A run whose actor had `devices: 2` saved one shard file per rank; both exports make them whole."""
    import json

    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from flowrl.cli import main

    run = tmp_path / "run"
    (run / "checkpoints" / "step00000003").mkdir(parents=True)
    lora = case.CONFIG.lora.model_dump(mode="json")
    (run / "graph.yaml").write_text(
        f"name: t\nnodes:\n  actor: {{kind: actor, devices: 2, config: {{model: {{type: hf, path: '{hf_model_dir}'}}, "
        f"train: {{kl_loss_coef: 0.1, lora: {json.dumps(lora)}}}}}}}\n")
    files = {}
    for r in range(WORLD):  # the runtime's layout (flowrl/runtime/protocol/checkpoints.py)
        files[f"actor/0/{r}"] = name = f"step00000003/actor.0.{r}.e0.pt"
        state = torch.load(ranks[r]["checkpoint"], weights_only=True)
        assert state["ranks"] == [r, WORLD]
        torch.save({"node": state, "version": 3, "step": 3, "epoch": 0}, run / "checkpoints" / name)
    for f in ("step00000003/commit.json", "latest.json"):
        (run / "checkpoints" / f).write_text(json.dumps({"step": 3, "files": files}))
    assert main(["export", str(run), "--adapter", str(tmp_path / "adapter")]) == 0
    assert main(["export", str(run), "--hf", str(tmp_path / "merged")]) == 0
    tokens = torch.randint(0, 18, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = one_rank["model"](tokens)
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir)
        loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        for got in (loaded(tokens).logits, merged(tokens).logits):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
