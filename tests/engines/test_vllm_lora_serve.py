"""Adapter (LoRA) versions served through vLLM's own LoRA support (``lora: serve``; skipped without
vllm): the adapters land in vLLM's LoRA slot from memory, the base weights stay, and the engine's
effective policy (base + B @ A) is the trainer's -- bitwise in its weights, in its generations to
float tolerance -- after every version; a version that fails partway leaves the previous adapter.

    pip install -e ".[vllm]" && python -m pytest tests/engines/test_vllm_lora_serve.py
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("vllm")

from flowrl.engines import Sampling, build_engine  # noqa: E402
from flowrl.engines.vllm import PREFIX, WeightLoadError, fuse_like_engine  # noqa: E402
from flowrl.engines.vllm_worker import digest  # noqa: E402
from flowrl.weights.adapters import merged  # noqa: E402
from tests.engines.layout import RAGGED  # noqa: E402
from tests.weights.adapter_peers import random_adapters  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MAX_RANK = 8
GREEDY = Sampling(n=1, temperature=0.0, max_new_tokens=8, eos_id=-1, pad_id=0)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = build_engine({"type": "vllm", "kv_cache_memory_bytes": 64 << 20, "max_model_len": 64,
                        "lora": "serve", "max_lora_rank": MAX_RANK},
                       model={"type": "hf", "path": tiny_llama}, seed=0)
    eng.base = {k: v.clone() for k, v in eng.weights().items()}  # version 0, as the trainer holds it
    yield eng
    eng.close()


def expected(engine, weights: dict) -> str:
    return digest(fuse_like_engine({k: v.clone() for k, v in weights.items()}, engine.packed_modules()))


def assert_serves(engine, adapters: dict) -> None:
    """vLLM's LoRA slot holds exactly the sent A and B (zero-padded to max_lora_rank); nothing else."""
    held = engine.served_adapters()
    sent = {k[len(PREFIX):].rsplit(".", 1)[0] for k in adapters}
    assert sent <= set(held), sorted(sent - set(held))[:3]
    for module, (a, b) in held.items():
        key = PREFIX + module
        if module not in sent:
            assert not a.any() and not b.any(), module  # not in this version: no adapter there
            continue
        want_a, want_b = adapters[key + ".lora_A"], adapters[key + ".lora_B"]
        r = want_a.shape[0]
        assert torch.equal(a[:r], want_a) and not a[r:].any(), module
        assert torch.equal(b[:, :r], want_b) and not b[:, r:].any(), module


def test_each_adapter_version_is_served_as_sent_and_the_effective_weights_are_base_plus_b_a(engine):
    base = engine.base
    assert engine.engine_digest(effective=True) == engine.engine_digest() == expected(engine, base)
    versions = [random_adapters(base, seed=v, targets=ATTENTION) for v in (1, 2)]
    versions.append(random_adapters(base, seed=3, targets=("q_proj", "v_proj")))  # k and o back at the base
    for v, adapters in enumerate(versions, start=1):
        engine.load_weights(adapters.items(), v)
        assert engine.version == v
        assert_serves(engine, adapters)
        assert engine.engine_digest() == expected(engine, base), v  # the base weights were never touched
        assert engine.engine_digest(effective=True) == expected(engine, merged(base, adapters)), v
    assert not engine.adapted.base  # nothing merged: no base copies kept


def test_generation_with_the_served_adapter_is_that_of_the_merged_weights(engine):
    base = engine.base
    adapters = random_adapters(base, seed=5, r=MAX_RANK, targets=ATTENTION)
    engine.load_weights(adapters.items(), 5)
    plain = engine.generate(RAGGED, GREEDY, seed=0)  # greedy
    sampled = engine.generate(RAGGED, Sampling(n=2, temperature=1.0, max_new_tokens=8, eos_id=-1, pad_id=0), seed=3)
    # the merged weights as a full version: the base becomes base + B @ A and the adapter empties
    full = merged(base, adapters)
    engine.load_weights(full.items(), 6)
    assert engine.engine_digest() == engine.engine_digest(effective=True) == expected(engine, full)
    assert_serves(engine, {})
    again = engine.generate(RAGGED, GREEDY, seed=0)
    assert torch.equal(again.tokens.values, plain.tokens.values)
    torch.testing.assert_close(again.logprobs.values, plain.logprobs.values, atol=1e-4, rtol=0)
    resampled = engine.generate(RAGGED, Sampling(n=2, temperature=1.0, max_new_tokens=8, eos_id=-1, pad_id=0), seed=3)
    if torch.equal(resampled.tokens.values, sampled.tokens.values):  # same draws (fp noise may flip a near tie)
        torch.testing.assert_close(resampled.logprobs.values, sampled.logprobs.values, atol=1e-4, rtol=0)
    # and the base is served again once it is loaded back
    engine.load_weights(base.items(), 7)
    assert engine.engine_digest(effective=True) == expected(engine, base)
    assert not torch.equal(engine.generate(RAGGED, GREEDY, seed=0).tokens.values, plain.tokens.values)


