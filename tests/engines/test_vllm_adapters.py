"""Adapter (LoRA) versions in the vLLM engine (skipped without vllm): merged into its weights in
place, only the adapted layers reloaded, transactionally.

    pip install -e ".[vllm]" && python -m pytest tests/engines/test_vllm_adapters.py
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from flowrl.engines import build_engine  # noqa: E402
from flowrl.engines.vllm import WeightLoadError, fuse_like_engine  # noqa: E402
from flowrl.engines.vllm_worker import digest  # noqa: E402
from flowrl.weights.adapters import merged  # noqa: E402
from tests.weights.adapter_peers import random_adapters  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = build_engine({"type": "vllm", "kv_cache_memory_bytes": 64 << 20, "max_model_len": 64},
                       model={"type": "hf", "path": tiny_llama}, seed=0)
    yield eng
    eng.close()


def expected(engine, weights: dict) -> str:
    return digest(fuse_like_engine({k: v.clone() for k, v in weights.items()}, engine.packed_modules()))


def test_after_each_adapter_version_the_engines_weights_are_base_plus_b_a(engine):
    base = {k: v.clone() for k, v in engine.weights().items()}
    assert engine.engine_digest() == expected(engine, base)
    versions = [random_adapters(base, seed=v, targets=ATTENTION) for v in (1, 2)]
    # q and v only: k is reloaded as held (vLLM loads q/k/v as one tensor), o goes back to its base
    versions.append(random_adapters(base, seed=3, targets=("q_proj", "v_proj")))
    for v, adapters in enumerate(versions, start=1):
        engine.load_weights(adapters.items(), v)
        assert engine.version == v and engine.engine_digest() == expected(engine, merged(base, adapters)), v
    assert all(".q_proj." in k or ".v_proj." in k for k in engine.adapted.base)  # bases of adapted weights only


def test_an_adapter_version_that_fails_in_the_engine_or_does_not_fit_leaves_the_previous_one(engine):
    base = {k: v.clone() for k, v in engine.weights().items()}
    one = random_adapters(base, seed=11, targets=ATTENTION)
    engine.load_weights(one.items(), 11)
    held = engine.engine_digest()
    assert held == expected(engine, merged(base, one))
    two = random_adapters(base, seed=12, targets=ATTENTION)
    engine.reload_faults = [3]  # vLLM's reload raises partway through the merged layers
    with pytest.raises(WeightLoadError, match="restored to version 11"):
        engine.load_weights(two.items(), 12)
    assert engine.version == 11 and engine.engine_digest() == held
    bad = {**two, sorted(two)[-1]: torch.zeros(3, 3)}  # the last pair does not fit: refused before the engine changes
    with pytest.raises(ValueError, match="nothing was applied"):
        engine.load_weights(bad.items(), 12)
    assert engine.version == 11 and engine.engine_digest() == held
    engine.load_weights(two.items(), 12)
    assert engine.engine_digest() == expected(engine, merged(base, two))


def test_a_full_version_after_adapters_is_the_new_base_and_an_adapter_version_lands_faster(engine):
    staging = engine.weights()
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():  # what the runtime does: receive a full version into the staging tensors
        for t in staging.values():
            t.copy_(torch.randn(t.shape, generator=g) * 0.2)
    reloads = []  # (tensors reloaded into vLLM, partial) per reload: what a version costs the engine
    reload = engine._reload
    engine._reload = lambda staged, partial=False: (reloads.append((len(staged), partial)), reload(staged, partial))
    try:
        engine.load_weights(staging.items(), 21)
        full = {k: v.clone() for k, v in staging.items()}
        assert engine.engine_digest() == expected(engine, full) and not engine.adapted.base
        adapters = random_adapters(full, seed=22, targets=("q_proj", "o_proj"))
        engine.load_weights(adapters.items(), 22)
    finally:
        del engine._reload
    assert engine.engine_digest() == expected(engine, merged(full, adapters))
    # partial: never a full reload (how much faster it lands: the benchmark, not a timed test)
    (full_n, full_partial), (adapter_n, adapter_partial) = reloads
    assert not full_partial and adapter_partial and 0 < adapter_n < full_n, reloads
