"""Codec: `Batch` <-> ZeroMQ frames, without pickle and without copying large tensors.

    frames = encode(batch)                        # [header bytes, tensor buffer, ...]
    same = decode(frames, limits=DecodeLimits())  # DecodeError on any violation

Tensors up to `inline_max` bytes travel inside the msgpack header (one frame for a small batch);
larger ones are their own frame, handed to ZeroMQ as a buffer (`copy=False`) and rebuilt on receipt
with `numpy.frombuffer` / `torch.frombuffer` over the received frame. The codec is kept dumb: the
schema lives in `wire.py`, the channel envelope (`env`) is added by the sender.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from flowrl.transport import wire
from flowrl.transport.batch import Batch, _check_route
from flowrl.transport.dtypes import ITEMSIZE, NUMPY_DTYPES, NUMPY_NAMES, dtype_name, torch_dtype, torch_module
from flowrl.transport.errors import DecodeError
from flowrl.transport.ragged import Ragged, offsets_problem

INLINE_MAX_BYTES = 8192
"""Default: tensors of at most this many bytes are copied into the header instead of own frames."""
_trusted_batch = Batch._trusted  # (looked up once: the decoder makes one per message)
_MAX_STR = wire.MAX_STR

_DESC_LEN = len(wire.TENSOR_FIELDS)
_D_TENSORS, _D_ENV, _D_SHM = wire.D_TENSORS, wire.D_ENV, wire.D_SHM


class Prepared:
    """A batch turned into its data header (the array of `wire.DATA_FIELDS`, envelope to be set) and
    zero-copy buffers, ready to be sent (and re-sent)."""

    __slots__ = ("batch", "header", "buffers", "payload_bytes")

    def __init__(self, batch: Batch, header: list, buffers: list, payload_bytes: int):
        self.batch, self.header, self.buffers, self.payload_bytes = batch, header, buffers, payload_bytes

    def frames(self, env: list | None = None) -> list:
        """[header, *buffers] with `env` ([incarnation, seq]) as the channel envelope (None: none)."""
        self.header[_D_ENV] = env
        try:
            head = wire.pack(self.header)
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(f"batch {self.batch.batch_id!r}: meta must hold JSON-like values only ({e})") from None
        return [head, *self.buffers]

    def shm_header(self, env: list, ref: list, offsets: list[int]) -> bytes:
        """Frame 0 of this batch sent through shared memory: tensor bytes that frame i holds
        (i >= 1) are at offsets[i - 1] of the block that `ref` ([block id, fd, used bytes]) names."""
        def moved(at: Any) -> Any:
            return offsets[at - 1] if type(at) is int else at

        descs = [[name, dtype, shape, lib, moved(at), None if sub is None else [sub[0], moved(sub[1])]]
                 for name, dtype, shape, lib, at, sub in self.header[_D_TENSORS]]
        header = list(self.header)
        header[_D_TENSORS], header[_D_ENV], header[_D_SHM] = descs, env, ref
        return wire.pack(header)


def prepare(batch: Batch, inline_max: int = INLINE_MAX_BYTES) -> Prepared:
    descs, buffers, payload = [], [], 0
    subs = None  # id of a ragged tensor's offsets -> their inline descriptor (a batch's ragged tensors share them)
    for name, t in batch.tensors.items():
        sub = None
        if type(t) is Ragged:  # values as a tensor; offsets in a nested descriptor, inline or a frame
            offsets = t.offsets
            key = id(offsets)
            if subs is None:
                subs = {}
            sub = subs.get(key)
            if sub is None:
                offsets = offsets if type(offsets) is _NDARRAY and offsets.flags.c_contiguous \
                    and offsets.dtype is _LE_INT64 else _host_array(offsets)[0]
                if offsets.nbytes <= inline_max:
                    sub = subs[key] = [offsets.shape, offsets.tobytes()]
                else:  # a frame of its own, for each tensor (a frame is one tensor's)
                    buffers.append(offsets)
                    payload += offsets.nbytes
                    sub = [offsets.shape, len(buffers)]
            t = t.values
        if type(t) is _NDARRAY and (dtype := _FAST_NAMES.get(t.dtype)) is not None and t.flags.c_contiguous:
            arr, lib = t, "numpy"  # the common case: native little-endian, C-contiguous, allowed
        else:
            arr, lib = _host_array(t)
            dtype = dtype_name(t)
        nbytes = arr.nbytes
        # shapes travel as msgpack arrays: a tuple packs as one, without a list made per tensor
        if nbytes <= inline_max:
            at = arr.tobytes()
        else:
            buffers.append(arr)
            payload += nbytes
            at = len(buffers)
        descs.append([name, dtype, t.shape, lib, at, sub])
    if batch.meta:
        try:
            wire.check_meta(batch.meta)
        except TypeError as e:
            raise TypeError(f"batch {batch.batch_id!r}: meta must hold JSON-like values only ({e})") from None
    route = None
    if batch.index != -1 or batch.min_version or batch.epoch or batch.drop is not None:
        route = list(batch.route)
    header = [_VERSION, _DATA, batch.batch_id, batch.attempt, batch.policy_version, batch.meta, descs, route, None, None]
    return Prepared(batch, header, buffers, payload)


_NDARRAY = np.ndarray
_VERSION, _DATA = wire.SCHEMA_VERSION, wire.DATA
_LE_INT64 = np.dtype("<i8")  # the int64 singleton on a little-endian host (checked with `is`)
_FAST_NAMES = {dt: name for dt, name in NUMPY_NAMES.items()
               if dt.byteorder in (("=", "|", "<") if np.little_endian else ("|", "<"))}
"""numpy dtypes whose bytes go on the wire as they are (native order on a little-endian host)."""


def encode(batch: Batch, inline_max: int = INLINE_MAX_BYTES) -> list:
    """Frames of one `data` message (without channel envelope): [header, *tensor buffers]."""
    return prepare(batch, inline_max).frames()


def frame_view(frame: Any) -> memoryview:
    """A flat byte view of a received frame (zmq.Frame, bytes, bytearray, memoryview, ndarray)."""
    buf = getattr(frame, "buffer", None)  # zmq.Frame: a view of the received message, no copy
    mv = buf if buf is not None else memoryview(frame)
    return mv if mv.ndim == 1 and mv.format in ("B", "b", "c") else mv.cast("B")


def decode(frames: Sequence[Any], limits: wire.DecodeLimits = wire.DecodeLimits(), plans: Plans | None = None) -> Batch:
    """Frames of one `data` message -> Batch. Raises DecodeError on anything unexpected. `plans`:
    what earlier messages of the same stream taught (Plans); they decide alike with or without it."""
    views, _ = check_frames(frames, limits)
    header = wire.unpack_header(views[0], limits)
    if type(header) is not list:
        raise DecodeError("bad_kind", f"expected a data message, got {header['kind']!r}")
    return decode_data(header, views, limits, plans=plans)


def check_frames(frames: Sequence[Any], limits: wire.DecodeLimits) -> tuple[list, int]:
    """Frame count and total size checks; returns flat views of the frames and their total size."""
    if not frames:
        raise DecodeError("no_frames", "empty message")
    if len(frames) > limits.max_frames:
        raise DecodeError("too_many_frames", f"{len(frames)} frames exceed max_frames={limits.max_frames}")
    try:
        views = [frame_view(f) for f in frames]
    except (TypeError, ValueError) as e:
        raise DecodeError("bad_frame", f"a frame is not a byte buffer ({e})") from None
    total = 0
    for v in views:
        total += v.nbytes
    if total > limits.max_message_bytes:
        raise DecodeError("message_too_large", f"message of {total} bytes exceeds max_message_bytes="
                                               f"{limits.max_message_bytes}")
    return views, total


class Plans:
    """What `decode_data` learned from the last batch it decoded whose tensors were all plain numpy or
    torch arrays inside the header (not bool: their values are checked each time): their descriptors
    without the bytes, and how each tensor is made. A batch whose descriptors are the same (equal
    names, dtypes, libraries and int shapes), with bytes of the same lengths, is decoded without
    checking each field again: a channel's batches mostly share all of that. A receiver keeps one."""

    __slots__ = ("steps", "n", "limits")

    def __init__(self):
        # per tensor: ([name, dtype, shape, lib], nbytes, numpy dtype, the shape to give the array (None:
        # 1-d, as it comes), torch.from_numpy for a torch tensor or None)
        self.steps: list | None = None
        self.n = 0  # the batch's samples
        self.limits: wire.DecodeLimits | None = None  # what the planned batch was checked against: used under these only


