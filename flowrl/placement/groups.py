"""Choosing device groups for `devices: auto` and `devices: N`: topology first, then tidiness.

A GPU group is judged by, in order (smaller is better):
  1. devices busy with foreign processes   (an OOM waiting to happen)
  2. devices already used by our own nodes (only when there are not enough free ones)
  3. distinct memory sizes - 1             (every rank is held to the smallest card)
  4. minus NVLink links inside the group   (tensor/data parallel traffic off PCIe)
  5. PCIe root complexes, then NUMA nodes spanned
  6. minus the smallest card's memory      (big roles, placed first, get the big cards)
  7. NVLink links cut to free devices left (keep pairs whole for the nodes placed later)
  8. the ids                               (deterministic)
Small hosts are searched exhaustively; above a few thousand candidate groups, greedily from each
seed device. A group larger than any host spans as few hosts as split it evenly (torchrun needs
the same number of processes on every host).

CPU cores carry no topology: the least-loaded cores win, ties broken round-robin, so that six nodes
on two cores alternate 0, 1, 0, 1, ...
"""

from __future__ import annotations

from itertools import combinations
from math import comb

from flowrl.placement.devices import GIB, Device, Inventory

Key = tuple[str, int]  # (host, physical id)
EXHAUSTIVE_LIMIT = 3000


def mem_class(d: Device) -> int | None:
    """Memory rounded to whole GiB: cards of one model compare equal despite ECC reserve noise."""
    return None if d.memory_bytes is None else round(d.memory_bytes / GIB)


def nvlink_links(group: list[Device]) -> int:
    return sum(1 for a, b in combinations(group, 2) if b.id in a.nvlink_peers)


def _score(group: list[Device], load: dict[Key, int], pool_ids: set[int]) -> tuple:
    ids = {d.id for d in group}
    mems = {mem_class(d) for d in group}
    cut = sum(1 for d in group for p in d.nvlink_peers if p in pool_ids and p not in ids)
    return (
        sum(d.busy for d in group),
        sum(load.get((d.host, d.id), 0) for d in group),
        len(mems) - 1,
        -nvlink_links(group),
        len({d.pcie_root for d in group}),
        len({d.numa_node for d in group}),
        -min((m or 0) for m in mems),
        cut,
        sorted(ids),
    )


def best_on_host(devs: list[Device], size: int, load: dict[Key, int]) -> list[Device]:
    """The best `size` devices among `devs` (all on one host)."""
    pool_ids = {d.id for d in devs}
    if comb(len(devs), size) <= EXHAUSTIVE_LIMIT:
        candidates = (list(c) for c in combinations(devs, size))
    else:
        candidates = []
        for seed in devs:
            group = [seed]
            while len(group) < size:
                rest = [d for d in devs if d not in group]
                group.append(min(rest, key=lambda d: _score(group + [d], load, pool_ids)))
            candidates.append(group)
    return sorted(min(candidates, key=lambda g: _score(g, load, pool_ids)), key=lambda d: d.id)


def best_group(pool: list[Device], size: int, load: dict[Key, int], hosts: list[str]) -> list[Device] | None:
    """The best group of `size` from `pool`, on one host if any can hold it. None if too few."""
    if len(pool) < size:
        return None
    by_host = {h: [d for d in pool if d.host == h] for h in hosts}
    single = [best_on_host(devs, size, load) for devs in by_host.values() if len(devs) >= size]
    if single:  # ties go to the first host
        return min(single, key=lambda g: _score(g, load, {d.id for d in by_host[g[0].host]})[:-1])
    for span in range(2, len(hosts) + 1):
        per = size // span
        if size % span == 0:
            roomy = [h for h in hosts if len(by_host[h]) >= per]
            if len(roomy) >= span:
                return [d for h in roomy[:span] for d in best_on_host(by_host[h], per, load)]
    out: list[Device] = []  # uneven: the rank-layout check will say so
    for h in hosts:
        take = by_host[h][: size - len(out)]
        out += take
    return out


def pick_gpus(inv: Inventory, size: int, hosts: list[str], load: dict[Key, int],
              partners: set[Key]) -> tuple[list[Device] | None, bool]:
    """A group for one replica: (devices, had_to_share). Colocation partners' devices come first,
    then free devices; only when too few are free, the least-used ones (`had_to_share`)."""
    visible = [d for h in hosts for d in inv.host(h).visible_devices()]
    shared_with_partner = [d for d in visible if (d.host, d.id) in partners]
    free = [d for d in visible if not load.get((d.host, d.id))]
    for pool in (shared_with_partner, shared_with_partner + [d for d in free if d not in shared_with_partner], free):
        group = best_group(pool, size, load, hosts)
        if group:
            return group, False
    return best_group(visible, size, load, hosts), True


def pick_cores(inv: Inventory, size: int, hosts: list[str], load: dict[Key, int],
               cursor: dict[str, int]) -> list[Device] | None:
    """`size` least-loaded cores on one host, ties broken round-robin from that host's cursor."""
    best = None
    for h in hosts:
        cores = inv.host(h).visible_devices()
        if len(cores) < size:
            continue
        start = cursor.get(h, 0) % len(cores)
        ring = cores[start:] + cores[:start]
        chosen = sorted(ring, key=lambda d: load.get((h, d.id), 0))[:size]  # stable: ring order on ties
        cost = sum(load.get((h, d.id), 0) for d in chosen)
        if best is None or cost < best[0]:
            best = (cost, h, chosen, (ring.index(chosen[-1]) + start + 1))
    if best is None:
        return None
    _, h, chosen, nxt = best
    cursor[h] = nxt
    return chosen
