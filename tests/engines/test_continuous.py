"""The continuous builtin engine (flowrl/engines/continuous.py): requests from several asyncio tasks
share iteration-level batches in a slot KV cache; what comes out is what the batch-at-a-time engine
and the trainer agree on (greedy tokens, log-probs), per-request budgets hold, a cancelled request
frees its slots, an error reaches every waiter, and a weights version landing mid-flight does what
``on_new_weights`` says (every token records its version).

Events are ordered by hooks on the engine's iterations, never by sleeping; every await has a bound.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from flowrl.engines import Sampling, build_engine
from flowrl.models import build_model
from flowrl.models.packing import packed_logprobs
from flowrl.tasks import EOS, PAD
from flowrl.transport.ragged import Ragged
from tests.engines.layout import RAGGED, assert_layout

TINY = {"type": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2}
NEVER = 10_000
"""An EOS id outside the vocabulary: responses run to their budget (the events below need that)."""

pytestmark = pytest.mark.timeout(60)


def sampling(**kw) -> Sampling:
    return Sampling(**{"n": 2, "temperature": 0.0, "max_new_tokens": 7, "eos_id": EOS, "pad_id": PAD, **kw})


def continuous(max_num_seqs: int = 3, on_new_weights: str = "finish", seed: int = 3, **spec):
    return build_engine({"type": "builtin", "continuous": True, "max_num_seqs": max_num_seqs, **spec},
                        model=TINY, seed=seed, on_new_weights=on_new_weights)


def run(coro, timeout: float = 30):
    """Run ``coro`` on a fresh loop, failing (not hanging) after ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def after_iterations(engine, count: int) -> asyncio.Event:
    """An event set at the end of the engine's ``count``-th iteration from now."""
    batcher, event, seen = engine.batcher, asyncio.Event(), [0]
    inner = batcher._iterate

    def counted():
        inner()
        seen[0] += 1
        if seen[0] == count:
            event.set()

    batcher._iterate = counted
    return event


def new_weights(engine, seed: int) -> dict[str, torch.Tensor]:
    """Another model's tensors, written into the engine's live ones as the runtime does."""
    other = build_model(TINY, seed=seed).state_dict()
    live = engine.weights()
    for name, tensor in other.items():
        live[name].copy_(tensor)
    return other


def requests() -> list[Ragged]:
    """Prompts of 6, 9, 4 and 7 tokens, cut into four requests of different sizes."""
    return [RAGGED, RAGGED.select(slice(1, 3)), RAGGED.select(slice(3, 4)), RAGGED.select(slice(0, 2))]


# tokens and log-probs ------------------------------------------------------------------------
def test_greedy_continuous_tokens_equal_batch_generate_with_many_concurrent_requests_and_reused_slots():
    engine, batch = continuous(max_num_seqs=3), build_engine({"type": "builtin"}, model=TINY, seed=3)
    s = sampling()

    async def main():
        return await asyncio.gather(*(engine.submit(p, s, seed=i) for i, p in enumerate(requests())))

    outs = run(main())  # 18 sequences through 3 slots
    for prompts, out in zip(requests(), outs):
        want = batch.generate(prompts, s, seed=0)
        assert_layout(out, prompts, s.n, s.max_new_tokens)
        assert torch.equal(out.tokens.values, want.tokens.values) and torch.equal(out.tokens.offsets,
                                                                                   want.tokens.offsets)
        assert torch.allclose(out.logprobs.values, want.logprobs.values, atol=1e-5)
        assert torch.equal(out.versions.values, torch.where(out.loss_mask.values, 0, -1))
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0 and len(engine.batcher.free) == 3
    assert stats["tokens"] == sum(int(o.loss_mask.values.sum()) for o in outs)


def test_sampled_logprobs_are_what_the_trainer_recomputes_at_the_sampling_temperature():
    engine = continuous(max_num_seqs=4)
    s = sampling(n=3, temperature=0.7, top_p=0.9, max_new_tokens=9)

    async def main():
        return await asyncio.gather(engine.submit(RAGGED, s, seed=0),
                                    engine.submit(RAGGED.select(slice(1, 3)), s, seed=1))

    for prompts, out in zip([RAGGED, RAGGED.select(slice(1, 3))], run(main())):
        assert_layout(out, prompts, 3, 9)
        lp = packed_logprobs(engine.model, out.tokens, temperature=0.7)
        gap = (lp.values * out.loss_mask.values - out.logprobs.values).abs().max()
        assert float(gap) < 1e-5


def test_requests_with_their_own_budgets_temperatures_and_eos_share_the_batch():
    engine, batch = continuous(max_num_seqs=5), build_engine({"type": "builtin"}, model=TINY, seed=3)
    short = sampling(max_new_tokens=2, n=1)
    long = sampling(max_new_tokens=11, n=3, temperature=1.3, eos_id=NEVER)
    greedy = sampling(max_new_tokens=6, n=1, eos_id=5)

    async def main():
        return await asyncio.gather(engine.submit(RAGGED, short, seed=0), engine.submit(RAGGED, long, seed=0),
                                    engine.submit(RAGGED, greedy, seed=0))

    a, b, c = run(main())
    assert_layout(a, RAGGED, 1, 2)
    assert b.response_lens.tolist() == [11] * 12  # no EOS in this vocabulary: every budget used
    assert_layout(c, RAGGED, 1, 6, stops=(5,))
    assert torch.equal(c.tokens.values, batch.generate(RAGGED, greedy, seed=0).tokens.values)


def test_no_prompts_give_no_samples_and_bad_prompts_are_refused_before_anything_runs():
    engine = continuous(max_len=16)
    out = run(engine.submit(Ragged.from_sequences([], "int64"), sampling(), seed=0))
    assert out.num_samples == 0 and out.versions is not None
    with pytest.raises(ValueError, match="the engine's max_len"):
        run(engine.submit(Ragged.from_sequences([[1] * 12]), sampling(max_new_tokens=5), seed=0))


