"""The Hugging Face adapter on a tiny randomly initialised Llama saved to a temp folder."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flowrl.models import build_model, generate, token_logprobs, values  # noqa: E402
from flowrl.models.packing import packed_logprobs  # noqa: E402
from flowrl.tasks import EOS, PAD, VOCAB_SIZE, build_task  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(hf_model_dir):
    return hf_model_dir


def test_hf_policy_generates_with_cache_and_recomputes_the_same_logprobs(model_dir):
    policy = build_model({"type": "hf", "path": model_dir})
    prompts = build_task({"name": "reverse", "digits": 4}).prompts(0, 0, 4)[0]
    out = generate(policy, prompts, max_new_tokens=5, eos_id=EOS, pad_id=PAD,
                   generator=torch.Generator().manual_seed(0))
    assert out.num_samples == 4 and out.prompt_lens.tolist() == [prompts.shape[1]] * 4
    assert (out.response_lens >= 1).all() and (out.response_lens <= 5).all()
    packed = packed_logprobs(policy, out.tokens)
    torch.testing.assert_close(packed.values * out.loss_mask.values, out.logprobs.values, atol=1e-4, rtol=0)
    # the rectangular helper agrees on the full grid (every prompt has P tokens here)
    p = prompts.shape[1]
    grid = out.tokens.to_padded(PAD)
    full = token_logprobs(policy, grid, p)
    mask = out.loss_mask.to_padded(False)[:, p:]
    torch.testing.assert_close(full * mask, out.logprobs.to_padded(0.0)[:, p:], atol=1e-4, rtol=0)
    again = generate(policy, prompts, max_new_tokens=5, eos_id=EOS, pad_id=PAD,
                     generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.tokens.values, again.tokens.values)


def test_hf_critic_has_a_zero_initialised_value_head_and_trains(model_dir):
    critic = build_model({"type": "hf", "path": model_dir}, value_head=True)
    tokens = torch.randint(0, VOCAB_SIZE, (3, 10))
    v = values(critic, tokens, prompt_len=6)
    assert v.shape == (3, 4) and torch.equal(v, torch.zeros(3, 4))
    loss = (values(critic, tokens, 6) - 1.0).pow(2).mean()
    loss.backward()
    assert critic.value_head.weight.grad is not None and float(critic.value_head.weight.grad.abs().sum()) > 0


def test_hf_loads_in_the_requested_dtype(model_dir):
    policy = build_model({"type": "hf", "path": model_dir, "dtype": "bfloat16"})
    assert next(policy.parameters()).dtype == torch.bfloat16


def test_a_missing_folder_is_a_clear_error_and_nothing_is_downloaded(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        build_model({"type": "hf", "path": str(tmp_path / "nope")})