def _planned(descs: list, steps: list) -> dict | None:
    """The tensors of `descs` made by `steps` (Plans), or None if a descriptor is not the same."""
    tensors = {}
    for desc, (skeleton, nbytes, np_dtype, shape, from_numpy) in zip(descs, steps):
        if type(desc) is not list or len(desc) != _DESC_LEN or desc[5] is not None \
                or type(data := desc[4]) is not bytes or len(data) != nbytes or desc[:4] != skeleton:
            return None
        # equal is not yet the same: 5.0 == True == 1 == 1.0, and a shape is ints
        if shape is None:
            if type(desc[2][0]) is not int:
                return None
        else:
            for d in desc[2]:
                if type(d) is not int:
                    return None
        t = _frombuffer(bytearray(data), np_dtype)  # writable, like a received frame
        if shape is not None:
            t = t.reshape(shape)
        tensors[skeleton[0]] = t if from_numpy is None else from_numpy(t)
    return tensors


def decode_data(header: list, views: list, limits: wire.DecodeLimits, delivery: Any = None,
                region: np.ndarray | None = None, plans: Plans | None = None) -> Batch:
    """A `data` header (as `wire.unpack_header` returns it: its length, version and kind checked)
    plus the message's frame views -> Batch (`delivery`: the receiver's tag for `ack`; `region`: the
    shared memory its tensors are in, a uint8 array, when the header names a block)."""
    _, _, batch_id, attempt, policy_version, meta, descs, route, _, ref = header
    if ref is None:
        region = None  # an int `at` is a frame index
    elif region is None:
        raise DecodeError("bad_field", "the message's tensors are in shared memory, which this decoder was not "
                                       "given (only a channel's receiver maps a producer's blocks)")
    if route is not None:
        if type(route) is not list or len(route) != 4:
            raise DecodeError("bad_field", "route must be nil or a list [index, min_version, epoch, drop]")
        try:
            _check_route(tuple(route))
        except ValueError as e:
            raise DecodeError("bad_field", f"route: {e}") from None
        route = tuple(route)
    if type(batch_id) is not str or not 0 < len(batch_id) <= _MAX_STR:
        wire.check_str("batch_id", batch_id)
    if type(attempt) is not int or attempt < 0:
        wire.check_int("attempt", attempt, 0)
    if type(policy_version) is not int or not -(1 << 63) <= policy_version < 1 << 63:
        wire.check_int("policy_version", policy_version)
    if type(meta) is not dict:
        raise DecodeError("bad_field", f"meta must be a map, got {type(meta).__name__}")
    if meta:
        wire.check_json(meta, limits.max_depth)
    if type(descs) is not list or len(descs) > limits.max_tensors:
        raise DecodeError("bad_field", f"tensors must be a list of at most max_tensors={limits.max_tensors}")
    if plans is not None and (steps := plans.steps) is not None and len(descs) == len(steps) and ref is None \
            and len(views) == 1 and plans.limits is limits:
        tensors = _planned(descs, steps)
        if tensors is not None:
            return _trusted_batch(tensors, meta, batch_id, attempt, policy_version, plans.n, delivery, route)
    nviews = len(views)
    plain = [] if plans is not None and ref is None else None  # steps of a plan, while every tensor is plain
    used = None  # which frames a tensor took (made when one is looked at: most messages are one frame)
    tensors: dict[str, Any] = {}
    n = None
    shared = None  # inline offsets bytes -> offsets already decoded and checked (aligned tensors)
    from_numpy = None  # torch.from_numpy, once a torch tensor comes
    max_ndim = limits.max_ndim
    for desc in descs:
        # the common case first: a numpy or torch tensor inline, plain or ragged with inline offsets;
        # anything else, or anything off in it, takes the exhaustive path, which decides
        t = None
        if type(desc) is list and len(desc) == _DESC_LEN:
            name, dtype, shape, lib, data, sub = desc
            if type(data) is bytes and type(dtype) is str and type(lib) is str \
                    and (spec := _FAST_SPECS.get((dtype, lib))) is not None \
                    and type(name) is str and 0 < len(name) <= _MAX_STR and type(shape) is list \
                    and 0 < (ndim := len(shape)) <= max_ndim and type(samples := shape[0]) is int and samples >= 0 \
                    and (spec[0] * samples if ndim == 1 else _fast_size(shape, spec[0])) == len(data) \
                    and (spec[2] is None or not data.translate(None, spec[2])):
                if spec[3] and from_numpy is None:  # a torch tensor: made over the numpy array's bytes
                    from_numpy = torch_module().from_numpy
                if sub is None:
                    t = _frombuffer(bytearray(data), spec[1])  # writable, like a received frame
                    if ndim > 1:
                        t = t.reshape(shape)
                    if spec[3]:
                        t = from_numpy(t)
                    if plain is not None:
                        if spec[2] is None:
                            plain.append((desc[:4], len(data), spec[1], None if ndim == 1 else tuple(shape),
                                          from_numpy if spec[3] else None))
                        else:
                            plain = None  # a bool tensor: its values are checked each time
                elif ndim == 1:
                    plain = None
                    if shared is None:
                        shared = {}
                    t = _fast_ragged(name, sub, data, spec[1], from_numpy if spec[3] else None, samples, shared)
                    if t is not None:
                        samples = sub[0][0] - 1
        else:
            plain = None
        if t is None:
            plain = None
            if used is None:
                used, shared = [False] * nviews, {} if shared is None else shared
            name, t = _decode_tensor(desc, views, used, limits, region, shared)
            samples = t.num_samples if type(t) is Ragged else (t.shape[0] if t.shape else None)
        if name in tensors:
            raise DecodeError("bad_field", f"tensor name {name!r} appears twice")
        tensors[name] = t
        if samples is not None:
            if n is None:
                n = samples
            elif samples != n:
                raise DecodeError("batch_invalid", f"tensor {name!r} has {samples} samples, others {n}")
    if nviews > 1 and (used is None or not all(used[1:])):
        raise DecodeError("stray_frame", f"frames {[i for i in range(1, nviews) if used is None or not used[i]]} "
                                         "are not referenced by any tensor")
    if plain is not None and len(plain) == len(descs):  # (every tensor inline: one frame, or stray_frame above)
        plans.steps, plans.n, plans.limits = plain, int(n or 0), limits
    return _trusted_batch(tensors, meta, batch_id, attempt, policy_version, int(n or 0), delivery, route)