def test_a_hugging_face_model_in_continuous_mode_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"continuous: false.*vllm"):
        build_engine({"type": "builtin", "continuous": True}, model={"type": "hf", "path": "no/such/model"})


# endings -------------------------------------------------------------------------------------
def test_a_cancelled_request_leaves_the_batch_and_frees_its_slots():
    engine = continuous(max_num_seqs=4)

    async def main():
        started = after_iterations(engine, 2)
        doomed = asyncio.create_task(engine.submit(RAGGED, sampling(max_new_tokens=40, eos_id=NEVER), seed=0))
        other = asyncio.create_task(engine.submit(RAGGED.select(slice(0, 1)),
                                                  sampling(max_new_tokens=30, eos_id=NEVER), seed=0))
        await started.wait()
        assert engine.stats()["running"] == 4 and engine.stats()["waiting"] > 0
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert {seq.request.sampling.max_new_tokens for seq in engine.batcher.running} <= {30}
        return await other

    out = run(main())
    assert out.response_lens.tolist() == [30, 30]
    assert len(engine.batcher.free) == 4 and engine.stats()["waiting"] == 0


def test_an_error_in_an_iteration_reaches_every_waiter_and_the_engine_goes_on():
    engine = continuous(max_num_seqs=2)
    forward, calls = engine.model.forward_slots, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("device fell over")
        return forward(*args, **kwargs)

    engine.model.forward_slots = failing

    async def main():
        return await asyncio.gather(*(engine.submit(p, sampling(eos_id=NEVER), seed=0) for p in requests()),
                                    return_exceptions=True)

    results = run(main())
    assert all(isinstance(r, RuntimeError) and "fell over" in str(r) for r in results)
    assert len(engine.batcher.free) == 2 and engine.stats()["running"] == engine.stats()["waiting"] == 0
    assert run(engine.submit(RAGGED, sampling(), seed=0)).num_samples == 8


# weights mid-flight --------------------------------------------------------------------------
def switch_weights_mid_flight(engine, *, submit_after: bool = False):
    """Two prompts generating 12 tokens each; after 3 iterations version 1 lands (before_weights,
    tensors written, load_weights). With ``submit_after``, one more request is submitted once the
    version was announced (before it loaded). Returns the outputs."""
    s = sampling(n=1, max_new_tokens=12, eos_id=NEVER)

    async def main():
        landed = after_iterations(engine, 3)
        first = asyncio.create_task(engine.submit(RAGGED.select(slice(0, 2)), s, seed=0))
        await landed.wait()
        announced = asyncio.create_task(engine.before_weights(1))
        later = asyncio.create_task(engine.submit(RAGGED.select(slice(2, 4)), s, seed=0)) if submit_after else None
        await announced  # created first, so it ran before the late submit
        engine.load_weights(new_weights(engine, seed=9).items(), 1)
        return await first, (await later if later else None)

    return run(main())


def response_versions(out) -> list[list[int]]:
    return [v[p:].tolist() for v, p in zip(out.versions, out.prompt_lens.tolist())]


def test_keep_goes_on_with_the_new_weights_and_each_token_records_its_version():
    engine = continuous(on_new_weights="keep")
    out, _ = switch_weights_mid_flight(engine)
    for versions in response_versions(out):
        assert len(versions) == 12 and versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
    assert engine.stats()["weight_loads"] == 1 and engine.version == 1


def test_restart_generates_in_flight_sequences_again_from_their_prompts_with_the_new_weights():
    engine = continuous(on_new_weights="restart")
    out, _ = switch_weights_mid_flight(engine)
    assert response_versions(out) == [[1] * 12, [1] * 12]
    fresh = build_engine({"type": "builtin"}, model=TINY, seed=9)  # the new weights from the start
    want = fresh.generate(RAGGED.select(slice(0, 2)), sampling(n=1, max_new_tokens=12, eos_id=NEVER), seed=0)
    assert torch.equal(out.tokens.values, want.tokens.values)


def test_finish_ends_in_flight_sequences_on_the_old_weights_and_starts_new_ones_on_the_new():
    engine = continuous(on_new_weights="finish")
    old = build_engine({"type": "builtin"}, model=TINY, seed=3)
    out, late = switch_weights_mid_flight(engine, submit_after=True)
    assert response_versions(out) == [[0] * 12, [0] * 12]
    assert response_versions(late) == [[1] * 12, [1] * 12]
    s = sampling(n=1, max_new_tokens=12, eos_id=NEVER)
    assert torch.equal(out.tokens.values, old.generate(RAGGED.select(slice(0, 2)), s, seed=0).tokens.values)
    stats = engine.stats()
    assert stats["weight_loads"] == 1 and stats["weight_pause_s"] > 0


@pytest.mark.parametrize("mode", ["keep", "restart", "finish"])
def test_a_version_that_never_lands_after_before_weights_leaves_nothing_paused(mode):
    engine = continuous(on_new_weights=mode)
    s = sampling(n=1, max_new_tokens=12, eos_id=NEVER)

    async def main():
        landed = after_iterations(engine, 3)
        first = asyncio.create_task(engine.submit(RAGGED.select(slice(0, 2)), s, seed=0))
        await landed.wait()
        await engine.before_weights(1)
        later = asyncio.create_task(engine.submit(RAGGED.select(slice(2, 4)), s, seed=0))
        engine.resume()  # the sync failed: no load_weights comes
        return await first, await later

    first, later = run(main())
    assert first.num_samples == later.num_samples == 2 and engine.version == 0
    assert {v for out in (first, later) for row in response_versions(out) for v in row} == {0}
