"""Ray, reduced to what flowrl needs: join a cluster or start a private one on loopback, list its hosts.

    cluster = RayCluster.connect("auto")            # the cluster `ray start --head` started here
    cluster = RayCluster.start_local(num_cpus=2)    # a private one on 127.0.0.1; close() stops it
    [(n.name, n.address, n.resources) for n in cluster.nodes()]
    cluster.close()

Both the Ray inventory (`flowrl check --inventory ray`) and the Ray launcher go through here, so
they agree on what a host is called: a Ray node's `NodeName` (`ray start --node-name`, default its
IP address), made unique with the node id's first 8 hex digits when several nodes share one name.

Keeping Ray on loopback. `ray.init(_node_ip_address="127.0.0.1")` alone is not enough: Ray rewrites
a loopback node address to the machine's interface address (`resolve_ip_for_localhost`), and then
its gRPC servers (GCS, raylet, object manager, every worker) listen on all interfaces. Ray keeps the
loopback address only while its multi-machine mode is off (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`,
the default on macOS and Windows); then the node registers as 127.0.0.1 and every listener binds to
127.0.0.1 (or unix sockets). `keep_on_loopback()` turns that mode off for this process and the Ray
processes it starts; `loopback_node_args()` are the node settings for `ray.cluster_utils.Cluster`,
and `loopback_cluster()` starts one with both (and the folder Ray writes its address to).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field

from flowrl.errors import FlowrlError

LOOPBACK = "127.0.0.1"
CLUSTER_MODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
INSTALL_FIX = 'pip install -e ".[ray]"  (or: pip install "ray>=2.9")'
START_HINT = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --node-ip-address=127.0.0.1 (docs/multi-host.md)"


class RayClusterError(FlowrlError):
    """No Ray, no cluster at the address, or a cluster flowrl cannot use (message says which + fix)."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayClusterError(f"the Ray launcher and inventory need Ray, which is not installed; {INSTALL_FIX}") from None
    return ray


def keep_on_loopback() -> None:
    """Make Ray nodes started from this process register and listen on 127.0.0.1 only."""
    os.environ[CLUSTER_MODE_ENV] = "0"  # for the Ray processes we start (they inherit it)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # read at import time; this process has imported it already


def loopback_node_args(**overrides) -> dict:
    """Arguments for `Cluster(head_node_args=...)` / `Cluster.add_node(...)`: a node on 127.0.0.1
    without a dashboard. Call `keep_on_loopback()` first."""
    return {"node_ip_address": LOOPBACK, "include_dashboard": False, **overrides}


def ray_default_dir() -> str:
    """Ray's own default folder, made when missing: `ray._common.utils.get_default_ray_temp_dir()`,
    i.e. `$RAY_TMPDIR/ray`, else `$TMPDIR/ray` (Linux), else `/tmp/ray`, read at each call.

    `ray.cluster_utils.Cluster` writes its address to `ray_current_cluster` there when it starts its
    head node, whatever `temp_dir` its nodes are given, and does not make the folder: on a machine
    where no Ray ran yet it fails with FileNotFoundError. (`ray start` and `ray.init` make it only
    for a node that uses it as its own temp dir.)"""
    from ray._common.utils import get_default_ray_temp_dir

    path = get_default_ray_temp_dir()
    os.makedirs(path, exist_ok=True)
    return path


def loopback_cluster(**head_node_args):
    """A `ray.cluster_utils.Cluster` whose head node (`loopback_node_args(**head_node_args)`) is up:
    Ray kept on loopback (`keep_on_loopback()`), the folder it writes its address to made
    (`ray_default_dir()`). Add nodes with `cluster.add_node(**loopback_node_args(...))`; stop it
    with `cluster.shutdown()` (which also removes that address file)."""
    from ray.cluster_utils import Cluster

    keep_on_loopback()
    ray_default_dir()
    return Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args=loopback_node_args(**head_node_args))


@dataclass(frozen=True)
class RayNode:
    """One live Ray node as flowrl sees it: a host."""

    name: str
    node_id: str
    address: str
    """NodeManagerAddress: the IP other nodes reach it at."""
    resources: dict = field(default_factory=dict)
    """Ray's total resources on the node: CPU, GPU, memory, custom ones (`--resources`)."""

    @property
    def cpus(self) -> int:
        return int(self.resources.get("CPU", 0))

    @property
    def gpus(self) -> int:
        return int(self.resources.get("GPU", 0))

    @property
    def custom(self) -> dict:
        """Resources a user declared (`ray start --resources '{"host_a": 1}'`), without Ray's own."""
        own = {"CPU", "GPU", "memory", "object_store_memory"}
        return {k: v for k, v in self.resources.items() if k not in own and not k.startswith(("node:", "accelerator_type:"))}


