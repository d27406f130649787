"""`Ragged`: one variable-length tensor per sample, stored as flat values plus offsets.

    r = Ragged.from_sequences([[5, 6, 7], [8], []], dtype="int64")    # 3 samples of 3, 1 and 0 tokens
    r.num_samples, r.lengths.tolist(), r[0].tolist()                   # 3, [3, 1, 0], [5, 6, 7]
    r.values                                                          # [5, 6, 7, 8]: every token, in order
    r.offsets                                                         # [0, 3, 4, 4]: sample i is values[o[i]:o[i+1]]
    r.select([2, 0]).lengths.tolist()                                 # [0, 3]
    padded = r.to_padded(pad=0)                                       # [3, 3] int64, right-padded
    mask = r.mask()                                                   # [3, 3] bool, True on real tokens
    same = Ragged.from_padded(padded, r.lengths)                      # back again
    lp = r.like(torch.zeros(len(r.values)))                           # a per-token tensor aligned with r

`values` is a numpy array or a torch tensor whose leading dimension counts tokens (it may have
trailing dimensions: `[total, V]`); `offsets` is int64 `[num_samples + 1]`, starting at 0,
non-decreasing, ending at `len(values)`, of the same kind (numpy or torch) as `values`.
Several per-token tensors of one batch (tokens, log-probs, loss mask) share their offsets: they are
*aligned*, and `aligned(other)` says so. A Batch carries Ragged tensors next to rectangular ones:
`select`, `split` and `concat` keep offsets right, and a channel sends values and offsets as raw
frames, never as Python lists.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from flowrl.transport.dtypes import dtype_name, is_torch, torch_module


class RaggedError(ValueError):
    """Offsets that do not describe the values (the message names what is wrong and the fix)."""


class Ragged:
    """Flat `values` + `offsets`: see the module docstring."""

    __slots__ = ("values", "offsets", "_valid")

    def __init__(self, values: Any, offsets: Any, *, check: bool = True) -> None:
        self.values = values
        self.offsets = offsets
        if check:
            problem = offsets_problem(values, offsets)
            if problem:
                raise RaggedError(f"{problem}; build it with Ragged.from_sequences or Ragged.from_padded")
        self._valid = (values, offsets)  # what was checked (or built by code that keeps offsets right)

    @property
    def valid(self) -> bool:
        """Whether values and offsets are still the ones checked at construction (not reassigned)."""
        return self._valid[0] is self.values and self._valid[1] is self.offsets

    # ------------------------------------------------------------------------------- construction
    @classmethod
    def from_sequences(cls, seqs: Iterable[Any], dtype: str | None = None, *, lib: str = "torch") -> "Ragged":
        """One sample per sequence (lists, numpy arrays or torch tensors, each 1-d or [len, ...])."""
        seqs = list(seqs)
        arrays = [s.detach().cpu().numpy() if is_torch(s) else np.asarray(s) for s in seqs]
        if dtype is None:
            dtype = dtype_name(arrays[0]) if arrays else "int64"
        np_dtype = np.dtype(dtype) if dtype != "bfloat16" else np.float32
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate([a.astype(np_dtype, copy=False) for a in arrays]) if arrays else \
            np.zeros(0, dtype=np_dtype)
        if lib == "numpy":
            return cls(values, offsets, check=False)
        torch = torch_module()
        v = torch.from_numpy(np.ascontiguousarray(values))
        if dtype == "bfloat16":
            v = v.to(torch.bfloat16)
        return cls(v, torch.from_numpy(offsets), check=False)

    @classmethod
    def from_padded(cls, padded: Any, lengths: Any = None, *, side: str = "right") -> "Ragged":
        """Rows of `padded [n, W, ...]` cut to `lengths [n]` (the real tokens on the `side` given);
        no `lengths`: every row whole (a rectangular batch of sequences that share one length)."""
        n = int(padded.shape[0])
        if lengths is None:
            lengths = [int(padded.shape[1]) if len(padded.shape) > 1 else 0] * n
        if is_torch(padded):
            torch = torch_module()
            lengths = torch.as_tensor(lengths, dtype=torch.int64, device=padded.device).reshape(-1)
            width = padded.shape[1] if padded.dim() > 1 else 0
            if lengths.numel() != n or bool((lengths < 0).any()) or bool((lengths > width).any()):
                raise RaggedError(f"lengths must be {n} ints in 0..{width}, got {lengths.tolist()[:8]}")
            pos = torch.arange(width, device=padded.device)[None]
            keep = pos < lengths[:, None] if side == "right" else pos >= (width - lengths)[:, None]
            offsets = torch.zeros(n + 1, dtype=torch.int64, device=padded.device)
            torch.cumsum(lengths, 0, out=offsets[1:])
            return cls(padded[keep], offsets, check=False)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        width = padded.shape[1] if padded.ndim > 1 else 0
        if lengths.size != n or (lengths < 0).any() or (lengths > width).any():
            raise RaggedError(f"lengths must be {n} ints in 0..{width}, got {lengths.tolist()[:8]}")
        pos = np.arange(width)[None]
        keep = pos < lengths[:, None] if side == "right" else pos >= (width - lengths)[:, None]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(padded[keep], offsets, check=False)

    def like(self, values: Any) -> "Ragged":
        """A tensor aligned with this one: the same offsets over other per-token `values`."""
        if int(values.shape[0]) != int(self.values.shape[0]):
            raise RaggedError(f"aligned values need {int(self.values.shape[0])} entries (one per token), "
                              f"got {int(values.shape[0])}")
        offsets = self.offsets
        if is_torch(values) != is_torch(offsets):
            offsets = offsets.numpy() if is_torch(offsets) else torch_module().from_numpy(offsets)
        return Ragged(values, offsets, check=False)

    # ------------------------------------------------------------------------------- facts
    @property
    def num_samples(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def __len__(self) -> int:
        return self.num_samples

    @property
    def lengths(self) -> Any:
        """Tokens per sample, int64 `[num_samples]` (numpy or torch, like `values`)."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def total(self) -> int:
        """Tokens of all samples."""
        return int(self.values.shape[0])

    @property
    def ndim(self) -> int:
        """As a padded tensor would have: 1 (samples) + 1 (tokens) + trailing dimensions."""
        return 1 + len(self.values.shape)

    @property
    def trailing(self) -> tuple:
        return tuple(int(d) for d in self.values.shape[1:])

    @property
    def nbytes(self) -> int:
        return _nbytes(self.values) + _nbytes(self.offsets)

    @property
    def is_torch(self) -> bool:
        return is_torch(self.values)

    def aligned(self, other: "Ragged") -> bool:
        """Whether `other` has the same offsets (its tokens match this one's one for one)."""
        if other.offsets is self.offsets:
            return True
        a, b = _np(self.offsets), _np(other.offsets)
        return a.shape == b.shape and bool(np.array_equal(a, b))

    def sample_ids(self) -> Any:
        """For every token, the sample it belongs to: int64 `[total]`."""
        if self.is_torch:
            torch = torch_module()
            return torch.repeat_interleave(torch.arange(self.num_samples, device=self.values.device),
                                           self.lengths.to(self.values.device))
        return np.repeat(np.arange(self.num_samples, dtype=np.int64), self.lengths)

    def __getitem__(self, i: int) -> Any:
        """Sample `i`'s values."""
        n = self.num_samples
        if not -n <= i < n:
            raise IndexError(f"sample {i} is out of range for {n} samples")
        i %= n
        return self.values[int(self.offsets[i]):int(self.offsets[i + 1])]

    def __iter__(self):
        for i in range(self.num_samples):
            yield self[i]

    def __repr__(self) -> str:
        lens = _np(self.lengths)
        span = f"{int(lens.min())}..{int(lens.max())}" if lens.size else "-"
        return f"Ragged({dtype_name(self.values)}, samples={self.num_samples}, tokens={self.total}, lengths {span})"

    # ------------------------------------------------------------------------------- derived
    def select(self, index: "slice | np.ndarray") -> "Ragged":
        """The samples at `index` (a slice, or an int64 numpy array of sample positions)."""
        if isinstance(index, slice):
            start, stop, step = index.indices(self.num_samples)
            if step == 1:
                stop = max(start, stop)
                lo, hi = int(self.offsets[start]), int(self.offsets[stop])
                return Ragged(self.values[lo:hi], self.offsets[start:stop + 1] - lo, check=False)
            index = np.arange(start, stop, step, dtype=np.int64)
        offs = _np(self.offsets)
        index = np.asarray(index, dtype=np.int64)
        lens = offs[index + 1] - offs[index]
        starts = offs[index]
        new_offsets = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lens, out=new_offsets[1:])
        total = int(new_offsets[-1])
        # token positions: start of each sample + 0..len-1
        take = np.repeat(starts - new_offsets[:-1], lens) + np.arange(total, dtype=np.int64)
        if self.is_torch:
            torch = torch_module()
            values = self.values.index_select(0, torch.from_numpy(take).to(self.values.device))
            return Ragged(values, torch.from_numpy(new_offsets).to(self.offsets.device), check=False)
        return Ragged(self.values[take], new_offsets, check=False)

    @classmethod
    def concat(cls, parts: Sequence["Ragged"]) -> "Ragged":
        """The samples of all parts, in order (values of one kind and dtype)."""
        parts = list(parts)
        if not parts:
            raise ValueError("concat needs at least one Ragged")
        if len(parts) == 1:
            return parts[0]
        torch = torch_module() if parts[0].is_torch else None
        shift, offs = 0, [parts[0].offsets[:1]]
        for p in parts:
            offs.append(p.offsets[1:] + shift)
            shift += p.total
        if torch is not None:
            return cls(torch.cat([p.values for p in parts]), torch.cat(offs), check=False)
        return cls(np.concatenate([p.values for p in parts]), np.concatenate(offs), check=False)

    def to_padded(self, pad: Any = 0, width: int | None = None, *, side: str = "right") -> Any:
        """`[num_samples, width, ...]`: each sample's values, then (or, `side="left"`, before) `pad`."""
        lens = self.lengths
        longest = int(lens.max()) if self.num_samples else 0
        width = longest if width is None else int(width)
        if longest > width:
            raise RaggedError(f"a sample has {longest} tokens, more than width={width}")
        n = self.num_samples
        pos = self._positions(width, side)
        if self.is_torch:
            torch = torch_module()
            out = torch.full((n, width, *self.trailing), pad, dtype=self.values.dtype, device=self.values.device)
            out[pos] = self.values
            return out
        out = np.full((n, width, *self.trailing), pad, dtype=self.values.dtype)
        out[pos] = self.values
        return out

    def mask(self, width: int | None = None, *, side: str = "right") -> Any:
        """`[num_samples, width]` bool: True where `to_padded` put a real value."""
        lens = self.lengths
        width = (int(lens.max()) if self.num_samples else 0) if width is None else int(width)
        if self.is_torch:
            torch = torch_module()
            pos = torch.arange(width, device=self.values.device)[None]
            lens = lens[:, None].to(self.values.device)
            return pos < lens if side == "right" else pos >= width - lens
        pos = np.arange(width)[None]
        return pos < lens[:, None] if side == "right" else pos >= width - lens[:, None]

    def _positions(self, width: int, side: str) -> Any:
        m = self.mask(width, side=side)
        return m

    def to_torch(self) -> "Ragged":
        if self.is_torch:
            return self
        torch = torch_module()
        v = self.values if self.values.flags.writeable else self.values.copy()
        o = self.offsets if self.offsets.flags.writeable else self.offsets.copy()
        return Ragged(torch.from_numpy(v), torch.from_numpy(o), check=False)

    def to_numpy(self) -> "Ragged":
        if not self.is_torch:
            return self
        if dtype_name(self.values) == "bfloat16":
            raise TypeError("a bfloat16 Ragged has no numpy form; convert its values with .float() first")
        return Ragged(self.values.detach().cpu().numpy(), self.offsets.detach().cpu().numpy(), check=False)

    def map(self, fn) -> "Ragged":
        """`fn(values)` with the same offsets (e.g. `r.map(lambda v: v.float())`)."""
        return self.like(fn(self.values))


