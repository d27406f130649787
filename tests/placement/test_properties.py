"""Invariants of every plan, over generated graphs and inventories (hypothesis)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.graph import GraphSpec, NodeSpec
from flowrl.placement import make_plan
from flowrl.placement.declared import DeclaredInventory

ROLES = ["Actor", "Critic", "Rollout", "Reference", "Reward"]


def _inventory(hosts: int, gpus: int, pairs: bool) -> DeclaredInventory:
    lines = ["hosts:"]
    for h in range(hosts):
        lines.append(f"  - name: h{h}\n    gpu_defaults: {{memory_gb: 80}}\n    gpus:")
        for g in range(gpus):
            peer = g ^ 1 if pairs and (g ^ 1) < gpus else None
            lines.append(f"      - {{id: {g}, nvlink: [{peer if peer is not None else ''}]}}")
    return DeclaredInventory.from_text("\n".join(lines))


nodes = st.lists(st.tuples(st.sampled_from(ROLES), st.integers(1, 2), st.integers(1, 4)), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(nodes=nodes, hosts=st.integers(1, 2), gpus=st.integers(1, 8), pairs=st.booleans())
def test_every_group_has_torchrun_ranks_and_auto_groups_are_disjoint_when_they_fit(nodes, hosts, gpus, pairs):
    inv = _inventory(hosts, gpus, pairs)
    spec = GraphSpec(nodes={f"n{i}": NodeSpec(kind=f"tests.placement.roles:{role}", replicas=r, devices=d)
                            for i, (role, r, d) in enumerate(nodes)})
    plan = make_plan(spec, inv)
    for (node, _), ranks in plan.groups().items():
        size = ranks[0].world_size
        assert [e.rank for e in ranks] == list(range(size))
        assert len({(e.host, e.devices[0]) for e in ranks}) == size  # one device per process, no repeats
        for e in ranks:
            same_host = [x for x in ranks if x.host == e.host]
            assert e.local_rank == same_host.index(e) == e.local_devices[0]
            assert e.visible_devices == [x.devices[0] for x in same_host]
    if sum(r * d for _, r, d in nodes) <= hosts * gpus:
        # everything fits: nothing is shared; only a group that cannot split evenly over the
        # hosts' leftover devices (3 GPUs as 2 + 1) may be reported, as a rank layout
        assert {f.code for f in plan.errors} <= {"rank-layout"}, [f.message for f in plan.errors]
        used = [(e.host, e.devices[0]) for e in plan.entries]
        assert len(used) == len(set(used))
