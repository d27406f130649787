"""Data parallelism inside a node: the ranks of one replica share every batch.

A node with `devices: N` (or a mesh) runs N processes, one torch.distributed group. Rank 0 (the
leader) owns the node's inputs and every input policy (fence, order, joins, version gate); for
each batch it decides to run, it splits the batch into N shards, sends shard r to rank r, runs
shard 0 itself while the others run theirs (so a collective inside `process` — a DDP/FSDP
backward, an all-reduce of a loss count — has every rank in it), gathers the outputs and emits
them concatenated in rank order. Followers see every ticket the leader runs, drops included (as
a marker, without a call), so their watermark and checkpoints follow the leader's exactly.

    shards = split_groups(batch, 2)          # a GRPO group (samples_per_prompt rows) stays whole
    merged = merge_outputs([out0, out1])     # rank order; drops count as empty

Shards travel over flowrl's own channels (ipc between the ranks of one host): no pickle, credit
flow, the same codec as every edge.
"""

from __future__ import annotations

from flowrl.node import Drop


def split_groups(batch, parts: int) -> list:
    """`parts` contiguous shards of near-equal size that never cut a prompt group in two
    (`meta["samples_per_prompt"]` rows each; 1 when absent)."""
    n = batch.num_samples
    g = int(batch.meta.get("samples_per_prompt", 1) or 1)
    if g < 1 or n % g:
        g = 1
    groups = n // g
    base, extra = divmod(groups, parts)
    out, start = [], 0
    for r in range(parts):
        stop = start + (base + (1 if r < extra else 0)) * g
        out.append(batch.select(slice(start, stop)))
        start = stop
    return out


def merge_outputs(outputs: list):
    """The ranks' outputs for one ticket as one: batches concatenated in rank order; a rank that
    dropped (or returned nothing) contributes no samples; all dropped -> a Drop."""
    from flowrl.transport import Batch

    kept = [o for o in outputs if not isinstance(o, Drop) and o is not None and o.num_samples]
    if not kept:
        drops = [o for o in outputs if isinstance(o, Drop)]
        return drops[0] if drops else Drop("every rank returned an empty batch")
    return Batch.concat(kept) if len(kept) > 1 else kept[0]


def shard_address(sockdir: str, node: str, replica: int, rank: int) -> str:
    return f"ipc://{sockdir}/{node}.{replica}.rank{rank}"