_SPECS: dict[tuple, tuple] = {(d, lib): (ITEMSIZE[d], NUMPY_DTYPES.get(d)) for d in ITEMSIZE
                                for lib in ("numpy", "torch") if lib == "torch" or d in NUMPY_DTYPES}
"""(wire dtype, lib) -> (itemsize, numpy dtype or None): the combinations a descriptor may name."""


_BOOL_BYTES = bytes([0, 1])  # what a bool tensor's bytes may be (`data.translate(None, _BOOL_BYTES)` leaves the rest)


def _fast_specs() -> dict[tuple, tuple]:
    """(wire dtype, lib) -> (itemsize, numpy dtype, the bytes a value may be or None, whether it is
    a torch tensor) for decode_data's fast path: every dtype numpy has (a torch tensor is made over
    the numpy array's bytes: torch.from_numpy costs a fraction of torch.frombuffer and a reshape)."""
    return {(d, lib): (size, np_dtype, _BOOL_BYTES if d == "bool" else None, lib == "torch")
            for (d, lib), (size, np_dtype) in _SPECS.items() if np_dtype is not None}


def _fast_size(shape: list, itemsize: int) -> int:
    """Bytes of a tensor of `shape` (whose first entry is checked), or -1 if an entry is not an int >= 0."""
    n = itemsize * shape[0]
    for d in shape[1:] if len(shape) > 1 else ():
        if type(d) is not int or d < 0:
            return -1
        n *= d
    return n


