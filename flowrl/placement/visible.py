"""`CUDA_VISIBLE_DEVICES` read the way CUDA reads it: the only truth about logical ids.

    resolve_visible("3,1", [0, 1, 2, 3], uuids)  ->  ([3, 1], [])     # logical 0 is physical 3

CUDA's rules, which users trip over (the classic `invalid device ordinal`):
- unset: every device, in order; empty: none.
- entries are integer indices or GPU UUIDs (`GPU-8932f937-...`), a unique prefix being enough;
- the first entry that is not a device (out of range, unknown UUID, a repeat, `-1`) ends the list:
  it and every entry after it are silently ignored.

Integer entries are physical ids in PCI bus order only under `CUDA_DEVICE_ORDER=PCI_BUS_ID`
(NVML's order); flowrl sets that for every node process, and warns when the controller's own
environment would order mixed GPU models differently.
"""

from __future__ import annotations

import re

_HEX = re.compile(r"^[0-9a-fA-F-]+$")


def _match_uuid(token: str, uuids: dict[int, str]) -> tuple[int | None, str]:
    """Physical id whose UUID starts with `token` (with or without the `GPU-` prefix)."""
    want = token.lower().removeprefix("gpu-")
    hits = [p for p, u in uuids.items() if u and u.lower().removeprefix("gpu-").startswith(want)]
    if len(hits) == 1:
        return hits[0], ""
    if not hits:
        return None, f"no GPU has a UUID starting with {token!r}"
    return None, f"UUID prefix {token!r} matches {len(hits)} GPUs; give more characters"


def resolve_visible(env: str | None, physical_ids: list[int], uuids: dict[int, str] | None = None
                    ) -> tuple[list[int], list[str]]:
    """Logical -> physical ids for `CUDA_VISIBLE_DEVICES=env`, plus why CUDA would stop early.

    `physical_ids` are the devices present (NVML indices); `uuids` maps them to their UUIDs.
    The second value lists problems worth a warning (empty when the value is clean, and for the
    deliberate `-1` / empty "hide every GPU").
    """
    uuids = uuids or {}
    if env is None:
        return list(physical_ids), []
    visible: list[int] = []
    tokens = [t.strip() for t in env.split(",")]
    if tokens in ([""], ["-1"]):
        return [], []
    for pos, token in enumerate(tokens):
        reason = ""
        phys: int | None = None
        if re.fullmatch(r"-?\d+", token):
            n = int(token)
            if n in physical_ids:
                phys = n
            else:
                hi = f"0-{max(physical_ids)}" if physical_ids else "none"
                reason = f"index {n} is not a GPU (present: {hi})"
        elif token.upper().startswith("MIG-"):
            reason = f"{token!r} is a MIG instance; flowrl plans whole GPUs (give GPU ids or UUIDs)"
        elif token.upper().startswith("GPU-") or (len(token) >= 4 and _HEX.match(token)):
            phys, reason = _match_uuid(token, uuids)
        else:
            reason = f"{token!r} is neither an index nor a GPU UUID"
        if phys is not None and phys in visible:
            phys, reason = None, f"{token!r} repeats GPU {phys}"
        if phys is None:
            ignored = tokens[pos:]
            return visible, [f"CUDA_VISIBLE_DEVICES={env}: {reason}; CUDA stops there and ignores "
                             f"{', '.join(repr(t) for t in ignored)}, so only {len(visible)} GPU(s) are visible"]
        visible.append(phys)
    return visible, []


def device_order_problem(env: str | None, names: set[str], order: str | None) -> str | None:
    """Why integer CUDA_VISIBLE_DEVICES may name other GPUs than nvidia-smi shows, or None.

    CUDA numbers GPUs fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID; with one GPU model on the
    host both orders agree, with mixed models integer ids can point at the wrong cards.
    """
    if not env or not any(t.strip().isdigit() for t in env.split(",")) or len(names) < 2 or order == "PCI_BUS_ID":
        return None
    return (f"CUDA_VISIBLE_DEVICES={env} uses indices and this host mixes GPU models ({', '.join(sorted(names))}), "
            "but CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA numbers GPUs fastest-first, so the "
            "indices may name other GPUs than nvidia-smi shows. Fix: export CUDA_DEVICE_ORDER=PCI_BUS_ID "
            "(flowrl sets it for its node processes) or use GPU UUIDs")