def test_an_adapter_version_that_fails_or_does_not_fit_leaves_the_previous_adapter(engine):
    base = engine.base
    engine.load_weights(base.items(), 10)
    one = random_adapters(base, seed=11, targets=ATTENTION)
    engine.load_weights(one.items(), 11)
    held = engine.engine_digest(effective=True)
    greedy = engine.generate(RAGGED, GREEDY, seed=0)
    two = random_adapters(base, seed=12, targets=ATTENTION)
    engine.lora_faults = [3]  # writing vLLM's LoRA slot raises after three layers
    with pytest.raises(WeightLoadError, match="serves version 11's adapter again"):
        engine.load_weights(two.items(), 12)
    assert engine.version == 11 and engine.engine_digest(effective=True) == held
    assert_serves(engine, one)
    assert torch.equal(engine.generate(RAGGED, GREEDY, seed=0).tokens.values, greedy.tokens.values)
    bad = {**two, sorted(two)[-1]: torch.zeros(3, 3)}  # the last pair does not fit: refused before vLLM
    with pytest.raises(ValueError, match="nothing was applied"):
        engine.load_weights(bad.items(), 12)
    too_big = random_adapters(base, seed=13, r=MAX_RANK + 1, targets=("q_proj",))
    with pytest.raises(ValueError, match=f"max_lora_rank={MAX_RANK}.*set `max_lora_rank: 16`"):
        engine.load_weights(too_big.items(), 12)
    assert engine.version == 11 and engine.engine_digest(effective=True) == held
    # a full version that fails partway: the base and the adapter served before it both stay
    engine.reload_faults = [5]
    with pytest.raises(WeightLoadError, match="restored to version 11"):
        engine.load_weights(merged(base, two).items(), 12)
    assert engine.engine_digest(effective=True) == held
    assert_serves(engine, one)
    engine.load_weights(two.items(), 12)
    assert_serves(engine, two)
    assert engine.engine_digest(effective=True) == expected(engine, merged(base, two))


def test_sequences_in_flight_go_on_with_the_new_adapter_from_the_next_step(engine):
    """``keep``: the adapter lands between two engine steps; the running requests keep their tokens and
    compute with it from then on (as after a reload); each token records its version."""
    base = engine.base
    engine.load_weights(base.items(), 20)
    engine.on_new_weights = "keep"
    adapters = random_adapters(base, seed=21, r=MAX_RANK, targets=ATTENTION)
    s = Sampling(n=1, temperature=0.0, max_new_tokens=24, eos_id=-1, pad_id=0)
    before = engine.generate(RAGGED, s, seed=0)

    async def mid_flight():
        job = asyncio.ensure_future(engine.submit(RAGGED, s, seed=0))
        while engine.stats()["tokens"] < tokens0 + 8:  # every request has a few tokens
            await asyncio.sleep(0)
        engine.load_weights(adapters.items(), 21)
        return await asyncio.wait_for(job, 120)

    try:
        tokens0 = engine.stats()["tokens"]
        out = asyncio.run(mid_flight())
    finally:
        engine.on_new_weights = "finish"
    moved = 0
    for r in range(out.num_samples):
        p = int(out.prompt_lens[r])
        vs = out.versions[r][p:].tolist()
        k = vs.index(21) if 21 in vs else len(vs)
        assert set(vs[:k]) == {20} and set(vs[k:]) <= {21} and 0 < k, vs
        assert torch.equal(out.tokens[r][: p + k], before.tokens[r][: p + k])  # the base's tokens so far
        moved += not torch.equal(out.tokens[r], before.tokens[r])
    assert moved >= 1  # the adapter took over mid-flight
    assert_serves(engine, adapters)


def test_the_lora_option_is_checked_with_the_engine_config():
    from flowrl.engines.spec import parse_engine_spec

    assert parse_engine_spec({"type": "vllm"}).lora == "merge"  # the default: merged (faster decode on CPU)
    with pytest.raises(ValueError, match="'merge' or 'serve'"):
        parse_engine_spec({"type": "vllm", "lora": "served"})


def test_when_the_previous_adapter_cannot_be_written_back_the_engine_refuses_until_an_adapter_version_lands(engine):
    base = engine.base
    engine.load_weights(base.items(), 30)
    one = random_adapters(base, seed=31, targets=ATTENTION)
    engine.lora_faults = [(3, 1)]  # the write fails after three layers, writing the previous one back after one
    with pytest.raises(WeightLoadError, match="refuses to generate"):
        engine.load_weights(one.items(), 31)
    assert engine.version == 30 and engine.unusable
    with pytest.raises(RuntimeError, match="cannot generate"):
        engine.generate(RAGGED, GREEDY, seed=0)
    engine.load_weights(one.items(), 31)  # every slot written whole: the engine generates again
    assert engine.unusable is None and engine.version == 31
    assert engine.engine_digest(effective=True) == expected(engine, merged(base, one))
    assert engine.generate(RAGGED, GREEDY, seed=0).num_samples == RAGGED.num_samples