_FAST_SPECS = _fast_specs()
_frombuffer = np.frombuffer


def _fast_ragged(name: str, sub: Any, data: bytes, np_dtype: np.dtype, from_numpy: Any, total: int,
                 shared: dict) -> Ragged | None:
    """A ragged tensor whose values (`data`: `total` checked values of `np_dtype`; torch tensors
    when `from_numpy` is torch's) and offsets are inline, or None when its offsets are not the plain
    `[[k], bin]` (the exhaustive path then decides)."""
    if type(sub) is not list or len(sub) != 2 or type(odata := sub[1]) is not bytes:
        return None
    shape = sub[0]
    if type(shape) is not list or len(shape) != 1 or type(k := shape[0]) is not int or k * 8 != len(odata) or k < 1:
        return None
    values = _frombuffer(bytearray(data), np_dtype)
    key = ("numpy" if from_numpy is None else "torch", odata, total)  # aligned tensors share one offsets
    # array, checked once (the exhaustive path's key)
    offsets = shared.get(key)
    if offsets is None:
        offsets = _frombuffer(bytearray(odata), _LE_INT64)
        # 1-d int64 of k >= 1 entries over 1-d values: what is left to check is start, end and order
        if offsets.item(0) != 0 or offsets.item(-1) != total or (k > 2 and _count_nonzero(offsets[1:] < offsets[:-1])):
            raise DecodeError("bad_offsets", f"ragged tensor {name!r}: {offsets_problem(values, offsets)}")
        if from_numpy is not None:
            offsets = from_numpy(offsets)
        shared[key] = offsets
    return Ragged(values if from_numpy is None else from_numpy(values), offsets, check=False)


