"""A data-parallel replica's own torch.distributed group, on one host or several.

    join_node_group(spec, timeout_s=120)    # every rank, before the node is built

Rank 0 serves the group's rendezvous store on its host's cluster address (MASTER_ADDR: never all
interfaces) at MASTER_PORT, a port the controller had its launcher pick free on that host. Every key
and value in it is sealed by the run's secret (flowrl/weights/store.py), so a stranger who reaches
the port can neither read the group's addresses nor join it. gloo (CPU) and NCCL (GPU) then open
their own sockets on the network interface that holds the rank's host address: GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME are set to it, unless the user set them (`interface_of`; where no interface holds
the address exactly, the libraries pick as they do by default, and the log says so). A rank that
cannot reach the store, or its peers, within the deadline fails at start with an error naming its
host, rank 0's host and the address it tried: a firewall between hosts never hangs a rendezvous.
"""

from __future__ import annotations

import datetime
import logging
import os

from flowrl.placement.network import interface_of

log = logging.getLogger("flowrl.worker")
_served: list = []  # rank 0's store server, alive as long as the process (a process is in one node group)


def pin_interface(spec) -> str | None:
    """Point gloo and NCCL at the interface that holds this rank's host address (unless set)."""
    name = interface_of(spec.host_address)
    var = "NCCL_SOCKET_IFNAME" if spec.device_type == "cuda" else "GLOO_SOCKET_IFNAME"
    if os.environ.get(var):
        log.info("%s=%s (set by you) for the group of %s", var, os.environ[var], spec.proc_id)
        return os.environ[var]
    if name is None:
        log.warning("no network interface here holds %s (this host's cluster address); %s picks its own "
                    "for the group of %s: set %s if it picks wrongly", spec.host_address,
                    "NCCL" if var.startswith("NCCL") else "gloo", spec.proc_id, var)
        return None
    os.environ[var] = name
    return name


def join_node_group(spec, timeout_s: float):
    """Form this replica's default process group (rank `spec.rank` of `spec.world_size`); rank 0
    serves its store (kept alive for the process's life)."""
    import torch.distributed as dist

    from flowrl.weights.store import SealedStore, WeightStore, connect

    addr, port = spec.env["MASTER_ADDR"], int(spec.env["MASTER_PORT"])
    where = f"{spec.node} replica {spec.replica}: rank {spec.rank} of {spec.world_size} on {spec.host or 'this host'} " \
            f"({spec.host_address})"
    pin_interface(spec)
    try:
        if spec.rank == 0:
            server = WeightStore(addr, port=port, timeout_s=timeout_s)
            _served.append(server)
            store = server.sealed(spec.secret)
        else:
            store = connect((addr, port), spec.secret, timeout_s=timeout_s)
    except Exception as e:  # noqa: BLE001 - re-raised with both hosts and the address
        raise RuntimeError(f"{where} cannot {'serve' if spec.rank == 0 else 'reach'} its group's store at "
                           f"{addr}:{port} (rank 0's host) within {timeout_s:.0f} s: {str(e).splitlines()[0][:200]}. "
                           f"Check that {spec.host_address} can reach {addr}:{port} (firewall, routes) and that "
                           "the port is free there") from None
    assert isinstance(store, SealedStore)
    try:
        dist.init_process_group("nccl" if spec.device_type == "cuda" else "gloo", store=store.child("node-group"),
                                rank=spec.rank, world_size=spec.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - re-raised with both hosts and the address
        raise RuntimeError(f"{where} could not form its group with the store at {addr}:{port} within "
                           f"{timeout_s:.0f} s: {str(e).splitlines()[0][:300]}. A peer rank may be unreachable "
                           "from here (its gloo/NCCL sockets are on its host address), or the interface picked "
                           "is wrong: set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME") from None
