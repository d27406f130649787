"""DAPO dynamic sampling: groups without reward variance are dropped, the rest kept whole, counted."""

import pytest
import torch

import flowrl
from flowrl.nodes.dapo import DapoFilter
from flowrl.rl.dynamic_sampling import DynamicSampling, filter_groups
from tests.node_harness import call, make_node, metrics_row


def reference_keep(scores, g):
    """The plain rule, one group at a time."""
    return [i for i in range(len(scores) // g) if len(set(scores[i * g:(i + 1) * g])) > 1]


@pytest.mark.parametrize("seed", range(5))
def test_the_kept_groups_are_exactly_those_whose_samples_disagree(seed):
    g = 4
    scores = torch.randint(0, 2, (8 * g,), generator=torch.Generator().manual_seed(seed)).float()
    f = filter_groups(scores, g)
    want = reference_keep(scores.tolist(), g)
    assert f.keep_groups.tolist() == want and (f.kept, f.dropped) == (len(want), 8 - len(want))
    assert f.keep_samples.tolist() == [i * g + j for i in want for j in range(g)]


def test_a_std_threshold_drops_nearly_uniform_groups_and_bad_shapes_are_refused():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 0.0, 0.0, 1.0])
    assert filter_groups(scores, 4).kept == 2
    assert filter_groups(scores, 4, min_std=0.1).keep_groups.tolist() == [1]
    with pytest.raises(ValueError, match="does not split into groups of 3"):
        filter_groups(scores, 3)


def test_the_running_counts_and_the_shortfall_against_a_target():
    sampler = DynamicSampling(target_groups=4)
    _, need = sampler(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]), 2)
    assert need == 2 and (sampler.seen, sampler.kept, sampler.dropped) == (4, 2, 2)
    _, need = sampler(torch.zeros(8), 2)
    assert need == 4 and sampler.empty_batches == 1 and sampler.dropped == 6


def _batch(scores, g):
    n = len(scores)
    return flowrl.Batch(tensors={"scores": torch.tensor(scores), "tokens": torch.arange(n)[:, None].repeat(1, 3),
                                 "response_mask": torch.ones(n, 2, dtype=torch.bool)},
                        meta={"samples_per_prompt": g}, batch_id="t-000001")


def test_the_node_shrinks_the_batch_to_whole_kept_groups_and_counts_the_drops(tmp_path):
    node = make_node(DapoFilter, {}, name="dapo")
    out = call(node.process, _batch([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0], 2), "in")
    assert out.num_samples == 4 and out.batch_id == "t-000001"
    assert out.tensors["tokens"][:, 0].tolist() == [0, 1, 6, 7]  # samples stay with their group, in order
    assert out.meta["dapo_need"] == 2 and out.meta["samples_per_prompt"] == 2
    assert call(node.process, _batch([1.0] * 4, 2), "in") is None  # nothing to learn from: the ticket is dropped
    full = _batch([1.0, 0.0] * 2, 2)
    assert call(node.process, full, "in") is full  # nothing dropped: the batch passes as it is
    row = metrics_row(node, tmp_path)
    assert row["dapo_groups_kept"] == 4 and row["dapo_groups_dropped"] == 4
    assert row["dapo_kept_ratio_mean"] == pytest.approx(4 / 8)
