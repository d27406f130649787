"""The vLLM engine batching continuously across tickets (skipped without vllm): several asyncio tasks
await ``submit`` on one loop, their requests share vLLM's steps, and a weights version lands while
they are in flight (``on_new_weights``: keep, restart, finish).

    python -m pytest tests/engines/test_vllm_continuous.py
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

pytest.importorskip("vllm")

from flowrl.engines import Sampling, VLLMEngineSpec, build_engine  # noqa: E402
from flowrl.tasks import EOS, PAD  # noqa: E402
from flowrl.transport.ragged import Ragged  # noqa: E402
from tests.engines.layout import RAGGED, assert_layout, reverse_prompt, too_long  # noqa: E402

PROMPTS = RAGGED  # four prompts of 6, 9, 4 and 7 tokens
NEVER = -1
"""A stop token no model generates: every response is max_new_tokens long (requests stay in flight)."""
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = build_engine({"type": "vllm", "kv_cache_memory_bytes": 64 << 20, "max_model_len": 64},
                       model={"type": "hf", "path": tiny_llama}, seed=0)
    assert eng.continuous
    yield eng
    eng.close()


@pytest.fixture
def policy(engine):
    """Set ``on_new_weights`` for one test (build_engine's default is finish)."""
    def set_to(value):
        engine.on_new_weights = value
    yield set_to
    engine.on_new_weights = "finish"


def sampling(**kw):
    return Sampling(**{"n": 4, "temperature": 1.0, "max_new_tokens": 6, "eos_id": EOS, "pad_id": PAD, **kw})


def run(work, timeout=120):
    """Await ``work`` (a coroutine, or a function making an awaitable on the loop) on a fresh loop --
    the node's compute loop -- never longer than ``timeout``."""
    async def main():
        return await asyncio.wait_for(work() if callable(work) else work, timeout)
    return asyncio.run(main())


async def until(condition, timeout=60.0):
    """Yield to the engine loop until ``condition()`` holds."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out waiting for the engine"
        await asyncio.sleep(0)


def randomise(staging, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # what the runtime does: receive a new version into the staging tensors
        for t in staging.values():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.2)


def assert_same(got, want, atol=1e-4):
    assert torch.equal(got.tokens.offsets, want.tokens.offsets) and torch.equal(got.prompt_lens, want.prompt_lens)
    assert torch.equal(got.tokens.values, want.tokens.values)
    assert torch.equal(got.loss_mask.values, want.loss_mask.values)
    torch.testing.assert_close(got.logprobs.values, want.logprobs.values, atol=atol, rtol=0)


def versions_of(out):
    """Each sample's response versions (a list per sample)."""
    return [out.versions[r][int(out.prompt_lens[r]):].tolist() for r in range(out.num_samples)]


def test_the_spec_option_and_the_contract(engine):
    assert VLLMEngineSpec().continuous is True and VLLMEngineSpec(continuous=False).continuous is False
    assert set(engine.stats()) == {"running", "waiting", "busy_s", "tokens", "weight_pause_s", "weight_loads"}


def test_concurrent_submits_share_the_engines_steps_and_each_gets_its_own_samples_in_order(engine, monkeypatch):
    other = Ragged.from_sequences([reverse_prompt(5, 7), reverse_prompt(2, 8)])
    jobs = [(PROMPTS, sampling(n=3, max_new_tokens=12), 1), (other, sampling(n=2, max_new_tokens=4), 2),
            (PROMPTS, sampling(n=1, max_new_tokens=8, temperature=0.7), 3)]
    alone = [engine.generate(p, s, seed=seed) for p, s, seed in jobs]  # batch-at-a-time, one ticket each
    tickets_per_step = []
    step = engine.llm.llm_engine.step

    def counting_step():
        tickets_per_step.append(len({rid.split("-")[1] for rid in engine._live}))
        return step()
    monkeypatch.setattr(engine.llm.llm_engine, "step", counting_step)
    order = []

    async def one(k, prompts, s, seed):
        out = await engine.submit(prompts, s, seed=seed)
        order.append(k)
        return out

    outs = run(lambda: asyncio.gather(*(one(k, *job) for k, job in enumerate(jobs))))
    assert max(tickets_per_step) == 3  # the three tickets' requests went through the same steps
    assert len(tickets_per_step) < sum(s.max_new_tokens for _, s, _ in jobs)  # ... not one after the other
    assert order[0] == 1  # the short ticket returned first, while the others went on
    for out, want, (prompts, s, _) in zip(outs, alone, jobs):
        assert_layout(out, prompts, s.n, s.max_new_tokens)
        assert_same(out, want)  # per-request seeds: the same draws whatever ran beside it
        assert all(set(v) == {0} for v in versions_of(out)) and (out.versions.values[~out.loss_mask.values] == -1).all()
    assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0


def test_greedy_continuous_generates_what_the_batch_does(engine):
    s = sampling(n=2, temperature=0.0, max_new_tokens=10)
    batch = engine.generate(PROMPTS, s, seed=0)
    outs = run(lambda: asyncio.gather(*(engine.submit(PROMPTS.select(slice(i, i + 2)), s, seed=0) for i in (0, 2)),
                                      engine.submit(PROMPTS, s, seed=0)))
    assert_same(outs[2], batch)
    halves = [outs[0].tokens[r] for r in range(4)] + [outs[1].tokens[r] for r in range(4)]
    assert all(torch.equal(a, batch.tokens[r]) for r, a in enumerate(halves))
    engine.continuous = False  # `continuous: false`: submit is a batch-at-a-time generate
    try:
        legacy = run(engine.submit(PROMPTS, s, seed=0))
    finally:
        engine.continuous = True
    assert_same(legacy, batch)
    assert legacy.versions is None


def test_prompts_are_checked_when_submitted(engine):
    with pytest.raises(ValueError, match=r"prompt 1 has 59 tokens"):
        run(engine.submit(too_long(6, 64), sampling(), seed=0))
    with pytest.raises(ValueError, match=r"prompt 1 is empty"):
        run(engine.submit(Ragged.from_sequences([[12, 1], []]), sampling(), seed=0))
    assert not engine._live and engine.stats()["waiting"] == 0


def mid_flight(engine, s, version, seed_weights, *, after_tokens=3, same_weights=False):
    """Submit PROMPTS, and load ``version`` once every sequence has ``after_tokens`` tokens:
    before_weights, the staging tensors filled, load_weights -- what the runtime does."""
    rows = PROMPTS.num_samples * (1 if s.temperature <= 0 else s.n)

    async def go():
        base = engine.stats()["tokens"]
        job = asyncio.ensure_future(engine.submit(PROMPTS, s, seed=0))
        await until(lambda: engine.stats()["tokens"] >= base + after_tokens * rows)
        assert engine.stats()["running"] > 0, "the load must come while requests are in flight"
        await engine.before_weights(version)
        if not same_weights:
            randomise(engine.weights(), seed_weights)
        engine.load_weights(engine.weights().items(), version)
        return await job
    return run(go())


def rows_of(out):
    return [out.tokens[r] for r in range(out.num_samples)]


def test_keep_the_sequences_in_flight_go_on_after_the_load_with_their_kv_and_tokens(engine, policy):
    policy("keep")
    s = sampling(n=1, temperature=0.0, max_new_tokens=24, eos_id=NEVER)
    v = engine.version
    before = engine.generate(PROMPTS, s, seed=0)
    loads = engine.stats()["weight_loads"]
    # the same weights loaded mid-flight: nothing changes, so the KV cache and the tokens were kept
    same = mid_flight(engine, s, v + 1, None, same_weights=True)
    assert_same(same, before)
    kept = 0
    for vs in versions_of(same):
        assert vs[:3] == [v] * min(3, len(vs)) and vs == sorted(vs)  # each token: the version it came from
        kept += vs[-1] == v + 1  # in flight at the load (the others had finished)
    assert kept >= 1
    # new weights mid-flight: the tokens before the load are the old version's, the rest the new one's
    new = mid_flight(engine, s, v + 2, 20)
    assert engine.version == v + 2 and engine.stats()["weight_loads"] == loads + 2
    moved = 0
    for r, vs in enumerate(versions_of(new)):
        k = vs.index(v + 2) if v + 2 in vs else len(vs)
        assert k >= min(3, len(vs)) and set(vs[:k]) == {v + 1} and set(vs[k:]) <= {v + 2}
        p = int(new.prompt_lens[r])
        assert torch.equal(new.tokens[r][: p + k], before.tokens[r][: p + k])  # the old prefix stays
        moved += not torch.equal(new.tokens[r], before.tokens[r])
    assert moved >= 1  # ... and the new weights took over


def test_restart_the_sequences_in_flight_start_again_from_their_prompts_with_the_new_weights(engine, policy):
    policy("restart")
    v = engine.version
    for k, s in enumerate([sampling(n=2, temperature=0.0, max_new_tokens=20, eos_id=NEVER),
                           sampling(n=3, max_new_tokens=20, eos_id=NEVER)]):  # sampled: their own seeds again
        old = engine.generate(PROMPTS, s, seed=0)
        out = mid_flight(engine, s, v + 1 + k, 30 + k)
        fresh = engine.generate(PROMPTS, s, seed=0)  # what the new weights generate from scratch
        restarted = 0
        for r, vs in enumerate(versions_of(out)):
            if set(vs) == {v + 1 + k}:  # in flight at the load: started again, all of it the new version's
                assert torch.equal(out.tokens[r], fresh.tokens[r])
                restarted += 1
            else:  # finished before the load
                assert set(vs) == {v + k} and torch.equal(out.tokens[r], old.tokens[r])
        assert restarted >= 1
        assert_layout(out, PROMPTS, s.n, 20, stops=(EOS,))


def test_finish_the_version_waits_for_the_running_sequences_and_new_ones_wait_for_it(engine, policy):
    policy("finish")
    s = sampling(n=2, temperature=0.0, max_new_tokens=20, eos_id=NEVER)
    v = engine.version
    old = engine.generate(PROMPTS, s, seed=0)
    other = Ragged.from_sequences([reverse_prompt(5, 9)])
    events = []

    async def go():
        base = engine.stats()["tokens"]
        first = asyncio.ensure_future(engine.submit(PROMPTS, s, seed=0))
        await until(lambda: engine.stats()["tokens"] >= base + 3 * 4)
        sync = asyncio.ensure_future(engine.before_weights(v + 1))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(engine.submit(other, s, seed=0))  # arrives while the version waits
        await until(lambda: engine.stats()["waiting"] > 0)  # held back, not in vLLM
        await sync
        events.append(("drained", first.done(), second.done()))
        randomise(engine.weights(), 40)
        engine.load_weights(engine.weights().items(), v + 1)
        return await first, await second

    first, second = run(go())
    assert events == [("drained", True, False)]
    assert_same(first, old)
    assert all(set(vs) == {v} for vs in versions_of(first))
    assert_same(second, engine.generate(other, s, seed=0))
    assert all(set(vs) == {v + 1} for vs in versions_of(second))
    assert engine.stats()["weight_pause_s"] > 0


def test_a_cancelled_submit_leaves_the_engine_and_the_others_go_on(engine):
    s = sampling(n=2, max_new_tokens=30, eos_id=NEVER)
    short = sampling(n=2, max_new_tokens=8)
    want = engine.generate(PROMPTS, short, seed=5)

    async def go():
        doomed = asyncio.ensure_future(engine.submit(PROMPTS, s, seed=4))
        kept = asyncio.ensure_future(engine.submit(PROMPTS, short, seed=5))
        base = engine.stats()["tokens"]
        await until(lambda: engine.stats()["tokens"] >= base + 16)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert not any(q.ticket is not None and q.ticket.sampling is s for q in engine._live.values())
        return await kept

    assert_same(run(go()), want)
    assert not engine._live and engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0


def test_an_engine_error_fails_every_waiter_and_the_engine_goes_on_afterwards(engine, monkeypatch):
    step = engine.llm.llm_engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("engine step blew up")
        return step()
    monkeypatch.setattr(engine.llm.llm_engine, "step", failing_step)

    async def go():
        return await asyncio.gather(*(engine.submit(PROMPTS, sampling(max_new_tokens=10), seed=k) for k in range(3)),
                                    return_exceptions=True)

    results = run(go())
    assert all(isinstance(r, RuntimeError) and "blew up" in str(r) for r in results), results
    assert not engine._live and engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0
    monkeypatch.setattr(engine.llm.llm_engine, "step", step)
    assert_layout(run(engine.submit(PROMPTS, sampling(), seed=0)), PROMPTS, 4, 6)
