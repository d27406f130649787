"""Data parallelism for the trainers: one model sharded (FSDP2) over the ranks of a node.

    >>> dp = DataParallel()                 # the default group, or DataParallel(group)
    >>> dp.shard(model)                     # fully_shard per layer + root; a no-op on one rank
    >>> sizes = dp.sizes(len(my_rows))      # every rank's shard size, the same list on every rank
    >>> for name, t in full_state_items(model): ...   # collective: every rank iterates to the end

Each rank holds a shard of the batch (rows ``offset_r .. offset_r + n_r - 1`` of the batch the
ranks' shards concatenate to, in rank order). The trainer draws ONE permutation of the whole
batch (same generator on every rank, so the same permutation), splits it into mini-batches exactly
as a 1-rank trainer does, and each rank trains on its own rows of each mini-batch
(:func:`local_rows`). Losses are sums over a mini-batch divided by the mini-batch's count over ALL
ranks (:meth:`DataParallel.all_sum`), and FSDP2 averages gradients over the ranks, so the scaled
per-rank losses (``loss_r * count_r / count * world_size``) sum to the 1-rank loss of the whole
mini-batch: N ranks make the 1-rank update, to float rounding. See docs/data-parallel.md.

Nothing here runs a collective when there is one rank (or no process group): a 1-rank trainer is
exactly the plain one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def local_rows(part: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """This rank's rows of a mini-batch of global row ids ``part``, as local indices, in ``part``'s order.

    >>> local_rows(torch.tensor([5, 0, 3, 2]), offset=2, n=3)   # this rank holds global rows 2, 3, 4
    tensor([1, 0])
    """
    mine = (part >= offset) & (part < offset + n)
    return part[mine] - offset


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class DataParallel:
    """The ranks a trainer spans: the node's process group (the default one unless given)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self.enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.group = group
        self.rank = dist.get_rank(group) if self.enabled else 0
        self.world_size = dist.get_world_size(group) if self.enabled else 1
        self.device = torch.device("cpu")  # collectives' tensors: cuda for NCCL (set by shard)

    def shard(self, model: nn.Module) -> nn.Module:
        """Make every rank start from rank 0's weights, then ``fully_shard`` each layer and the root.

        A "layer" is every item of every ``nn.ModuleList`` (the transformer blocks of the built-in
        model and of Hugging Face models); the rest (embeddings, heads, final norm) is the root's
        group. The module stays the same object, its class gains FSDP's methods. A backend's own packed
        kernel (``forward_packed``) is registered as a forward method too, so calling it all-gathers the
        root's parameters as ``model(...)`` does (``flowrl.models.packing.forward_packed`` calls it).
        """
        if not self.enabled:
            return model
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        from flowrl.models.packing import has_packed_kernel

        device = next(model.parameters()).device
        self.device = device
        group = self.group if self.group is not None else dist.group.WORLD
        with torch.no_grad():  # ranks may have built from different seeds: rank 0's weights win
            for t in model.state_dict().values():
                dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
        mesh = DeviceMesh.from_group(group, device.type)
        for module in list(model.modules()):
            if isinstance(module, nn.ModuleList):
                for layer in module:
                    fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if has_packed_kernel(model):
            register_fsdp_forward_method(model, "forward_packed")
        return model

    def from_rank0(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's value of ``t`` on every rank (a copy; e.g. the shuffling generator's state)."""
        if not self.enabled:
            return t.clone()
        import torch.distributed as dist

        group = self.group if self.group is not None else dist.group.WORLD
        out = t.to(self.device).clone()
        dist.broadcast(out, src=dist.get_global_rank(group, 0), group=group)
        return out.to(t.device)

    def sizes(self, n: int) -> list[int]:
        """Every rank's ``n``, in rank order (one all-gather)."""
        if not self.enabled:
            return [n]
        import torch.distributed as dist

        out = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(out, torch.tensor([n], dtype=torch.int64, device=self.device), group=self.group)
        return [int(t) for t in out]

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the ranks (a copy; float64 in, float64 out for exact counts)."""
        if not self.enabled:
            return values.clone()
        import torch.distributed as dist

        out = values.to(self.device).clone()
        dist.all_reduce(out, group=self.group)
        return out.cpu()

    def all_max(self, value: float) -> float:
        """The largest of every rank's `value`."""
        if not self.enabled:
            return value
        import torch.distributed as dist

        out = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return float(out.cpu()[0])

    def weighted_means(self, rows: list[dict[str, tuple[float, float]]]) -> list[dict[str, float]]:
        """Each ``name: (value, weight)`` becomes the weight-averaged value over the ranks, in one all-reduce.

        A rank with weight 0 (no rows of that mini-batch) contributes nothing, its value unread.
        One rank: the values as they are.
        """
        if not self.enabled:
            return [{k: float(v) for k, (v, _) in row.items()} for row in rows]
        flat = [(float(v) * w if w else 0.0, float(w)) for row in rows for v, w in row.values()]
        sums = self.all_sum(torch.tensor(flat, dtype=torch.float64).reshape(-1, 2)) if flat else torch.zeros(0, 2)
        out, i = [], 0
        for row in rows:
            means = {}
            for k in row:
                num, den = sums[i].tolist()
                means[k] = num / den if den else 0.0
                i += 1
            out.append(means)
        return out


def full_state_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every entry of ``model.state_dict()``, one at a time, in its order.

    Sharded (FSDP2) model: each DTensor is all-gathered as it is reached (``full_tensor()``), so a
    rank holds its shard plus ONE full tensor at a time, never a second full copy of the model.
    This is a collective: every rank of the model's group must iterate it to the end, in the same
    order (the publisher on rank 0 keeps what it needs, the other ranks just drain it). Plain
    model: the tensors themselves, detached (no communication). Copy what you keep: a yielded
    tensor may be the live parameter.
    """
    for name, t in model.state_dict().items():
        yield name, (t.full_tensor() if is_dtensor(t) else t).detach()


def local_state(state: Any) -> Any:
    """A (nested) state dict with every DTensor replaced by this rank's shard (plain tensors only)."""
    if is_dtensor(state):
        return state.to_local()
    if isinstance(state, dict):
        return {k: local_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(local_state(v) for v in state)
    return state


def load_local_model_state(model: nn.Module, saved: dict[str, torch.Tensor], only: set[str] | None = None) -> None:
    """Copy shards saved by :func:`local_state` back into a sharded model (same ranks, same layout);
    ``only``: the entries a checkpoint holds (LoRA: the adapters), the rest is left as it is."""
    live = {k: v for k, v in model.state_dict().items() if only is None or k in only}
    missing, unexpected = live.keys() - saved.keys(), saved.keys() - live.keys()
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}; load a checkpoint of the same model")
    with torch.no_grad():
        for name, t in live.items():
            target = t.to_local() if is_dtensor(t) else t
            if target.shape != saved[name].shape:
                raise ValueError(f"checkpoint shard of {name!r} is {tuple(saved[name].shape)}, this rank holds "
                                 f"{tuple(target.shape)}: resume with the devices the checkpoint was saved with")
            target.copy_(saved[name])


def shard_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """Turn the plain shards of a saved optimizer state back into DTensors shaped like their params."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for pid, entry in saved["state"].items():
        p = params[int(pid)]
        state[pid] = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
                      if is_dtensor(p) and torch.is_tensor(v) and v.dim() > 0 else v
                      for k, v in entry.items()}
    return {**saved, "state": state}
