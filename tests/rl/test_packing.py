"""Packed compute (flowrl.models.packing) and the ragged per-token helpers (flowrl.rl.tokens, the ragged
advantages and loss weights): each against the sequence alone, the rectangular grid, or a plain loop."""

from __future__ import annotations

import pytest
import torch

from flowrl.models import TinyLMSpec, build_model
from flowrl.models.base import CausalLM
from flowrl.models.packing import (
    aligned_logprobs, forward_packed, packed_logprobs, packed_values, plan_microbatches, shift_to_tokens,
    token_index,
)
from flowrl.rl import (
    aggregate, broadcast_to_tokens, broadcast_to_tokens_ragged, from_grid, gae, loss_weights, ppo_advantages,
    ppo_advantages_ragged, to_grid,
)
from flowrl.rl.tokens import rect_to_ragged, to_rect
from flowrl.transport.ragged import Ragged
from tests.rl.batches import PackedTinyLM, random_batch

SPEC = TinyLMSpec(d_model=32, n_layers=2, n_heads=2, max_seq_len=32)


class OneByOne(CausalLM):
    """A backend without a packed kernel of its own (CausalLM's default runs the sequences one by one)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.has_value_head, self.vocab_size = inner, inner.has_value_head, inner.vocab_size

    def forward(self, tokens):
        return self.inner(tokens)

    def new_cache(self, batch, max_len):
        raise NotImplementedError

    def forward_cached(self, tokens, cache, start):
        raise NotImplementedError


@torch.no_grad()
def _alone(model, tokens: Ragged, temperature: float = 1.0) -> list[torch.Tensor]:
    """Each sequence's aligned log-probs from the model run on that sequence only."""
    out = []
    for seq in tokens:
        logp = torch.log_softmax(model(seq[None])[0].float() / temperature, dim=-1)
        lp = torch.zeros(len(seq))
        lp[1:] = logp[:-1].gather(-1, seq[1:, None]).squeeze(-1)
        out.append(lp)
    return out


def test_plan_packs_first_fit_decreasing_and_names_a_sequence_over_the_budget():
    assert plan_microbatches([5, 300, 12, 40], max_tokens=320) == [[0, 1, 2], [3]]
    assert plan_microbatches([5, 300, 12, 40], max_tokens=None) == [[0, 1, 2, 3]]
    assert plan_microbatches([], max_tokens=8) == []
    bins = plan_microbatches([7, 3, 8, 1, 4, 6, 2], max_tokens=8)
    assert sorted(i for b in bins for i in b) == list(range(7))
    assert all(sum([7, 3, 8, 1, 4, 6, 2][i] for i in b) <= 8 for b in bins)
    with pytest.raises(ValueError, match=r"sequence 1 has 300 tokens, more than max_tokens_per_microbatch=64; "
                                         r"raise max_tokens_per_microbatch to at least 300"):
        plan_microbatches([5, 300], max_tokens=64, where="actor")


@pytest.mark.parametrize("budget", [16, 24, 64])
def test_padded_plan_bounds_the_padded_positions_and_cuts_the_sorted_lengths_where_it_costs_least(budget):
    from itertools import combinations

    from flowrl.models.packing import PADDED_CALL_SHARE

    lengths = [7, 3, 8, 1, 4, 6, 2, 8, 5, 12, 2, 9]
    bins = plan_microbatches(lengths, max_tokens=budget, padded=True)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= budget for b in bins)
    runs = [sorted((lengths[i] for i in b), reverse=True) for b in bins]
    flat = [x for r in runs for x in r]
    assert flat == sorted(lengths, reverse=True)  # runs of the sorted lengths
    cost = lambda rs: sum(len(r) * r[0] + budget / PADDED_CALL_SHARE for r in rs)  # noqa: E731
    partitions = ([flat[a:b] for a, b in zip((0, *cuts), (*cuts, None))]
                  for k in range(len(flat)) for cuts in combinations(range(1, len(flat)), k))
    assert cost(runs) == pytest.approx(min(cost(rs) for rs in partitions if all(len(r) * r[0] <= budget for r in rs)))
    assert plan_microbatches([5, 300], max_tokens=None, padded=True) == [[0, 1]]


