"""A swap subscriber (`WeightSubscriber(module)`): each committed version is the module's, without
a copy, and buffers it no longer alternates between are let go."""

from __future__ import annotations

import gc
import weakref

import torch

from flowrl.weights import WeightSubscriber


def module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def stage(sub: WeightSubscriber, value: float) -> None:
    """What a receive leaves in staging: every tensor of the version set to `value`."""
    for _, view in sub.plan.iter_views(sub.staging):
        view.fill_(value)


def inside(t: torch.Tensor, buffers: list) -> bool:
    return any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() * b.element_size() for b in buffers)


def test_every_version_is_the_modules_own_and_lies_in_the_buffers_it_arrived_in():
    m = module()
    sub = WeightSubscriber(m, device="cpu")
    x = torch.ones(2, 8)
    for version in range(1, 6):
        stage(sub, float(version))
        arrived = sub.staging
        sub.commit(version)
        assert sub._serving is arrived  # the set it arrived in serves now: no copy
        for p in m.parameters():
            assert inside(p, arrived) and bool((p == float(version)).all())
        assert m(x).shape == (2, 4)  # the module computes with them
        assert len(sub._swap_views) == 2


def test_a_staging_set_made_anew_lets_the_old_one_go():
    m = module()
    sub = WeightSubscriber(m, device="cpu")
    for version in (1, 2):
        stage(sub, float(version))
        sub.commit(version)
    old = weakref.ref(sub.staging[0])
    sub._allocate(sub.layout)  # as a publisher of another layout and back makes it (`_adopt`)
    stage(sub, 3.0)
    sub.commit(3)
    gc.collect()
    assert old() is None  # neither staging nor serving any more: nothing keeps it
    assert all(p.eq(3.0).all() for p in m.parameters())
