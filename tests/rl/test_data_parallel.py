"""Data-parallel trainers: 2 real processes in a gloo group make the update 1 rank makes on the whole batch.

The ranks run ``tests/rl/dp_cases.py`` once (module fixture: every case, then a publish to a
subscriber here); each test compares what they saved with a plain 1-rank trainer run here on the
concatenated batches.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl.rl.parallel import local_rows
from tests.rl import dp_cases
from tests.rl.batches import comparable

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ranks(out: Path, secret: str) -> list[subprocess.Popen]:
    """The ranks of one data-parallel node, with the env the worker gives them."""
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FLOWRL_TEST_SECRET": secret}
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.rl.dp_cases", str(out)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _finish(procs: list[subprocess.Popen], timeout: float = 150) -> None:
    try:
        logs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, logs):
        assert p.returncode == 0, err[-3000:]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every case on 2 ranks, then their publish to a subscriber here (rank 1 of weight-sync epoch 1)."""
    import json
    import secrets

    from flowrl.models import build_model
    from flowrl.weights import WeightSubscriber

    out, secret = tmp_path_factory.mktemp("dp"), secrets.token_hex(16)
    procs = _start_ranks(out, secret)
    try:
        hello = json.loads(procs[0].stdout.readline() or "null")  # printed once the snapshot is packed
        assert hello, procs[0].stderr.read()[-3000:]
        live = {k: v.bfloat16() for k, v in build_model(dp_cases.SPEC, seed=3).state_dict().items()}
        sub = WeightSubscriber(live, bucket_bytes=16 << 10, version=0)
        sub.join(1, 1, 2, tuple(hello["addr"]), secret, timeout_s=30, ready_timeout_s=60)
        received = sub.receive()
        sub.close()
    finally:
        _finish(procs)
    results = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    results[0]["published"] = {"hello": hello, "received": received, "live": live,
                               "expected": torch.load(out / "expected.pt", weights_only=True)}
    return results


@pytest.fixture(scope="module")
def reference() -> dict[str, dict]:
    """Each case on one rank, no process group, on the whole batches."""
    torch.set_num_threads(1)
    data, out = {form: dp_cases.batches(form) for form in ("rect", "ragged")}, {}
    for name, (kind, config, _, form) in dp_cases.CASES.items():
        t = dp_cases.trainer(kind, config, form)
        metrics = [dp_cases.step(t, b) for b in data["rect" if form == "rect" else "ragged"]]
        out[name] = {"params": {k: v.clone() for k, v in t.model.state_dict().items()}, "metrics": metrics}
    return out


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def test_a_rank_keeps_its_own_rows_of_each_mini_batch_in_the_permutations_order():
    part = torch.tensor([5, 0, 3, 2, 7])
    assert local_rows(part, offset=2, n=3).tolist() == [1, 0]  # global rows 3, 2 of 2..4
    assert local_rows(part, offset=0, n=2).tolist() == [0]
    assert local_rows(part, offset=8, n=0).tolist() == []
    shards = [(0, 3), (3, 5), (8, 0)]
    union = sorted(int(i) + off for off, n in shards for i in local_rows(part, off, n))
    assert union == sorted(part.tolist())  # the ranks' slices partition the 1-rank mini-batch


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(dp_cases.CASES))
def test_two_ranks_make_the_one_rank_update_after_k_steps(ranks, reference, case):
    ref = comparable(reference[case]["params"])
    kind, config, _, form = dp_cases.CASES[case]
    start = comparable(dp_cases.trainer(kind, config, form).model.state_dict())
    for r in ranks:
        got = comparable(r[case]["params"])
        assert got.keys() == ref.keys()
        for k in ref:
            if k.endswith("[key]"):
                assert float(got[k].abs().max()) < 1e-3 and float(ref[k].abs().max()) < 1e-3  # noise, both
                continue
            err = _relative_error(got[k], ref[k])
            assert err < 1e-5, f"{case}: {k} differs by {err:.2e} relative after {dp_cases.STEPS} steps"
        assert max(_relative_error(ref[k], start[k]) for k in ref) > 1e-3  # the runs trained: not both standing still


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(dp_cases.CASES))
def test_metrics_are_reduced_over_all_ranks(ranks, reference, case):
    for r in ranks:
        for got, want in zip(r[case]["metrics"], reference[case]["metrics"]):
            assert got.keys() == want.keys()
            for k in want:
                assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-5), f"{case} {k}"