def test_token_index_and_shift():
    offsets = torch.tensor([0, 3, 3, 7, 9]).numpy()
    take, cu = token_index(offsets, [3, 0])
    assert take.tolist() == [7, 8, 0, 1, 2] and cu.tolist() == [0, 2, 5]
    out = torch.arange(1.0, 6.0)
    assert shift_to_tokens(out, torch.tensor([0, 2, 5])).tolist() == [0.0, 1.0, 0.0, 3.0, 4.0]


@pytest.mark.parametrize("kind", ["fallback", "kernel", "one_by_one"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_equal_each_sequence_alone(kind, temperature):
    model = PackedTinyLM(SPEC, seed=0) if kind == "kernel" else build_model(SPEC, seed=0)
    if kind == "one_by_one":
        model = OneByOne(model)
    tokens = random_batch(build_model(SPEC, seed=0), 9, seed=1, response=(1, 20))["tokens"]
    want = _alone(model, tokens, temperature)
    for budget in (None, 25, 40):
        got = packed_logprobs(model, tokens, temperature=temperature, max_tokens=budget)
        assert got.aligned(tokens)
        for g, w in zip(got, want):
            assert float((g - w).abs().max()) <= 1e-5


def test_packed_values_equal_each_sequence_alone_and_are_aligned():
    critic = build_model(SPEC, value_head=True, seed=0)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)  # a fresh head is zero: make values non-trivial
    tokens = random_batch(build_model(SPEC, seed=0), 7, seed=2)["tokens"]
    got = packed_values(critic, tokens, max_tokens=20)
    for g, seq in zip(got, tokens):
        with torch.no_grad():
            v = critic(seq[None])[0]
        assert float(g[0]) == 0.0 and float((g[1:] - v[:-1]).abs().max()) <= 1e-5


def test_aligned_entropy_is_the_entropy_of_the_distribution_each_token_was_drawn_from():
    model = build_model(SPEC, seed=0)
    tokens = random_batch(model, 4, seed=3)["tokens"]
    tok, cu = tokens.values, tokens.offsets
    logits = forward_packed(model, tok, cu)
    _, ent = aligned_logprobs(logits, tok, cu, 1.0, entropy=True)
    p = torch.softmax(logits, -1)
    want = shift_to_tokens(-(p * p.log()).sum(-1), cu)
    assert torch.allclose(ent, want, atol=1e-6)


def test_grid_gathers_the_masked_tokens_in_order_and_scatters_back():
    mask = Ragged.from_sequences([[0, 1, 1, 0, 1], [0, 0], [1, 1, 1]], dtype="bool")
    vals = mask.like(torch.arange(10.0))
    grid, gmask = to_grid(vals, mask)
    assert grid.tolist() == [[1.0, 2.0, 4.0], [0.0, 0.0, 0.0], [7.0, 8.0, 9.0]]
    assert gmask.sum(dim=1).tolist() == [3, 0, 3]
    back = from_grid(grid, mask)
    assert back.values.tolist() == [0, 1, 2, 0, 4, 0, 0, 7, 8, 9]


def test_ragged_gae_equals_the_grid_gae_with_holes_and_kl():
    b = random_batch(build_model(SPEC, seed=0), 6, seed=4, holes=True)
    mask, values = b["loss_mask"], b["returns"]
    kl = b["ref_logprobs"]
    adv, ret = ppo_advantages_ragged(b["scores"], values, mask, gamma=0.9, lam=0.8, kl=kl, kl_coef=0.1)
    # the rectangular functions on the sequences right-padded (holes stay holes there: gae skips them)
    width = int(mask.lengths.max())
    want_adv, want_ret = ppo_advantages(b["scores"], values.to_padded(0.0, width), mask.to_padded(False, width),
                                        gamma=0.9, lam=0.8, kl=kl.to_padded(0.0, width), kl_coef=0.1)
    assert torch.allclose(adv.to_padded(0.0, width), want_adv, atol=1e-5)
    assert torch.allclose(ret.to_padded(0.0, width), want_ret, atol=1e-5)
    assert adv.aligned(mask) and float(adv.values[~mask.values].abs().max()) == 0.0


def test_ragged_gae_on_hand_worked_numbers():
    mask = Ragged.from_sequences([[0, 1, 1, 1]], dtype="bool")
    values = mask.like(torch.tensor([9.0, 0.5, 0.6, 0.7]))
    adv, ret = ppo_advantages_ragged(torch.tensor([1.0]), values, mask, gamma=1.0, lam=1.0, whiten=False)
    assert adv.values.tolist() == pytest.approx([0.0, 0.5, 0.4, 0.3])
    assert ret.values.tolist() == pytest.approx([0.0, 1.0, 1.0, 1.0])
    want, _ = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma=1, lam=1)
    assert adv.values[1:].tolist() == pytest.approx(want[0].tolist())


