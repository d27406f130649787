"""What one node process costs: CPU and resident memory, and on GPUs utilisation, memory and
allocator fragmentation.

    sampler = ProcessSampler()
    sampler.sample()   # -> [("cpu_percent", 97.0, {}), ("gpu_utilization_percent", 88, {"device": "3"}), ...]

Why both NVML and torch.cuda: NVML sees the whole device (utilisation, memory used by everyone,
this PID's share), while only the caching allocator knows how much of what it reserved is really
allocated — `fragmentation = 1 - allocated / reserved`; above ~0.3 a long run starts to OOM at
apparently moderate usage. Device labels are physical ids (from CUDA_VISIBLE_DEVICES), so numbers
from different node processes line up with `flowrl check`'s plan.

Sampling never initialises CUDA (that must stay the node's choice, made after its devices are set)
and never raises: a broken NVML turns GPU sampling off for the rest of the process.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import psutil

log = logging.getLogger(__name__)

Sample = tuple[str, float, dict[str, str]]


def visible_devices(env: dict[str, str] | None = None) -> list[str] | None:
    """Physical ids (indices or UUIDs) this process may use; None when CUDA_VISIBLE_DEVICES is unset."""
    raw = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [d.strip() for d in raw.split(",") if d.strip() and d.strip() != "-1"]


class ProcessSampler:
    """Samples this process; `nvml` and `torch_module` can be injected (tests use fakes)."""

    def __init__(self, pid: int | None = None, nvml: Any = None, torch_module: Any = None):
        self._proc = psutil.Process(pid)
        self._proc.cpu_percent(None)  # psutil measures CPU since the previous call; prime it
        self._nvml = nvml
        self._nvml_state = "unknown" if nvml is None else "ready"
        self._torch = torch_module

    def sample(self) -> list[Sample]:
        out: list[Sample] = []
        try:
            with self._proc.oneshot():
                out.append(("cpu_percent", self._proc.cpu_percent(None), {}))
                out.append(("rss_bytes", float(self._proc.memory_info().rss), {}))
                out.append(("num_threads", float(self._proc.num_threads()), {}))
        except psutil.Error as e:  # process vanished or restricted /proc: report nothing rather than die
            log.debug("psutil sampling failed: %s", e)
        out += self._sample_nvml()
        out += self._sample_allocator()
        return out

    # --- NVML: whole-device view -------------------------------------------------------------
    def _nvml_handles(self) -> list[tuple[str, Any]]:
        if self._nvml_state == "off":
            return []
        if self._nvml_state == "unknown":
            devices = visible_devices()
            if devices == []:
                self._nvml_state = "off"  # a CPU node on a GPU host: nothing to sample
                return []
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml, self._nvml_state = pynvml, "ready"
            except Exception as e:  # no driver / no library: a CPU machine
                log.debug("NVML unavailable, GPU sampling off: %s", e)
                self._nvml_state = "off"
                return []
        nvml, devices = self._nvml, visible_devices()
        if devices is None:
            devices = [str(i) for i in range(nvml.nvmlDeviceGetCount())]
        handles = []
        for d in devices:
            # With CUDA_DEVICE_ORDER=PCI_BUS_ID (set by the runtime) NVML indices are CUDA's ids.
            h = (nvml.nvmlDeviceGetHandleByUUID(d) if d.startswith(("GPU-", "MIG-"))
                 else nvml.nvmlDeviceGetHandleByIndex(int(d)))
            handles.append((d, h))
        return handles

    def _sample_nvml(self) -> list[Sample]:
        out: list[Sample] = []
        try:
            pid = self._proc.pid
            for dev, h in self._nvml_handles():
                labels = {"device": dev}
                nvml = self._nvml
                util = nvml.nvmlDeviceGetUtilizationRates(h)
                mem = nvml.nvmlDeviceGetMemoryInfo(h)
                out.append(("gpu_utilization_percent", float(util.gpu), labels))
                out.append(("gpu_memory_used_bytes", float(mem.used), labels))
                out.append(("gpu_memory_total_bytes", float(mem.total), labels))
                mine = sum((p.usedGpuMemory or 0) for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)
                           if p.pid == pid)
                out.append(("gpu_process_memory_bytes", float(mine), labels))
        except Exception as e:
            log.warning("NVML sampling failed, GPU sampling off for this process: %s", e)
            self._nvml_state = "off"
        return out

    # --- torch caching allocator: fragmentation -----------------------------------------------
    def _sample_allocator(self) -> list[Sample]:
        torch = self._torch or sys.modules.get("torch")  # never import torch just to sample
        if torch is None:
            return []
        out: list[Sample] = []
        try:
            if not torch.cuda.is_initialized():
                return []
            physical = visible_devices() or []
            for i in range(torch.cuda.device_count()):
                labels = {"device": physical[i] if i < len(physical) else str(i)}
                allocated = float(torch.cuda.memory_allocated(i))
                reserved = float(torch.cuda.memory_reserved(i))
                out.append(("cuda_memory_allocated_bytes", allocated, labels))
                out.append(("cuda_memory_reserved_bytes", reserved, labels))
                out.append(("cuda_max_memory_allocated_bytes",
                            float(torch.cuda.max_memory_allocated(i)), labels))
                frag = 1.0 - allocated / reserved if reserved > 0 else 0.0
                out.append(("memory_fragmentation", frag, labels))
        except Exception as e:
            log.debug("torch.cuda sampling failed: %s", e)
        return out