_count_nonzero = np.count_nonzero


def _decode_tensor(desc: Any, views: list, used: list, limits: wire.DecodeLimits, region: np.ndarray | None,
                   shared: dict | None = None) -> tuple[str, Any]:
    """`region`: the shared memory the message names (None: it names none, and an int `at` is a
    frame index)."""
    if type(desc) is not list or len(desc) != _DESC_LEN:
        raise DecodeError("bad_field", f"a tensor descriptor is an array {wire.TENSOR_FIELDS}, got "
                                       f"{type(desc).__name__} of {len(desc) if type(desc) is list else '?'}")
    name, dtype, shape, lib, at, sub = desc
    if type(name) is not str or not 0 < len(name) <= wire.MAX_STR:
        raise DecodeError("bad_field", f"tensor name must be a str of 1..{wire.MAX_STR} chars, got {wire.short(name)}")
    spec = _SPECS.get((dtype, lib)) if type(dtype) is str and type(lib) is str else None
    if spec is None:
        if type(dtype) is not str or dtype not in ITEMSIZE:
            raise DecodeError("dtype", f"tensor {name!r}: dtype {wire.short(dtype)} is not allowed")
        raise DecodeError("bad_field", f"tensor {name!r}: lib {wire.short(lib)} with dtype {dtype} is not allowed")
    values = _decode_array(name, at, spec, dtype, lib, shape, views, used, limits, region)
    if sub is None:
        return name, values
    if type(sub) is not list or len(sub) != 2:
        raise DecodeError("bad_field", f"tensor {name!r}: offsets must be nil or [shape, at]")
    shape, data = sub
    if type(shape) is not list or len(shape) != 1:
        raise DecodeError("shape", f"tensor {name!r}: offsets must have a 1-d shape")
    if not len(values.shape):
        raise DecodeError("shape", f"ragged tensor {name!r}: values need a leading (token) dimension")
    key = (lib, data, values.shape[0]) if type(data) is bytes and shared is not None else None
    offsets = shared.get(key) if key is not None else None
    if offsets is None:
        offsets = _decode_array(f"{name}.offsets", data, _SPECS[("int64", lib)], "int64", lib, shape, views, used,
                                limits, region)
        problem = offsets_problem(values, offsets)
        if problem:
            raise DecodeError("bad_offsets", f"ragged tensor {name!r}: {problem}")
        if key is not None:
            shared[key] = offsets
    return name, Ragged(values, offsets, check=False)


