"""DAPO dynamic sampling: groups without reward variance are dropped, the rest kept whole, counted."""

import pytest
import torch

import flowrl
from flowrl.nodes.dapo import DapoFilter
from flowrl.rl.dynamic_sampling import filter_groups
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


def _batch(scores, g, index=1, version=5):
    n = len(scores)
    return flowrl.Batch(tensors={"scores": torch.tensor(scores, dtype=torch.float32),
                                 "tokens": (torch.arange(n)[:, None] + 100 * index).repeat(1, 3),
                                 "response_mask": torch.ones(n, 2, dtype=torch.bool)},
                        meta={"samples_per_prompt": g, "prompt_len": 1}, batch_id=f"t-{index:06d}",
                        policy_version=version)


def test_without_fill_the_node_shrinks_the_batch_to_whole_kept_groups_and_counts_the_drops(tmp_path):
    node = make_node(DapoFilter, {"fill": False}, name="dapo")
    out = call(node.process, _batch([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0], 2), "in")
    assert out.num_samples == 4 and out.batch_id == "t-000001"
    assert out.tensors["tokens"][:, 0].tolist() == [100, 101, 106, 107]  # samples stay with their group, in order
    assert out.meta["samples_per_prompt"] == 2
    assert call(node.process, _batch([1.0] * 4, 2), "in") is None  # nothing to learn from: the ticket is dropped
    full = _batch([1.0, 0.0] * 2, 2)
    assert call(node.process, full, "in") is full  # nothing dropped: the batch passes as it is
    row = metrics_row(node, tmp_path)
    assert row["dapo_groups_kept"] == 4 and row["dapo_groups_dropped"] == 4
    assert row["dapo_kept_ratio_mean"] == pytest.approx(4 / 8)


def test_fill_holds_kept_groups_until_a_batch_of_the_tickets_size_is_full_and_asks_for_replacements(tmp_path):
    node = make_node(DapoFilter, {}, name="dapo")
    first = call(node.process, _batch([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0], 2, index=1, version=3), "in")
    assert isinstance(first, flowrl.Drop) and first.replace and "2/4 groups" in first.reason
    out = call(node.process, _batch([0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.5, 1.0], 2, index=2, version=4), "in")
    # 4 groups = the ticket's prompt count: the two held (ticket 1) first, then two of ticket 2
    assert out.num_samples == 8 and out.tensors["tokens"][:, 0].tolist() == [100, 101, 106, 107, 200, 201, 204, 205]
    assert out.policy_version == 3  # its oldest sample's version: staleness counts the wait
    assert out.meta["dapo_groups"] == 4
    # the surplus group of ticket 2 is held for the next batch, and is saved with the node's state
    assert [b.tensors["tokens"][:, 0].tolist() for b in node.held] == [[206, 207]]
    assert node.held[0].policy_version == 4  # its own version, not the oldest of the batch it left
    state = node.state_dict()
    again = make_node(DapoFilter, {}, name="dapo")
    again.load_state_dict(state)
    assert again.waited == node.waited == 0
    assert torch.equal(again.held[0].tensors["tokens"], node.held[0].tensors["tokens"])
    row = metrics_row(node, tmp_path)
    assert row["dapo_groups_kept"] == 5 and row["dapo_groups_dropped"] == 3
    assert row["dapo_tickets_per_batch_mean"] == 2 and row["dapo_groups_held"] == 1


def test_fill_gives_up_after_max_batches_with_what_it_has_or_drops_for_good_when_it_has_nothing(tmp_path):
    node = make_node(DapoFilter, {"max_batches": 2, "groups": 3}, name="dapo")
    assert call(node.process, _batch([1.0, 0.0, 1.0, 1.0], 2, index=1), "in").replace
    out = call(node.process, _batch([1.0, 1.0, 0.0, 0.0], 2, index=2), "in")
    assert out.num_samples == 2 and out.meta["dapo_groups"] == 1  # underfilled, not stuck
    assert call(node.process, _batch([1.0] * 4, 2, index=3), "in").replace
    last = call(node.process, _batch([0.0] * 4, 2, index=4), "in")
    assert isinstance(last, flowrl.Drop) and not last.replace and "no group" in last.reason
    assert metrics_row(node, tmp_path)["dapo_underfilled"] == 1


def test_groups_of_different_widths_are_refused_with_the_fix():
    node = make_node(DapoFilter, {}, name="dapo")
    call(node.process, _batch([1.0, 0.0, 1.0, 1.0], 2, index=1), "in")
    wide = _batch([1.0, 0.0, 0.0, 1.0], 2, index=2)
    wide = wide.replace(tensors={**wide.tensors, "tokens": torch.zeros(4, 5, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"rectangular \[2, 5\] in the other.*layout: ragged"):
        call(node.process, wide, "in")


def test_a_batch_smaller_than_the_ticket_is_refused_since_surplus_groups_would_pile_up():
    node = make_node(DapoFilter, {"groups": 1}, name="dapo")
    with pytest.raises(ValueError, match="groups=1 is below the ticket's 2 prompts"):
        call(node.process, _batch([1.0, 0.0, 1.0, 0.0], 2), "in")


def test_data_parallel_ranks_that_disagree_on_holding_a_ticket_are_an_error_not_a_half_batch():
    from flowrl.runtime.worker.contract import NodeContractError
    from flowrl.runtime.worker.ranks import merge_outputs

    held = flowrl.Drop("held", replace=True)
    with pytest.raises(NodeContractError, match="1 of 2 ranks returned Drop"):
        merge_outputs([held, _batch([1.0, 0.0], 2)])
    with pytest.raises(NodeContractError):
        merge_outputs([held, flowrl.Drop("none")])
    assert merge_outputs([held, held]) is held
