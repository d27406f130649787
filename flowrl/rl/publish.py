"""Weight publishing from a sharded (FSDP2) trainer: the full state, gathered one tensor at a time.

    view = FullState(trainer.model, serving_dtype)      # on every rank of the trainer, once
    # rank 0                                            # ranks > 0
    pub = WeightPublisher(lambda: view, ...)            # (nothing: no publisher)
    pub.snapshot(version)                               view.drain()      # at the same points

The publisher copies its tensors into its send buckets in its plan's order (``BucketPlan``: by
dtype, then name). ``view[name]`` all-gathers that one parameter (``DTensor.full_tensor()``); the
bucket copy is made, the gathered tensor dropped: rank 0 holds its shard, the send buckets (the
serving copy every publisher holds) and ONE full tensor at a time; never a second full model.
All-gathers are collectives, so the other ranks walk the same order in :meth:`FullState.drain`;
a publisher that asks out of order gets an error instead of a deadlock. ``items()`` lists the
layout (meta tensors: shapes and dtypes, no data, no communication), which is what the publisher
reads it for. On one rank (no DTensor) ``view[name]`` is the live tensor and ``drain`` does nothing.

``FullState(model, serving_dtype, state=adapter_weights)`` publishes another view of the model than
its state dict: ``state(model)`` names the tensors (LoRA: the adapters only, see
:func:`flowrl.models.lora.adapter_weights`) and only those are gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from flowrl.rl.parallel import is_dtensor


class FullState(Mapping):
    """The unsharded state of ``model`` as the mapping ``WeightPublisher`` packs (see the module docstring)."""

    def __init__(self, model: nn.Module, serving_dtype: str | None = None,
                 state: Callable[[nn.Module], Mapping[str, torch.Tensor]] | None = None) -> None:
        from flowrl.weights import BucketPlan, layout_of, serving_layout

        self.model = model
        self._state = (lambda: state(model)) if state is not None else model.state_dict
        now = self._state()
        self._meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in now.items()}
        plan = BucketPlan(serving_layout(layout_of(self._meta), serving_dtype))
        order = [name for _, entries, _ in plan.buckets for name, *_ in entries]
        self.gather_order = [name for name in order if is_dtensor(now[name])]
        """The sharded entries, in the order the publisher packs them (the order of the all-gathers)."""
        self._next = 0
        self._live: dict[str, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._live is None or self._next == 0:
            self._live = self._state()  # this round's tensors (cheap: no data is copied)
        t = self._live[name]
        if not is_dtensor(t):
            return t.detach()
        expected = self.gather_order[self._next]
        if name != expected:
            raise RuntimeError(f"publisher asked for {name!r} while the ranks gather {expected!r} next: it must "
                               "read tensors in its bucket plan's order (build FullState with its serving_dtype)")
        self._next = (self._next + 1) % len(self.gather_order)
        return t.full_tensor().detach()

    def drain(self) -> None:
        """Ranks > 0: take part in every all-gather of one snapshot, keeping nothing."""
        live = self._state()
        for name in self.gather_order:
            live[name].full_tensor()

    def items(self):  # type: ignore[override] - the layout, not the data (see the module docstring)
        return self._meta.items()

    def __iter__(self) -> Iterator[str]:
        return iter(self._meta)

    def __len__(self) -> int:
        return len(self._meta)
