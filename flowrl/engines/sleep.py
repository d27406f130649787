"""A rollout engine's sleep between turns (colocated nodes that take turns, docs/colocation.md).

    sleeper = EngineSleep(engine, path, level=2)
    sleeper.sleep()     # level 1: KV caches dropped; level 2: the weights released too
    sleeper.wake()      # the weights back, bitwise; caches are rebuilt as generation needs them

vLLM sleeps itself (`LLM.sleep(level)` / `wake_up()`) where its build supports it: a GPU engine
built with `enable_sleep_mode`. The CPU build of vLLM does not (its worker logs "sleep mode is not
supported on CPU" and keeps everything): there the engine stays as it is and `supported` says so.
The builtin and hf engines keep no KV cache between calls (a continuous batcher's slot cache is
dropped at level 1) and release their model's tensors at level 2 (`flowrl.rl.offload`: host memory
on a GPU, a file on a CPU), restored exactly on wake.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from flowrl.rl.offload import Offload, module_tensors

log = logging.getLogger("flowrl.engines")


def vllm_sleep_mode(engine: Any) -> bool | None:
    """None: not a vLLM engine; else whether this vLLM can sleep (a GPU build with sleep mode on)."""
    llm = getattr(engine, "llm", None)
    if llm is None or getattr(engine, "type", None) != "vllm":
        return None
    try:
        import torch

        config = llm.llm_engine.vllm_config.model_config
        return bool(getattr(config, "enable_sleep_mode", False)) and torch.cuda.is_available()
    except AttributeError:
        return False


class EngineSleep:
    """Puts one engine to sleep and wakes it."""

    def __init__(self, engine: Any, path: Path | str, level: int = 2):
        if level not in (1, 2):
            raise ValueError(f"engine sleep level {level}: 1 (KV caches) or 2 (KV caches and weights)")
        self.engine = engine
        self.level = level
        self.offload = Offload(path)
        self.asleep = False
        vllm = vllm_sleep_mode(engine)
        self.supported = vllm is None or vllm
        if vllm is False:
            log.warning("this vLLM cannot sleep (a CPU build, or enable_sleep_mode off): the engine keeps its "
                        "memory between turns")

    def sleep(self) -> int:
        """Returns the bytes released where known (0 for vLLM, which frees them itself)."""
        if self.asleep:
            return 0
        self.asleep = True
        if vllm_sleep_mode(self.engine) is not None:
            if self.supported:
                self.engine.llm.sleep(level=self.level)
            return 0
        batcher = getattr(self.engine, "batcher", None)
        drop = getattr(batcher, "drop_cache", None)
        if drop is not None:
            drop()
        model = getattr(self.engine, "model", None)
        if self.level >= 2 and model is not None:
            return self.offload.put(module_tensors(model))
        return 0

    def wake(self) -> None:
        if not self.asleep:
            return
        self.asleep = False
        if vllm_sleep_mode(self.engine) is not None:
            if self.supported:
                self.engine.llm.wake_up()
            return
        self.offload.take()