def _decode_array(name: str, at: Any, spec: tuple, dtype: str, lib: str, shape: Any, views: list, used: list,
                  limits: wire.DecodeLimits, region: np.ndarray | None) -> Any:
    nbytes, np_dtype = spec
    if type(shape) is not list or len(shape) > limits.max_ndim:
        raise DecodeError("shape", f"tensor {name!r}: shape must be a list of at most {limits.max_ndim} ints")
    for d in shape:
        if type(d) is not int or d < 0:
            raise DecodeError("shape", f"tensor {name!r}: shape entries must be ints >= 0, got {wire.short(d, 20)}")
        nbytes *= d
    if type(at) is bytes:
        size = len(at)
        buf = bytearray(at)  # writable, like a received frame
    elif type(at) is not int:
        raise DecodeError("bad_field", f"tensor {name!r}: `at` must be bin (inline bytes) or an int (a frame "
                                       f"index, or an offset in shared memory), got {type(at).__name__}")
    elif region is not None:
        buf = _shm_bytes(name, at, nbytes, region)
        size = buf.nbytes
    else:
        if not 0 < at < len(views) or used[at]:
            raise DecodeError("frame_index", f"tensor {name!r}: frame {wire.short(at, 20)} is missing or used twice")
        used[at] = True
        buf = views[at]
        size = buf.nbytes
    if size != nbytes:
        raise DecodeError("size_mismatch", f"tensor {name!r}: shape {shape} x {dtype} needs {nbytes} bytes, "
                                           f"got {size}")
    if dtype == "bool" and nbytes and np.frombuffer(buf, np.uint8).max() > 1:
        raise DecodeError("bad_value", f"tensor {name!r}: bool bytes must be 0 or 1")
    if np_dtype is not None and lib == "numpy":
        arr = np.frombuffer(buf, np_dtype)
        return arr if len(shape) == 1 else arr.reshape(shape)
    torch = torch_module()
    if not nbytes:
        return torch.empty(shape, dtype=torch_dtype(dtype))
    t = torch.frombuffer(buf, dtype=torch_dtype(dtype))
    return t if len(shape) == 1 else t.reshape(shape)  # (torch's reshape costs more than the rest)


def _shm_bytes(name: str, offset: Any, nbytes: int, region: np.ndarray) -> np.ndarray:
    """Bytes [offset, offset + nbytes) of a shared-memory region (a view: tensors built on it keep
    the region, and with it the block, alive)."""
    if type(offset) is not int or offset < 0 or offset + nbytes > region.nbytes:
        raise DecodeError("out_of_bounds", f"tensor {name!r}: bytes at {wire.short(offset, 20)} + {nbytes} lie outside "
                                           f"the {region.nbytes}-byte region")
    return region[offset:offset + nbytes]


def _host_array(t: Any) -> tuple[np.ndarray, str]:
    """A C-contiguous little-endian numpy view of a tensor's bytes (copying only when it must)."""
    if isinstance(t, np.ndarray):
        if t.dtype.byteorder == ">":
            t = t.astype(t.dtype.newbyteorder("<"))
        if not t.flags.c_contiguous:
            t = t.copy(order="C")
        return t, "numpy"
    try:  # the common case: a CPU tensor without grad (nor conj/neg bit) of a dtype numpy has
        arr = t.numpy()
    except (RuntimeError, TypeError):
        arr = None
    if arr is not None and arr.flags.c_contiguous:
        return arr, "torch"
    torch = torch_module()
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy(), "torch"