@pytest.mark.timeout(240)
def test_ragged_cases_had_ranks_with_fewer_micro_batches_padding_with_dummy_passes(ranks):
    ragged = [name for name, case in dp_cases.CASES.items() if case[3] != "rect"]
    assert all(ranks[1][name]["dummy_passes"] > 0 for name in ragged if name.endswith("_empty"))
    assert sum(r[name]["dummy_passes"] for r in ranks for name in ragged) > len(ragged)


@pytest.mark.timeout(240)
def test_ragged_gae_advantages_are_whitened_with_the_whole_batchs_statistics(ranks):
    from flowrl.rl import ppo_advantages_ragged

    b = dp_cases.batches("ragged")[0]
    whole, _ = ppo_advantages_ragged(b["scores"], b["returns"], b["loss_mask"])
    got = torch.cat([r["whitened_ragged"] for r in ranks])
    assert torch.allclose(got, whole.values, atol=1e-5)


@pytest.mark.timeout(240)
def test_gae_advantages_are_whitened_with_the_whole_batchs_statistics(ranks):
    from flowrl.rl import ppo_advantages

    b = dp_cases.batches()[0]
    whole, _ = ppo_advantages(b["advantages"], b["returns"], b["response_mask"])
    local, _ = ppo_advantages(b["advantages"][:5], b["returns"][:5], b["response_mask"][:5])
    got = torch.cat([r["whitened"] for r in ranks])
    assert torch.allclose(got, whole, atol=1e-5)
    assert not torch.allclose(local, whole[:5], atol=1e-3)  # a shard's own statistics would differ


@pytest.mark.timeout(240)
def test_full_state_items_of_a_sharded_model_is_the_unsharded_state_dict(ranks):
    for r in ranks:
        items = r["fresh"]["items"]
        assert [k for k, _ in items] == list(r["fresh"]["expected"])
        assert all(torch.equal(v, r["fresh"]["expected"][k]) for k, v in items)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["actor", "critic", "ragged_actor"])
def test_each_rank_resumes_bitwise_from_its_own_checkpoint(ranks, kind):
    for r in ranks:
        assert r[f"resume_{kind}"]["bitwise"] and r[f"resume_{kind}"]["metrics_equal"]


def test_a_checkpoint_of_another_rank_layout_is_refused_with_the_fix():
    t = dp_cases.trainer("actor", dp_cases.CASES["actor_token_mean"][1])
    state = {**t.state_dict(), "ranks": [1, 2]}
    with pytest.raises(ValueError, match="rank 1 of 2, this is rank 0 of 1: resume with the devices"):
        t.load_state_dict(state)


@pytest.mark.timeout(240)
def test_a_sharded_trainer_publishes_its_full_state_to_a_subscriber_bitwise(ranks):
    """Rank 0's publisher packs FullState (one all-gather per parameter, rank 1 drains); we subscribe."""
    pub = ranks[0]["published"]
    assert pub["received"] == 1 and pub["hello"]["gathers"] > 0  # the state really was sharded
    live, expected = pub["live"], pub["expected"]
    assert live.keys() == expected.keys() and all(torch.equal(live[k], expected[k]) for k in expected)
    assert "while the ranks gather" in pub["hello"]["refused"]  # asking out of order is an error, not a hang


def test_on_one_rank_full_state_is_the_live_state_and_publishes_like_a_state_dict():
    from flowrl.models import build_model
    from flowrl.rl import FullState, full_state_items
    from flowrl.weights import WeightPublisher, layout_of, weights_digest

    model = build_model(dp_cases.SPEC, seed=0)
    view = FullState(model, serving_dtype=None)
    view.drain()  # nothing sharded: no collective, nothing to do
    assert view.gather_order == [] and list(view) == list(model.state_dict())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in full_state_items(model))
    pub = WeightPublisher(lambda: view, secret="s" * 32)
    try:
        pub.snapshot(1)
        sd = model.state_dict()
        assert pub.digest() == weights_digest(sd, layout_of(sd))
    finally:
        pub.close()