def offsets_problem(values: Any, offsets: Any) -> str | None:
    """What is wrong with `offsets` for `values`, or None (used by Ragged, Batch and the decoder)."""
    if type(offsets) is np.ndarray and type(values) is np.ndarray:  # the common case, checked in a few us
        if offsets.dtype == np.int64 and offsets.ndim == 1 and offsets.shape[0] >= 1 and values.ndim >= 1 \
                and offsets[0] == 0 and offsets[-1] == values.shape[0] \
                and not np.count_nonzero(offsets[1:] < offsets[:-1]):  # (count_nonzero: a third of .any())
            return None
    elif is_torch(values) and is_torch(offsets):
        o = offsets.detach().cpu().numpy() if offsets.dtype == torch_module().int64 else offsets
        if isinstance(o, np.ndarray) and o.ndim == 1 and o.shape[0] >= 1 and len(values.shape) >= 1 \
                and o[0] == 0 and o[-1] == values.shape[0] and not (o[1:] < o[:-1]).any():
            return None
    return _offsets_problem(values, offsets)


def _offsets_problem(values: Any, offsets: Any) -> str | None:
    if not (isinstance(values, np.ndarray) or is_torch(values)):
        return f"values must be a numpy array or torch tensor, got {type(values).__name__}"
    if is_torch(values) != is_torch(offsets) or not (isinstance(offsets, np.ndarray) or is_torch(offsets)):
        return "offsets must be of the same kind (numpy or torch) as values"
    if len(values.shape) < 1:
        return "values must have a leading (token) dimension"
    if dtype_name(offsets) != "int64" or len(offsets.shape) != 1 or offsets.shape[0] < 1:
        return f"offsets must be a 1-d int64 array of num_samples + 1 entries, got {dtype_name(offsets)} " \
               f"of shape {list(offsets.shape)}"
    o = _np(offsets)
    total = int(values.shape[0])
    if o[0] != 0 or o[-1] != total:
        return f"offsets must start at 0 and end at the {total} values, got {int(o[0])}..{int(o[-1])}"
    if o.size > 1 and (np.diff(o) < 0).any():
        at = int(np.flatnonzero(np.diff(o) < 0)[0])
        return f"offsets must not decrease, but offsets[{at + 1}]={int(o[at + 1])} < offsets[{at}]={int(o[at])}"
    return None

def _np(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if is_torch(x) else x


def _nbytes(t: Any) -> int:
    return int(t.nbytes) if isinstance(t, np.ndarray) else t.numel() * t.element_size()
