"""`Batch`: the unit that travels on a channel — named tensors, JSON-like metadata and work ids.

    b = Batch(tensors={"tokens": tokens, "logprobs": logprobs}, meta={"task": "reverse"},
              batch_id="t17", attempt=0, policy_version=3)
    left, right = b.split(2)                 # two halves, for two replicas
    joined = Batch.concat([left, right])     # the same samples again
    b.select([0, 2]).num_samples == 2

Tensors are numpy arrays or torch tensors of any shape, with a dtype from `DTYPES`, or `Ragged`
tensors (one variable-length sequence per sample: flat values + offsets, see `flowrl.transport.ragged`);
every tensor with at least one dimension shares the leading (sample) dimension. 0-d tensors are per-batch
values: `select` / `split` keep them and `concat` requires them to be equal. A tensor comes out of a
channel as the same kind (numpy or torch) it went in as.

A batch is immutable (its fields cannot be reassigned) but its tensors are not copied: do not
write into a tensor after sending it, since the sender holds it until the consumer acknowledges.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from flowrl.transport.dtypes import NUMPY_NAMES, dtype_name, is_torch, torch_module
from flowrl.transport.ragged import Ragged, offsets_problem

MAX_NAME_CHARS = 256
_DEFAULT: Any = object()  # "argument not given" (None is a value the checks must refuse)


def new_batch_id() -> str:
    """A fresh random batch id (the scheduler normally gives ids; this is the fallback)."""
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True, eq=False)
class Batch:
    """Named tensors + metadata + ids; see the module docstring for an example."""

    tensors: Mapping[str, Any] = field(default_factory=dict)
    """name -> numpy array or torch tensor; all tensors with ndim >= 1 share dimension 0."""
    meta: Mapping[str, Any] = field(default_factory=dict)
    """JSON-like values only (None, bool, int, float, str, list, dict with str keys)."""
    batch_id: str = field(default_factory=new_batch_id)
    """The scheduler's work id; sinks and joins drop duplicates by it."""
    attempt: int = 0
    """How many times this work was re-issued after a failure (0 = first try)."""
    policy_version: int = -1
    """Weights version that produced the data; -1 when no policy was involved."""
    index: int = -1
    """Routing: the ticket's position in the run's work sequence (-1: not from a ticket). Set by the
    runtime; user code reads it (e.g. to seed sampling) and never needs to set it."""
    min_version: int = 0
    """Routing: weight subscribers process this batch only once they hold at least this version."""
    epoch: int = 0
    """Routing: the recovery epoch the batch belongs to; batches of an older epoch are dropped."""
    drop: str | None = None
    """Routing: not None = a drop marker (a node dropped this ticket, the value says why). It flows
    on, without tensors, so every sink can record the ticket as dropped."""
    _n: int = field(init=False, repr=False, default=0)
    _delivery: Any = field(init=False, repr=False, default=None)

    def __init__(self, tensors: Mapping[str, Any] = _DEFAULT, meta: Mapping[str, Any] = _DEFAULT,
                 batch_id: str = _DEFAULT, attempt: int = 0, policy_version: int = -1, index: int = -1,
                 min_version: int = 0, epoch: int = 0, drop: str | None = None) -> None:
        # written out (not generated): a frozen dataclass's __init__ + __post_init__ set every field
        # twice, and batches are made per message on hot paths
        if batch_id is _DEFAULT:
            batch_id = new_batch_id()
        elif type(batch_id) is not str or not batch_id or len(batch_id) > MAX_NAME_CHARS:
            raise ValueError(f"batch_id must be a non-empty str of at most {MAX_NAME_CHARS} chars, got {batch_id!r}")
        if type(attempt) is not int or attempt < 0:
            raise ValueError(f"attempt must be an int >= 0, got {attempt!r}")
        if type(policy_version) is not int:
            raise TypeError(f"policy_version must be an int, got {type(policy_version).__name__} {policy_version!r}")
        route = (index, min_version, epoch, drop)
        if route != _NO_ROUTE:
            _check_route(route)
        meta = {} if meta is _DEFAULT else meta.copy() if type(meta) is dict else _own_dict(meta, "meta must be a dict")
        tensors = tensors.copy() if type(tensors) is dict else _own_dict(tensors, "tensors must be a dict name -> array")
        _fill(self, tensors, meta, batch_id, attempt, policy_version, _leading_dim(tensors), None, route)

    @classmethod
    def _trusted(cls, tensors: dict, meta: dict, batch_id: str, attempt: int, policy_version: int,
                 n: int, delivery: Any = None, route: tuple = None) -> "Batch":
        """Build without re-validating: for the decoder, which has checked everything already."""
        b = object.__new__(cls)
        _fill(b, tensors, meta, batch_id, attempt, policy_version, n, delivery, route or _NO_ROUTE)
        return b

    @property
    def route(self) -> tuple:
        """(index, min_version, epoch, drop): the routing facts the header carries."""
        return (self.index, self.min_version, self.epoch, self.drop)

    # ------------------------------------------------------------------------------- properties
    @property
    def num_samples(self) -> int:
        """Size of the shared leading dimension (0 when there are no tensors with ndim >= 1)."""
        return self._n

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (what a channel moves, without the header)."""
        return sum(_nbytes(t) for t in self.tensors.values())

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {_describe(v)}" for k, v in self.tensors.items())
        drop = f", drop={self.drop!r}" if self.drop is not None else ""
        return (f"Batch(id={self.batch_id!r}, attempt={self.attempt}, index={self.index}, epoch={self.epoch}, "
                f"policy_version={self.policy_version}{drop}, "
                f"samples={self._n}, tensors={{{shapes}}}, meta_keys={sorted(self.meta)})")

    # ------------------------------------------------------------------------------- derived batches
    def replace(self, **changes: Any) -> "Batch":
        """A new batch with some fields changed; ids are kept unless given."""
        return dataclasses.replace(self, **changes)

    def select(self, indices: Any) -> "Batch":
        """The samples at `indices` (ints, a bool mask, a slice, a numpy array or a torch tensor)."""
        index = _as_index(indices, self._n)
        return self.replace(tensors={k: _take(v, index) for k, v in self.tensors.items()})

    def split(self, parts: int, *, group: int | None = None, by_tokens: bool = False) -> "list[Batch]":
        """`parts` contiguous batches that never cut a prompt group in two (some may be empty).

        `group`: samples per prompt group (default `meta["samples_per_prompt"]` when it divides the
        batch, else 1). Groups are spread by count (numpy.array_split rule), or, `by_tokens`, so that
        each part holds near the same number of tokens of the batch's ragged tensors (what balances
        data-parallel ranks when sequences have their own lengths)."""
        if not isinstance(parts, int) or parts < 1:
            raise ValueError(f"split needs parts >= 1, got {parts!r}")
        g = group if group is not None else int(self.meta.get("samples_per_prompt", 1) or 1)
        if type(g) is not int or g < 1:
            raise ValueError(f"split needs group >= 1, got {g!r}")
        if self._n % g:
            if group is not None:
                raise ValueError(f"a batch of {self._n} samples is not made of groups of {g}")
            g = 1
        bounds = _group_bounds(self._n // g, parts, self._group_tokens(g) if by_tokens else None)
        return [self.select(slice(start * g, stop * g)) for start, stop in zip(bounds, bounds[1:])]

    def _group_tokens(self, g: int) -> "np.ndarray | None":
        """Tokens per group of `g` samples (over the ragged tensors, `tokens` alone when present)."""
        ragged = [v for k, v in self.tensors.items() if type(v) is Ragged]
        if "tokens" in self.tensors and type(self.tensors["tokens"]) is Ragged:
            ragged = [self.tensors["tokens"]]
        if not ragged:
            return None
        lens = sum(np.asarray(r.lengths.cpu() if r.is_torch else r.lengths, dtype=np.int64) for r in ragged)
        return lens.reshape(-1, g).sum(axis=1)

    @classmethod
    def concat(cls, batches: Sequence["Batch"], **ids: Any) -> "Batch":
        """Samples of all batches in order. Ids and meta come from the first batch unless given;
        `policy_version` defaults to the oldest of the parts (what staleness must account for)."""
        batches = list(batches)
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], 1):
            if b.tensors.keys() != first.tensors.keys():
                raise ValueError(f"batch {i} has tensors {sorted(b.tensors)}, batch 0 has "
                                 f"{sorted(first.tensors)}; concat needs the same names")
        tensors = {name: _cat(name, [b.tensors[name] for b in batches]) for name in first.tensors}
        fields = dict(meta=first.meta, batch_id=first.batch_id, attempt=first.attempt,
                      policy_version=min(b.policy_version for b in batches), index=first.index,
                      min_version=first.min_version, epoch=first.epoch, drop=first.drop)
        fields.update(ids)
        return cls(tensors=tensors, **fields)

    def to_torch(self) -> "Batch":
        """The same batch with every tensor as a torch tensor (numpy arrays are shared, not copied)."""
        torch = torch_module()

        def conv(v):
            if type(v) is Ragged:
                return v.to_torch()
            if is_torch(v):
                return v
            return torch.from_numpy(v if v.flags.writeable else v.copy())

        return self.replace(tensors={k: conv(v) for k, v in self.tensors.items()})

    def to_numpy(self) -> "Batch":
        """The same batch with every tensor as a numpy array (CPU tensors are shared, not copied)."""

        def conv(k, v):
            if type(v) is Ragged:
                return v.to_numpy()
            if not is_torch(v):
                return v
            if dtype_name(v) == "bfloat16":
                raise TypeError(f"tensor {k!r} is bfloat16, which numpy lacks; convert it with .float() first")
            return v.detach().cpu().numpy()

        return self.replace(tensors={k: conv(k, v) for k, v in self.tensors.items()})


# ----------------------------------------------------------------------------------- helpers
_NO_ROUTE = (-1, 0, 0, None)
MAX_DROP_CHARS = 1024


def _check_route(route: tuple) -> None:
    index, min_version, epoch, drop = route
    for name, value, low in (("index", index, -1), ("min_version", min_version, 0), ("epoch", epoch, 0)):
        if type(value) is not int or not low <= value < 1 << 62:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if drop is not None and (type(drop) is not str or len(drop) > MAX_DROP_CHARS):
        raise ValueError(f"drop must be None or a str of at most {MAX_DROP_CHARS} chars, got {drop!r:.80}")


def _fill(b: Batch, tensors: dict, meta: dict, batch_id: str, attempt: int, policy_version: int, n: int,
          delivery: Any, route: tuple) -> None:
    """Set every field of a (frozen) batch, in its instance dict: a batch is built per message on
    hot paths, and eleven dict stores cost half of what eleven slot setters do (and a third of
    `object.__setattr__`, which looks each name up)."""
    d = b.__dict__
    d["tensors"] = tensors
    d["meta"] = meta
    d["batch_id"] = batch_id
    d["attempt"] = attempt
    d["policy_version"] = policy_version
    d["index"], d["min_version"], d["epoch"], d["drop"] = route
    d["_n"] = n
    d["_delivery"] = delivery


def _own_dict(value: Any, what: str) -> dict:
    """A fresh dict of a mapping argument ({} when not given)."""
    if value is _DEFAULT:
        return {}
    if type(value) is dict or isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{what}, got {type(value).__name__}")


def _nbytes(t: Any) -> int:
    if type(t) is Ragged:
        return t.nbytes
    return int(t.nbytes) if isinstance(t, np.ndarray) else t.numel() * t.element_size()


def _describe(t: Any) -> str:
    if type(t) is Ragged:
        return f"ragged {dtype_name(t.values)}[{t.num_samples}, ~{list(t.values.shape)}]"
    return f"{dtype_name(t)}{list(t.shape)}"


def _leading_dim(tensors: dict) -> int:
    n = first = None
    for name, t in tensors.items():
        if type(name) is not str or not name or len(name) > MAX_NAME_CHARS:
            raise ValueError(f"tensor names must be non-empty str of at most {MAX_NAME_CHARS} chars, got {name!r}")
        if type(t) is np.ndarray:
            if t.dtype not in NUMPY_NAMES:  # the common case is one dict lookup
                dtype_name(t)
        elif type(t) is Ragged:
            _check_ragged(name, t)
            if n is None:
                n, first = t.num_samples, name
            elif t.num_samples != n:
                raise ValueError(f"ragged tensor {name!r} has {t.num_samples} samples but {first!r} has {n}; "
                                 "all tensors of a batch share the leading dimension")
            continue
        else:
            if not isinstance(t, np.ndarray):
                if not is_torch(t):
                    raise TypeError(f"tensor {name!r} is a {type(t).__name__}; give a numpy array or a torch tensor")
                if t.layout != torch_module().strided:
                    raise TypeError(f"tensor {name!r} has layout {t.layout}; only dense (strided) tensors travel")
            dtype_name(t)
        shape = t.shape
        if not shape:
            continue
        if n is None:
            n, first = int(shape[0]), name
        elif shape[0] != n:
            raise ValueError(f"tensor {name!r} has {shape[0]} samples (leading dim) but {first!r} has {n}; "
                             "all tensors of a batch share the leading dimension")
    return n or 0


def _as_index(indices: Any, n: int) -> "slice | np.ndarray":
    if isinstance(indices, slice):
        return indices
    if isinstance(indices, range):
        indices = np.arange(indices.start, indices.stop, indices.step, dtype=np.int64)
    elif is_torch(indices):
        indices = indices.detach().cpu().numpy()
    idx = np.asarray(indices)
    if idx.dtype == np.bool_:
        if idx.shape != (n,):
            raise IndexError(f"a bool mask must have shape ({n},) for a batch of {n} samples, got {idx.shape}")
        return np.flatnonzero(idx)
    if idx.size == 0:
        return np.zeros(0, dtype=np.int64)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise IndexError(f"indices must be a 1-d sequence of ints or a bool mask, got dtype {idx.dtype} "
                         f"and shape {idx.shape}")
    idx = idx.astype(np.int64, copy=False)
    bad = (idx < -n) | (idx >= n)
    if bad.any():
        raise IndexError(f"index {int(idx[bad][0])} is out of range for a batch of {n} samples")
    return np.where(idx < 0, idx + n, idx)


def _group_bounds(groups: int, parts: int, weights: "np.ndarray | None") -> list[int]:
    """parts + 1 group boundaries: equal counts (weights None) or near-equal cumulative weight."""
    if weights is None or groups == 0 or int(weights.sum()) == 0:
        base, extra = divmod(groups, parts)
        return [0] + [int(i * base + min(i, extra)) for i in range(1, parts + 1)]
    bounds, start, remaining = [0], 0, float(weights.sum())
    for r in range(parts - 1):
        left = parts - r
        target = remaining / left
        last = max(start, groups - (left - 1))  # leave a group for each part after this one, when there are enough
        stop, acc = start, 0.0
        while stop < last and (stop == start or acc + weights[stop] / 2 <= target):
            acc += float(weights[stop])
            stop += 1
        bounds.append(stop)
        start, remaining = stop, remaining - acc
    bounds.append(groups)
    return bounds


def _check_ragged(name: str, t: Ragged) -> None:
    values = t.values
    if type(values) is np.ndarray and values.dtype in NUMPY_NAMES and t._valid[0] is values \
            and t._valid[1] is t.offsets:
        return  # checked when built, not reassigned since: the common case, in well under a microsecond
    dtype_name(values)
    if t.valid:
        return
    if is_torch(t.values) and t.values.layout != torch_module().strided:
        raise TypeError(f"ragged tensor {name!r} has layout {t.values.layout}; only dense (strided) values travel")
    problem = offsets_problem(t.values, t.offsets)
    if problem:
        raise ValueError(f"ragged tensor {name!r}: {problem}; build it with Ragged.from_sequences or from_padded")


def _take(t: Any, index: "slice | np.ndarray") -> Any:
    if type(t) is Ragged:
        return t.select(index)
    if t.ndim == 0:
        return t
    if isinstance(index, slice) or isinstance(t, np.ndarray):
        return t[index]
    torch = torch_module()
    return t.index_select(0, torch.from_numpy(index).to(t.device))


def _cat(name: str, parts: Iterable[Any]) -> Any:
    parts = list(parts)
    ragged = {type(p) is Ragged for p in parts}
    if ragged == {True}:
        return _cat_ragged(name, parts)
    if len(ragged) > 1:
        raise TypeError(f"tensor {name!r} is ragged in some batches and rectangular in others; make them alike "
                        "(Ragged.from_padded, or .to_padded()) first")
    kinds = {is_torch(p) for p in parts}
    if len(kinds) > 1:
        raise TypeError(f"tensor {name!r} is numpy in some batches and torch in others; "
                        "convert them alike with to_torch() or to_numpy() first")
    dtypes = {dtype_name(p) for p in parts}
    if len(dtypes) > 1:
        raise TypeError(f"tensor {name!r} has dtypes {sorted(dtypes)} across batches; cast them alike first")
    torch = torch_module() if kinds == {True} else None
    if parts[0].ndim == 0:
        same = all((torch.equal(parts[0], p) if torch else np.array_equal(parts[0], p)) for p in parts[1:])
        if not same:
            raise ValueError(f"0-d tensor {name!r} differs between batches; concat keeps one value per batch")
        return parts[0]
    tails = {tuple(p.shape[1:]) for p in parts}
    if len(tails) > 1:
        raise ValueError(f"tensor {name!r} has trailing shapes {sorted(tails)} across batches; they must match")
    return torch.cat(parts) if torch else np.concatenate(parts)


def _cat_ragged(name: str, parts: list) -> Ragged:
    kinds = {p.is_torch for p in parts}
    if len(kinds) > 1:
        raise TypeError(f"ragged tensor {name!r} is numpy in some batches and torch in others; "
                        "convert them alike with to_torch() or to_numpy() first")
    dtypes = {dtype_name(p.values) for p in parts}
    if len(dtypes) > 1:
        raise TypeError(f"ragged tensor {name!r} has dtypes {sorted(dtypes)} across batches; cast them alike first")
    tails = {p.trailing for p in parts}
    if len(tails) > 1:
        raise ValueError(f"ragged tensor {name!r} has trailing shapes {sorted(tails)} across batches; they must match")
    return Ragged.concat(parts)
