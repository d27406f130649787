"""Launchers: how node processes start (fork server, subprocess, Ray). Nothing here knows what a
node process runs: the entry module comes from the process spec protocol (`WORKER_MODULE`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flowrl.runtime.launch.launcher import Launcher


def make_launcher(kind: str, *, address: str | None = None, preload: Sequence[str] | None = None) -> Launcher:
    """`address`: the Ray cluster (`ray` only; None starts a private one on loopback). `preload`:
    the modules the local fork server imports before it forks (`local` only; None: torch's)."""
    from flowrl.runtime.launch.launcher import LocalLauncher, SubprocessLauncher

    if kind == "local":
        return LocalLauncher(preload=preload)
    if kind == "subprocess":
        return SubprocessLauncher()
    if kind == "ray":
        from flowrl.runtime.launch.ray_launcher import RayLauncher

        return RayLauncher(address)
    raise ValueError(f"unknown launcher {kind!r}; use local, subprocess or ray")
