"""Built-in nodes on sequences of their own length: either layout in, the same answers out.

A batch in the rectangular layout of earlier versions (tokens [R, P+T], response_mask [R, T]) and
the same sequences as ragged tensors give equal scores, reference log-probs and advantages; the
padding after a response never reaches a model (changing it changes nothing, bitwise); the rollout
gives each sample exactly its own prompt; the DAPO filter joins groups of any widths and
checkpoints them.
"""

from __future__ import annotations

import io

import pytest
import torch

import flowrl
from flowrl.nodes.advantages import GroupAdvantages
from flowrl.nodes.common import Sequences
from flowrl.nodes.dapo import DapoFilter
from flowrl.nodes.reference import Reference
from flowrl.nodes.reward import Reward
from flowrl.nodes.rollout import Rollout
from flowrl.tasks import EOS, PAD, build_task
from tests.node_harness import call, make_node

MODEL = {"type": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 48}
TASK = {"name": "reverse", "digits": 4}


def legacy_batch(pad: int = PAD) -> flowrl.Batch:
    """Two prompts x 2 samples in the rectangular layout, responses of 3, 1, 4 and 2 tokens."""
    prompts, targets = build_task(TASK).prompts(0, 0, 2)
    p = prompts.shape[1]
    lens = [3, 1, 4, 2]
    g = torch.Generator().manual_seed(0)
    tokens = torch.full((4, p + 5), pad, dtype=torch.int64)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    logprobs = torch.zeros(4, 5)
    for i, n in enumerate(lens):
        tokens[i, :p] = prompts[i // 2]
        tokens[i, p:p + n] = torch.randint(0, 10, (n,), generator=g)
        tokens[i, p + n - 1] = EOS
        mask[i, :n] = True
        logprobs[i, :n] = -torch.rand(n, generator=g)
    return flowrl.Batch(tensors={"tokens": tokens, "response_mask": mask, "logprobs": logprobs,
                                 "targets": targets.repeat_interleave(2, 0), "scores": torch.tensor([1., 0., .5, 0.])},
                        meta={"samples_per_prompt": 2, "temperature": 1.0})


def ragged_batch() -> flowrl.Batch:
    b = legacy_batch()
    s = Sequences.of(b)
    return flowrl.Batch(tensors={"tokens": s.tokens, "loss_mask": s.loss_mask, "prompt_lens": s.prompt_lens,
                                 "logprobs": s.per_token(b, "logprobs"), "targets": b.tensors["targets"],
                                 "scores": b.tensors["scores"]}, meta=dict(b.meta))


def test_sequences_read_either_layout_and_cut_the_padding_after_each_response():
    s = Sequences.of(legacy_batch())
    p = build_task(TASK).prompt_len
    assert s.tokens.lengths.tolist() == [p + 3, p + 1, p + 4, p + 2]
    assert s.loss_mask.values.sum() == 10 and s.prompt_lens.tolist() == [p] * 4
    r = Sequences.of(ragged_batch())
    assert torch.equal(r.tokens.values, s.tokens.values) and r.padded_width is None
    lp = s.per_token(legacy_batch(), "logprobs")
    assert torch.equal(s.emit(lp), legacy_batch().tensors["logprobs"])  # back to the [R, T] grid
    with pytest.raises(ValueError, match="loss_mask"):
        Sequences.of(flowrl.Batch(tensors={"tokens": s.tokens}))


def test_reward_scores_the_same_in_both_layouts():
    node = make_node(Reward, {"task": TASK}, name="reward")
    a = call(node.process, legacy_batch(), "in").tensors["scores"]
    b = call(node.process, ragged_batch(), "in").tensors["scores"]
    assert torch.equal(a, b)


def test_reference_logprobs_are_equal_in_both_layouts_and_blind_to_the_padding():
    node = make_node(Reference, {"model": MODEL, "max_tokens_per_microbatch": 16}, name="reference")
    legacy = call(node.process, legacy_batch(), "in").tensors["ref_logprobs"]
    other_pad = call(node.process, legacy_batch(pad=7), "in").tensors["ref_logprobs"]
    ragged = call(node.process, ragged_batch(), "in").tensors["ref_logprobs"]
    assert isinstance(ragged, flowrl.Ragged) and legacy.shape == (4, 5)
    assert torch.equal(legacy, other_pad)  # bitwise: a pad token is never attended to
    assert torch.equal(Sequences.of(legacy_batch()).emit(ragged), legacy)
    mask = legacy_batch().tensors["response_mask"]
    assert (legacy[~mask] == 0).all() and (legacy[mask] < 0).all()


def test_group_advantages_go_to_the_trained_tokens_only_in_both_layouts():
    node = make_node(GroupAdvantages, {}, name="advantages")
    legacy = call(node.process, legacy_batch(), "in").tensors["advantages"]
    ragged = call(node.process, ragged_batch(), "in").tensors["advantages"]
    assert torch.equal(Sequences.of(legacy_batch()).emit(ragged), legacy)
    trained = ragged_batch().tensors["loss_mask"].values
    assert (ragged.values[~trained] == 0).all() and (ragged.values[trained] != 0).all()


def test_rollout_gives_each_sample_exactly_its_own_prompt_and_the_padded_layout_on_request():
    prompts = flowrl.Ragged.from_sequences([[1, 2, 3, 4, 5, 6, 7], [8, 9], [3, 4, 5, 6]], dtype="int64")
    batch = flowrl.Batch(tensors={"prompts": prompts, "targets": torch.zeros(3, 2, dtype=torch.int64)},
                         meta={"max_new_tokens": 5}, index=0)
    node = make_node(Rollout, {"model": MODEL, "samples_per_prompt": 2}, name="rollout")
    out = call(node.process, batch, "in")
    tokens, mask, lens = out.tensors["tokens"], out.tensors["loss_mask"], out.tensors["prompt_lens"]
    assert lens.tolist() == [7, 7, 2, 2, 4, 4]
    for i in range(6):
        assert tokens[i][: lens[i]].tolist() == prompts[i // 2].tolist()
        assert not mask[i][: lens[i]].any() and mask[i][lens[i]:].all()
        assert 1 <= len(tokens[i]) - lens[i] <= 5
    versions = out.tensors["versions"]
    assert versions.aligned(tokens) and set(versions.values.tolist()) <= {-1, 0}
    padded = make_node(Rollout, {"model": MODEL, "samples_per_prompt": 2, "layout": "padded"}, name="rollout")
    rect = call(padded.process, batch, "in")
    assert rect.tensors["tokens"].shape[1] == 7 + rect.tensors["response_mask"].shape[1]
    back = Sequences.of(rect)
    assert torch.equal(back.loss_mask.values.sum(), mask.values.sum())


def test_dapo_joins_groups_of_any_widths_and_checkpoints_them(tmp_path):
    node = make_node(DapoFilter, {"groups": 4}, name="dapo")
    first = call(node.process, ragged_batch(), "in")  # 2 groups with reward variance, 4 wanted: held
    assert isinstance(first, flowrl.Drop)
    buf = io.BytesIO()
    torch.save(node.state_dict(), buf)
    again = make_node(DapoFilter, {"groups": 4}, name="dapo")
    again.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    longer = ragged_batch()
    t = dict(longer.tensors)
    seqs = Sequences.of(longer)
    t["tokens"] = flowrl.Ragged.from_sequences([torch.cat([s, torch.tensor([1, 2])]) for s in seqs.tokens])
    t["loss_mask"] = t["tokens"].like(torch.cat([torch.cat([m, torch.tensor([True, True])]) for m in seqs.loss_mask]))
    t["logprobs"] = t["tokens"].like(torch.zeros(t["tokens"].total))
    out = call(again.process, longer.replace(tensors=t), "in")
    assert out.num_samples == 8
    assert out.tensors["tokens"].lengths.tolist()[:4] == seqs.tokens.lengths.tolist()
    assert out.tensors["tokens"].lengths.tolist()[4:] == (seqs.tokens.lengths + 2).tolist()


def test_tokens_the_model_cannot_take_are_refused_by_name_before_any_kernel_runs():
    node = make_node(Reference, {"model": MODEL}, name="reference")
    b = ragged_batch()
    t = dict(b.tensors)
    values = t["tokens"].values.clone()
    values[3] = 10_000  # a prompt tokenized for another model
    t["tokens"] = t["tokens"].like(values)
    with pytest.raises(ValueError, match=r"node `reference`: tensor `tokens` holds token id 10000.*same `model:`"):
        call(node.process, b.replace(tensors=t, meta={**b.meta, "tokenizer": {"type": "char"}}), "in")
    long = flowrl.Ragged.from_sequences([list(range(10)) * 6])  # 60 tokens, the model takes 48
    t = {"tokens": long, "loss_mask": long.like(torch.ones(60, dtype=torch.bool))}
    with pytest.raises(ValueError, match="sequence 0 of tensor `tokens` has 60 tokens, more than the model's context"):
        call(node.process, flowrl.Batch(tensors=t, meta={"temperature": 1.0}), "in")
