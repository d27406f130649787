"""The dtype allow-list shared by batches and the codec, and numpy/torch conversions.

Only these dtypes cross a channel; everything else is refused at `Batch` construction (sender side)
and at decoding (receiver side). Bytes on the wire are little-endian, C-contiguous. torch is
imported lazily: a process that never touches a torch tensor never imports it, which keeps
`flowrl check` and the graph loader light.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

DTYPES: tuple[str, ...] = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
)
"""Every dtype a tensor in a `Batch` may have (numpy has no bfloat16: bfloat16 tensors are torch only)."""

ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
}

NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<") if ITEMSIZE[name] > 1 else np.dtype(name)
    for name in DTYPES
    if name != "bfloat16"
}
"""Wire dtype name -> little-endian numpy dtype."""

NUMPY_NAMES: dict[np.dtype, str] = {}
"""numpy dtype (any byte order) -> wire dtype name; byte order is fixed when encoding."""
for _name in NUMPY_DTYPES:
    for _order in ("=", "<", ">"):
        NUMPY_NAMES[np.dtype(_name).newbyteorder(_order)] = _name
_TORCH_NAMES: dict[Any, str] = {}


def torch_module():
    """The torch module, imported on first use."""
    import torch

    if not _TORCH_NAMES:
        for name in DTYPES:
            _TORCH_NAMES[getattr(torch, name)] = name
    return torch


def is_torch(x: Any) -> bool:
    """True for a torch.Tensor, without importing torch (if torch is not loaded, x is no tensor)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def dtype_name(x: Any) -> str:
    """The wire name of a numpy array's or torch tensor's dtype; TypeError if it is not allowed."""
    if isinstance(x, np.ndarray):
        name = NUMPY_NAMES.get(x.dtype)
        if name is not None:
            return name
        if x.dtype.name in NUMPY_DTYPES and x.dtype.kind in "biuf":  # e.g. 'q' vs 'l' for int64
            return x.dtype.name
        shown = x.dtype.str
    else:
        if not _TORCH_NAMES:
            torch_module()
        name = _TORCH_NAMES.get(x.dtype)
        if name is not None:
            return name
        shown = str(x.dtype)
    raise TypeError(f"dtype {shown} cannot cross a channel; allowed: {', '.join(DTYPES)}")


def torch_dtype(name: str):
    """The torch dtype for a wire dtype name."""
    return getattr(torch_module(), name)