def ray_nodes(raw: list[dict]) -> list[RayNode]:
    """flowrl hosts from `ray.nodes()`: live nodes only, each with a unique name."""
    alive = [n for n in raw if n.get("Alive")]
    names = [n.get("NodeName") or n["NodeManagerAddress"] for n in alive]
    out = []
    for n, name in zip(alive, names):
        if names.count(name) > 1:
            name = f"{name}-{n['NodeID'][:8]}"
        out.append(RayNode(name=name, node_id=n["NodeID"], address=n["NodeManagerAddress"],
                           resources=dict(n.get("Resources") or {})))
    return sorted(out, key=lambda n: n.name)


def _resolve(address: str) -> str:
    """`auto` -> the HOST:PORT of the cluster on this machine ($RAY_ADDRESS, then the latest
    `ray start`); any other address as given. Raises ConnectionError when there is none."""
    from ray._private.services import get_ray_address_from_environment

    return get_ray_address_from_environment(address, None)


def _reachable(address: str, timeout_s: float = 3.0) -> bool:
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


class RayCluster:
    """This process's connection to a Ray cluster (Ray allows one per process)."""

    def __init__(self, address: str | None, owned: bool, temp_dir: str | None = None, joined: bool = True):
        self.address = address
        self.owned = owned  # we started it: close() stops it
        self.temp_dir = temp_dir
        self.joined = joined  # we called ray.init: close() calls ray.shutdown

    @classmethod
    def connect(cls, address: str = "auto") -> "RayCluster":
        """Join the running cluster at `address` (`auto`: the one on this machine, or $RAY_ADDRESS)."""
        ray = import_ray()
        if address.startswith("ray://"):
            raise RayClusterError(
                f"launcher address {address!r} is a Ray Client address; the controller must run on a node of the "
                "cluster (node processes connect back to its control address on the cluster network): run flowrl there "
                "with launcher.address=auto (or the GCS address HOST:PORT)")
        if ray.is_initialized():  # one cluster per process: reuse it when it is the one asked for
            current = ray.get_runtime_context().gcs_address
            if address not in ("auto", current):
                raise RayClusterError(f"this process is connected to the Ray cluster at {current} already, not "
                                      f"{address!r}; use that address (or auto)")
            return cls(current, owned=False, joined=False)
        asked = address
        try:
            address = _resolve(address)
        except (ConnectionError, ValueError) as e:
            raise RayClusterError(f"no Ray cluster found for address {address!r} ({e}). Fix: start one "
                                  f"({START_HINT}), give its GCS address HOST:PORT, "
                                  "or use launcher.address=null for a private one") from None
        if not _reachable(address):  # ray.init would retry for minutes
            raise RayClusterError(f"no Ray cluster answers at {address} (nothing accepts connections there). Fix: "
                                  f"start one ({START_HINT}), check the address "
                                  "(the GCS HOST:PORT that `ray start` printed), or use launcher.address=null "
                                  "for a private one")
        if _is_loopback(address):
            keep_on_loopback()  # else this driver looks for its raylet at the interface address and waits forever
        try:  # `auto` as such: then Ray itself turns on its token auth when ~/.ray/auth_token exists
            ray.init(address="auto" if asked == "auto" else address, log_to_driver=False, configure_logging=False,
                     logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as e:
            text = f"{e} {e.__cause__ or ''}"
            if "uthentication" in text or "InvalidAuthToken" in text:
                raise RayClusterError(
                    f"the Ray cluster at {address} wants Ray's auth token: set RAY_AUTH_MODE=token (the token is read "
                    "from ~/.ray/auth_token or $RAY_AUTH_TOKEN), or give the address as auto") from None
            raise RayClusterError(f"cannot join a Ray cluster at {address!r}: {str(e).splitlines()[0] if str(e) else e!r}. "
                                  f"Fix: start one ({START_HINT}) or give its "
                                  "address (HOST:PORT of its GCS); launcher.address=null starts a private one") from None
        return cls(address, owned=False)

    @classmethod
    def start_local(cls, num_cpus: int | None = None, num_gpus: int | None = None) -> "RayCluster":
        """A private single-node cluster on 127.0.0.1 (no dashboard), stopped by `close()`."""
        ray = import_ray()
        if ray.is_initialized():
            raise RayClusterError("this process is already connected to a Ray cluster; give its address as "
                                  "launcher.address (or auto) instead of null")
        keep_on_loopback()
        temp_dir = tempfile.mkdtemp(prefix="frl-ray-")  # short: Ray's unix socket paths live under it
        try:
            ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                     _node_ip_address=LOOPBACK, _temp_dir=temp_dir, log_to_driver=False, configure_logging=False,
                     logging_level=logging.WARNING)
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
        return cls(ray.get_runtime_context().gcs_address, owned=True, temp_dir=temp_dir)

    def nodes(self) -> list[RayNode]:
        return ray_nodes(import_ray().nodes())

    def local_node_id(self) -> str:
        """The Ray node this process (the controller) runs on."""
        return import_ray().get_runtime_context().get_node_id()

    def close(self) -> None:
        """Leave the cluster; stop it (every Ray process it started) when we started it."""
        ray = import_ray()
        if self.joined and ray.is_initialized():
            ray.shutdown()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None