def test_ragged_broadcast_puts_a_sequence_value_on_its_masked_tokens():
    mask = Ragged.from_sequences([[0, 1, 1], [0, 0, 1, 0]], dtype="bool")
    out = broadcast_to_tokens_ragged(torch.tensor([2.0, -1.0]), mask)
    assert out.values.tolist() == [0, 2, 2, 0, 0, -1, 0]
    rect = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert rect.tolist() == [[2, 2, 0], [-1, 0, 0]]


def test_a_legacy_batch_maps_onto_the_ragged_one_and_back():
    tokens = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 1, 2, 3]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]])
    r, m, f = rect_to_ragged(tokens, 2, mask, lp=lp, adv=torch.tensor([1.0, 2.0]), none=None)
    assert r.lengths.tolist() == [4, 3] and r.values.tolist() == [5, 6, 7, 8, 5, 6, 1]  # padding after the last dropped
    assert m.values.tolist() == [False, False, True, True, False, False, True]
    assert f["lp"].values.tolist() == [0, 0, -1, -2, 0, 0, -3] and f["adv"].tolist() == [1.0, 2.0] and f["none"] is None
    assert to_rect(f["lp"], 2, 3).tolist() == lp.tolist()
    with pytest.raises(ValueError, match=r"need a \[2, 3\] response_mask"):
        rect_to_ragged(tokens, 2, mask[:, :2])


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_loss_weights_over_any_split_add_up_to_the_aggregate(mode):
    b = random_batch(build_model(SPEC, seed=0), 8, seed=5, holes=True)
    mask, loss = b["loss_mask"], b["ref_logprobs"].map(torch.abs)
    width = int(mask.lengths.max())
    want = aggregate(loss.to_padded(0.0, width), mask.to_padded(False, width), mode, norm_len=12)
    seq = mask.sample_ids()
    seq_tokens = torch.zeros(8).index_add_(0, seq, mask.values.float())[seq]
    total = 0.0
    for part in ([0, 3, 4], [1, 2], [5, 6, 7]):  # any split into micro-batches (or ranks)
        take, _ = token_index(mask.offsets.numpy(), part)
        w = loss_weights(mask.values[take], seq_tokens[take], mode, tokens=float(mask.values.sum()), sequences=8,
                         norm_len=12)
        total += float((w * loss.values[take]).sum())
    assert total == pytest.approx(float(want), rel=1e-6)


@pytest.mark.timeout(120)
def test_the_packing_benchmark_runs_both_modes_and_packed_computes_fewer_positions():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "packing.py"
    spec = importlib.util.spec_from_file_location("bench_packing", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    padded = bench.child("padded", None, 6, 1, 1)
    packed = bench.child("packed", 1024, 6, 1, 1)
    assert padded["real_tokens_per_step"] == packed["real_tokens_per_step"] > 0
    assert packed["computed_per_real"] < padded["computed_per_real"]
