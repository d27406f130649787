"""Which network interface holds an address of this machine: what gloo and NCCL bind for a group
that spans hosts (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, flowrl/runtime/worker/group.py), and
what `flowrl check` names for the hosts it can see (rules_layout.py)."""

from __future__ import annotations


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds `address`, or None."""
    try:
        import psutil
    except ImportError:  # psutil is a core dependency; a stripped environment still runs
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None
