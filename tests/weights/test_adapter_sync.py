"""Adapter-only (LoRA) versions over a real weight sync: a publisher in this process, a rollout-side
subscriber with a builtin engine in its own process (tests/weights/adapter_peers.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flowrl.weights import WeightPublisher, WeightSyncError, layout_of, weights_digest
from flowrl.weights.adapters import AdaptedWeights, adapter_mismatch, merged
from tests.weights.adapter_peers import random_adapters
from tests.weights.conftest import ROOT

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def base() -> dict[str, torch.Tensor]:
    from flowrl.engines import build_engine

    return {k: v.clone() for k, v in build_engine({"type": "builtin"}, model={"type": "tiny"}, seed=0).weights().items()}


def start(peers, cfg: dict) -> subprocess.Popen:
    """The rollout-side peer, in the environment tests.weights.peers gets (killed by PID at the end)."""
    env = {**os.environ, "FLOWRL_TEST_SECRET": peers.secret, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-m", "tests.weights.adapter_peers", json.dumps(cfg)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peers.procs.append(p)
    return p


@pytest.mark.parametrize("apply_adapters", [True, False], ids=["subscriber-applies", "engine-applies"])
def test_every_adapter_version_lands_as_base_plus_b_a_and_only_adapters_travel(peers, base, apply_adapters):
    versions = {v: random_adapters(base, seed=v) for v in (1, 2, 3)}  # one publisher: one set of targets
    weights = dict(versions[1])
    pub = WeightPublisher(lambda: weights, bucket_bytes=32 << 10, secret=peers.secret)
    sub = start(peers, {"addr": pub.store_addr, "apply_adapters": apply_adapters, "versions": 3})
    published = {}
    try:
        for v in (1, 2, 3):
            weights.clear()
            weights.update(versions[v])
            pub.snapshot(v)
            published[v] = pub.digest()
            assert pub.serve(1, 2, timeout_s=20, ready_timeout_s=30) == v
    finally:
        pub.close()
    rows = peers.results(sub)
    assert [r.get("version") for r in rows] == [1, 2, 3], rows
    for r in rows:
        want = merged(base, versions[r["version"]])
        assert r["engine"] == weights_digest(want, layout_of(base)), f"version {r['version']}: not base + B @ A"
        assert r["subscriber"] == published[r["version"]]  # what it holds is what was published
    full = sum(t.numel() * t.element_size() for t in base.values())
    assert rows[0]["bytes"] == sum(t.numel() * 4 for t in versions[1].values()) < full / 4
    handed = rows[0]["handed"]
    assert all(n.endswith((".lora_A", ".lora_B")) for n in handed) != apply_adapters  # engine-applies gets adapters


def test_an_adapter_that_fits_no_weight_of_the_rollout_is_refused_at_join_naming_it(peers, base):
    bad = random_adapters(base, seed=1)
    bad["blocks.0.attn.qkv.lora_B"] = torch.zeros(100, 4)  # the weight has 384 rows
    pub = WeightPublisher(lambda: bad, bucket_bytes=32 << 10, secret=peers.secret)
    pub.snapshot(1)
    sub = start(peers, {"addr": pub.store_addr, "apply_adapters": False,
                                                           "versions": 1})
    try:
        with pytest.raises(WeightSyncError, match=r"blocks\.0\.attn\.qkv\.weight"):
            pub.serve(1, 2, timeout_s=20, ready_timeout_s=30)
    finally:
        pub.close()
    error = peers.results(sub)[-1]["error"]
    assert error.startswith("LayoutMismatchError") and "'blocks.0.attn.qkv.weight' does not fit it" in error
    assert "[100, 4]" in error and "[384, 128]" in error


def test_adapter_layouts_are_checked_against_the_receivers_weights(base):
    held = layout_of(base)
    good = layout_of(random_adapters(base, seed=1))
    assert adapter_mismatch(good, held) is None
    unknown = good + [("blocks.9.attn.qkv.lora_A", [4, 128], "float32"), ("blocks.9.attn.qkv.lora_B", [384, 4], "float32")]
    assert "'blocks.9.attn.qkv.weight', which the subscriber does not hold" in adapter_mismatch(unknown, held)
    half = [x for x in good if x[0] != "blocks.0.attn.proj.lora_B"]
    assert "adapter of 'blocks.0.attn.proj.weight' is incomplete" in adapter_mismatch(half, held)


def test_a_version_that_does_not_apply_leaves_the_weights_and_the_bases_untouched(base):
    live = {k: v.clone() for k, v in base.items()}
    adapted = AdaptedWeights()
    one = random_adapters(base, seed=1)
    adapted.apply(live, one)
    before = weights_digest(live, layout_of(live))
    two = random_adapters(base, seed=2)
    two["blocks.1.attn.qkv.lora_A"] = torch.zeros(4, 7)  # sorted last among the qkv pairs
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.qkv\.weight.*nothing was applied"):
        adapted.apply(live, two)
    assert weights_digest(live, layout_of(live)) == before == weights_digest(merged(base, one), layout_of(base))
    adapted.apply(live, random_adapters(base, seed=3))
    assert weights_digest(live, layout_of(live)) == weights_digest(merged(base, random_adapters(base, seed=3)),
                                                                   layout_of(base))
