"""The vLLM engine (skipped without vllm): one engine, in this process, on the tiny example Llama.

    pip install -e ".[vllm]" && python -m pytest tests/engines/test_vllm.py
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")

from flowrl.engines import Sampling, build_engine  # noqa: E402
from flowrl.engines.vllm import EngineUnusableError, WeightLoadError, fuse_like_engine  # noqa: E402
from flowrl.engines.vllm_worker import digest  # noqa: E402
from flowrl.models import build_model  # noqa: E402
from flowrl.tasks import EOS, PAD  # noqa: E402
from flowrl.transport.ragged import Ragged  # noqa: E402
from tests.engines.layout import (  # noqa: E402
    RAGGED,
    RECT,
    assert_batch_equals_alone,
    assert_layout,
    recompute,
    too_long,
)

PROMPTS = RAGGED  # four prompts of 6, 9, 4 and 7 tokens
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = build_engine({"type": "vllm", "kv_cache_memory_bytes": 64 << 20, "max_model_len": 64},
                       model={"type": "hf", "path": tiny_llama}, seed=0)
    yield eng
    eng.close()


def sampling(**kw):
    return Sampling(**{"n": 4, "temperature": 1.0, "max_new_tokens": 6, "eos_id": EOS, "pad_id": PAD, **kw})


def test_the_engine_runs_in_this_process_and_only_on_loopback(engine):
    from vllm.utils.network_utils import get_ip

    assert os.environ["VLLM_HOST_IP"] == "127.0.0.1" and get_ip() == "127.0.0.1"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["VLLM_NO_USAGE_STATS"] == "1"


def test_vllm_gets_each_prompts_own_tokens_and_its_logprobs_are_close_to_the_trainers(engine, tiny_llama):
    out = engine.generate(PROMPTS, sampling(temperature=0.8), seed=7)
    assert_layout(out, PROMPTS, 4, 6)
    trainer = build_model({"type": "hf", "path": tiny_llama}).eval()
    gap = (recompute(trainer, out, 0.8) - out.logprobs.values).abs().max()
    assert gap < 1e-3, f"vLLM vs trainer log-probs differ by {gap}"
    again = engine.generate(PROMPTS, sampling(temperature=0.8), seed=7)
    assert torch.equal(again.tokens.values, out.tokens.values)  # per-request seeds: reproducible
    legacy = engine.generate(RECT, sampling(n=2), seed=7)  # a [B, P] tensor: B prompts of P tokens
    assert_layout(legacy, Ragged.from_padded(RECT, torch.full((3,), 7)), 2, 6)


def test_vllm_agrees_with_the_hf_engine_on_layout_and_greedy_tokens(engine, tiny_llama):
    s = sampling(n=2, temperature=0.0)
    ours = engine.generate(PROMPTS, s, seed=0)
    theirs = build_engine({"type": "hf"}, model={"type": "hf", "path": tiny_llama}).generate(PROMPTS, s, seed=0)
    assert_layout(ours, PROMPTS, 2, 6)
    assert torch.equal(ours.tokens.offsets, theirs.tokens.offsets) and torch.equal(ours.prompt_lens, theirs.prompt_lens)
    assert torch.equal(ours.tokens.values, theirs.tokens.values)
    assert torch.equal(ours.loss_mask.values, theirs.loss_mask.values)
    torch.testing.assert_close(ours.logprobs.values, theirs.logprobs.values, atol=1e-4, rtol=0)


def test_greedy_a_ragged_batch_generates_what_each_prompt_alone_does(engine):
    assert_batch_equals_alone(engine, PROMPTS, sampling(n=2, temperature=0.0), atol=1e-4)


def test_a_prompt_too_long_for_max_model_len_or_an_empty_one_is_refused_before_generating(engine):
    with pytest.raises(ValueError, match=r"prompt 1 has 59 tokens, more than the 58 that fit: the model's context "
                                         r"of 64 tokens \(the engine's max_model_len\) minus max_new_tokens=6"):
        engine.generate(too_long(6, 64), sampling(), seed=0)
    with pytest.raises(ValueError, match=r"prompt 1 is empty"):
        engine.generate(Ragged.from_sequences([[12, 1], []]), sampling(), seed=0)
    fits = Ragged.from_sequences([[12, 1], [1] * 58])  # exactly at the limit: fine
    assert_layout(engine.generate(fits, sampling(n=1), seed=0), fits, 1, 6)


def test_loaded_weights_are_bitwise_the_trainers_at_every_version(engine, tiny_llama):
    staging = engine.weights()
    assert all(k.startswith("backbone.") for k in staging)  # the trainer's (HF adapter's) names
    packed = engine.packed_modules()
    assert engine.engine_digest() == digest(fuse_like_engine(staging, packed))  # version 0: the folder
    before = engine.generate(PROMPTS, sampling(temperature=0.0), seed=0).tokens.values
    for version in (1, 2):
        gen = torch.Generator().manual_seed(version)
        with torch.no_grad():  # what the runtime does: receive the new version into the staging tensors
            for t in staging.values():
                t.copy_(torch.randn(t.shape, generator=gen) * 0.2)
        engine.load_weights(staging.items(), version)
        want = digest(fuse_like_engine({k: v.clone() for k, v in staging.items()}, packed))
        assert engine.engine_digest() == want, f"version {version}: engine weights differ from the trainer's"
        assert engine.version == version
    after = engine.generate(PROMPTS, sampling(temperature=0.0), seed=0).tokens.values
    assert not torch.equal(before, after)  # greedy output moved with the weights


def randomise(staging, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # what the runtime does: receive a new version into the staging tensors
        for t in staging.values():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.2)


def test_a_version_that_fails_in_the_middle_of_the_engines_reload_leaves_the_previous_one_bitwise(engine):
    staging, packed = engine.weights(), engine.packed_modules()
    randomise(staging, 10)
    engine.load_weights(staging.items(), 10)
    v10 = engine.engine_digest()
    greedy = engine.generate(PROMPTS, sampling(temperature=0.0), seed=0).tokens.values
    randomise(staging, 11)
    engine.reload_faults = [2]  # vLLM's reload raises with the embedding and layer 0's q in, its k and v not
    with pytest.raises(WeightLoadError, match=r"after \d+ tensors.*restored to version 10"):
        engine.load_weights(staging.items(), 11)
    assert engine.version == 10 and engine.engine_digest() == v10
    assert torch.equal(engine.generate(PROMPTS, sampling(temperature=0.0), seed=0).tokens.values, greedy)
    # a source that breaks while being read fails before the engine is touched
    def broken():
        for i, item in enumerate(staging.items()):
            if i == 3:
                raise ConnectionError("the broadcast broke")
            yield item
    with pytest.raises(ConnectionError):
        engine.load_weights(broken(), 11)
    assert engine.version == 10 and engine.engine_digest() == v10
    # the same version sent again lands whole
    engine.load_weights(staging.items(), 11)
    assert engine.engine_digest() == digest(fuse_like_engine({k: v.clone() for k, v in staging.items()}, packed))


def test_if_the_restore_fails_too_the_engine_refuses_to_generate_until_a_whole_version_loads(engine):
    staging, packed = engine.weights(), engine.packed_modules()
    randomise(staging, 12)
    engine.reload_faults = [4, 2]  # the reload and then the restore raise partway
    with pytest.raises(WeightLoadError, match="restoring version .* failed too"):
        engine.load_weights(staging.items(), 12)
    with pytest.raises(EngineUnusableError, match="mixed weights"):
        engine.generate(PROMPTS, sampling(), seed=0)
    engine.load_weights(staging.items(), 12)
    assert engine.version == 12 and engine.unusable is None
    assert engine.engine_digest() == digest(fuse_like_engine({k: v.clone() for k, v in staging.items()}, packed))
    assert_layout(engine.generate(PROMPTS, sampling(), seed=0), PROMPTS, 4, 6)
