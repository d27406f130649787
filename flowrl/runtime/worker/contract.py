"""The node's boundary: what a node may return, and how its errors are reported.

`outputs_of` turns whatever `process` / `generate` / `join` returned into {port: Batch or Drop},
or raises `NodeContractError` naming the node, the method, what it returned and what it should
return. `describe_error` finds the user's exception (not anyio's ExceptionGroup wrapper) and the
innermost frame of the node's own code, for a last-error line such as

    process: KeyError: 'scores' at examples/custom_node/nodes.py:21 (ticket t-000014)
"""

from __future__ import annotations

import traceback
from pathlib import Path

from flowrl.errors import FlowrlError
from flowrl.node import Drop

_RUNTIME_DIRS = (str(Path(__file__).resolve().parent), "anyio", "asyncio", "concurrent", "threading")


class NodeContractError(FlowrlError, TypeError):
    """A node returned something the runtime cannot send."""


def _is_empty(batch) -> bool:
    return batch.num_samples == 0 and any(getattr(t, "ndim", 0) >= 1 for t in batch.tensors.values())


def outputs_of(result, *, node: str, method: str, ports: tuple[str, ...]) -> dict:
    """{port: Batch | Drop} for every output port (ports a dict leaves out get a Drop)."""
    from flowrl.transport import Batch

    def one(value, where: str):
        if value is None:
            return Drop("returned None")
        if isinstance(value, Drop):
            return value
        if isinstance(value, Batch):
            return Drop("empty batch") if _is_empty(value) else value
        raise NodeContractError(
            f"node {node!r}: {method}() returned {type(value).__name__}{where}; return a flowrl.Batch"
            + (f", a dict {{port: Batch}} for ports {list(ports)}" if len(ports) > 1 else "")
            + ", or None / flowrl.Drop(reason) to drop the ticket")

    if isinstance(result, dict):
        unknown = [p for p in result if p not in ports]
        if unknown:
            raise NodeContractError(f"node {node!r}: {method}() returned a dict with ports {unknown!r} it does "
                                    f"not have; its output ports are {list(ports)}")
        return {p: one(result[p], f" for port {p!r}") if p in result else Drop(f"nothing for port {p!r}")
                for p in ports}
    value = one(result, "")
    if len(ports) > 1 and not isinstance(value, Drop):
        raise NodeContractError(f"node {node!r}: {method}() returned one Batch but the node has output ports "
                                f"{list(ports)}; return a dict {{port: Batch}}")
    return {p: value for p in ports}


def leaf_exception(e: BaseException) -> BaseException:
    """The exception the user raised, unwrapped from task-group wrappers."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def describe_error(e: BaseException) -> dict:
    """{type, message, file, line, traceback} of the user's exception."""
    e = leaf_exception(e)
    frames = traceback.extract_tb(e.__traceback__)
    user = [f for f in frames if not any(d in f.filename for d in _RUNTIME_DIRS)]
    frame = (user or frames or [None])[-1]
    try:
        cwd = Path.cwd()
        file = str(Path(frame.filename).resolve().relative_to(cwd)) if frame else None
    except ValueError:
        file = frame.filename if frame else None
    notes = "".join(f" ({n})" for n in getattr(e, "__notes__", ()) if isinstance(n, str))  # which fused node raised
    return {"type": type(e).__name__, "message": (str(e) + notes)[:2000], "file": file,
            "line": frame.lineno if frame else None,
            "traceback": "".join(traceback.format_exception(e))[-16000:]}
